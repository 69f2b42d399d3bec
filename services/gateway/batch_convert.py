"""The protobuf edge of BatchService: CreateBatchRequest into a new BatchRecord (with its checks),
BatchRecord into `Batch`."""

from __future__ import annotations

from collections.abc import Mapping

from asyncinfer.batch_webhooks import ERROR_FILE as ERROR_FILE
from asyncinfer.batch_webhooks import OUTPUT_FILE as OUTPUT_FILE
from asyncinfer.batch_webhooks import error_ref, has_files, output_ref
from asyncinfer.batches import BatchRecord, BatchState, InputFormat, progress_rate
from asyncinfer.blob_meta import INPUT_KIND
from asyncinfer.config import Config
from asyncinfer.errors import FieldViolation, InvalidArgument
from asyncinfer.jobs import Priority
from asyncinfer.proto_durations import checked_duration
from asyncinfer.tracing import trace_id_of, trace_sampled_of
from asyncinfer.v1 import batch_service_pb2, job_pb2
from asyncinfer.webhook_status import CallbackEvent
from services.gateway.convert import callback_from_proto
from services.gateway.model_catalog import ModelCatalog
from services.gateway.submit_request import (
    MAX_IDEMPOTENCY_KEY_BYTES,
    callback_url_violations,
    label_violations,
    resolve_model,
)

_STATE_TO_PROTO = {state: batch_service_pb2.BatchState.Value(f"BATCH_STATE_{state.value}") for state in BatchState}
_FORMAT_FROM_PROTO = {
    batch_service_pb2.BATCH_INPUT_FORMAT_JSONL: InputFormat.JSONL,
    batch_service_pb2.BATCH_INPUT_FORMAT_NPY: InputFormat.NPY,
    batch_service_pb2.BATCH_INPUT_FORMAT_NPZ: InputFormat.NPZ,
}
_FORMAT_TO_PROTO = {fmt: value for value, fmt in _FORMAT_FROM_PROTO.items()}
_PRIORITY_FROM_PROTO = {
    job_pb2.PRIORITY_UNSPECIFIED: Priority.LOW,  # a batch gives way to interactive jobs by default
    job_pb2.PRIORITY_HIGH: Priority.HIGH,
    job_pb2.PRIORITY_NORMAL: Priority.NORMAL,
    job_pb2.PRIORITY_LOW: Priority.LOW,
}
_PRIORITY_TO_PROTO = {p: v for v, p in _PRIORITY_FROM_PROTO.items() if v != job_pb2.PRIORITY_UNSPECIFIED}


def fields_unlike(
    request: batch_service_pb2.CreateBatchRequest,
    candidate: BatchRecord,
    first: BatchRecord,
    *,
    same_input: bool | None = None,
) -> list[str]:
    """The fields in which a create that reuses an idempotency key asks for something other than
    the batch holding the key (`candidate`: the batch this create would have made). A field the
    create left to its default is compared only where the default cannot have changed since the
    first create (a model's default version or attempts can, by a hot update), and a format the
    first create left to detection only once it was detected. `same_input`: whether two different
    refs hold the same content (a retry that uploaded the file again), as the caller found it;
    None compares the refs."""
    unlike = []
    if candidate.model_name != first.model_name:
        unlike.append("model_name")
    if request.model_version and candidate.model_version != first.model_version:
        unlike.append("model_version")
    if not (candidate.input_ref == first.input_ref if same_input is None else same_input):
        unlike.append("input_ref")
    if None not in (candidate.input_format, first.input_format) and candidate.input_format is not first.input_format:
        unlike.append("input_format")
    if candidate.priority is not first.priority:
        unlike.append("priority")
    if request.max_attempts and candidate.max_attempts != first.max_attempts:
        unlike.append("max_attempts")
    window_s, first_window_s = candidate.expires_at - candidate.create_time, first.expires_at - first.create_time
    if request.HasField("completion_window") and abs(window_s - first_window_s) > 1e-3:
        unlike.append("completion_window")
    if dict(candidate.labels) != dict(first.labels):
        unlike.append("labels")
    if candidate.callback != first.callback:
        unlike.append("callback")
    return unlike


def _invalid(violations: list[FieldViolation]) -> InvalidArgument:
    first = violations[0]
    return InvalidArgument(f"invalid batch: {first.field}: {first.description}", violations)


