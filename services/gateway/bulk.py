"""SubmitJobs: bulk submission over one bidirectional stream, one answer per request, in order.

Several submits run at once (up to `window` one-job messages, and up to MAX_JOBS_IN_FLIGHT jobs
in all), so a stream is not one NATS round trip per record, while answers still leave in request
order: a reader task reads requests, starts each one-job submit, or each many-jobs message's
submit as one, as a task and queues it; the response side awaits the queued tasks in order. When
the window is full the reader stops reading, gRPC flow control stops the client, and memory stays
bounded however large the client's file.

A many-jobs message is submitted as a group (`SubmitMany`: bulk_message.py): its jobs validated
together and their writes published as one pipelined group, each still answered on its own.

An item that fails (invalid, unknown model, over a quota) answers an ErrorStatus for that item and
the stream goes on; only a failure of the stream itself (the client cancelled, the gateway stops)
ends it. A submit whose stream ended is still seen through by the submitter (its job may already
be queued); its answer is lost, which an idempotency key makes safe to retry.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from asyncinfer.error_bounds import clip_error
from asyncinfer.error_status import error_to_proto
from asyncinfer.errors import AsyncInferError, FieldViolation, InvalidArgument, ResourceExhausted, Unavailable
from asyncinfer.jobs import JobError, JobRecord
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.v1 import error_pb2, job_pb2, job_service_pb2
from services.gateway.idempotency import SubmitOutcome

log = structlog.get_logger("asyncinfer.gateway.bulk")

DEFAULT_WINDOW = 128
# Jobs in flight on one stream, whatever the messages carry: enough for several many-jobs
# messages at once, so one message's acks are awaited while the next is read and published.
MAX_JOBS_IN_FLIGHT = 1024
# The most items one message may carry. Its answer is one message too, each item's a job record
# (a few hundred bytes beyond what the item itself carried), and it must fit the send limit: 9,000
# small items (657 KB) were all queued and their answer (over 5 MiB) never left, so the client
# learnt no job ID. 1,000, as GetJobs, keeps an answer within the limit's headroom.
MAX_ITEMS_PER_MESSAGE = 1000

SubmitOne = Callable[[job_service_pb2.SubmitJobRequest], Coroutine[Any, Any, SubmitOutcome]]
# Each job's outcome (or error), in order.
ItemOutcome = SubmitOutcome | Exception
SubmitMany = Callable[[Sequence[job_service_pb2.SubmitJobRequest]], Coroutine[Any, Any, list[ItemOutcome]]]
ToJob = Callable[[JobRecord], job_pb2.Job]


def error_status(error: AsyncInferError) -> error_pb2.ErrorStatus:
    """The per-item form of what a unary call would answer as a rich status: its RetryInfo delay
    in `retry_after` (no metadata: the messages name the job)."""
    retriable = isinstance(error, Unavailable | ResourceExhausted)
    # Bounded like a unary call's status: one item can quote thousands of bad tensors.
    status = error_to_proto(JobError.from_exception(clip_error(error), retriable=retriable))
    if isinstance(error, ResourceExhausted) and error.retry_after_s:
        status.retry_after.FromNanoseconds(round(error.retry_after_s * 1e9))
    return status


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


@dataclass(frozen=True, slots=True)
class _One:
    """A one-job message's submit."""

    index: int
    correlation_id: str
    task: asyncio.Task[SubmitOutcome]


@dataclass(frozen=True, slots=True)
class _Many:
    """A many-jobs message's submit: its first job's index on the stream, its items' correlation
    IDs, and the jobs it holds of the stream's MAX_JOBS_IN_FLIGHT."""

    index: int
    correlation_ids: tuple[str, ...]
    task: asyncio.Task[list[ItemOutcome]]
    units: int


async def _read(
    requests: AsyncIterator[job_service_pb2.SubmitJobsRequest],
    submit_one: SubmitOne,
    submit_many: SubmitMany,
    pending: asyncio.Queue[_One | _Many | _End],
    room: asyncio.Semaphore,
) -> None:
    index = 0
    try:
        async for request in requests:
            if not request.items:
                await room.acquire()
                # Blocks while the window is full: backpressure to the client.
                await pending.put(_One(index, request.correlation_id, _start(submit_one(request.job))))
                index += 1
                continue
            if (refusal := _refusal(request, index)) is not None:
                await pending.put(_End(refusal))
                return
            units = min(len(request.items), MAX_JOBS_IN_FLIGHT)
            for _ in range(units):
                await room.acquire()
            jobs = [item.job for item in request.items]
            task = _start(submit_many(jobs))
            await pending.put(_Many(index, tuple(item.correlation_id for item in request.items), task, units))
            index += len(jobs)
    except asyncio.CancelledError:
        raise  # the response side is gone; nobody reads the queue any more
    except Exception as error:
        await pending.put(_End(error))
        return
    await pending.put(_End())


