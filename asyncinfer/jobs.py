"""Jobs as the domain sees them: states, priorities, the job record kept in the KV bucket, and the
work envelope published to the WORK stream. How they are stored is asyncinfer.codecs's business
(versioned JSON, tensor data as base64, so `nats kv get` shows something a person can read).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Named in asyncinfer.contract; re-exported for their callers here.
from asyncinfer.contract import WORK_SUBJECT_PREFIX as WORK_SUBJECT_PREFIX
from asyncinfer.contract import job_key as job_key
from asyncinfer.contract import job_work_subject as job_work_subject
from asyncinfer.contract import work_subject as work_subject
from asyncinfer.errors import AsyncInferError, FieldViolation, InvalidArgument
from asyncinfer.open_enums import OpenStrEnum
from asyncinfer.tensors import Tensor

# Model names and tenants become NATS subject tokens and KV key parts.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
# NAME_PATTERN in words, as a field violation's description says it.
NAME_RULE = "1-64 letters, digits, '_' or '-', starting with a letter or digit"


class JobState(OpenStrEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLING = "CANCELLING"
    CANCELED = "CANCELED"
    EXPIRED = "EXPIRED"
    TIMED_OUT = "TIMED_OUT"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED, JobState.EXPIRED, JobState.TIMED_OUT}
)


class Priority(OpenStrEnum):
    HIGH = "HIGH"
    NORMAL = "NORMAL"
    LOW = "LOW"

    @property
    def subject_token(self) -> str:
        return self.value.lower()


PRIORITIES_BY_RANK = (Priority.HIGH, Priority.NORMAL, Priority.LOW)

# Labels the system sets on the jobs it makes: a batch's chunk jobs name their batch and their
# record range. A caller's own label keys may not start with the prefix (INVALID_ARGUMENT), so a
# user's job is never taken for a chunk, nor hidden from ListJobs as one.
RESERVED_LABEL_PREFIX = "asyncinfer-"
BATCH_LABEL = "asyncinfer-batch"
CHUNK_LABEL = "asyncinfer-chunk"


@dataclass(frozen=True, slots=True)
class JobError:
    """Why a job (or one attempt of it) failed; kept in the record."""

    code: int  # canonical gRPC code number
    reason: str
    message: str
    violations: tuple[FieldViolation, ...] = ()
    retriable: bool = False
    # What it is about (ErrorInfo metadata: a model control's refusal names the model, version,
    # pipeline, tensor). Carried between services; a job record does not keep it (its codec).
    metadata: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_exception(cls, error: AsyncInferError, *, retriable: bool = False) -> JobError:
        violations = error.violations if isinstance(error, InvalidArgument) else ()
        return cls(
            code=error.code.value[0],
            reason=error.reason,
            message=error.message,
            violations=violations,
            retriable=retriable,
        )


@dataclass(frozen=True, slots=True)
class BatchInfo:
    batcher_id: str
    batch_size: int
    compute_s: float


@dataclass(frozen=True, slots=True)
class BlobRef:
    ref: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class CallbackSpec:
    url: str
    events: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ProgressReport:
    """What a running attempt's model reported last: `fraction` 0..1 (None: unknown), a short
    message, and its partial outputs so far. `step` counts the attempt's reports sent (later
    ones are higher), so that a reader can drop one that arrives after a newer one."""

    attempt: int
    step: int
    fraction: float | None = None
    message: str = ""
    outputs: tuple[Tensor, ...] = ()

    def is_newer_than(self, other: ProgressReport | None) -> bool:
        return other is None or (self.attempt, self.step) > (other.attempt, other.step)


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job's record. Times are Unix seconds (float); durations are seconds."""

    job_id: str
    tenant: str
    model_name: str
    model_version: str
    state: JobState
    priority: Priority
    create_time: float
    update_time: float
    max_attempts: int
    result_retention_s: float
    attempt: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    idempotency_key: str = ""
    start_time: float | None = None
    end_time: float | None = None
    queue_duration_s: float | None = None
    run_duration_s: float | None = None
    deadline: float | None = None
    execution_timeout_s: float | None = None
    batch: BatchInfo | None = None
    error: JobError | None = None
    last_error: JobError | None = None
    outputs: tuple[Tensor, ...] = ()
    result_ref: BlobRef | None = None
    input_ref: BlobRef | None = None
    callback: CallbackSpec | None = None
    # The batcher the latest attempt was dispatched to (set at its start, kept after it).
    batcher_id: str = ""
    # The latest progress kept (services.scheduler.progress_relay: not every report is written).
    progress: ProgressReport | None = None
    # The scheduler instance ("<name>/<run>") that dispatched the latest attempt, and the ack
    # subject of the work message's delivery it holds: while the job is RUNNING, a scheduler that
    # finds that instance gone naks the message there, so the job runs again at once rather than
    # after AckWait (services.scheduler.lease_reclaim). Kept after the attempt; read only then.
    dispatched_by: str = ""
    lease_subject: str = ""
    # The W3C traceparent of the job's submit span (asyncinfer.tracing), "" when tracing was off:
    # the scheduler's spans continue it, and its trace ID is on the Job and the job's log lines.
    traceparent: str = ""
    # A keyed job's idempotency claim as its submit wrote it: its revision in the idempotency bucket
    # and the request's fingerprint, so that whoever ends the job cuts the claim's TTL to the
    # record's in one write, without reading it (asyncinfer.claim_lifetimes). 0 and "": no key, or
    # a job submitted by a gateway from before they were kept.
    claim_revision: int = 0
    claim_fingerprint: str = ""
    # When nats-server stored the work message of the job's latest dispatch, on the server's clock
    # (Unix seconds): its stamp on the message, which the scheduler reads from the delivery it
    # dispatches (services.scheduler.job_dispatch); None before a dispatch, or from a scheduler of
    # the release before. A job put back for a retry is the same message (a nak keeps its stamp),
    # so its QUEUED record in the bucket is placed among the server's stamps on the queued messages
    # like with like, whichever gateway's clock stamped its create_time (services.gateway.queue_view).
    queued_server_time: float | None = None
    # The attempts since the job's submit or its latest Replay that failed and were retried (a
    # Requeue that gave no refund: a model error, a lost batcher, a timeout retried), which the
    # retry backoff's exponent counts (lifecycle.after_failure). `attempt` also counts the attempts
    # given back and those before a replay: a job shed four times then failing once waited 16
    # times the base backoff. 0 in a record from a scheduler of the release before.
    failed_attempts: int = 0
    # The attempts given back over the job's life (a Requeue with refund: shed by a batcher, put
    # back by a scheduler's stop, a batcher leaving before its order went out, an input read
    # retried), which did not count against max_attempts. `attempt` counts them too: a job with
    # max_attempts 2 given back four times gave up at attempt 6, after 2 that counted. 0 in a
    # record from a scheduler of the release before (its count then stays `attempt`).
    given_back_attempts: int = 0
    # The batchers' hand-backs of this job since its last attempt that ran or was put back for
    # another reason (an order answered dropped, unrun: its batcher stops, its model is stuck, it
    # does not serve the version): lifecycle.after_hand_back waits longer after each and counts
    # those past FREE_HAND_BACKS as attempts (unless their batcher no longer serves the version).
    # 0 in a record from a scheduler of the release before.
    handed_back_in_a_row: int = 0
    # Of those, the batchers that handed it back no longer serving its version (their Triton out of
    # reach, LOADING): each does so once per outage, so a second hand-back by one of them is a second
    # outage with the job on it (a Triton flapping, or one the job brings down), which
    # lifecycle.after_hand_back counts past FREE_HAND_BACKS. () in a record from a scheduler of the
    # release before.
    handed_back_by: tuple[str, ...] = ()
    # A dead-lettered job's letter: its sequence in the dead-letter stream (what OpsService's
    # GetDeadLetter and ReplayDeadLetters name it by), set by the give-up that ended the job, so
    # that its page and `asyncinfer get` name the letter without searching the model's letters for
    # it. 0: not dead-lettered (or replayed since: the letter is deleted), or a record from a
    # scheduler of the release before.
    dead_letter_sequence: int = 0
    # The KV revision this record was read at; not stored (the KV knows it).
    revision: int = 0
    # When nats-server stored the job's work message, on the server's clock (Unix seconds), where the
    # reader had the message at hand (a queued job read from it: asyncinfer.job_store); None
    # otherwise. Not stored. A queued job's position compares it with the server's stamps on the
    # queue's oldest and newest messages (services.gateway.queue_view), like with like.
    work_message_time: float | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return job_key(self.tenant, self.job_id)

    @property
    def spent_attempts(self) -> int:
        """The attempts that counted against max_attempts over the job's life, across replays: those
        that ran and failed, or were lost with their scheduler (a lapsed lease), and the one running
        or last run. Not those given back."""
        return self.attempt - self.given_back_attempts

    def evolve(self, **changes: Any) -> JobRecord:
        # Not dataclasses.replace: it walks dataclasses.fields() and checks each one on every call,
        # several times slower, and every record write evolves the record at least twice.
        values = {name: getattr(self, name) for name in _RECORD_FIELDS}
        values.update(changes)
        return JobRecord(**values)


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(JobRecord))


