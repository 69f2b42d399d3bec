"""SubmitJobs: bulk submission over one bidirectional stream, one answer per request, in order.

Several submits run at once (up to `window`), so a stream is not one NATS round trip per record,
while answers still leave in request order: a reader task reads requests, starts each submit as a
task and queues it; the response side awaits the queued tasks in order. When `window` submits are
in flight the reader stops reading, gRPC flow control stops the client, and memory stays bounded
however large the client's file.

An item that fails (invalid, unknown model, over a quota) answers an ErrorStatus for that item and
the stream goes on; only a failure of the stream itself (the client cancelled, the gateway stops)
ends it. A submit whose stream ended is still seen through by the submitter (its job may already
be queued); its answer is lost, which an idempotency key makes safe to retry.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from asyncinfer.error_bounds import clip_error
from asyncinfer.errors import AsyncInferError, ResourceExhausted, Unavailable
from asyncinfer.jobs import JobError, JobRecord
from asyncinfer.v1 import error_pb2, job_pb2, job_service_pb2
from services.gateway.convert import error_to_proto
from services.gateway.idempotency import SubmitOutcome

log = structlog.get_logger("asyncinfer.gateway.bulk")

DEFAULT_WINDOW = 128

SubmitOne = Callable[[job_service_pb2.SubmitJobRequest], Coroutine[Any, Any, SubmitOutcome]]
ToJob = Callable[[JobRecord], job_pb2.Job]


def error_status(error: AsyncInferError) -> error_pb2.ErrorStatus:
    """The per-item form of what a unary call would answer as a rich status (no metadata or
    RetryInfo there: the messages name the job or the delay)."""
    retriable = isinstance(error, Unavailable | ResourceExhausted)
    # Bounded like a unary call's status: one item can quote thousands of bad tensors.
    return error_to_proto(JobError.from_exception(clip_error(error), retriable=retriable))


def _internal() -> error_pb2.ErrorStatus:
    return error_pb2.ErrorStatus(
        code=grpc.StatusCode.INTERNAL.value[0],
        reason="INTERNAL",
        message="internal error while submitting this item; it may be retried",
        retriable=True,
    )


@dataclass(frozen=True, slots=True)
class _End:
    """The reader's last word: the request stream ended (error None) or failed."""

    error: BaseException | None = None


# (index, correlation_id, the submit, its place in a many-jobs message: None for a one-job
# message, else whether it is that message's last item).
_Item = tuple[int, str, "asyncio.Task[SubmitOutcome]", bool | None]


async def _read(
    requests: AsyncIterator[job_service_pb2.SubmitJobsRequest],
    submit_one: SubmitOne,
    pending: asyncio.Queue[_Item | _End],
) -> None:
    index = 0
    try:
        async for request in requests:
            if not request.items:
                await pending.put((index, request.correlation_id, _start(submit_one, request.job), None))
                index += 1
                continue
            last = len(request.items) - 1
            for position, item in enumerate(request.items):
                # Blocks while the window is full: backpressure to the client.
                await pending.put((index, item.correlation_id, _start(submit_one, item.job), position == last))
                index += 1
    except asyncio.CancelledError:
        raise  # the response side is gone; nobody reads the queue any more
    except Exception as error:
        await pending.put(_End(error))
        return
    await pending.put(_End())


def _start(submit_one: SubmitOne, request: job_service_pb2.SubmitJobRequest) -> asyncio.Task[SubmitOutcome]:
    task = asyncio.create_task(submit_one(request))
    # Outcomes are read by the response side; one it never reads (the stream ended) is not an error.
    task.add_done_callback(_retrieve)
    return task


def _retrieve(task: asyncio.Task[SubmitOutcome]) -> None:
    if not task.cancelled():
        task.exception()


def _answer(
    response: job_service_pb2.SubmitJobsResponse | job_service_pb2.SubmitJobsAnswer,
    index: int,
    correlation_id: str,
    task: asyncio.Task[SubmitOutcome],
    to_job: ToJob,
) -> None:
    """Fills in the answer for one job (the fields of a one-job response and of an answer agree)."""
    response.correlation_id = correlation_id
    response.index = index
    error = task.exception()
    if error is None:
        outcome = task.result()
        response.job.CopyFrom(to_job(outcome.record))
        response.deduplicated = outcome.deduplicated
    elif isinstance(error, AsyncInferError):
        response.error.CopyFrom(error_status(error))
    else:
        log.error("bulk_item_failed", index=index, error=repr(error), exc_info=error)
        response.error.CopyFrom(_internal())


async def submit_stream(
    requests: AsyncIterator[job_service_pb2.SubmitJobsRequest],
    submit_one: SubmitOne,
    to_job: ToJob,
    *,
    window: int = DEFAULT_WINDOW,
) -> AsyncGenerator[job_service_pb2.SubmitJobsResponse, None]:
    """One SubmitJobsResponse per request, in request order, with up to about `window` submits
    in flight."""
    pending: asyncio.Queue[_Item | _End] = asyncio.Queue(maxsize=max(window - 1, 1))
    reader = asyncio.create_task(_read(requests, submit_one, pending))
    current: asyncio.Task[SubmitOutcome] | None = None
    answers: job_service_pb2.SubmitJobsResponse | None = None  # a many-jobs message's, being filled
    try:
        while True:
            item = await pending.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            index, correlation_id, current, last_in_message = item
            await asyncio.wait((current,))  # its outcome, success or error, without raising here
            if last_in_message is None:
                response = job_service_pb2.SubmitJobsResponse()
                _answer(response, index, correlation_id, current, to_job)
                yield response
                continue
            if answers is None:
                answers = job_service_pb2.SubmitJobsResponse()
            _answer(answers.answers.add(), index, correlation_id, current, to_job)
            if last_in_message:
                yield answers
                answers = None
    finally:
        reader.cancel()
        left: list[asyncio.Task[object]] = [reader]
        if current is not None and not current.done():
            current.cancel()  # the submit itself is shielded and seen through
            left.append(current)
        while not pending.empty():
            item = pending.get_nowait()
            if not isinstance(item, _End):
                item[2].cancel()  # the submit itself is shielded and seen through
                left.append(item[2])
        await asyncio.gather(*left, return_exceptions=True)
