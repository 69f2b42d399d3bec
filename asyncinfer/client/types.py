"""What the SDK hands back: frozen dataclasses and enums, never protobuf messages.

Timestamps are timezone-aware UTC `datetime`s; durations are float seconds (`*_s`); tensors are
numpy arrays (read-only views of the received bytes; `.copy()` one to write to it). An enum value
newer than the SDK reads as `UNKNOWN_<number>` of its enum, never an error (asyncinfer.client._enums).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

import grpc
import numpy as np
import numpy.typing as npt

from asyncinfer.errors import FieldViolation
from asyncinfer.jobs import JobState, Priority
from asyncinfer.open_enums import OpenStrEnum
from asyncinfer.tensors import Tensor, TensorSpec

__all__ = [
    "BatchInfo",
    "BlobRef",
    "BulkResult",
    "Callback",
    "CallbackDelivery",
    "CallbackDeliveryState",
    "CallbackEvent",
    "FieldViolation",
    "Inputs",
    "Job",
    "JobError",
    "JobProgress",
    "JobRequest",
    "JobState",
    "ModelInfo",
    "Priority",
    "QueuePosition",
    "TensorSpec",
    "WaitingReason",
]

# A job's inputs: name -> array (anything numpy.asarray accepts), or ready-made tensors.
Inputs = Mapping[str, npt.ArrayLike | Tensor] | tuple[Tensor, ...] | list[Tensor]


class WaitingReason(OpenStrEnum):
    NO_WORKER = "NO_WORKER"
    WAITING_FOR_CAPACITY = "WAITING_FOR_CAPACITY"
    PAUSED = "PAUSED"
    RETRY_BACKOFF = "RETRY_BACKOFF"
    DRAINING = "DRAINING"
    NO_VERSION = "NO_VERSION"  # pinned to a model version no batcher serves now
    # A batcher could not load the model's version and none serves it: ModelInfo's version reason
    # says why (AsyncClient.models). A gateway of the release before says NO_WORKER (or NO_VERSION).
    MODEL_LOAD_FAILED = "MODEL_LOAD_FAILED"

    @property
    def not_served(self) -> bool:
        """The job's model version is not served: `why_not_served` says why, from ListModels."""
        return self in (WaitingReason.MODEL_LOAD_FAILED, WaitingReason.NO_WORKER, WaitingReason.NO_VERSION)


class CallbackEvent(OpenStrEnum):
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"


class CallbackDeliveryState(OpenStrEnum):
    PENDING = "PENDING"
    DELIVERED = "DELIVERED"
    FAILED = "FAILED"
    DISABLED = "DISABLED"