def batch_from_request(
    request: batch_service_pb2.CreateBatchRequest,
    config: Config,
    *,
    tenant: str,
    batch_id: str,
    now: float,
    catalog: ModelCatalog | None = None,
) -> BatchRecord:
    """The new batch (VALIDATING); NotFound for an unknown model, InvalidArgument with every
    violation found. `catalog`: the models known now, those loaded at runtime too (else the
    configuration's alone)."""
    model = resolve_model(config, request.model_name, request.model_version, catalog)
    settings = config.batches
    violations: list[FieldViolation] = []
    if not request.input_ref.startswith(INPUT_KIND + "/"):
        violations.append(FieldViolation("input_ref", "give the ref UploadInput returned for the file"))
    window_s = settings.default_completion_window_s
    if request.HasField("completion_window"):
        window = checked_duration(request.completion_window, "completion_window", violations)
        window_s = window if window is not None else window_s
        if window is not None and not 0 < window <= settings.max_completion_window_s:
            violations.append(
                FieldViolation(
                    "completion_window",
                    f"must be positive and at most {settings.max_completion_window_s:g} s "
                    "(batches.max_completion_window_s)",
                )
            )
    if request.input_format and request.input_format not in _FORMAT_FROM_PROTO:
        violations.append(FieldViolation("input_format", f"unknown input format {request.input_format}"))
    if request.priority not in _PRIORITY_FROM_PROTO:
        violations.append(FieldViolation("priority", f"unknown priority {request.priority}"))
    if not 0 <= request.max_attempts <= model.max_attempts_limit:
        violations.append(
            FieldViolation("max_attempts", f"must be between 1 and {model.max_attempts_limit} (0: the model's default)")
        )
    if len(request.idempotency_key.encode()) > MAX_IDEMPOTENCY_KEY_BYTES:
        violations.append(FieldViolation("idempotency_key", f"at most {MAX_IDEMPOTENCY_KEY_BYTES} bytes (UTF-8)"))
    labels: Mapping[str, str] = dict(request.labels)
    violations += label_violations(labels)
    callback = None
    if request.HasField("callback"):
        callback, callback_violations = callback_from_proto(request.callback)
        violations += callback_url_violations(callback.url) + callback_violations
        if CallbackEvent.RUNNING.value in callback.events:
            violations.append(
                FieldViolation("callback.events", "a batch sends only its end (COMPLETED, FAILED, CANCELED)")
            )
    if violations:
        raise _invalid(violations)
    return BatchRecord(
        batch_id=batch_id,
        tenant=tenant,
        model_name=model.name,
        model_version=model.version,
        input_ref=request.input_ref,
        input_format=_FORMAT_FROM_PROTO.get(request.input_format),
        state=BatchState.VALIDATING,
        priority=_PRIORITY_FROM_PROTO[request.priority],
        max_attempts=request.max_attempts or model.max_attempts,
        create_time=now,
        expires_at=now + window_s,
        result_retention_s=config.gateway.default_result_retention_s,
        labels=labels,
        idempotency_key=request.idempotency_key,
        callback=callback,
    )


def batch_to_proto(record: BatchRecord, *, now: float) -> batch_service_pb2.Batch:
    counts = record.counts
    batch = batch_service_pb2.Batch(
        batch_id=record.batch_id,
        state=_STATE_TO_PROTO[record.state],
        model_name=record.model_name,
        model_version=record.model_version,
        input_ref=record.input_ref,
        input_format=_FORMAT_TO_PROTO[record.input_format]
        if record.input_format
        else batch_service_pb2.BATCH_INPUT_FORMAT_UNSPECIFIED,
        priority=_PRIORITY_TO_PROTO[record.priority],
        max_attempts=record.max_attempts,
        labels=dict(record.labels),
        idempotency_key=record.idempotency_key,
        request_counts=batch_service_pb2.BatchRequestCounts(
            total=counts.total, completed=counts.completed, failed=counts.failed
        ),
        first_errors=[
            batch_service_pb2.BatchError(line=e.line, custom_id=e.custom_id, code=e.code, message=e.message)
            for e in record.first_errors
        ],
        failure_message=record.failure_message,
        chunks_total=len(record.live_chunks),
        chunks_done=sum(1 for c in record.live_chunks if c.status.value in "DFX"),
        revision=record.revision,
        trace_id=trace_id_of(record.traceparent),
        trace_sampled=trace_sampled_of(record.traceparent),
    )
    batch.create_time.FromNanoseconds(round(record.create_time * 1e9))
    batch.expires_at.FromNanoseconds(round(record.expires_at * 1e9))
    for field, value in (
        ("in_progress_time", record.in_progress_time),
        ("finalizing_time", record.finalizing_time),
        ("end_time", record.end_time),
    ):
        if value is not None:
            getattr(batch, field).FromNanoseconds(round(value * 1e9))
    rate, finish = progress_rate(record, now=now)
    batch.records_per_second = rate
    if finish is not None:
        batch.estimated_finish_time.FromNanoseconds(round(finish * 1e9))
    if record.reading is not None and record.state is BatchState.VALIDATING:
        reading = record.reading
        rate, end = reading.rate()
        progress = batch.read_progress
        progress.bytes_read, progress.bytes_total = reading.bytes_read, reading.bytes_total
        progress.records_read, progress.records_per_second = reading.records, rate
        progress.update_time.FromNanoseconds(round(reading.updated * 1e9))
        if end is not None:
            progress.estimated_end_time.FromNanoseconds(round(end * 1e9))
    if has_files(record):
        batch.output_ref.ref = output_ref(record)
        batch.error_ref.ref = error_ref(record)
    if record.callback is not None:
        batch.callback.url = record.callback.url
    return batch
