"""What overrides the configuration file, read by pydantic-settings: the environment's
ASYNCINFER_<SECTION>__<KEY> variables and a secrets directory's <section>__<key> files (a Docker
/run/secrets, a mounted Kubernetes Secret). asyncinfer.config.load_config lays them over the file's
values, the secrets first, the environment on top, and validates the result once.

Only names of the form <section>__<key> count: ASYNCINFER_GATEWAY_ADDRESS (the client CLI's) or a
`tls.crt` beside the secrets are not configuration. A value is read by its key's type: lists and
tables (`gateway__api_keys`) as JSON, the rest as text that validation converts ("6000", "true").
Imported only when a configuration is loaded: pydantic-settings is not needed to print `--help`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NestedSecretsSettingsSource,
    SecretsSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.exceptions import SettingsError
from pydantic_settings.sources.utils import parse_env_vars

from asyncinfer.errors import ConfigError

# asyncinfer.config.ENV_PREFIX (tests/unit/test_config_overlay.py checks they agree): not imported
# from there, which imports this module (lazily) to load the configuration.
ENV_PREFIX = "ASYNCINFER_"

DELIMITER = "__"
SECRETS_DIR_VARIABLE = "ASYNCINFER_SECRETS_DIR"


@functools.cache
def _settings_class(model: type[BaseModel]) -> type[BaseSettings]:
    """`model`'s fields as a BaseSettings class, for the sources to read (never instantiated:
    `model` validates the merged values, so its errors read as they always have)."""
    config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=DELIMITER, case_sensitive=False, extra="forbid", frozen=True
    )
    return type(f"{model.__name__}Overlay", (BaseSettings, model), {"model_config": config})


def _sections(model: type[BaseModel]) -> dict[str, bool]:
    """Each top-level key, and whether it is a section (a table of keys an overlay may set one by one)."""
    return {
        name: isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
        for name, info in model.model_fields.items()
    }


def _checked(
    names: Mapping[str, str | None], model: type[BaseModel], where: Callable[[str], str]
) -> dict[str, str | None]:
    """The <section>__<key> names (lower case) among `names`; ConfigError for one that names no section."""
    sections = _sections(model)
    kept: dict[str, str | None] = {}
    for name, value in names.items():
        section, delimiter, key = name.partition(DELIMITER)
        if not delimiter or not section or not key or "/" in name:
            continue
        if section not in sections:
            raise ConfigError(f"{where(name)} names no section; the sections are {', '.join(sections)}")
        if not sections[section]:
            raise ConfigError(f"{where(name)} overrides a key of [{section}], which is not a section")
        kept[name] = value
    return kept


class _LenientJson:
    """JSON where it parses, else the text as it is: validation then names the key and what it
    expected ("gateway.api_keys: Input should be a valid tuple"), rather than the source failing."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)  # type: ignore[misc]
        except ValueError:
            return value


class _Environment(_LenientJson, EnvSettingsSource):
    """ASYNCINFER_<SECTION>__<KEY> from a given mapping (os.environ, or a test's)."""

    def __init__(self, model: type[BaseModel], environ: Mapping[str, str]) -> None:
        prefix = ENV_PREFIX.lower()
        names = {k.lower()[len(prefix) :]: v for k, v in environ.items() if k.lower().startswith(prefix)}
        self._given = {
            prefix + k: v for k, v in _checked(names, model, lambda name: (ENV_PREFIX + name).upper()).items()
        }
        super().__init__(
            _settings_class(model),
            case_sensitive=False,
            env_prefix=ENV_PREFIX,
            env_nested_delimiter=DELIMITER,
            env_parse_none_str="null",
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._given, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


class _SecretsDirectory(_LenientJson, NestedSecretsSettingsSource):
    """<section>__<key> files of a directory (ASYNCINFER_<SECTION>__<KEY> too, so that the Secret
    that gives the environment its values can be mounted as files instead), each holding one value."""

    def __init__(self, model: type[BaseModel], directory: Path) -> None:
        self._model = model
        super().__init__(
            SecretsSettingsSource(_settings_class(model), secrets_dir=directory),
            secrets_dir=directory,
            secrets_dir_missing="error",
            secrets_prefix="",
            secrets_nested_delimiter=DELIMITER,
            secrets_case_sensitive=False,
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        prefix = ENV_PREFIX.lower()
        files = {k.removeprefix(prefix): v for k, v in super()._load_env_vars().items()}
        return _checked(files, self._model, lambda name: f"{self.secrets_dir}/{name}")


def overlays(
    model: type[BaseModel], environ: Mapping[str, str], secrets_dir: str | Path | None
) -> list[dict[str, Any]]:
    """The values the secrets directory (when given) and then the environment set, as
    {section: {key: value}}, in the order they apply."""
    try:
        found = [_SecretsDirectory(model, Path(secrets_dir))()] if secrets_dir else []
        found.append(_Environment(model, environ)())
    except SettingsError as exc:  # the secrets directory is missing, not a directory, or too large
        raise ConfigError(f"secrets directory {secrets_dir}: {exc}") from None
    return found
