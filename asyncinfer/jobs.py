"""Jobs as the domain sees them: states, priorities, the job record kept in the KV bucket, and the
work envelope published to the WORK stream. Both are stored as compact JSON (tensor data as
base64), so `nats kv get` shows something a person can read.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Named in asyncinfer.contract; re-exported for their callers here.
from asyncinfer.contract import WORK_SUBJECT_PREFIX as WORK_SUBJECT_PREFIX
from asyncinfer.contract import job_key as job_key
from asyncinfer.contract import work_subject as work_subject
from asyncinfer.errors import AsyncInferError, FieldViolation, InvalidArgument
from asyncinfer.tensors import Tensor

# Model names and tenants become NATS subject tokens and KV key parts.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class JobState(enum.StrEnum):
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


class Priority(enum.StrEnum):
    HIGH = "HIGH"
    NORMAL = "NORMAL"
    LOW = "LOW"

    @property
    def subject_token(self) -> str:
        return self.value.lower()


PRIORITIES_BY_RANK = (Priority.HIGH, Priority.NORMAL, Priority.LOW)


@dataclass(frozen=True, slots=True)
class JobError:
    """Why a job (or one attempt of it) failed; kept in the record."""

    code: int  # canonical gRPC code number
    reason: str
    message: str
    violations: tuple[FieldViolation, ...] = ()
    retriable: bool = False

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
    # The KV revision this record was read at; not stored (the KV knows it).
    revision: int = 0

    @property
    def key(self) -> str:
        return job_key(self.tenant, self.job_id)

    def evolve(self, **changes: Any) -> JobRecord:
        # Not dataclasses.replace: it walks dataclasses.fields() and checks each one on every call,
        # several times slower, and every record write evolves the record at least twice.
        values = {name: getattr(self, name) for name in _RECORD_FIELDS}
        values.update(changes)
        return JobRecord(**values)


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(JobRecord))


@dataclass(frozen=True, slots=True)
class WorkEnvelope:
    """What a WORK message carries: enough to run the job without reading its record."""

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

    @property
    def subject(self) -> str:
        return work_subject(self.model_name, self.priority)

    @property
    def key(self) -> str:
        return job_key(self.tenant, self.job_id)


# --- JSON codec -------------------------------------------------------------------------------


def _tensor_to_json(tensor: Tensor) -> dict[str, Any]:
    return {
        "name": tensor.name,
        "datatype": tensor.datatype,
        "shape": list(tensor.shape),
        "data": base64.b64encode(tensor.data).decode("ascii"),
    }


def _tensor_from_json(obj: Mapping[str, Any]) -> Tensor:
    return Tensor(
        name=obj["name"],
        datatype=obj["datatype"],
        shape=tuple(obj["shape"]),
        data=base64.b64decode(obj["data"]),
    )


def error_to_json(error: JobError | None) -> dict[str, Any] | None:
    if error is None:
        return None
    return {
        "code": error.code,
        "reason": error.reason,
        "message": error.message,
        "violations": [[v.field, v.description] for v in error.violations],
        "retriable": error.retriable,
    }


def error_from_json(obj: Mapping[str, Any] | None) -> JobError | None:
    if obj is None:
        return None
    return JobError(
        code=obj["code"],
        reason=obj["reason"],
        message=obj["message"],
        violations=tuple(FieldViolation(f, d) for f, d in obj.get("violations", ())),
        retriable=obj.get("retriable", False),
    )


def _blob_from_json(obj: Mapping[str, Any] | None) -> BlobRef | None:
    return None if obj is None else BlobRef(obj["ref"], obj["size_bytes"], obj["sha256"])


def encode_record(record: JobRecord) -> bytes:
    """The record as compact JSON: keys in field order, empty values (None, "", {}) left out, except
    `outputs`, always written (as it always was). Written out field by field rather than looping
    over dataclasses.fields() with dataclasses.asdict: several times faster, and every record write
    goes through here. tests/test_record_codec.py holds it to the generic encoder's bytes."""
    r = record
    obj: dict[str, Any] = {}
    for key, text in (
        ("job_id", r.job_id),
        ("tenant", r.tenant),
        ("model_name", r.model_name),
        ("model_version", r.model_version),
    ):
        if text != "":
            obj[key] = text
    obj["state"] = r.state.value
    obj["priority"] = r.priority.value
    obj["create_time"] = r.create_time
    obj["update_time"] = r.update_time
    obj["max_attempts"] = r.max_attempts
    obj["result_retention_s"] = r.result_retention_s
    obj["attempt"] = r.attempt
    if r.labels:
        obj["labels"] = dict(r.labels)
    if r.idempotency_key != "":
        obj["idempotency_key"] = r.idempotency_key
    for key, number in (
        ("start_time", r.start_time),
        ("end_time", r.end_time),
        ("queue_duration_s", r.queue_duration_s),
        ("run_duration_s", r.run_duration_s),
        ("deadline", r.deadline),
        ("execution_timeout_s", r.execution_timeout_s),
    ):
        if number is not None:
            obj[key] = number
    if r.batch is not None:
        obj["batch"] = {
            "batcher_id": r.batch.batcher_id,
            "batch_size": r.batch.batch_size,
            "compute_s": r.batch.compute_s,
        }
    if r.error is not None:
        obj["error"] = error_to_json(r.error)
    if r.last_error is not None:
        obj["last_error"] = error_to_json(r.last_error)
    obj["outputs"] = [_tensor_to_json(t) for t in r.outputs]
    if r.result_ref is not None:
        obj["result_ref"] = _blob_to_json(r.result_ref)
    if r.input_ref is not None:
        obj["input_ref"] = _blob_to_json(r.input_ref)
    if r.callback is not None:
        obj["callback"] = {"url": r.callback.url, "events": list(r.callback.events)}
    if r.batcher_id != "":
        obj["batcher_id"] = r.batcher_id
    return json.dumps(obj, separators=(",", ":")).encode()


