"""`Client`: the synchronous SDK, a thin wrapper over `AsyncClient`.

Why a private event loop in a background thread rather than grpc's synchronous channel: one
implementation of retries, resumable watches and bulk flow control instead of two, and no clash
with whatever event loop the caller has (or has not): the sync client never touches the caller's
loop, so it works from plain scripts, from threads, from Jupyter, and from sync tests running next
to pytest-asyncio. Each `Client` owns one daemon thread and one channel; `close()` it (or use
`with`). A call blocks the calling thread only; several threads may share one `Client`.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import os
import threading
import uuid
import warnings
import weakref
from collections.abc import AsyncGenerator, Awaitable, Coroutine, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, BinaryIO, Protocol, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from asyncinfer.client._async import (
    AsyncClient,
    BatchData,
    JobLike,
    check_not_forked,
    run_interrupted_note,
    wait_interrupted_note,
)
from asyncinfer.client._retry import RetryPolicy, checked_timeout
from asyncinfer.client._targets import check_target
from asyncinfer.client.batches import Batch, BatchPage
from asyncinfer.client.errors import AsyncInferClientError
from asyncinfer.client.job_listing import JobListing
from asyncinfer.client.types import (
    BlobRef,
    BulkResult,
    Callback,
    Inputs,
    Job,
    JobRequest,
    JobState,
    ModelInfo,
    Priority,
)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class AsyncUpdates(Protocol[T_co]):
    """What a StreamIterator steps and closes: an async generator, or a JobsWatch."""

    def __anext__(self) -> Awaitable[T_co]: ...

    def aclose(self) -> Coroutine[Any, Any, None]: ...


# How often a blocked call wakes to let a pending signal (Ctrl-C) be raised.
WAIT_SLICE_S = 0.2
FORKED = (
    "this Client was made in the parent of a forked process: a process forked after gRPC was used "
    "cannot use gRPC (its threads are not copied); make clients in each worker started with "
    "multiprocessing's 'spawn' or 'forkserver' method (multiprocessing.get_context('spawn'))"
)
CLOSED_MEANWHILE = "the client was closed while this call ran"


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The client's thread: its loop, until `close()` stops it. What is still on the loop then (a
    call another thread is in, sleeping before a retry: closing the channel does not end that) is
    cancelled and unwound here, so that its caller is answered instead of waiting for ever."""
    try:
        loop.run_forever()
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left, timeout=5.0))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _collected(loop: asyncio.AbstractEventLoop, client: AsyncClient, pid: int, target: str) -> None:
    """A Client dropped without close(): its thread would run for ever, holding its loop and the
    channel's sockets (a thread and 3 descriptors each; a web app making one per request ran
    out). Closes it as a file does, and says so; runs in whatever thread collected it, so it does
    not wait."""
    if os.getpid() != pid:  # a forked child's copy: nothing of it runs here
        return

    async def close() -> None:
        try:
            await client.close()
        finally:
            loop.stop()  # _serve then ends the thread

    with contextlib.suppress(RuntimeError):  # the loop closed already (the interpreter exiting)
        asyncio.run_coroutine_threadsafe(close(), loop)
    warnings.warn(
        f"an asyncinfer Client for {target} was never closed (closed now, as it was garbage-collected): "
        "close() it, or use `with Client(...)`",
        ResourceWarning,
        stacklevel=1,  # no caller's line to point at: the collector called it
    )


# The closes of StreamIterators collected unclosed, under way on their clients' loops.
_CLOSING: set[asyncio.Future[None]] = set()


def _closed_there(task: asyncio.Future[None]) -> None:
    _CLOSING.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: nobody waits for it, and its stream is ended either way