def _refusal(request: job_service_pb2.SubmitJobsRequest, index: int) -> InvalidArgument | None:
    """Why a many-jobs message cannot be taken, if it cannot: it then ends the stream, after the
    answers to the messages before it, and nothing of it is queued."""
    if len(request.items) > MAX_ITEMS_PER_MESSAGE:
        return InvalidArgument(
            f"at most {MAX_ITEMS_PER_MESSAGE} items per SubmitJobs message; the message at job index {index} has "
            f"{len(request.items)} (nothing of it was queued; send them in several messages)",
            [FieldViolation("items", f"{len(request.items)} items; at most {MAX_ITEMS_PER_MESSAGE}")],
            reason="TOO_MANY_ITEMS",
        )
    if request.HasField("job"):
        return InvalidArgument(
            f"a SubmitJobs message carries one job or items, not both; the message at job index {index} has both "
            "(nothing of it was queued)",
            [FieldViolation("job", "set with items: put the job among the items")],
        )
    return None


def _start(submit: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    task = asyncio.create_task(submit)
    # Outcomes are read by the response side; one it never reads (the stream ended) is not an error.
    task.add_done_callback(_retrieve)
    return task


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _answer(
    response: job_service_pb2.SubmitJobsResponse | job_service_pb2.SubmitJobsAnswer,
    index: int,
    correlation_id: str,
    outcome: SubmitOutcome | BaseException,
    to_job: ToJob,
    lines: RepeatedLines,
) -> None:
    """Fills in the answer for one job (the fields of a one-job response and of an answer agree)."""
    response.correlation_id = correlation_id
    response.index = index
    if isinstance(outcome, SubmitOutcome):
        response.job.CopyFrom(to_job(outcome.record))
        response.deduplicated = outcome.deduplicated
    elif isinstance(outcome, AsyncInferError):
        response.error.CopyFrom(error_status(outcome))
    else:
        # Once per interval per exception type (the rest at debug, each with its traceback): a
        # message's submit that fails as a whole fails each of its items alike, a traceback each.
        lines.say(
            log,
            "error",
            "bulk_item_failed",
            kind=type(outcome).__name__,
            index=index,
            error=repr(outcome),
            exc_info=outcome,
        )
        response.error.CopyFrom(_internal())


def _outcome(task: asyncio.Task[SubmitOutcome]) -> SubmitOutcome | BaseException:
    error = task.exception()
    return task.result() if error is None else error


def _outcomes(task: asyncio.Task[list[ItemOutcome]], count: int) -> Sequence[SubmitOutcome | BaseException]:
    error = task.exception()
    if error is not None:  # the message's submit failed as a whole: every item says so
        return [error] * count
    outcomes = task.result()
    if len(outcomes) != count:
        return [RuntimeError(f"{len(outcomes)} outcomes for {count} jobs")] * count
    return outcomes


async def submit_stream(
    requests: AsyncIterator[job_service_pb2.SubmitJobsRequest],
    submit_one: SubmitOne,
    submit_many: SubmitMany,
    to_job: ToJob,
    *,
    lines: RepeatedLines,
    window: int = DEFAULT_WINDOW,
) -> AsyncGenerator[job_service_pb2.SubmitJobsResponse, None]:
    """One SubmitJobsResponse per request, in request order, with up to about `window` one-job
    submits in flight, and MAX_JOBS_IN_FLIGHT jobs in all. `lines`: the service's (shared by its
    streams), for an item that failed unexpectedly."""
    pending: asyncio.Queue[_One | _Many | _End] = asyncio.Queue(maxsize=max(window - 1, 1))
    room = asyncio.Semaphore(MAX_JOBS_IN_FLIGHT)
    reader = asyncio.create_task(_read(requests, submit_one, submit_many, pending, room))
    current: asyncio.Task[Any] | None = None
    try:
        while True:
            item = await pending.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            current = item.task
            await asyncio.wait((current,))  # its outcome, success or error, without raising here
            response = job_service_pb2.SubmitJobsResponse()
            if isinstance(item, _One):
                _answer(response, item.index, item.correlation_id, _outcome(item.task), to_job, lines)
                room.release()
            else:
                outcomes = _outcomes(item.task, len(item.correlation_ids))
                for n, (correlation_id, outcome) in enumerate(zip(item.correlation_ids, outcomes, strict=True)):
                    _answer(response.answers.add(), item.index + n, correlation_id, outcome, to_job, lines)
                for _ in range(item.units):
                    room.release()
            yield response
    finally:
        reader.cancel()
        left: list[asyncio.Task[Any]] = [reader]
        if current is not None and not current.done():
            current.cancel()  # the submit itself is shielded and seen through
            left.append(current)
        while not pending.empty():
            item = pending.get_nowait()
            if not isinstance(item, _End):
                item.task.cancel()  # the submit itself is shielded and seen through
                left.append(item.task)
        await asyncio.gather(*left, return_exceptions=True)