@dataclass(frozen=True, slots=True)
class JobError:
    """Why a job (or one attempt, or one bulk item) failed."""

    code: grpc.StatusCode
    reason: str
    message: str
    violations: tuple[FieldViolation, ...] = ()
    retriable: bool = False
    # How long the server asks to wait before trying again (a bulk item refused QUEUE_FULL).
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class BlobRef:
    """A blob in the claim-check store: an uploaded input or a large result."""

    ref: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Callback:
    """A webhook; no events means the terminal ones (COMPLETED, FAILED, CANCELED)."""

    url: str
    events: tuple[CallbackEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class CallbackDelivery:
    webhook_id: str
    event: CallbackEvent | None
    state: CallbackDeliveryState | None
    attempts: int
    last_attempt_time: datetime | None
    last_status_code: int
    last_error: str
    next_attempt_time: datetime | None


@dataclass(frozen=True, slots=True)
class QueuePosition:
    """Where a queued job stands: jobs ahead of it, when it should start, why it waits."""

    position: int
    estimated_start_time: datetime | None
    waiting_reason: WaitingReason | None


@dataclass(frozen=True, slots=True)
class BatchInfo:
    batcher_id: str
    batch_size: int
    compute_duration_s: float | None


@dataclass(frozen=True, slots=True, eq=False)
class JobProgress:
    """Progress a model reported while running: each WatchJob message's, and the latest kept on
    the record (GetJob)."""

    fraction: float | None
    message: str
    partial_outputs: Mapping[str, npt.NDArray[np.generic]]


@dataclass(frozen=True, slots=True, eq=False)
class Job:
    """A job record as the gateway reported it at `revision`. Compare jobs by `job_id` and
    `revision` (arrays have no plain equality, so dataclass `==` is identity)."""

    job_id: str
    model_name: str
    model_version: str
    state: JobState
    priority: Priority
    # `attempt` and `max_attempts` count the attempts given back too (the record's fencing number,
    # and its limit raised by one for each): `spent_attempts` of `allowed_attempts` is a person's count.
    attempt: int
    max_attempts: int
    revision: int
    labels: Mapping[str, str] = field(default_factory=dict)
    idempotency_key: str = ""
    create_time: datetime | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None
    update_time: datetime | None = None
    queue_duration_s: float | None = None
    run_duration_s: float | None = None
    deadline: datetime | None = None
    execution_timeout_s: float | None = None
    result_retention_s: float | None = None
    expire_time: datetime | None = None
    queue: QueuePosition | None = None
    batch: BatchInfo | None = None
    error: JobError | None = None
    last_error: JobError | None = None
    # When SUCCEEDED and small; a large result has `result_ref` instead (use read_result).
    outputs: Mapping[str, npt.NDArray[np.generic]] = field(default_factory=dict)
    result_ref: BlobRef | None = None
    input_ref: BlobRef | None = None
    callback: Callback | None = None
    callback_deliveries: tuple[CallbackDelivery, ...] = ()
    progress: JobProgress | None = None
    # The batcher its latest attempt was dispatched to: where a RUNNING job runs.
    batcher_id: str = ""
    # Its OpenTelemetry trace ID when the gateway traces jobs (the caller's, given a traceparent).
    trace_id: str = ""
    # Whether that trace was sampled (recorded and exported: a trace viewer shows it); False when
    # the gateway says it was not, True when it was or does not say (a gateway before session 34).
    trace_sampled: bool = True
    # The attempts given back, which did not count against its limit: shed by a batcher, put back
    # by a scheduler's stop, a batcher gone before its order went out, an input read retried. 0 from
    # a gateway of a release before.
    given_back_attempts: int = 0
    # A dead-lettered job's letter, by its sequence in the dead-letter stream (what OpsService's
    # GetDeadLetter and `asyncinfer dlq show` take); 0 for any other job, after a replay (its letter
    # is deleted), and for a job a scheduler of a release before dead-lettered.
    dead_letter_sequence: int = 0

    @property
    def done(self) -> bool:
        """True in a terminal state: nothing about the job changes any more."""
        return self.state.is_terminal

    @property
    def spent_attempts(self) -> int:
        """The attempts that counted against its limit, the one running included: `attempt` less
        those given back. A job of max_attempts 2 given back four times then failing twice has
        spent 2 (at `attempt` 6)."""
        return self.attempt - self.given_back_attempts

    @property
    def allowed_attempts(self) -> int:
        """The attempts it may spend: `max_attempts` less the one added for each attempt given back
        (its max_attempts as submitted, plus any replay's)."""
        return self.max_attempts - self.given_back_attempts

    @property
    def succeeded(self) -> bool:
        return self.state is JobState.SUCCEEDED


@dataclass(frozen=True, slots=True)
class JobRequest:
    """One job to submit (the arguments of `submit`, as a value, for `bulk`).

    Give `inputs` or `input_ref` (from `upload`), not both. Give `deadline` (absolute, aware
    datetime) or `queue_ttl_s`, not both. An empty `idempotency_key` gets a fresh UUID when sent,
    so that the SDK's retries can never queue a job twice; give your own to make resubmission
    across processes safe too. `correlation_id` is only echoed back by `bulk`. `priority` is a
    Priority or its name in any case ("high"), as `submit` takes it."""

    model: str
    inputs: Inputs | None = None
    input_ref: str = ""
    model_version: str = ""
    priority: Priority | str | None = None
    idempotency_key: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    deadline: datetime | None = None
    queue_ttl_s: float | None = None
    execution_timeout_s: float | None = None
    retention_s: float | None = None
    callback: Callback | None = None
    max_attempts: int = 0
    correlation_id: str = ""


@dataclass(frozen=True, slots=True)
class BulkResult:
    """The answer for one request of `bulk`: the job when accepted, the error when refused.
    `index` is the request's 0-based position in what you passed in."""

    index: int
    correlation_id: str
    job: Job | None
    error: JobError | None
    deduplicated: bool = False

    @property
    def accepted(self) -> bool:
        return self.job is not None


@dataclass(frozen=True, slots=True)
class ModelVersion:
    """One version of a model: LOADING (a batcher warms it up, or waits for its Triton server to
    answer), READY (served), UNAVAILABLE (declared or registered, served by no batcher now:
    `reason`; jobs pinned to it wait)."""

    version: str
    state: str
    reason: str = ""
    batchers: tuple[str, ...] = ()
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    max_batch_size: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model the gateway accepts jobs for (`AsyncClient.models`). Shapes are full, batch
    dimension first, -1 for any size; `max_batch_size` bounds the rows of one job's inputs.
    The fields describe `version`, the one a job that names none runs on now; `versions` lists
    every version (a job pins one with `model_version`)."""

    name: str
    version: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    default_max_attempts: int
    max_attempts_limit: int
    default_execution_timeout_s: float | None
    versions: tuple[ModelVersion, ...] = ()

    def input(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.inputs if spec.name == name), None)

    @property
    def versions_summary(self) -> str:
        """Every version, those not READY with their state: `1, 2, 3 (loading)` (`version` alone
        from a gateway that lists none)."""
        if not self.versions:
            return self.version
        return ", ".join(v.version if v.state == "READY" else f"{v.version} ({v.state.lower()})" for v in self.versions)


def why_not_served(job: Job, models: Iterable[ModelInfo]) -> str:
    """Why the job's model version does not serve, as ListModels says it ("batcher X could not load
    it: ..."; every version's reason for a job that names none); "" when nothing says. The job's
    record has no room for the text: a waiting reason that is `not_served` is explained by this."""
    model = next((m for m in models if m.name == job.model_name), None)
    if model is None:
        return ""
    return "; ".join(v.reason for v in model.versions if v.reason and job.model_version in ("", v.version))
