"""What the scheduler and a batcher say to each other on the Connect stream, as domain types.

`worker_service` converts the protobuf messages at the edge; nothing else sees them."""

from __future__ import annotations

from dataclasses import dataclass

from asyncinfer.jobs import BlobRef, JobError, Priority, ProgressReport
from asyncinfer.tensors import ModelSignature, Tensor


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One version of a model a batcher serves (ready) or is loading (not ready: no work yet)."""

    model_name: str
    model_version: str
    max_batch_size: int
    ready: bool = True
    signature: ModelSignature | None = None  # None from a batcher that does not send it


@dataclass(frozen=True, slots=True)
class LoadFailure:
    """A version a batcher was told to serve and could not (it failed to load or warm up)."""

    model_name: str
    model_version: str
    reason: str


@dataclass(frozen=True, slots=True)
class WorkerHello:
    batcher_id: str
    models: tuple[ServedModel, ...]
    takes_batches: bool = False  # reads several orders per message
    reads_claim_checks: bool = False  # reads input refs and stores large outputs itself
    times_out_runs: bool = False  # answers a run past its execution timeout itself (from its batch's start)
    load_failures: tuple[LoadFailure, ...] = ()


@dataclass(frozen=True, slots=True)
class CreditGrant:
    model_name: str
    credits: int


@dataclass(frozen=True, slots=True)
class WorkResult:
    """The outcome of one work order; `error` is None on success."""

    job_id: str
    attempt: int
    outputs: tuple[Tensor, ...] = ()
    error: JobError | None = None
    batch_size: int = 0
    compute_s: float = 0.0
    dropped: bool = False
    output_ref: BlobRef | None = None  # the outputs, stored by the batcher (its order's output_name)


@dataclass(frozen=True, slots=True)
class WorkProgress:
    """What a running order's model reported last (its attempt and step are in `report`)."""

    job_id: str
    report: ProgressReport


@dataclass(frozen=True, slots=True)
class WorkOrder:
    job_id: str
    attempt: int
    model_name: str
    model_version: str
    priority: Priority
    tenant: str
    inputs: tuple[Tensor, ...] = ()
    input_ref: BlobRef | None = None
    deadline: float | None = None
    execution_timeout_s: float | None = None
    traceparent: str = ""  # the dispatch span's, when the job is traced
    # To a batcher that reads claim checks: outputs over this many bytes are stored by it as the
    # object output_name, kept result_retention_s after the job's end (0: never).
    store_outputs_over_bytes: int = 0
    output_name: str = ""
    result_retention_s: float = 0.0
    # Its previous attempt was lost with its batcher (a crash it may have caused): computed alone.
    run_alone: bool = False


@dataclass(frozen=True, slots=True)
class CancelOrder:
    """Tells a batcher to drop an attempt it has not started (a cancel or an execution timeout)."""

    job_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class ModelControlOrder:
    """Load (or replace) or unload a model's versions on a batcher (OpsService.LoadModel / UnloadModel)."""

    request_id: int
    action: str  # LOAD or UNLOAD
    model_name: str
    config_json: str = ""
    model_version: str = ""
