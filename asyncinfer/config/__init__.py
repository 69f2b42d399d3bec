"""Typed configuration: one TOML file, overridable by environment variables and a secrets
directory's files, validated once at start-up. `asyncinfer config` prints the complete file with
every key, its default and its meaning.

Overrides (read by pydantic-settings in asyncinfer/config_overlay.py), the later on top:
a file `<section>__<key>` in $ASYNCINFER_SECRETS_DIR (a mounted Secret), then an environment
variable ASYNCINFER_<SECTION>__<KEY>=value, e.g. ASYNCINFER_GATEWAY__PORT=6000 or
ASYNCINFER_NATS__URL=nats://nats:4222. Lists and tables are read as JSON, `null` as unset, the rest
as text that validation converts. Models are declared in the file only (`asyncinfer up` adds its
embedders and sample models when the file declares none: services/up/defaults.py with_up_defaults).

The sections live in modules of this package, one or a few sections each (section, nats_sections,
gateway_sections, worker_sections, models, operations, shipped_models, root, render); every name is
imported from here: `from asyncinfer.config import Config, load_config`.
"""

from __future__ import annotations

from asyncinfer.config.gateway_sections import (
    TRACE_ID_PLACEHOLDER,
    ApiKeyConfig,
    BatchesConfig,
    ConsoleConfig,
    GatewayConfig,
)
from asyncinfer.config.models import (
    ModelConfig,
    ModelVersionConfig,
    PipelineStepConfig,
    TensorSpecConfig,
    checked_version,
    default_version_config,
    version_order,
)
from asyncinfer.config.nats_sections import EmbeddedNatsConfig, NatsConfig
from asyncinfer.config.operations import LoggingConfig, TlsConfig, TracingConfig, WebhooksConfig, WebhookSecretConfig
from asyncinfer.config.render import render_default_config
from asyncinfer.config.root import Config, load_config
from asyncinfer.config.section import DEVICE_PATTERN, ENV_PREFIX, SHA256_HEX_PATTERN, Section
from asyncinfer.config.shipped_models import (
    DEMO_MODEL,
    FLAKY_MODEL,
    MINILM_DOC_MODEL,
    MINILM_DOC_PIPELINE,
    MINILM_EMBEDDING_DIM,
    MINILM_MODEL,
)
from asyncinfer.config.worker_sections import BatcherConfig, SchedulerConfig

__all__ = [
    "DEMO_MODEL",
    "DEVICE_PATTERN",
    "ENV_PREFIX",
    "FLAKY_MODEL",
    "MINILM_DOC_MODEL",
    "MINILM_DOC_PIPELINE",
    "MINILM_EMBEDDING_DIM",
    "MINILM_MODEL",
    "SHA256_HEX_PATTERN",
    "TRACE_ID_PLACEHOLDER",
    "ApiKeyConfig",
    "BatcherConfig",
    "BatchesConfig",
    "Config",
    "ConsoleConfig",
    "EmbeddedNatsConfig",
    "GatewayConfig",
    "LoggingConfig",
    "ModelConfig",
    "ModelVersionConfig",
    "NatsConfig",
    "PipelineStepConfig",
    "SchedulerConfig",
    "Section",
    "TensorSpecConfig",
    "TlsConfig",
    "TracingConfig",
    "WebhookSecretConfig",
    "WebhooksConfig",
    "checked_version",
    "default_version_config",
    "load_config",
    "render_default_config",
    "version_order",
]
