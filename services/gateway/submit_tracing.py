"""The gateway's span of a submit (asyncinfer.tracing): `submit`, a child of the caller's
traceparent (gRPC metadata), whose own traceparent the job's record carries on to the scheduler.
Off, a submit builds nothing of it: no metadata scan, no span, an empty traceparent."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from asyncinfer.tracing import Tracing, traceparent_in
from asyncinfer.v1 import job_service_pb2
from services.gateway.idempotency import SubmitOutcome

# One submit, handed the traceparent its record is to carry.
SubmitTraced = Callable[[job_service_pb2.SubmitJobRequest, str, str], Awaitable[SubmitOutcome]]


def caller_trace(tracing: Tracing, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The caller's traceparent, read only when tracing is on (off: not even a metadata scan)."""
    return traceparent_in(metadata) if tracing.enabled else ""


async def traced_submit(
    tracing: Tracing,
    submit: SubmitTraced,
    request: job_service_pb2.SubmitJobRequest,
    tenant: str,
    caller_trace: str,
) -> SubmitOutcome:
    """`submit`, in a span when tracing is on."""
    if not tracing.enabled:
        return await submit(request, tenant, "")
    attributes = {"asyncinfer.model": request.model_name, "asyncinfer.tenant": tenant}
    with tracing.span("submit", parent=caller_trace, server=True, attributes=attributes) as span:
        outcome = await submit(request, tenant, span.traceparent)
        span.set("asyncinfer.job_id", outcome.record.job_id)
        span.set("asyncinfer.deduplicated", outcome.deduplicated)
        return outcome
