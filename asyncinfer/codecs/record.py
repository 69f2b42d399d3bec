"""The job record's codec (the jobs bucket, key `<tenant>.<job_id>`): every record write and read
goes through here, on the gateway and the scheduler alike.

Version 1: version 0's fields (the same names, order and types) with `v` first and every default
left out (version 0 always wrote `attempt` and `outputs`; its readers took them as optional).
Fields added since, with defaults: `batcher_id`, `progress` (the latest progress kept),
`traceparent` (the submit span's W3C trace context, when tracing is on), `claim_revision` and
`claim_fingerprint` (a keyed job's idempotency claim, to cut its TTL when the job ends),
`queued_server_time` (nats-server's stamp on the work message its latest dispatch pulled),
`failed_attempts` (the attempts that failed and were retried since the submit or the last replay),
`given_back_attempts` (the attempts given back, over the job's life), `handed_back_in_a_row` (the
batchers' hand-backs since the last attempt that ran), `handed_back_by` (of those, the batchers
that handed it back no longer serving its version), `dead_letter_sequence` (a dead-lettered job's letter
in the dead-letter stream)."""

from __future__ import annotations

import msgspec

from asyncinfer.codecs.parts import (
    BlobRefWire,
    ErrorWire,
    ProgressWire,
    TensorWire,
    blob_from_wire,
    blob_to_wire,
    error_from_wire,
    error_to_wire,
    progress_from_wire,
    progress_to_wire,
    tensors_from_wire,
    tensors_to_wire,
)
from asyncinfer.jobs import BatchInfo, CallbackSpec, JobRecord, JobState, Priority

VERSION = 1


class BatchWire(msgspec.Struct):
    batcher_id: str
    batch_size: int
    compute_s: float


class CallbackWire(msgspec.Struct):
    url: str
    events: tuple[str, ...] = ()


class RecordWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 0  # missing: version 0
    job_id: str
    tenant: str
    model_name: str
    model_version: str = ""
    state: JobState
    priority: Priority
    create_time: float
    update_time: float
    max_attempts: int
    result_retention_s: float
    attempt: int = 0
    labels: dict[str, str] = {}
    idempotency_key: str = ""
    start_time: float | None = None
    end_time: float | None = None
    queue_duration_s: float | None = None
    run_duration_s: float | None = None
    deadline: float | None = None
    execution_timeout_s: float | None = None
    batch: BatchWire | None = None
    error: ErrorWire | None = None
    last_error: ErrorWire | None = None
    outputs: tuple[TensorWire, ...] = ()
    result_ref: BlobRefWire | None = None
    input_ref: BlobRefWire | None = None
    callback: CallbackWire | None = None
    batcher_id: str = ""
    progress: ProgressWire | None = None  # added in version 1 (a default: older readers skip it)
    dispatched_by: str = ""
    lease_subject: str = ""
    traceparent: str = ""  # added in version 1 (a default: older readers skip it)
    claim_revision: int = 0  # added in version 1 (defaults: older readers skip them)
    claim_fingerprint: str = ""
    queued_server_time: float | None = None  # added in version 1 (a default: older readers skip it)
    failed_attempts: int = 0  # added in version 1 (a default: older readers skip it)
    given_back_attempts: int = 0  # added in version 1 (a default: older readers skip it)
    handed_back_in_a_row: int = 0  # added in version 1 (a default: older readers skip it)
    handed_back_by: tuple[str, ...] = ()  # added in version 1 (a default: older readers skip it)
    dead_letter_sequence: int = 0  # added in version 1 (a default: older readers skip it)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RecordWire)