@dataclass(frozen=True, slots=True)
class WorkEnvelope:
    """What a WORK message carries: enough to run the job without reading its record.

    A submit's message is also the job's QUEUED record (`is_record`): the record's fields ride
    with the inputs, and the jobs bucket holds the job only from its first transition (the
    RUNNING write, or a cancel or expiry while queued), each a create that exactly one writer
    wins. A replay's message is not (its record, with its history, is in the bucket)."""

    job_id: str
    tenant: str
    model_name: str
    model_version: str
    priority: Priority
    create_time: float
    max_attempts: int
    inputs: tuple[Tensor, ...] = ()
    input_ref: BlobRef | None = None
    deadline: float | None = None
    execution_timeout_s: float | None = None
    is_record: bool = False
    result_retention_s: float = 0.0
    labels: Mapping[str, str] = field(default_factory=dict)
    idempotency_key: str = ""
    callback: CallbackSpec | None = None
    traceparent: str = ""  # the QUEUED record's (is_record)
    claim_revision: int = 0  # the QUEUED record's (is_record)
    claim_fingerprint: str = ""

    @property
    def subject(self) -> str:
        return job_work_subject(self.model_name, self.priority, self.tenant, self.job_id)

    @property
    def key(self) -> str:
        return job_key(self.tenant, self.job_id)

    def queued_record(self, *, work_message_time: float | None = None) -> JobRecord:
        """The QUEUED record this message is (is_record), at revision 0: not yet in the bucket, so
        the first write of it is a create. `work_message_time`: the server's stamp on the message,
        where the reader has it (JobRecord.work_message_time)."""
        return JobRecord(
            job_id=self.job_id,
            tenant=self.tenant,
            model_name=self.model_name,
            model_version=self.model_version,
            state=JobState.QUEUED,
            priority=self.priority,
            create_time=self.create_time,
            update_time=self.create_time,
            max_attempts=self.max_attempts,
            result_retention_s=self.result_retention_s,
            labels=self.labels,
            idempotency_key=self.idempotency_key,
            deadline=self.deadline,
            execution_timeout_s=self.execution_timeout_s,
            input_ref=self.input_ref,
            callback=self.callback,
            traceparent=self.traceparent,
            claim_revision=self.claim_revision,
            claim_fingerprint=self.claim_fingerprint,
            work_message_time=work_message_time,
        )


def queued_envelope(record: JobRecord, inputs: tuple[Tensor, ...]) -> WorkEnvelope:
    """The work message of a new job: its QUEUED `record` with the `inputs` to run."""
    return WorkEnvelope(
        job_id=record.job_id,
        tenant=record.tenant,
        model_name=record.model_name,
        model_version=record.model_version,
        priority=record.priority,
        create_time=record.create_time,
        max_attempts=record.max_attempts,
        inputs=inputs,
        input_ref=record.input_ref,
        deadline=record.deadline,
        execution_timeout_s=record.execution_timeout_s,
        is_record=True,
        result_retention_s=record.result_retention_s,
        labels=record.labels,
        idempotency_key=record.idempotency_key,
        callback=record.callback,
        traceparent=record.traceparent,
        claim_revision=record.claim_revision,
        claim_fingerprint=record.claim_fingerprint,
    )
