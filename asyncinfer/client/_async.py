"""`AsyncClient`: the asyncio client for the gateway's JobService, over grpc.aio.

Every call has a deadline: unary calls (submit, get, cancel, one page of list) take `timeout_s`,
defaulting to the client's `timeout_s` (30 s); calls that last as long as a job does (wait, watch,
bulk, upload, read_result) take `timeout_s` as their whole budget, defaulting to no limit.
UNAVAILABLE (and RESOURCE_EXHAUSTED, honouring the server's RetryInfo) is retried with
exponential backoff and jitter, within both the `RetryPolicy`'s attempts and the call's deadline.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import io
import os
import uuid
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Iterable,
    Mapping,
)
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import grpc
import numpy as np
import numpy.typing as npt
from grpc import aio

from asyncinfer.client._async_blobs import UPLOAD_CHUNK_BYTES
from asyncinfer.client._async_channel import (
    FORKED_AFTER_USE,
    JobLike,
    T,
    check_not_forked,
    tls_credentials,
)
from asyncinfer.client._async_jobs import GET_JOBS_MAX_IDS, SUBMIT_JOBS_MAX_ITEMS, WATCH_JOBS_MAX_IDS
from asyncinfer.client._async_wait import JobWaits, run_interrupted_note, wait_interrupted_note
from asyncinfer.client._async_watch import watch_given_up_note
from asyncinfer.client._convert import (
    error_from_proto,
    job_from_proto,
    submit_request_to_proto,
    with_idempotency_key,
)
from asyncinfer.client._retry import Deadline, StreamBreaks
from asyncinfer.client.batches import Batch, BatchCalls, create_batch_request, write_file
from asyncinfer.client.errors import (
    AsyncInferClientError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    UnavailableError,
    from_rpc_error,
)
from asyncinfer.client.types import (
    BulkResult,
    JobRequest,
)
from asyncinfer.v1 import job_service_pb2

# What this module gave before AsyncClient's parts moved to the _async_* modules, still importable from here.
__all__ = [
    "FORKED_AFTER_USE",
    "GET_JOBS_MAX_IDS",
    "SUBMIT_JOBS_MAX_ITEMS",
    "UPLOAD_CHUNK_BYTES",
    "WATCH_JOBS_MAX_IDS",
    "AsyncClient",
    "BatchData",
    "JobLike",
    "check_not_forked",
    "run_interrupted_note",
    "tls_credentials",
    "wait_interrupted_note",
    "watch_given_up_note",
]


# What create_batch uploads: a file (bytes, a path, a binary file), an array (NPY) or arrays by input name (NPZ).
BatchData = (
    bytes
    | str
    | os.PathLike[str]
    | BinaryIO
    | npt.NDArray[Any]
    | list[Any]
    | tuple[Any, ...]
    | Mapping[str, npt.ArrayLike]
)


@dataclass(slots=True)
class _Pending:
    index: int
    correlation_id: str
    item: job_service_pb2.SubmitJobsItem


class AsyncClient(JobWaits):
    """An asyncio client for one gateway.

    >>> async with AsyncClient("127.0.0.1:50051", api_key="...") as client:
    ...     job = await client.submit("demo", {"x": np.ones((1, 4), np.float32)})
    ...     done = await client.wait(job)
    ...     done.outputs["y"]

    Make it inside a running event loop (a coroutine): grpc.aio binds the channel to the loop
    current at creation. The blocking `Client` has no such rule.

    `target` is a gRPC target ("host:port", "dns:///gateway:50051"). `credentials` switches to
    TLS (`grpc.ssl_channel_credentials()`); so do `tls_ca_file` (PEM CA bundle that verifies the
    gateway) and `tls_cert_file` with `tls_key_file` (a client certificate, for a gateway that
    requires mutual TLS). `api_key` is sent as `authorization: Bearer <key>`. While a call is in
    flight the client pings the gateway every `keepalive_s` (None: never), so a call on a connection
    that died silently (the gateway's host lost, a NAT that dropped the flow) ends UNAVAILABLE within
    twice that (and a watch resumes, as after any break) instead of waiting for ever;
    `channel_options` go before the client's own (gRPC takes the first of a name).
    The client owns one channel; `close()` it (or use `async with`).
    """

    # -- bulk ---------------------------------------------------------------------------------

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
        attempt = 0
        breaks = StreamBreaks()
        # The pull from the caller's iterator runs in its own task, shielded: when a broken stream
        # cancels the writer, a pull in progress carries on for the next stream's writer instead of
        # having CancelledError thrown into the caller's iterator.
        pull: asyncio.Task[JobRequest] | None = None

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
                request = await asyncio.shield(pull)
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
            pending.append(_Pending(next_index, request.correlation_id, item))
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
                attempt += 1
                call = self._stub.SubmitJobs(None, timeout=deadline.remaining(), metadata=metadata)
                writer = asyncio.create_task(write(call))
                first_index = pending[0].index if pending else next_index
                cause: BaseException | None = None
                try:
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
                            attempt = 0
                            breaks.answered()
                            yield BulkResult(
                                index=item.index,
                                correlation_id=answer.correlation_id,
                                job=job_from_proto(answer.job) if answer.HasField("job") else None,
                                error=error_from_proto(answer.error) if answer.HasField("error") else None,
                                deduplicated=answer.deduplicated,
                            )
                        space.set()
                    if source_done and not pending:
                        if source_error is not None:
                            raise source_error
                        return
                    error: AsyncInferClientError = UnavailableError(
                        "SubmitJobs ended before answering every request", code=grpc.StatusCode.UNAVAILABLE
                    )
                except asyncio.CancelledError:
                    self._raise_if_closed_meanwhile()
                    raise
                except grpc.RpcError as rpc_error:
                    error, cause = from_rpc_error(rpc_error), rpc_error
                finally:
                    call.cancel()
                    await _finish(writer)
                await self._backoff_or_raise(error, max(attempt, 1), deadline, cause, breaks.broke())
        finally:
            if pull is not None:
                pull.cancel()
                await asyncio.wait([pull])
                if not pull.cancelled():
                    pull.exception()  # retrieved: the stream is over, nobody wants it now

    # -- batches over files (asyncinfer.client.batches) ------------------------------------------

    @property
    def _batch_calls(self) -> BatchCalls:
        if self._closed:
            raise RuntimeError("the client is closed")
        return self._batches

    async def create_batch(
        self,
        data: BatchData,
        model: str,
        *,
        upload_timeout_s: float | None = None,
        **options: Any,
    ) -> Batch:
        """Uploads a JSONL (or NPY/NPZ) file of records and creates a batch over it (state
        VALIDATING); `options` are `create_batch_request`'s (version, input_format, priority,
        completion_window_s, max_attempts, labels, callback or callback_url, idempotency_key). `data` may
        also be an array (uploaded as an NPY file: one record per row, the model's only input)
        or a mapping of input name to array (an NPZ file), held in memory once more as a file;
        `output_arrays` then reads the outputs back as arrays. Without an `idempotency_key` one is
        generated (as `submit` does), so that a create sent again after a lost answer makes no second batch."""
        if isinstance(data, list | tuple):  # rows as lists, as submit takes them: an array
            data = np.asarray(data)
            if data.dtype.hasobject:
                raise ValueError("rows given as lists must make a numeric array (numpy.asarray(rows))")
        if isinstance(data, np.ndarray):
            buffer = io.BytesIO()
            np.save(buffer, data, allow_pickle=False)
            data = buffer.getvalue()
        elif isinstance(data, Mapping):
            arrays = {name: np.asarray(array) for name, array in data.items()}
            for name, array in arrays.items():
                if array.dtype.hasobject:  # np.savez would pickle it, which the gateway refuses to load
                    raise ValueError(
                        f"input {name!r} is an array of Python objects ({array.dtype}): a batch's arrays are "
                        "numeric or fixed-width strings (for text, numpy.str_ or bytes_ arrays)"
                    )
            buffer = io.BytesIO()
            np.savez(buffer, **arrays)
            data = buffer.getvalue()
        request = create_batch_request("", model, **options)  # a bad option fails before the upload
        # As submit's: a create whose answer was lost (UNAVAILABLE) is sent again, and without a
        # key that made a second batch over the same upload, every record run twice.
        generated_key = not request.idempotency_key
        if generated_key:
            request.idempotency_key = str(uuid.uuid4())
        ref = await self.upload(data, timeout_s=upload_timeout_s)
        request.input_ref = ref.ref
        try:
            batch = await self._batch_calls.create(request)
        except AsyncInferClientError as refused:
            # The upload was this call's own: a refused create (an unknown model, a bad option)
            # would leave it counting against the tenant's stored uploads until its retention ends.
            # (A create whose answer was lost may have made the batch: UNAVAILABLE and
            # DEADLINE_EXCEEDED keep the upload, which that batch reads.)
            if not isinstance(refused, UnavailableError | DeadlineExceededError):
                with contextlib.suppress(AsyncInferClientError):
                    await self.delete_input(ref)
            raise
        if batch.deduplicated and batch.input_ref != ref.ref:
            # A retry under an idempotency key: the batch reads the first upload, not this one.
            with contextlib.suppress(AsyncInferClientError):
                await self.delete_input(ref)
        if generated_key and batch.deduplicated:  # this call's own retry found its first create
            batch = dataclasses.replace(batch, deduplicated=False)
        return batch

    async def get_batch(self, batch: Batch | str) -> Batch:
        return await self._batch_calls.get(batch)

    async def cancel_batch(self, batch: Batch | str) -> Batch:
        """Stops the batch's chunks (CANCELLING, then CANCELLED); what finished is kept. Safe to
        repeat, as `cancel` is: a batch that had ended (FAILED_PRECONDITION BATCH_ALREADY_ENDED)
        is returned as it is."""
        try:
            return await self._batch_calls.cancel(batch)
        except FailedPreconditionError as error:
            if error.reason != "BATCH_ALREADY_ENDED":
                raise
        return await self._batch_calls.get(batch)

    async def list_batches(self, *, page_size: int = 0, page_token: str = "") -> tuple[builtins.list[Batch], str]:
        """One page of the caller's batches, newest first, and the next page's token ("" at the end)."""
        return await self._batch_calls.list(page_size=page_size, page_token=page_token)

    def watch_batch(self, batch: Batch | str, *, timeout_s: float | None = None) -> AsyncIterator[Batch]:
        """The batch now, then each change of state or progress, until it ends."""
        return self._batch_calls.watch(batch, timeout_s=timeout_s)

    async def wait_batch(self, batch: Batch | str, *, timeout_s: float | None = None) -> Batch:
        last = batch if isinstance(batch, Batch) else None
        async for update in self.watch_batch(batch, timeout_s=timeout_s):
            last = update
        assert last is not None
        return last

    async def download(
        self,
        batch: Batch | str,
        target: str | os.PathLike[str] | BinaryIO,
        *,
        file: str = "output",
        timeout_s: float | None = None,
    ) -> int:
        """Writes the batch's output file (JSONL in input order), or with file="errors" its error
        file, or with file="npz" the NPZ archive of a batch over an NPY or NPZ file (see
        `output_arrays`), to a path or a binary file; the bytes written. `timeout_s`: the most the
        whole download may take (none by default: a large file takes as long as it takes)."""
        return await write_file(self._batch_calls.download(batch, file, timeout_s=timeout_s), target)

    async def output_arrays(self, batch: Batch | str) -> dict[str, npt.NDArray[Any]]:
        """The outputs of a batch over an NPY or NPZ file as arrays, in memory: "succeeded" (a bool
        per record) and one array per model output, first dimension every record in input order
        (a record that did not succeed is a row of zeros; `download(..., file="errors")` says
        why). FailedPreconditionError for a batch over a JSONL file, or a model whose outputs are
        not one numeric shape per record. For outputs larger than memory, `download(file="npz")`
        to a path and `numpy.load(path, mmap_mode=...)` on its members."""
        buffer = io.BytesIO()
        await write_file(self._batch_calls.download(batch, "npz"), buffer)
        buffer.seek(0)
        with np.load(buffer, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}


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
