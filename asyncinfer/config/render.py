"""The commented default file: `asyncinfer config` prints it, and `load_config` reads it back unchanged."""

from __future__ import annotations

import json
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from asyncinfer.config.root import Config


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, BaseModel):
        return _toml_value(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot render {value!r} as TOML")


def _unset_placeholder(annotation: Any) -> str:
    kinds = [kind for kind in get_args(annotation) if kind is not type(None)]
    for kind in kinds:
        if get_origin(kind) is Literal:
            return _toml_value(get_args(kind)[0])
        if kind in (int, float, bool):
            return _toml_value(kind())
    return '""'


def _render_section(lines: list[str], section: BaseModel) -> None:
    for name, info in type(section).model_fields.items():
        if info.description:
            lines.append(f"# {info.description}")
        value = getattr(section, name)
        if value is None and info.default is not None and _unset_placeholder(info.annotation) == '""':
            # Unset against a default that is set (a standalone batcher's scheduler_address): a
            # commented line read back as the default (127.0.0.1:50052), so it is written empty,
            # which reads as unset.
            lines.append(f'{name} = ""')
        elif value is None:
            # Unset: a placeholder of the key's type, so that the line uncommented still parses
            # (an empty string reads as unset).
            lines.append(f"# {name} = {_unset_placeholder(info.annotation)}")
        elif value == ():
            # Commented out, so that a user may add the entries as tables ([[gateway.api_keys]])
            # without first deleting a conflicting `name = []` line.
            lines.append(f"# {name} = []")
        elif name in ("inputs", "outputs"):
            lines.append(f"{name} = [")
            lines.extend(f"  {_toml_value(v)}," for v in value)
            lines.append("]")
        else:
            lines.append(f"{name} = {_toml_value(value)}")


def render_default_config(config: Config | None = None) -> str:
    """The complete configuration as commented TOML; `load_config` reads it back unchanged."""
    config = config or Config()
    lines = [
        "# asyncinfer configuration. Every key is shown with its default.",
        "# Override any key with ASYNCINFER_<SECTION>__<KEY>, e.g. ASYNCINFER_GATEWAY__PORT=6000.",
        "",
    ]
    for name in type(config).model_fields:
        if name == "models":
            continue
        lines.append(f"[{name}]")
        _render_section(lines, getattr(config, name))
        lines.append("")
    lines.append("# Models: one [[models]] table each. The batcher loads them; the gateway validates")
    lines.append("# inputs against their signatures.")
    for model in config.models:
        lines.append("[[models]]")
        _render_section(lines, model)
        lines.append("")
    return "\n".join(lines)