def encode_record(record: JobRecord) -> bytes:
    r = record
    batch, callback = r.batch, r.callback
    return _encoder.encode(
        RecordWire(
            v=VERSION,
            job_id=r.job_id,
            tenant=r.tenant,
            model_name=r.model_name,
            model_version=r.model_version,
            state=r.state,
            priority=r.priority,
            create_time=r.create_time,
            update_time=r.update_time,
            max_attempts=r.max_attempts,
            result_retention_s=r.result_retention_s,
            attempt=r.attempt,
            labels=dict(r.labels),
            idempotency_key=r.idempotency_key,
            start_time=r.start_time,
            end_time=r.end_time,
            queue_duration_s=r.queue_duration_s,
            run_duration_s=r.run_duration_s,
            deadline=r.deadline,
            execution_timeout_s=r.execution_timeout_s,
            batch=None if batch is None else BatchWire(batch.batcher_id, batch.batch_size, batch.compute_s),
            error=error_to_wire(r.error),
            last_error=error_to_wire(r.last_error),
            outputs=tensors_to_wire(r.outputs),
            result_ref=blob_to_wire(r.result_ref),
            input_ref=blob_to_wire(r.input_ref),
            callback=None if callback is None else CallbackWire(callback.url, callback.events),
            batcher_id=r.batcher_id,
            progress=progress_to_wire(r.progress),
            dispatched_by=r.dispatched_by,
            lease_subject=r.lease_subject,
            traceparent=r.traceparent,
            claim_revision=r.claim_revision,
            claim_fingerprint=r.claim_fingerprint,
            queued_server_time=r.queued_server_time,
            failed_attempts=r.failed_attempts,
            given_back_attempts=r.given_back_attempts,
            handed_back_in_a_row=r.handed_back_in_a_row,
            handed_back_by=r.handed_back_by,
            dead_letter_sequence=r.dead_letter_sequence,
        )
    )


def decode_record(data: bytes, revision: int = 0) -> JobRecord:
    """The record in `data` (any version), read at KV revision `revision`. ValueError, whatever is
    wrong with it (not JSON, a field missing or of another shape, a state or priority this release
    does not know: a later release's, written during a rolling upgrade), so that a reader skips one
    record with one `except` (asyncinfer.job_store.UnreadableJob)."""
    try:
        return _decoded(data, revision)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a job record: {type(exc).__name__}: {exc}") from exc


def _decoded(data: bytes, revision: int) -> JobRecord:
    w = _decoder.decode(data)
    batch, callback = w.batch, w.callback
    return JobRecord(
        job_id=w.job_id,
        tenant=w.tenant,
        model_name=w.model_name,
        model_version=w.model_version,
        state=w.state,
        priority=w.priority,
        create_time=w.create_time,
        update_time=w.update_time,
        max_attempts=w.max_attempts,
        result_retention_s=w.result_retention_s,
        attempt=w.attempt,
        labels=w.labels,
        idempotency_key=w.idempotency_key,
        start_time=w.start_time,
        end_time=w.end_time,
        queue_duration_s=w.queue_duration_s,
        run_duration_s=w.run_duration_s,
        deadline=w.deadline,
        execution_timeout_s=w.execution_timeout_s,
        batch=None if batch is None else BatchInfo(batch.batcher_id, batch.batch_size, batch.compute_s),
        error=error_from_wire(w.error),
        last_error=error_from_wire(w.last_error),
        outputs=tensors_from_wire(w.outputs),
        result_ref=blob_from_wire(w.result_ref),
        input_ref=blob_from_wire(w.input_ref),
        callback=None if callback is None else CallbackSpec(callback.url, callback.events),
        batcher_id=w.batcher_id,
        progress=progress_from_wire(w.progress),
        dispatched_by=w.dispatched_by,
        lease_subject=w.lease_subject,
        traceparent=w.traceparent,
        claim_revision=w.claim_revision,
        claim_fingerprint=w.claim_fingerprint,
        queued_server_time=w.queued_server_time,
        failed_attempts=w.failed_attempts,
        given_back_attempts=w.given_back_attempts,
        handed_back_in_a_row=w.handed_back_in_a_row,
        handed_back_by=tuple(w.handed_back_by),
        dead_letter_sequence=w.dead_letter_sequence,
        revision=revision,
    )
