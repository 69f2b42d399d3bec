"""Writes docs/CONFIGURATION.md, the configuration reference, from the typed configuration itself
(every key, its default, its environment variable, its meaning), so the reference cannot drift
from the code. `--check` fails when the file is stale (`make docs-check`, part of `make test`).

    .venv/bin/python scripts/gen_config_docs.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from asyncinfer.config import (  # noqa: E402
    ENV_PREFIX,
    ApiKeyConfig,
    Config,
    ModelConfig,
    PipelineStepConfig,
    TensorSpecConfig,
    WebhookSecretConfig,
)
from asyncinfer.config_overlay import SECRETS_DIR_VARIABLE  # noqa: E402

TARGET = ROOT / "docs" / "CONFIGURATION.md"

# Sections that are lists of tables: documented once, without an environment variable per key.
TABLES: dict[str, type[BaseModel]] = {
    "[[models]]": ModelConfig,
    "models.inputs / models.outputs": TensorSpecConfig,
    "models.steps": PipelineStepConfig,
    "gateway.api_keys": ApiKeyConfig,
    "webhooks.secrets": WebhookSecretConfig,
}


def _default(section: type[BaseModel], name: str) -> str:
    info = section.model_fields[name]
    if info.is_required():
        return "(required)"
    value: Any = info.get_default(call_default_factory=True)
    if value is None:
        return "(unset)"
    if isinstance(value, tuple) and not value:
        return "[]"
    if isinstance(value, tuple) and all(isinstance(v, BaseModel) for v in value):
        return f"{len(value)} entr{'y' if len(value) == 1 else 'ies'} (see below)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"' if value else '""'
    return str(list(value) if isinstance(value, tuple) else value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `asyncinfer/config/` by `scripts/gen_config_docs.py`; do not edit by hand.",
        "",
        "One TOML file (`asyncinfer config` prints it complete, with every default), passed with `--config FILE`.",
        "Two overlays are laid over the file, each key on its own, and read by pydantic-settings:",
        "",
        f"- an environment variable `{ENV_PREFIX}<SECTION>__<KEY>` per key (the column below), on top of everything;",
        f"- the files of a secrets directory, named by `${SECRETS_DIR_VARIABLE}` (for example `/run/secrets`, or where a",
        "  Kubernetes Secret is mounted): a file `<section>__<key>` (or `ASYNCINFER_<SECTION>__<KEY>`, so that the",
        "  Secret that fills the environment can be mounted as files instead) holds that key's value, e.g.",
        "  `gateway__api_keys` or `nats__password`; surrounding whitespace is dropped. Other names (`tls.crt`)",
        "  are left alone; a `<section>__<key>` name that names no section stops start-up.",
        "",
        "So the order is: defaults, the file, the secrets directory, the environment. A value is read by its key's",
        'type: lists and tables as JSON (`ASYNCINFER_GATEWAY__API_KEYS=\'[{"tenant": "acme", "sha256": "..."}]\'`),',
        "`null` as unset, anything else as text that validation converts (`6000`, `true`). Models are declared in",
        "the file only. Everything is validated once at start-up; a bad value stops the process with a message",
        "that names the key.",
        "",
    ]
    for section_name, info in Config.model_fields.items():
        if section_name == "models":
            continue
        section = info.annotation
        assert isinstance(section, type)
        assert issubclass(section, BaseModel)
        lines += [f"## [{section_name}]", "", "| key | default | environment variable | meaning |", "|---|---|---|---|"]
        for name, field in section.model_fields.items():
            env = f"`{ENV_PREFIX}{section_name.upper()}__{name.upper()}`"
            lines.append(
                f"| `{name}` | `{_cell(_default(section, name))}` | {env} | {_cell(field.description or '')} |"
            )
        lines.append("")
    for title, table in TABLES.items():
        lines += [f"## {title}", "", "| key | default | meaning |", "|---|---|---|"]
        for name, field in table.model_fields.items():
            lines.append(f"| `{name}` | `{_cell(_default(table, name))}` | {_cell(field.description or '')} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when docs/CONFIGURATION.md is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET.relative_to(ROOT)} is stale: run scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    TARGET.parent.mkdir(exist_ok=True)
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
