"""The gateway's span of a submit (asyncinfer.tracing): `submit`, a child of the caller's
traceparent (gRPC metadata), whose own traceparent the job's record carries on to the scheduler.
Off, a submit builds nothing of it: no metadata scan, no span, an empty traceparent."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from asyncinfer.tracing import Tracing, traceparent_in
from asyncinfer.v1 import job_service_pb2
from services.gateway.idempotency import SubmitOutcome

# One submit, handed the traceparent its record is to carry.
Submit = Coroutine[Any, Any, SubmitOutcome]
SubmitTraced = Callable[[job_service_pb2.SubmitJobRequest, str, str], Submit]


def caller_trace(tracing: Tracing, context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The caller's traceparent, read only when tracing is on (off: not even a metadata read)."""
    return traceparent_in(context.invocation_metadata()) if tracing.enabled else ""


def traced_submit(
    tracing: Tracing,
    submit: SubmitTraced,
    request: job_service_pb2.SubmitJobRequest,
    tenant: str,
    caller_trace: str,
) -> Submit:
    """`submit`, in a span when tracing is on. Off, `submit`'s own coroutine: no frame between the
    servicer and the submit (the hot path is a few microseconds a job)."""
    if not tracing.enabled:
        return submit(request, tenant, "")
    return _in_span(tracing, submit, request, tenant, caller_trace)


async def _in_span(
    tracing: Tracing,
    submit: SubmitTraced,
    request: job_service_pb2.SubmitJobRequest,
    tenant: str,
    caller_trace: str,
) -> SubmitOutcome:
    attributes = {"asyncinfer.model": request.model_name, "asyncinfer.tenant": tenant}
    with tracing.span("submit", parent=caller_trace, server=True, attributes=attributes) as span:
        outcome = await submit(request, tenant, span.traceparent)
        span.set("asyncinfer.job_id", outcome.record.job_id)
        span.set("asyncinfer.deduplicated", outcome.deduplicated)
        return outcome
