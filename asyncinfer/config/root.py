"""The whole configuration (`Config`), read from a file and its overlays (`load_config`), and what
an invalid one is told."""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, Field, ValidationError, model_validator

from asyncinfer.config.gateway_sections import BatchesConfig, ConsoleConfig, GatewayConfig
from asyncinfer.config.models import ModelConfig, default_version_config
from asyncinfer.config.nats_sections import EmbeddedNatsConfig, NatsConfig
from asyncinfer.config.operations import LoggingConfig, TlsConfig, TracingConfig, WebhooksConfig
from asyncinfer.config.section import Section
from asyncinfer.config.shipped_models import DEMO_MODEL
from asyncinfer.config.worker_sections import BatcherConfig, SchedulerConfig
from asyncinfer.errors import ConfigError


class Config(Section):
    nats: NatsConfig = Field(default_factory=NatsConfig)
    embedded_nats: EmbeddedNatsConfig = Field(default_factory=EmbeddedNatsConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    batcher: BatcherConfig = Field(default_factory=BatcherConfig)
    console: ConsoleConfig = Field(default_factory=ConsoleConfig)
    batches: BatchesConfig = Field(default_factory=BatchesConfig)
    webhooks: WebhooksConfig = Field(default_factory=WebhooksConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    tls: TlsConfig = Field(default_factory=TlsConfig)
    models: tuple[ModelConfig, ...] = Field(
        (DEMO_MODEL,),
        description="The models served. `asyncinfer up`, given a file that declares none, serves the text "
        "embedders minilm-l6, minilm-l6-doc and minilm-l6-doc-pipeline, the demo model and `flaky`, which fails on demand (README: "
        "Operations).",
    )

    @model_validator(mode="after")
    def _orphan_grace_covers_enqueue_retries(self) -> Config:
        if self.scheduler.orphan_message_grace_s <= self.gateway.enqueue_retry_s:
            raise ValueError(
                "scheduler.orphan_message_grace_s must exceed gateway.enqueue_retry_s: a submit may still be "
                "writing the job record that long after its work message was published"
            )
        return self

    @model_validator(mode="after")
    def _unique_models(self) -> Config:
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"models declared twice: {duplicates}")
        return self

    @model_validator(mode="after")
    def _valid_pipelines(self) -> Config:
        from asyncinfer.pipelines import PipelineMismatch, check_pipeline

        pipelines = [m for m in self.models if m.steps]
        if not pipelines:
            return self
        # A step runs on its model's default version, whose [[models.versions]] entry may change
        # the inputs or outputs the model's own table declares: that version is the one checked.
        defaults = {m.name: default_version_config(m.version_configs()) for m in self.models}
        for pipeline in pipelines:
            try:
                check_pipeline(pipeline, defaults)
            except PipelineMismatch as mismatch:
                own = {m.name: m.version for m in self.models}
                elsewhere = [
                    f"{step.model!r} on version {defaults[step.model].version!r}"
                    for step in pipeline.steps
                    if step.model in defaults and defaults[step.model].version != own[step.model]
                ]
                raise PipelineMismatch(
                    f"{mismatch} (steps run on their model's default version: {', '.join(dict.fromkeys(elsewhere))})"
                    if elsewhere
                    else str(mismatch),
                    mismatch.tensor,
                ) from None
        return self

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if model.name == name:
                return model
        return None

    def replace(self, **sections: Any) -> Config:
        """A copy with whole sections or fields of sections replaced, e.g.
        replace(gateway={"port": 0}). The copy knows which settings were set as this one does,
        plus those replaced (`model_fields_set`: what a file or caller chose, as `up`'s defaults
        ask), though it is validated from a dump of every setting."""
        data = self.model_dump()
        for section, values in sections.items():
            if isinstance(values, Mapping) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
        copy = Config.model_validate(data)
        _keep_fields_set(copy, self, sections)
        return copy


def _keep_fields_set(copy: BaseModel, original: BaseModel, replaced: Mapping[str, Any]) -> None:
    """`copy` (validated from a full dump, so every setting looks set) told which settings were
    set: the original's, and those replaced; for each section too (a section replaced whole has
    every field set)."""
    object.__setattr__(copy, "__pydantic_fields_set__", original.model_fields_set | set(replaced))
    for name in type(copy).model_fields:
        section, before = getattr(copy, name), getattr(original, name)
        if not (isinstance(section, BaseModel) and isinstance(before, BaseModel)):
            continue
        values = replaced.get(name)
        if isinstance(values, Mapping):
            chosen = set(values)
        else:
            chosen = set(type(section).model_fields) if name in replaced else set()
        object.__setattr__(section, "__pydantic_fields_set__", before.model_fields_set | chosen)


def load_config(
    path: str | Path | None = None, environ: Mapping[str, str] | None = None, *, secrets_dir: str | Path | None = None
) -> Config:
    """Reads the file (if any), lays the secrets directory's values over it (`secrets_dir`, else
    $ASYNCINFER_SECRETS_DIR; none when neither is set), then the environment's, and validates;
    ConfigError says what is wrong (asyncinfer/config_overlay.py reads the overlays)."""
    from asyncinfer import config_overlay  # pydantic-settings: not needed to print the CLI's --help

    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    secrets_dir = secrets_dir or environ.get(config_overlay.SECRETS_DIR_VARIABLE) or None
    for overlay in config_overlay.overlays(Config, environ, secrets_dir):
        for section, values in overlay.items():
            data.setdefault(section, {})
            if not isinstance(data[section], dict):
                raise ConfigError(f"[{section}] is overridden key by key, but the file sets {section} to a value")
            data[section].update(values)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid configuration: {_problems(exc)}") from None


# A list or table given as text that is not JSON: the environment's and the secrets directory's
# values are text, read as JSON for such keys (asyncinfer/config_overlay.py), and one that does not
# parse reached validation as text, "gateway.api_keys: Input should be a valid tuple", which did not
# say what was expected (a TOML table pasted into ASYNCINFER_GATEWAY__API_KEYS, say).
_TABLE_OR_LIST_TYPES = frozenset({"tuple_type", "list_type", "dict_type", "model_type", "model_attributes_type"})
_NOT_JSON = (
    "the value given is text that is not JSON; from the environment (ASYNCINFER_<SECTION>__<KEY>) or a secrets "
    'directory\'s file (<section>__<key>), a list or table is JSON, e.g. [{"tenant": "acme", "sha256": "..."}] '
    "for gateway.api_keys"
)


def _problems(error: ValidationError) -> str:
    """Each problem as `location: message`; a check of the whole file (no location) as its message,
    without pydantic's "Value error, " prefix."""
    problems = []
    for err in error.errors(include_url=False):
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":  # pydantic's "Extra inputs are not permitted": a typo, most times
            message = _unknown_key(tuple(err["loc"]))
        if err["type"] in _TABLE_OR_LIST_TYPES and isinstance(err.get("input"), str):
            message += f": {_NOT_JSON}"
        location = ".".join(str(p) for p in err["loc"])
        problems.append(f"{location}: {message}" if location else message)
    return "; ".join(problems)


def _unknown_key(location: tuple[int | str, ...]) -> str:
    """What to say of a key no section (or model table) has: the nearest one it has, if any."""
    fields = _keys_at(location[:-1])
    what = "section" if len(location) == 1 else "key"
    close = difflib.get_close_matches(str(location[-1]), fields, n=1, cutoff=0.6)
    if close:
        return f"unknown {what}; did you mean {close[0]!r}? (`asyncinfer config` prints every one)"
    return f"unknown {what} (`asyncinfer config` prints every one, commented)"


def _keys_at(location: tuple[int | str, ...]) -> list[str]:
    """The keys of the table at `location` (a section, a model's table, ...): [] if not a table."""
    model: type[BaseModel] = Config
    for part in location:
        if isinstance(part, int):  # an item of a list of tables: its type was taken with the list
            continue
        field = model.model_fields.get(part)
        found = _table_type(field.annotation) if field is not None else None
        if found is None:
            return []
        model = found
    return list(model.model_fields)


def _table_type(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel a field holds, directly or as the items of a list, tuple or optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _table_type(arg)
        if found is not None:
            return found
    return None


# --- the commented default file --------------------------------------------------------------
