"""The protobuf edge of the gateway: requests into domain dataclasses, records into `Job`s."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf import duration_pb2, timestamp_pb2

from asyncinfer.error_status import error_to_proto
from asyncinfer.errors import FieldViolation, InvalidArgument
from asyncinfer.jobs import BlobRef, CallbackSpec, JobRecord, JobState, Priority
from asyncinfer.proto_durations import checked_duration
from asyncinfer.tensor_codec import decode_tensors, to_output_proto
from asyncinfer.tensors import TensorSpec
from asyncinfer.tracing import trace_id_of, trace_sampled_of
from asyncinfer.v1 import job_pb2, job_service_pb2
from services.gateway.model_catalog import ModelListing
from services.gateway.queue_view import QueueStanding
from services.gateway.submit_request import SubmitRequest

_PRIORITY_FROM_PROTO: dict[int, Priority] = {
    job_pb2.PRIORITY_UNSPECIFIED: Priority.NORMAL,
    job_pb2.PRIORITY_HIGH: Priority.HIGH,
    job_pb2.PRIORITY_NORMAL: Priority.NORMAL,
    job_pb2.PRIORITY_LOW: Priority.LOW,
}
_CALLBACK_EVENT_PREFIX = "CALLBACK_EVENT_"
_STATE_TO_PROTO: dict[JobState, job_pb2.JobState.ValueType] = {
    state: job_pb2.JobState.Value(f"JOB_STATE_{state.value}") for state in JobState
}
_PRIORITY_TO_PROTO: dict[Priority, job_pb2.Priority.ValueType] = {
    p: job_pb2.Priority.Value(f"PRIORITY_{p.value}") for p in Priority
}
# queue_view.WaitingReason's names are the proto's without the prefix.
_WAITING_REASON_TO_PROTO: dict[str, job_pb2.WaitingReason.ValueType] = {
    name.removeprefix("WAITING_REASON_"): value for name, value in job_pb2.WaitingReason.items()
}


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(round(seconds * 1e9))
    return stamp


def _set_time(field: Any, seconds: float) -> None:
    """`field.FromNanoseconds(round(seconds * 1e9))` for a Timestamp, or a Duration of at least
    zero (for which both normalize alike), without its Python-level call: 1.4 against 1.9 us."""
    if seconds < 0:
        field.FromNanoseconds(round(seconds * 1e9))
        return
    field.seconds, field.nanos = divmod(round(seconds * 1e9), 1_000_000_000)


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


# What google.protobuf's Timestamp (years 1-9999) and Duration (about ±10,000 years) can hold: a
# value outside them would be accepted, then fail when the job is turned back into a `Job`.
_TIMESTAMP_MIN_S = -62_135_596_800
_TIMESTAMP_MAX_S = 253_402_300_799
_NANOS = 1_000_000_000


def _checked_timestamp(stamp: timestamp_pb2.Timestamp, field: str, violations: list[FieldViolation]) -> float | None:
    # The float sum is checked too: 9999-12-31T23:59:59.999999999 rounds up past the last second.
    value = stamp.seconds + stamp.nanos / 1e9
    if not _TIMESTAMP_MIN_S <= value <= _TIMESTAMP_MAX_S or not 0 <= stamp.nanos < _NANOS:
        violations.append(
            FieldViolation(
                field,
                f"not a valid timestamp (seconds {stamp.seconds}, nanos {stamp.nanos}): seconds lie in years "
                "1-9999 and nanos in 0-999999999",
            )
        )
        return None
    return value


def submit_wait_s(request: job_service_pb2.SubmitJobRequest) -> float:
    """How long a SubmitJob asks to hold its answer for the job to end (0: not at all), from a
    request `submit_request_from_proto` accepted with `wait_allowed`."""
    if not request.HasField("wait"):
        return 0.0
    return max(request.wait.seconds + request.wait.nanos / 1e9, 0.0)


def submit_request_from_proto(
    request: job_service_pb2.SubmitJobRequest, *, now: float, traceparent: str = "", wait_allowed: bool = False
) -> SubmitRequest:
    """Raises InvalidArgument for what cannot be mapped (bad tensors, an unknown priority, both a
    deadline and a queue TTL, a negative wait, or a wait where none is allowed: a SubmitJobs
    item); the semantic checks are `submit_request.validate_submit`'s.
    `traceparent`: the gateway's submit span, when it traces jobs."""
    violations: list[FieldViolation] = []
    if request.HasField("wait"):
        wait = checked_duration(request.wait, "wait", violations)
        if not wait_allowed:
            violations.append(
                FieldViolation(
                    "wait", "only SubmitJob waits for its job; watch a SubmitJobs stream's jobs with WatchJobs"
                )
            )
        elif wait is not None and wait < 0:
            violations.append(FieldViolation("wait", "must not be negative"))
    priority = _PRIORITY_FROM_PROTO.get(request.priority)
    if priority is None:
        violations.append(FieldViolation("priority", f"unknown priority {request.priority}"))
    deadline: float | None = None
    queue_ttl_s: float | None = None
    if request.HasField("deadline") and request.HasField("queue_ttl"):
        violations.append(FieldViolation("queue_ttl", "give a deadline or a queue_ttl, not both"))
    elif request.HasField("deadline"):
        deadline = _checked_timestamp(request.deadline, "deadline", violations)
    elif request.HasField("queue_ttl"):
        queue_ttl_s = ttl = checked_duration(request.queue_ttl, "queue_ttl", violations)
        if ttl is not None and ttl <= 0:
            violations.append(FieldViolation("queue_ttl", "must be positive"))
        elif ttl is not None and now + ttl > _TIMESTAMP_MAX_S:
            violations.append(FieldViolation("queue_ttl", "ends after the year 9999"))
        elif ttl is not None:
            deadline = now + ttl
    execution_timeout_s = (
        checked_duration(request.execution_timeout, "execution_timeout", violations)
        if request.HasField("execution_timeout")
        else None
    )
    result_retention_s = (
        checked_duration(request.result_retention, "result_retention", violations)
        if request.HasField("result_retention")
        else None
    )
    callback: CallbackSpec | None = None
    if request.HasField("callback"):
        callback, callback_violations = callback_from_proto(request.callback)
        violations += callback_violations
    try:
        inputs = tuple(decode_tensors(request.inputs, "inputs"))
    except InvalidArgument as exc:
        violations.extend(exc.violations)
        inputs = ()
    if violations:
        first = violations[0]
        raise InvalidArgument(f"invalid request: {first.field}: {first.description}", violations)
    return SubmitRequest(
        model_name=request.model_name,
        model_version=request.model_version,
        inputs=inputs,
        input_ref=request.input_ref,
        priority=priority or Priority.NORMAL,
        idempotency_key=request.idempotency_key,
        deadline=deadline,
        queue_ttl_s=queue_ttl_s,
        execution_timeout_s=execution_timeout_s,
        result_retention_s=result_retention_s,
        max_attempts=request.max_attempts,
        labels=dict(request.labels),
        callback=callback,
        traceparent=traceparent,
    )