class StreamIterator(Iterator[T]):
    """What the blocking client's `watch`, `watch_jobs`, `watch_batch`, `list` and `bulk` return:
    an iterator over a stream that, like a file, is closed by `close()` or at the end of a `with`
    block, whether it was iterated to its end, part-way or not at all: its stream is ended before
    `close()` returns, and the gateway stops sending. Iterated to its end, or to an error, it
    closes itself. A closed one ends (StopIteration), as a closed generator does.

    They were generators: one never started ignored `close()` (a label watch's stream, open once
    `watch_jobs` returned, stayed open until its objects were collected) and none took `with`. One
    dropped unclosed is still closed when it is collected (as soon as the last reference goes, in
    CPython), without waiting there: a last resort, not a way to close it."""

    def __init__(self, client: Client, updates: AsyncUpdates[T]) -> None:
        self._client = client
        self._updates = updates
        self._closed = False

    def __iter__(self) -> StreamIterator[T]:
        return self

    def __next__(self) -> T:
        if self._closed:
            raise StopIteration
        updates = self._updates

        async def step() -> tuple[bool, T | None]:
            try:
                return True, await anext(updates)
            except StopAsyncIteration:
                return False, None

        try:
            more, item = self._client._run(step())
        except BaseException:
            self._close(quietly=True)  # the error under way (Ctrl-C, the stream's) wins
            raise
        if not more:
            self.close()
            raise StopIteration
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Ends the stream (and waits for it to end); idempotent."""
        self._close(quietly=False)

    def _close(self, *, quietly: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._client._closed:  # its close() ended every stream already
            return
        if not quietly:
            self._client._run(self._updates.aclose())
            return
        with contextlib.suppress(Exception):
            self._client._run(self._updates.aclose())

    def __enter__(self) -> StreamIterator[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close(quietly=exc[1] is not None)

    def __del__(self) -> None:
        # Collected unclosed: the close is handed to the client's loop, not waited for here (the
        # collector may be any thread, the loop's own among them, where waiting would never end).
        if getattr(self, "_closed", True):
            return
        self._closed = True
        client = self._client
        if client._closed or os.getpid() != client._pid:
            return
        updates = self._updates

        def close_there() -> None:  # made on the loop: a loop closed meanwhile leaves nothing unawaited
            task = asyncio.ensure_future(updates.aclose())
            _CLOSING.add(task)  # held until done (the loop keeps only a weak reference)
            task.add_done_callback(_closed_there)

        with contextlib.suppress(RuntimeError):  # the loop closed already (the interpreter exiting)
            client._loop.call_soon_threadsafe(close_there)


class JobListingIterator(StreamIterator[Job]):
    """What the blocking client's `list` returns: its jobs, and `unreadable_skipped`, how many the
    pages fetched so far left out unreadable (asyncinfer.client.job_listing)."""

    def __init__(self, client: Client, listing: JobListing) -> None:
        super().__init__(client, listing)
        self._listing = listing

    @property
    def unreadable_skipped(self) -> int:
        return self._listing.unreadable_skipped


class Client:
    """A blocking client for one gateway; the same calls as `AsyncClient`, with iterators for
    `watch`, `list` and `bulk`.

    >>> with Client("127.0.0.1:50051") as client:
    ...     job = client.submit("demo", {"x": np.ones((1, 4), np.float32)})
    ...     client.wait(job).outputs["y"]
    """

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        tls_ca_file: str | os.PathLike[str] | None = None,
        tls_cert_file: str | os.PathLike[str] | None = None,
        tls_key_file: str | os.PathLike[str] | None = None,
        keepalive_s: float | None = 30.0,
    ) -> None:
        check_not_forked()  # before a thread and a loop are started for nothing
        check_target(target)  # as AsyncClient does, but before the thread and the loop
        self._pid = os.getpid()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_serve, args=(self._loop,), name="asyncinfer-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def make() -> AsyncClient:
            # grpc.aio binds a channel to the loop it is created on: create it on ours.
            return AsyncClient(
                target,
                api_key=api_key,
                timeout_s=timeout_s,
                retry=retry,
                credentials=credentials,
                channel_options=channel_options,
                tls_ca_file=tls_ca_file,
                tls_cert_file=tls_cert_file,
                tls_key_file=tls_key_file,
                keepalive_s=keepalive_s,
            )

        try:
            self._client = self._run(make())
        except BaseException:
            # The thread and its loop are this client's alone: one whose channel could not be made
            # (a TLS file missing, a certificate without its key) ran on for ever, one per try.
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()  # _serve closes the loop
            raise
        self._collected = weakref.finalize(self, _collected, self._loop, self._client, self._pid, target)
        self._collected.atexit = False  # at exit the daemon thread just ends, as before

    @property
    def async_client(self) -> AsyncClient:
        """The wrapped client; only usable from coroutines run on this client's loop."""
        return self._client

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coroutine.close()
            raise RuntimeError("the client is closed")
        if os.getpid() != self._pid:
            # A forked child has no copy of the client's loop thread: a call waited for ever.
            coroutine.close()
            raise RuntimeError(FORKED)
        ended = threading.Event()

        async def tracked() -> T:
            try:
                return await coroutine
            finally:
                ended.set()

        try:
            future = asyncio.run_coroutine_threadsafe(tracked(), self._loop)
        except RuntimeError:  # another thread's close() closed the loop since the check above
            coroutine.close()
            raise RuntimeError("the client is closed") from None
        try:
            while True:
                # In slices: Ctrl-C (SIGINT) reaches Python's handler in whichever thread the
                # kernel picks, and a main thread blocked in one long wait would not run it until
                # the call ended (a bulk never did). Woken every slice, it raises at once.
                try:
                    return future.result(timeout=WAIT_SLICE_S)
                except concurrent.futures.TimeoutError:
                    if future.done():  # the call's own outcome (a TimeoutError of its own included)
                        return future.result()
                    if not self._thread.is_alive():  # closed by another thread before this call began
                        raise RuntimeError(CLOSED_MEANWHILE) from None
                except concurrent.futures.CancelledError:
                    if self._closed:  # cancelled by the closing loop (_serve), not by this thread
                        raise RuntimeError(CLOSED_MEANWHILE) from None
                    raise
        except BaseException:
            # KeyboardInterrupt or the like in the caller: stop the call instead of leaving it
            # running, and wait (a while) for it to stop: the future says cancelled at once, its
            # task only once it has unwound (a generator stepped by it is then free to close).
            if not future.done():
                future.cancel()
                if self._thread.is_alive():  # else nothing runs it: it never ends
                    ended.wait(timeout=5.0)
            raise

    def close(self) -> None:
        """Closes the channel and stops the thread; idempotent. A call another thread is in
        raises RuntimeError."""
        if self._closed:
            return
        self._collected.detach()
        if os.getpid() != self._pid:  # a forked child's copy: nothing of it runs here to stop
            self._closed = True
            return
        try:
            self._run(self._client.close())
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()  # _serve answers what is left and closes the loop

    def __enter__(self) -> Client:
        if self._closed:  # said here, not at the block's first call
            raise RuntimeError("the client is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        model: str,
        inputs: Inputs | None = None,
        *,
        input_ref: str | BlobRef = "",
        model_version: str = "",
        priority: Priority | str | None = None,
        idempotency_key: str = "",
        labels: Mapping[str, str] | None = None,
        deadline: datetime | None = None,
        queue_ttl_s: float | None = None,
        execution_timeout_s: float | None = None,
        retention_s: float | None = None,
        callback: Callback | str | None = None,
        max_attempts: int = 0,
        timeout_s: float | None = None,
        traceparent: str = "",
        wait_s: float | None = None,
    ) -> Job:
        """See `AsyncClient.submit` (an idempotency key is generated when none is given)."""
        return self._run(
            self._client.submit(
                model,
                inputs,
                input_ref=input_ref,
                model_version=model_version,
                priority=priority,
                idempotency_key=idempotency_key,
                labels=labels,
                deadline=deadline,
                queue_ttl_s=queue_ttl_s,
                execution_timeout_s=execution_timeout_s,
                retention_s=retention_s,
                callback=callback,
                max_attempts=max_attempts,
                timeout_s=timeout_s,
                traceparent=traceparent,
                wait_s=wait_s,
            )
        )

    def submit_request(
        self, request: JobRequest, *, timeout_s: float | None = None, traceparent: str = "", wait_s: float | None = None
    ) -> Job:
        return self._run(
            self._client.submit_request(request, timeout_s=timeout_s, traceparent=traceparent, wait_s=wait_s)
        )

    def get(self, job: JobLike, *, timeout_s: float | None = None) -> Job:
        return self._run(self._client.get(job, timeout_s=timeout_s))

    def get_jobs(
        self, jobs: Iterable[JobLike], *, timeout_s: float | None = None
    ) -> dict[str, Job | AsyncInferClientError]:
        return self._run(self._client.get_jobs(jobs, timeout_s=timeout_s))

    def wait_jobs(
        self, jobs: Iterable[JobLike], *, timeout_s: float | None = None
    ) -> dict[str, Job | AsyncInferClientError]:
        return self._run(self._client.wait_jobs(jobs, timeout_s=timeout_s))

    def watch_jobs(
        self,
        jobs: Iterable[JobLike] = (),
        *,
        labels: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> StreamIterator[Job | tuple[str, AsyncInferClientError]]:
        """See `AsyncClient.watch_jobs`. With `labels`, it returns once the gateway listens (the
        async `ready()`): a job submitted after it is seen from QUEUED on."""
        watch = self._client.watch_jobs(jobs, labels=labels, timeout_s=timeout_s)
        if labels:
            try:
                self._run(watch.ready())
            except BaseException:
                # Closed here, as a StreamIterator closes a watch it stepped: the caller never gets it. (An
                # error out of the stream has ended it already; a Ctrl-C whose step had not unwound
                # within _run's wait has not.)
                if not self._closed:
                    with contextlib.suppress(Exception):  # the error under way wins
                        self._run(watch.aclose())
                raise
        return StreamIterator(self, watch)

    def models(self, *, timeout_s: float | None = None) -> list[ModelInfo]:
        return self._run(self._client.models(timeout_s=timeout_s))

    def cancel(self, job: JobLike, *, reason: str = "", timeout_s: float | None = None) -> Job:
        return self._run(self._client.cancel(job, reason=reason, timeout_s=timeout_s))

    def watch(self, job: JobLike, *, after_revision: int = 0, timeout_s: float | None = None) -> StreamIterator[Job]:
        checked_timeout(timeout_s)  # here, not at the first `next`
        return StreamIterator(self, self._client.watch(job, after_revision=after_revision, timeout_s=timeout_s))

    def wait(self, job: JobLike, *, timeout_s: float | None = None) -> Job:
        try:
            return self._run(self._client.wait(job, timeout_s=timeout_s))
        except KeyboardInterrupt as interrupt:
            # `client.wait(client.submit(...))` in a notebook: the job ID was never seen.
            interrupt.add_note(wait_interrupted_note(job.job_id if isinstance(job, Job) else job))
            raise

    def run(
        self, model: str, inputs: Inputs | None = None, *, timeout_s: float | None = None, **submit_options: Any
    ) -> dict[str, npt.NDArray[np.generic]]:
        """See `AsyncClient.run`. Interrupted (Ctrl-C, a notebook's interrupt), its job goes on:
        the KeyboardInterrupt's note names it, or, when the gateway had not answered the submit
        yet, the idempotency key that finds it."""
        # Known here, not only inside the submit: a run is mostly interrupted while the gateway
        # holds the submit's answer (wait_s), before any job ID has come back.
        key = submit_options.get("idempotency_key") or str(uuid.uuid4())
        submitted: builtins.list[Job] = []
        try:
            return self._run(
                self._client._run_job(
                    model, inputs, timeout_s, {**submit_options, "idempotency_key": key}, submitted.append
                )
            )
        except KeyboardInterrupt as interrupt:
            interrupt.add_note(run_interrupted_note(submitted, key))
            raise

    def outputs(self, job: Job, *, timeout_s: float | None = None) -> dict[str, npt.NDArray[np.generic]]:
        return self._run(self._client.outputs(job, timeout_s=timeout_s))

    def list(
        self,
        *,
        states: Iterable[JobState | str] = (),
        model: str = "",
        labels: Mapping[str, str] | None = None,
        page_size: int = 100,
        limit: int | None = None,
        timeout_s: float | None = None,
    ) -> JobListingIterator:
        """See `AsyncClient.list`; its `unreadable_skipped` is the listing's so far."""
        return JobListingIterator(
            self,
            self._client.list(
                states=tuple(states), model=model, labels=labels, page_size=page_size, limit=limit, timeout_s=timeout_s
            ),
        )

    def bulk(
        self,
        requests: Iterable[JobRequest],
        *,
        window: int = 256,
        items_per_message: int = 64,
        timeout_s: float | None = None,
        traceparent: str = "",
    ) -> StreamIterator[BulkResult]:
        """See `AsyncClient.bulk`. `requests` is iterated on the client's thread."""
        return StreamIterator(
            self,
            self._client.bulk(
                requests,
                window=window,
                items_per_message=items_per_message,
                timeout_s=timeout_s,
                traceparent=traceparent,
            ),
        )

    def upload(
        self,
        data: bytes | str | os.PathLike[str] | BinaryIO,
        *,
        retention_s: float | None = None,
        timeout_s: float | None = None,
    ) -> BlobRef:
        return self._run(self._client.upload(data, retention_s=retention_s, timeout_s=timeout_s))

    def upload_inputs(
        self, inputs: Inputs, *, retention_s: float | None = None, timeout_s: float | None = None
    ) -> BlobRef:
        return self._run(self._client.upload_inputs(inputs, retention_s=retention_s, timeout_s=timeout_s))

    def delete_input(self, ref: str | BlobRef, *, timeout_s: float | None = None) -> BlobRef:
        return self._run(self._client.delete_input(ref, timeout_s=timeout_s))

    def read_result(self, job: JobLike, *, timeout_s: float | None = None) -> dict[str, npt.NDArray[np.generic]]:
        return self._run(self._client.read_result(job, timeout_s=timeout_s))

    # -- batches over files ---------------------------------------------------------------------

    def create_batch(self, data: BatchData, model: str, **options: Any) -> Batch:
        return self._run(self._client.create_batch(data, model, **options))

    def get_batch(self, batch: Batch | str) -> Batch:
        return self._run(self._client.get_batch(batch))

    def cancel_batch(self, batch: Batch | str) -> Batch:
        return self._run(self._client.cancel_batch(batch))

    def list_batches(self, *, page_size: int = 0, page_token: str = "") -> tuple[builtins.list[Batch], str]:
        return self._run(self._client.list_batches(page_size=page_size, page_token=page_token))

    def list_batches_page(self, *, page_size: int = 0, page_token: str = "") -> BatchPage:
        return self._run(self._client.list_batches_page(page_size=page_size, page_token=page_token))

    def watch_batch(self, batch: Batch | str, *, timeout_s: float | None = None) -> StreamIterator[Batch]:
        checked_timeout(timeout_s)  # here, not at the first `next`

        async def updates() -> AsyncGenerator[Batch, None]:
            async for update in self._client.watch_batch(batch, timeout_s=timeout_s):
                yield update

        return StreamIterator(self, updates())

    def wait_batch(self, batch: Batch | str, *, timeout_s: float | None = None) -> Batch:
        return self._run(self._client.wait_batch(batch, timeout_s=timeout_s))

    def download(
        self,
        batch: Batch | str,
        target: str | os.PathLike[str] | BinaryIO,
        *,
        file: str | None = None,
        timeout_s: float | None = None,
    ) -> int:
        return self._run(self._client.download(batch, target, file=file, timeout_s=timeout_s))

    def output_arrays(self, batch: Batch | str) -> dict[str, npt.NDArray[Any]]:
        return self._run(self._client.output_arrays(batch))
