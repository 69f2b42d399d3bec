"""AsyncClient's bulk submits (asyncinfer.client._async): requests streamed through SubmitJobs, a window of
them in flight, those ready together in one message, the unanswered ones sent again on a new stream after a
break."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from dataclasses import dataclass, replace
from typing import Any, cast

import grpc
from grpc import aio

from asyncinfer.client._async_channel import T
from asyncinfer.client._async_jobs import SUBMIT_JOBS_MAX_ITEMS, JobCalls
from asyncinfer.client._convert import (
    Declined,
    error_from_proto,
    explained,
    job_from_proto,
    signature_refused,
    submit_request_to_proto,
    with_idempotency_key,
)
from asyncinfer.client._retry import Deadline
from asyncinfer.client._stream_retry import StreamAttempts
from asyncinfer.client.errors import InternalError
from asyncinfer.client.types import BulkResult, JobRequest
from asyncinfer.v1 import job_service_pb2


@dataclass(slots=True)
class _Pending:
    index: int
    correlation_id: str
    item: job_service_pb2.SubmitJobsItem
    declined: Declined  # inputs the SDK left as they were: a refusal of them says why


async def _finish(writer: asyncio.Task[None]) -> None:
    """Cancels a bulk stream's writer and waits for it; what a broken call made it raise is
    expected (the reader reports the call's status), anything else is a bug and propagates."""
    writer.cancel()
    await asyncio.wait([writer])
    if writer.cancelled():
        return
    error = writer.exception()
    if error is not None and not isinstance(error, grpc.RpcError | asyncio.InvalidStateError | aio.UsageError):
        raise error


async def _aiter(items: AsyncIterable[T] | Iterable[T]) -> AsyncGenerator[T, None]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


class BulkSubmits(JobCalls):
    """AsyncClient's bulk: one SubmitJobs stream, reopened after a break, one BulkResult per request in order."""

    async def bulk(
        self,
        requests: AsyncIterable[JobRequest] | Iterable[JobRequest],
        *,
        window: int = 256,
        items_per_message: int = 64,
        timeout_s: float | None = None,
        traceparent: str = "",
    ) -> AsyncGenerator[BulkResult, None]:
        """Streams `requests` through SubmitJobs and yields one `BulkResult` per request, in order.

        At most `window` requests are in flight (sent and unanswered), so memory stays bounded
        however long the input. Requests that are ready together travel in one message (up to
        `items_per_message`, at most 1,000, the gateway's limit; a request that is alone goes at
        once); 1 sends one per message, for a gateway older than many-jobs messages. Each request without an idempotency key gets a generated one, so
        when the stream breaks (UNAVAILABLE) the unanswered requests are sent again on a new stream
        without queuing anything twice (the answer for a resent request that had been queued says
        `deduplicated`). A refused item is a result with `error`, not an exception. An exception
        raised by your iterator is raised here after the answers for what was already sent.
        `traceparent`: a W3C trace context for the stream; each job's trace is a child of it (as
        `submit`'s)."""
        if window < 1:
            raise ValueError(f"window is the most requests in flight, at least 1; got {window}")
        if isinstance(requests, JobRequest):  # was "'JobRequest' object is not iterable"
            raise TypeError("pass many requests as a list (e.g. [request]), not one JobRequest (or submit it)")
        source = _aiter(requests)
        try:
            bulk = self._bulk(
                source,
                window=window,
                items_per_message=min(max(items_per_message, 1), SUBMIT_JOBS_MAX_ITEMS),
                deadline=Deadline(timeout_s),
                metadata=(*self._metadata, ("traceparent", traceparent)) if traceparent else self._metadata,
            )
            async with contextlib.aclosing(bulk) as results:
                async for result in results:
                    yield result
        finally:
            await source.aclose()

    async def _bulk(
        self,
        source: AsyncGenerator[JobRequest, None],
        *,
        window: int,
        items_per_message: int,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...],
    ) -> AsyncGenerator[BulkResult, None]:
        pending: deque[_Pending] = deque()
        space = asyncio.Event()
        next_index = 0
        source_done = False
        source_error: BaseException | None = None
        attempts = StreamAttempts(self._backoff_or_raise, deadline, on_cancel=self._raise_if_closed_meanwhile)
        # The pull from the caller's iterator runs in its own task, shielded: when a broken stream
        # cancels the writer, a pull in progress carries on for the next stream's writer instead of
        # having CancelledError thrown into the caller's iterator.
        pull: asyncio.Task[tuple[JobRequest, Declined]] | None = None

        def message(group: list[_Pending]) -> job_service_pb2.SubmitJobsRequest:
            if items_per_message == 1:
                return job_service_pb2.SubmitJobsRequest(job=group[0].item.job, correlation_id=group[0].correlation_id)
            return job_service_pb2.SubmitJobsRequest(items=[p.item for p in group])

        async def take() -> bool:
            """Takes the next request from the caller's iterator into `pending`; False at its end."""
            nonlocal next_index, source_done, source_error, pull
            if pull is None:
                pull = asyncio.create_task(self._next_typed(source))
            try:
                request, declined = await asyncio.shield(pull)
                pull = None
                item = job_service_pb2.SubmitJobsItem(
                    job=submit_request_to_proto(with_idempotency_key(request)), correlation_id=request.correlation_id
                )
            except StopAsyncIteration:
                pull = None
                source_done = True
                return False
            except Exception as exc:  # the caller's iterator or a bad request: raised after the answers
                pull = None
                source_error = exc
                source_done = True
                return False
            pending.append(_Pending(next_index, request.correlation_id, item, declined))
            next_index += 1
            return True

        async def write(call: Any) -> None:
            nonlocal pull
            resend = list(pending)
            for start in range(0, len(resend), items_per_message):
                await call.write(message(resend[start : start + items_per_message]))
            while not source_done:
                while len(pending) >= window:
                    space.clear()
                    await space.wait()
                if not await take():
                    break
                group = [pending[-1]]
                # Whatever the iterator has ready now joins this message; nothing waits for more.
                while len(group) < items_per_message and len(pending) < window and not source_done:
                    if pull is None:
                        pull = asyncio.create_task(self._next_typed(source))
                    await asyncio.sleep(0)  # one step: a ready iterator has its next item now
                    if not pull.done() or not await take():
                        break
                    group.append(pending[-1])
                await call.write(message(group))
            await call.done_writing()

        try:
            while True:
                call = self._stub.SubmitJobs(None, timeout=attempts.start("the bulk"), metadata=metadata)
                writer = asyncio.create_task(write(call))
                first_index = pending[0].index if pending else next_index
                try:
                    with attempts.running(call):
                        while True:
                            read = await call.read()
                            if read is aio.EOF:  # type: ignore[attr-defined]
                                break
                            response = cast(job_service_pb2.SubmitJobsResponse, read)
                            answers = response.answers if response.answers else (response,)
                            for answer in answers:
                                if not pending or pending[0].index != first_index + answer.index:
                                    raise InternalError(
                                        f"SubmitJobs answered item {answer.index} out of order",
                                        code=grpc.StatusCode.INTERNAL,
                                    )
                                item = pending.popleft()
                                attempts.answered()
                                error = error_from_proto(answer.error) if answer.HasField("error") else None
                                if error is not None and signature_refused(error.violations):
                                    self.forget_signature(item.item.job.model_name)
                                if error is not None and item.declined:
                                    names = [t.name for t in item.item.job.inputs]
                                    error = replace(error, violations=explained(error.violations, names, item.declined))
                                yield BulkResult(
                                    index=item.index,
                                    correlation_id=answer.correlation_id,
                                    job=job_from_proto(answer.job) if answer.HasField("job") else None,
                                    error=error,
                                    deduplicated=answer.deduplicated,
                                )
                            space.set()
                        if source_done and not pending:
                            if source_error is not None:
                                raise source_error
                            return
                finally:
                    await _finish(writer)  # once the call is cancelled (attempts.running)
                await attempts.broke("SubmitJobs ended before answering every request")
        finally:
            if pull is not None:
                pull.cancel()
                await asyncio.wait([pull])
                if not pull.cancelled():
                    pull.exception()  # retrieved: the stream is over, nobody wants it now