def job_to_proto(record: JobRecord, standing: QueueStanding | None = None) -> job_pb2.Job:
    """The Job message; `standing` (computed on read for a QUEUED job) fills `queue`."""
    # Runs for every submit, read and watch update: times are set in place (FromNanoseconds on the
    # field itself, as _timestamp/_duration do on a new message) rather than built and copied in,
    # and enum values come from tables rather than by name.
    job = job_pb2.Job(
        job_id=record.job_id,
        model_name=record.model_name,
        model_version=record.model_version,
        state=_STATE_TO_PROTO[record.state],
        priority=_PRIORITY_TO_PROTO[record.priority],
        attempt=record.attempt,
        max_attempts=record.max_attempts,
        labels=dict(record.labels),
        idempotency_key=record.idempotency_key,
        outputs=[to_output_proto(t) for t in record.outputs],
        revision=record.revision,
        batcher_id=record.batcher_id,
        given_back_attempts=record.given_back_attempts,
        dead_letter_sequence=record.dead_letter_sequence,
    )
    if record.traceparent:
        job.trace_id = trace_id_of(record.traceparent)
        if (sampled := trace_sampled_of(record.traceparent)) is not None:
            job.trace_sampled = sampled
    _set_time(job.create_time, record.create_time)
    _set_time(job.update_time, record.update_time)
    _set_time(job.result_retention, record.result_retention_s)
    if record.start_time is not None:
        _set_time(job.start_time, record.start_time)
    if record.end_time is not None:
        _set_time(job.end_time, record.end_time)
        _set_time(job.expire_time, record.end_time + record.result_retention_s)
    if record.queue_duration_s is not None:
        _set_time(job.queue_duration, record.queue_duration_s)
    if record.run_duration_s is not None:
        _set_time(job.run_duration, record.run_duration_s)
    if record.deadline is not None:
        _set_time(job.deadline, record.deadline)
    if record.execution_timeout_s is not None:
        _set_time(job.execution_timeout, record.execution_timeout_s)
    if record.batch is not None:
        job.batch.batcher_id = record.batch.batcher_id
        job.batch.batch_size = record.batch.batch_size
        _set_time(job.batch.compute_duration, record.batch.compute_s)
    if record.error is not None:
        job.error.CopyFrom(error_to_proto(record.error))
    if record.last_error is not None:
        job.last_error.CopyFrom(error_to_proto(record.last_error))
    if record.result_ref is not None:
        job.result_ref.CopyFrom(_blob_to_proto(record.result_ref))
    if record.input_ref is not None:
        job.input_ref.CopyFrom(_blob_to_proto(record.input_ref))
    if standing is not None:
        job.queue.position = standing.position
        job.queue.waiting_reason = _WAITING_REASON_TO_PROTO[standing.waiting_reason]
        if standing.estimated_start_time is not None:
            job.queue.estimated_start_time.CopyFrom(_timestamp(standing.estimated_start_time))
    if record.callback is not None:
        job.callback.CopyFrom(
            job_pb2.Callback(
                url=record.callback.url,
                events=[job_pb2.CallbackEvent.Value(_CALLBACK_EVENT_PREFIX + e) for e in record.callback.events],
            )
        )
    return job


