"""The protobuf edge of the gateway: requests into domain dataclasses, records into `Job`s."""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2

from asyncinfer.errors import FieldViolation, InvalidArgument
from asyncinfer.jobs import BlobRef, CallbackSpec, JobError, JobRecord, Priority
from asyncinfer.tensor_codec import decode_tensors, to_output_proto
from asyncinfer.v1 import error_pb2, job_pb2, job_service_pb2
from services.gateway.queue_view import QueueStanding
from services.gateway.submit import SubmitRequest

_PRIORITY_FROM_PROTO: dict[int, Priority] = {
    job_pb2.PRIORITY_UNSPECIFIED: Priority.NORMAL,
    job_pb2.PRIORITY_HIGH: Priority.HIGH,
    job_pb2.PRIORITY_NORMAL: Priority.NORMAL,
    job_pb2.PRIORITY_LOW: Priority.LOW,
}
_CALLBACK_EVENT_PREFIX = "CALLBACK_EVENT_"


def _seconds(duration: duration_pb2.Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(round(seconds * 1e9))
    return stamp


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


def submit_request_from_proto(request: job_service_pb2.SubmitJobRequest, *, now: float) -> SubmitRequest:
    """Raises InvalidArgument for what cannot be mapped (bad tensors, an unknown priority, both a
    deadline and a queue TTL); the semantic checks are `submit.validate_submit`'s."""
    violations: list[FieldViolation] = []
    priority = _PRIORITY_FROM_PROTO.get(request.priority)
    if priority is None:
        violations.append(FieldViolation("priority", f"unknown priority {request.priority}"))
    deadline: float | None = None
    if request.HasField("deadline") and request.HasField("queue_ttl"):
        violations.append(FieldViolation("queue_ttl", "give a deadline or a queue_ttl, not both"))
    elif request.HasField("deadline"):
        deadline = request.deadline.ToNanoseconds() / 1e9
    elif request.HasField("queue_ttl"):
        ttl = _seconds(request.queue_ttl)
        if ttl <= 0:
            violations.append(FieldViolation("queue_ttl", "must be positive"))
        deadline = now + ttl
    callback: CallbackSpec | None = None
    if request.HasField("callback"):
        events = []
        for event in request.callback.events:
            if event not in job_pb2.CallbackEvent.values() or event == job_pb2.CALLBACK_EVENT_UNSPECIFIED:
                violations.append(FieldViolation("callback.events", f"unknown callback event {event}"))
            else:
                events.append(job_pb2.CallbackEvent.Name(event).removeprefix(_CALLBACK_EVENT_PREFIX))
        callback = CallbackSpec(url=request.callback.url, events=tuple(events))
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
        execution_timeout_s=_seconds(request.execution_timeout) if request.HasField("execution_timeout") else None,
        result_retention_s=_seconds(request.result_retention) if request.HasField("result_retention") else None,
        max_attempts=request.max_attempts,
        labels=dict(request.labels),
        callback=callback,
    )


def error_to_proto(error: JobError) -> error_pb2.ErrorStatus:
    return error_pb2.ErrorStatus(
        code=error.code,
        reason=error.reason,
        message=error.message,
        field_violations=[error_pb2.FieldViolation(field=v.field, description=v.description) for v in error.violations],
        retriable=error.retriable,
    )


def job_to_proto(record: JobRecord, standing: QueueStanding | None = None) -> job_pb2.Job:
    """The Job message; `standing` (computed on read for a QUEUED job) fills `queue`."""
    job = job_pb2.Job(
        job_id=record.job_id,
        model_name=record.model_name,
        model_version=record.model_version,
        state=job_pb2.JobState.Value(f"JOB_STATE_{record.state.value}"),
        priority=job_pb2.Priority.Value(f"PRIORITY_{record.priority.value}"),
        attempt=record.attempt,
        max_attempts=record.max_attempts,
        labels=dict(record.labels),
        idempotency_key=record.idempotency_key,
        create_time=_timestamp(record.create_time),
        update_time=_timestamp(record.update_time),
        result_retention=_duration(record.result_retention_s),
        outputs=[to_output_proto(t) for t in record.outputs],
        revision=record.revision,
    )
    if record.start_time is not None:
        job.start_time.CopyFrom(_timestamp(record.start_time))
    if record.end_time is not None:
        job.end_time.CopyFrom(_timestamp(record.end_time))
        job.expire_time.CopyFrom(_timestamp(record.end_time + record.result_retention_s))
    if record.queue_duration_s is not None:
        job.queue_duration.CopyFrom(_duration(record.queue_duration_s))
    if record.run_duration_s is not None:
        job.run_duration.CopyFrom(_duration(record.run_duration_s))
    if record.deadline is not None:
        job.deadline.CopyFrom(_timestamp(record.deadline))
    if record.execution_timeout_s is not None:
        job.execution_timeout.CopyFrom(_duration(record.execution_timeout_s))
    if record.batch is not None:
        job.batch.CopyFrom(
            job_pb2.BatchInfo(
                batcher_id=record.batch.batcher_id,
                batch_size=record.batch.batch_size,
                compute_duration=_duration(record.batch.compute_s),
            )
        )
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
        job.queue.waiting_reason = job_pb2.WaitingReason.Value(f"WAITING_REASON_{standing.waiting_reason}")
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
