"""A job's error (asyncinfer.jobs.JobError) as the `ErrorStatus` the services' answers carry: a
Job's `error` and `last_error` and a bulk item's refusal (the gateway), a dead letter's
`last_error` and a model control's outcome (the scheduler's OpsService). One conversion, so that
every answer says an error alike (the gateway and the scheduler each had a copy)."""

from __future__ import annotations

from asyncinfer.jobs import JobError
from asyncinfer.v1 import error_pb2


def error_to_proto(error: JobError) -> error_pb2.ErrorStatus:
    return error_pb2.ErrorStatus(
        code=error.code,
        reason=error.reason,
        message=error.message,
        field_violations=[error_pb2.FieldViolation(field=v.field, description=v.description) for v in error.violations],
        retriable=error.retriable,
        metadata=dict(error.metadata),
    )