def _blob_to_proto(blob: BlobRef) -> job_pb2.BlobRef:
    return job_pb2.BlobRef(ref=blob.ref, size_bytes=blob.size_bytes, sha256=blob.sha256)


_VERSION_STATES = {
    "READY": job_service_pb2.MODEL_VERSION_STATE_READY,
    "LOADING": job_service_pb2.MODEL_VERSION_STATE_LOADING,
    "UNAVAILABLE": job_service_pb2.MODEL_VERSION_STATE_UNAVAILABLE,
}


def models_to_proto(listings: Iterable[ModelListing]) -> job_service_pb2.ListModelsResponse:
    """What ListModels answers: each model's default version's signature and job defaults, then
    every version with its state and the batchers serving it."""

    def specs(tensors: Iterable[TensorSpec]) -> list[job_service_pb2.TensorSpec]:
        return [job_service_pb2.TensorSpec(name=t.name, datatype=t.datatype, shape=t.shape) for t in tensors]

    response = job_service_pb2.ListModelsResponse()
    for listing in listings:
        model = listing.default
        signature = model.signature
        info = job_service_pb2.ModelInfo(
            name=model.name,
            version=model.version,
            inputs=specs(signature.inputs),
            outputs=specs(signature.outputs),
            max_batch_size=model.max_batch_size,
            default_max_attempts=model.max_attempts,
            max_attempts_limit=model.max_attempts_limit,
            default_execution_timeout=_duration(model.default_execution_timeout_s),
            default_version=model.version,
        )
        for version in listing.versions:
            config = version.config
            info.versions.add(
                version=config.version,
                state=_VERSION_STATES[version.state],
                reason=version.reason,
                batchers=version.batchers,
                inputs=specs(config.signature.inputs),
                outputs=specs(config.signature.outputs),
                max_batch_size=config.max_batch_size,
            )
        response.models.append(info)
    return response


def callback_from_proto(callback: job_pb2.Callback) -> tuple[CallbackSpec, list[FieldViolation]]:
    """The callback (its events as CallbackEvent names) and what is wrong with its events (a job's
    and a batch's callback alike; the URL is checked by submit_request.callback_url_violations)."""
    events = []
    violations = []
    for event in callback.events:
        if event not in job_pb2.CallbackEvent.values() or event == job_pb2.CALLBACK_EVENT_UNSPECIFIED:
            violations.append(FieldViolation("callback.events", f"unknown callback event {event}"))
        else:
            events.append(job_pb2.CallbackEvent.Name(event).removeprefix(_CALLBACK_EVENT_PREFIX))
    return CallbackSpec(url=callback.url, events=tuple(events)), violations