def _blob_to_json(blob: BlobRef) -> dict[str, Any]:
    return {"ref": blob.ref, "size_bytes": blob.size_bytes, "sha256": blob.sha256}


def decode_record(data: bytes, revision: int = 0) -> JobRecord:
    obj = json.loads(data)
    batch = obj.get("batch")
    callback = obj.get("callback")
    return JobRecord(
        job_id=obj["job_id"],
        tenant=obj["tenant"],
        model_name=obj["model_name"],
        model_version=obj.get("model_version", ""),
        state=JobState(obj["state"]),
        priority=Priority(obj["priority"]),
        create_time=obj["create_time"],
        update_time=obj["update_time"],
        max_attempts=obj["max_attempts"],
        result_retention_s=obj["result_retention_s"],
        attempt=obj.get("attempt", 0),
        labels=obj.get("labels", {}),
        idempotency_key=obj.get("idempotency_key", ""),
        start_time=obj.get("start_time"),
        end_time=obj.get("end_time"),
        queue_duration_s=obj.get("queue_duration_s"),
        run_duration_s=obj.get("run_duration_s"),
        deadline=obj.get("deadline"),
        execution_timeout_s=obj.get("execution_timeout_s"),
        batch=BatchInfo(**batch) if batch else None,
        error=error_from_json(obj.get("error")),
        last_error=error_from_json(obj.get("last_error")),
        outputs=tuple(_tensor_from_json(t) for t in obj.get("outputs", ())),
        result_ref=_blob_from_json(obj.get("result_ref")),
        input_ref=_blob_from_json(obj.get("input_ref")),
        callback=CallbackSpec(callback["url"], tuple(callback.get("events", ()))) if callback else None,
        batcher_id=obj.get("batcher_id", ""),
        revision=revision,
    )


def encode_envelope(envelope: WorkEnvelope) -> bytes:
    obj: dict[str, Any] = {
        "job_id": envelope.job_id,
        "tenant": envelope.tenant,
        "model_name": envelope.model_name,
        "model_version": envelope.model_version,
        "priority": envelope.priority.value,
        "create_time": envelope.create_time,
        "max_attempts": envelope.max_attempts,
    }
    if envelope.inputs:
        obj["inputs"] = [_tensor_to_json(t) for t in envelope.inputs]
    if envelope.input_ref is not None:
        obj["input_ref"] = _blob_to_json(envelope.input_ref)
    if envelope.deadline is not None:
        obj["deadline"] = envelope.deadline
    if envelope.execution_timeout_s is not None:
        obj["execution_timeout_s"] = envelope.execution_timeout_s
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_envelope(data: bytes) -> WorkEnvelope:
    obj = json.loads(data)
    return WorkEnvelope(
        job_id=obj["job_id"],
        tenant=obj["tenant"],
        model_name=obj["model_name"],
        model_version=obj.get("model_version", ""),
        priority=Priority(obj["priority"]),
        create_time=obj["create_time"],
        max_attempts=obj["max_attempts"],
        inputs=tuple(_tensor_from_json(t) for t in obj.get("inputs", ())),
        input_ref=_blob_from_json(obj.get("input_ref")),
        deadline=obj.get("deadline"),
        execution_timeout_s=obj.get("execution_timeout_s"),
    )
