"""Batch jobs over files in the SDK (BatchService, docs/BATCHES.md): `Batch`, what a batch is as
the SDK gives it, and the calls behind AsyncClient's `create_batch`, `get_batch`, `watch_batch`,
`cancel_batch`, `list_batches` and `download`, written once here over the client's channel, its
metadata and its retrying `_call`."""

from __future__ import annotations

import asyncio
import errno
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar

import grpc
from google.protobuf import duration_pb2
from grpc import aio

from asyncinfer.batches import BatchState
from asyncinfer.client._convert import model_name_problem, named
from asyncinfer.client._enums import from_proto, name_from_proto, to_proto, unknown_number
from asyncinfer.client._retry import Deadline
from asyncinfer.client._stream_retry import Backoff, StreamAttempts
from asyncinfer.client.errors import from_rpc_error
from asyncinfer.client.types import Callback, CallbackEvent
from asyncinfer.output_paths import descriptor_or_file, is_special
from asyncinfer.v1 import batch_service_pb2, batch_service_pb2_grpc, job_pb2

if TYPE_CHECKING:
    from asyncinfer.v1.batch_service_pb2_grpc import BatchServiceAsyncStub

T = TypeVar("T")


class Call(Protocol):
    """The client's retrying call (`ClientChannel._call`): within `deadline`, or the client's
    unary timeout_s when none is given."""

    def __call__(
        self, invoke: Callable[[float | None], Awaitable[Any]], deadline: Deadline | None = None
    ) -> Awaitable[Any]: ...


_PRIORITIES = {"HIGH": job_pb2.PRIORITY_HIGH, "NORMAL": job_pb2.PRIORITY_NORMAL, "LOW": job_pb2.PRIORITY_LOW}
_FORMATS = {
    "JSONL": batch_service_pb2.BATCH_INPUT_FORMAT_JSONL,
    "NPY": batch_service_pb2.BATCH_INPUT_FORMAT_NPY,
    "NPZ": batch_service_pb2.BATCH_INPUT_FORMAT_NPZ,
}
# download(file=...): the JSONL output, the error file, or the NPZ archive of a batch over an array file.
FILES = {
    "output": batch_service_pb2.BATCH_FILE_OUTPUT,
    "errors": batch_service_pb2.BATCH_FILE_ERRORS,
    "npz": batch_service_pb2.BATCH_FILE_OUTPUT_NPZ,
}


@dataclass(frozen=True, slots=True)
class BatchError:
    line: int
    custom_id: str
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class BatchReadProgress:
    """How far a VALIDATING batch's input has been read, as the gateway last reported it (every
    few seconds of a large file's reading)."""

    bytes_read: int
    bytes_total: int
    records_read: int  # valid or not
    records_per_second: float
    estimated_end_time: datetime | None  # when the reading should end at its rate so far
    update_time: datetime | None


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch as it stands: state (VALIDATING, IN_PROGRESS, COMPLETED, FAILED, EXPIRED,
    CANCELLING, CANCELLED), request counts, progress and the first errors."""

    batch_id: str
    state: BatchState  # a StrEnum: it compares equal to its name, as Job.state does
    model_name: str
    total: int
    completed: int
    failed: int
    records_per_second: float
    chunks_total: int
    chunks_done: int
    create_time: datetime | None
    expires_at: datetime | None
    end_time: datetime | None = None
    estimated_finish_time: datetime | None = None
    failure_message: str = ""
    first_errors: tuple[BatchError, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    deduplicated: bool = False
    # The rest of what GetBatch gives (the console's batch page shows all of it).
    model_version: str = ""
    priority: str = ""
    input_ref: str = ""
    input_format: str = ""
    max_attempts: int = 0
    idempotency_key: str = ""
    in_progress_time: datetime | None = None
    finalizing_time: datetime | None = None
    # Set once the batch is terminal (or has invalid lines): read them with `download`.
    output_ref: str = ""
    error_ref: str = ""
    callback_url: str = ""
    # Its CreateBatch's OpenTelemetry trace ID when the gateway traces (the caller's, given a
    # traceparent); each chunk job's trace links to it.
    trace_id: str = ""
    # Whether that trace was sampled (a trace viewer shows it); False when the gateway says it was
    # not, True when it was or does not say (a gateway before session 34).
    trace_sampled: bool = True
    # While VALIDATING: how far its input has been read (None before the first report and after).
    read_progress: BatchReadProgress | None = None

    @property
    def done(self) -> bool:
        return self.state.is_terminal

    @property
    def not_run(self) -> int:
        """The records a CANCELLED or EXPIRED batch never ran (skipped by the cancel or the end of its
        completion window: the error file's CANCELLED and DEADLINE_EXCEEDED lines). As OpenAI's Batch
        API counts, they are neither `completed` nor `failed`, the rest of `total`. 0 otherwise (a
        CANCELLING batch's are not known yet)."""
        if self.state not in (BatchState.CANCELLED, BatchState.EXPIRED):
            return 0
        return max(self.total - self.completed - self.failed, 0)


def _time(message: Any, name: str) -> datetime | None:
    if not message.HasField(name):
        return None
    return datetime.fromtimestamp(getattr(message, name).ToNanoseconds() / 1e9, UTC)


def batch_from_proto(batch: batch_service_pb2.Batch, *, deduplicated: bool = False) -> Batch:
    counts = batch.request_counts
    return Batch(
        batch_id=batch.batch_id,
        state=from_proto(BatchState, batch_service_pb2.BatchState, batch.state, "BATCH_STATE_"),
        model_name=batch.model_name,
        total=counts.total,
        completed=counts.completed,
        failed=counts.failed,
        records_per_second=batch.records_per_second,
        chunks_total=batch.chunks_total,
        chunks_done=batch.chunks_done,
        create_time=_time(batch, "create_time"),
        expires_at=_time(batch, "expires_at"),
        end_time=_time(batch, "end_time"),
        estimated_finish_time=_time(batch, "estimated_finish_time"),
        failure_message=batch.failure_message,
        first_errors=tuple(BatchError(e.line, e.custom_id, e.code, e.message) for e in batch.first_errors),
        labels=dict(batch.labels),
        deduplicated=deduplicated,
        model_version=batch.model_version,
        priority=name_from_proto(job_pb2.Priority, batch.priority, "PRIORITY_") if batch.priority else "",
        input_ref=batch.input_ref,
        input_format=name_from_proto(batch_service_pb2.BatchInputFormat, batch.input_format, "BATCH_INPUT_FORMAT_")
        if batch.input_format
        else "",
        max_attempts=batch.max_attempts,
        idempotency_key=batch.idempotency_key,
        in_progress_time=_time(batch, "in_progress_time"),
        finalizing_time=_time(batch, "finalizing_time"),
        output_ref=batch.output_ref.ref,
        error_ref=batch.error_ref.ref,
        callback_url=batch.callback.url,
        trace_id=batch.trace_id,
        trace_sampled=batch.trace_sampled if batch.HasField("trace_sampled") else True,
        read_progress=_read_progress(batch),
    )


def _read_progress(batch: batch_service_pb2.Batch) -> BatchReadProgress | None:
    if not batch.HasField("read_progress"):
        return None
    p = batch.read_progress
    return BatchReadProgress(
        bytes_read=p.bytes_read,
        bytes_total=p.bytes_total,
        records_read=p.records_read,
        records_per_second=p.records_per_second,
        estimated_end_time=_time(p, "estimated_end_time"),
        update_time=_time(p, "update_time"),
    )


def _batch_id(batch: Batch | str) -> str:
    return batch if isinstance(batch, str) else batch.batch_id


def create_batch_request(
    input_ref: str,
    model: str,
    *,
    version: str = "",
    input_format: str | None = None,
    priority: str | None = None,
    completion_window_s: float | None = None,
    max_attempts: int = 0,
    labels: Mapping[str, str] | None = None,
    callback_url: str | None = None,
    idempotency_key: str = "",
    callback: Callback | str | None = None,
) -> batch_service_pb2.CreateBatchRequest:
    """A CreateBatch request; ValueError or TypeError for options it cannot carry (checked
    before anything is uploaded: `AsyncClient.create_batch` builds it first). `callback` is
    `submit`'s (a URL, or a Callback whose `events` pick the ends it is sent for: COMPLETED,
    FAILED, CANCELED; none: every end), or `callback_url`."""
    if problem := model_name_problem(model, "create_batch(data, model) takes the data first"):
        raise TypeError(problem)
    events: tuple[CallbackEvent, ...] = ()
    if callback is not None:
        if callback_url:
            raise ValueError("give callback or callback_url, not both")
        if isinstance(callback, str):
            callback_url = callback
        else:
            callback_url, events = callback.url, tuple(CallbackEvent(e) for e in callback.events)
    if labels is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise TypeError("labels map strings to strings")
    request = batch_service_pb2.CreateBatchRequest(
        model_name=model,
        model_version=version,
        input_ref=input_ref,
        input_format=named(input_format, _FORMATS, "input_format")
        if input_format
        else batch_service_pb2.BATCH_INPUT_FORMAT_UNSPECIFIED,
        priority=named(priority, _PRIORITIES, "priority") if priority else job_pb2.PRIORITY_UNSPECIFIED,
        max_attempts=max_attempts,
        labels=dict(labels or {}),
        idempotency_key=idempotency_key,
    )
    if completion_window_s is not None:
        window = duration_pb2.Duration()
        window.FromNanoseconds(round(completion_window_s * 1e9))
        request.completion_window.CopyFrom(window)
    if callback_url:
        request.callback.url = callback_url
        # RUNNING among them is the gateway's to refuse (INVALID_ARGUMENT), as for any client.
        request.callback.events.extend(
            job_pb2.CallbackEvent.ValueType(to_proto(e, job_pb2.CallbackEvent, "CALLBACK_EVENT_")) for e in events
        )
    return request


@dataclass(frozen=True, slots=True)
class BatchPage:
    """One page of ListBatches: the caller's batches, newest first; the next page's token ("" at
    the end); and how many batches the gateway left out of it because it cannot decode their
    record (a later release's, during a rolling upgrade, or a corrupted one: GetBatch answers each
    InternalError BATCH_UNREADABLE). 0 from a gateway before session 39, which left them out unsaid."""

    batches: tuple[Batch, ...]
    next_page_token: str
    unreadable_skipped: int = 0


class BatchCalls:
    """The BatchService calls of one AsyncClient (its channel, metadata and retrying call)."""

    def __init__(
        self,
        channel: Any,
        metadata: tuple[tuple[str, str], ...],
        call: Call,
        backoff: Backoff,
    ) -> None:
        self._stub: BatchServiceAsyncStub = batch_service_pb2_grpc.BatchServiceStub(channel)
        self._metadata = metadata
        self._call = call
        self._backoff = backoff

    async def create(self, request: batch_service_pb2.CreateBatchRequest, *, traceparent: str = "") -> Batch:
        """CreateBatch with a request from `create_batch_request`, in the trace `traceparent` names
        (a W3C trace context; "": none)."""
        metadata = (*self._metadata, ("traceparent", traceparent)) if traceparent else self._metadata

        async def invoke(remaining: float | None) -> batch_service_pb2.CreateBatchResponse:
            return await self._stub.CreateBatch(request, timeout=remaining, metadata=metadata)

        response = await self._call(invoke)
        return batch_from_proto(response.batch, deduplicated=response.deduplicated)

    async def get(self, batch: Batch | str) -> Batch:
        request = batch_service_pb2.GetBatchRequest(batch_id=_batch_id(batch))

        async def invoke(remaining: float | None) -> batch_service_pb2.GetBatchResponse:
            return await self._stub.GetBatch(request, timeout=remaining, metadata=self._metadata)

        return batch_from_proto((await self._call(invoke)).batch)

    async def cancel(self, batch: Batch | str) -> Batch:
        request = batch_service_pb2.CancelBatchRequest(batch_id=_batch_id(batch))

        async def invoke(remaining: float | None) -> batch_service_pb2.CancelBatchResponse:
            return await self._stub.CancelBatch(request, timeout=remaining, metadata=self._metadata)

        return batch_from_proto((await self._call(invoke)).batch)

    async def list(self, *, page_size: int = 0, page_token: str = "") -> BatchPage:
        request = batch_service_pb2.ListBatchesRequest(page_size=page_size, page_token=page_token)

        async def invoke(remaining: float | None) -> batch_service_pb2.ListBatchesResponse:
            return await self._stub.ListBatches(request, timeout=remaining, metadata=self._metadata)

        response = await self._call(invoke)
        return BatchPage(
            tuple(batch_from_proto(b) for b in response.batches), response.next_page_token, response.unreadable_skipped
        )

    async def watch(self, batch: Batch | str, *, timeout_s: float | None = None) -> AsyncIterator[Batch]:
        """The batch now, then each change, until it ends (at a state newer than this SDK too: the
        last batch yielded is then not `done`). A broken stream is opened again as a
        job's watch is, per the client's RetryPolicy: what it retries (UNAVAILABLE, and
        RESOURCE_EXHAUSTED unless turned off), its jittered backoff and `on_retry`, `max_attempts`
        until the stream first answers and `stream_resume_s` after a break. DeadlineExceededError
        when `timeout_s` passes first (the batch carries on), as a job's watch raises: the limit is
        each stream's gRPC deadline, not a cancel of the caller's task."""
        batch_id = _batch_id(batch)
        deadline = Deadline(timeout_s)
        request = batch_service_pb2.WatchBatchRequest(batch_id=batch_id)
        attempts = StreamAttempts(self._backoff, deadline)
        what = f"the watch of batch {batch_id} (it goes on)"
        while True:
            call = self._stub.WatchBatch(request, metadata=self._metadata, timeout=attempts.start(what))
            last: Batch | None = None
            with attempts.running(call, timed_out=what):
                async for update in call:
                    attempts.answered()
                    last = batch_from_proto(update.batch)
                    yield last
                    if last.done:
                        return
                if last is not None and unknown_number(last.state) is not None:
                    # Ended at a state newer than this SDK, which the gateway took for terminal.
                    # Before, the watch was opened again, yielded the batch again and ended, for ever.
                    return
            # The gateway ends a watch only at the batch's end: one ended sooner is a break. Before,
            # every break was opened again 0.5 s later, INTERNAL too, with no jitter: after a
            # gateway restart every batch watch came back in the same instant.
            await attempts.broke("the watch ended before the batch did")

    async def download(
        self, batch: Batch | str, file: str = "output", *, timeout_s: float | None = None
    ) -> AsyncIterator[bytes]:
        """The batch's output (or error, or NPZ) file, in pieces; within `timeout_s` when given (a
        large file may take long: none by default)."""
        if file not in FILES:
            raise ValueError(f"file must be one of {sorted(FILES)}, not {file!r}")
        request = batch_service_pb2.ReadBatchFileRequest(batch_id=_batch_id(batch), file=FILES[file])

        async def opened(remaining: float | None) -> tuple[Any, Any]:
            call = self._stub.ReadBatchFile(request, metadata=self._metadata, timeout=remaining)
            try:
                return call, await call.read()
            except BaseException:
                call.cancel()
                raise

        # Opened as any call is, retried (UNAVAILABLE: a gateway restarting) until its first piece
        # comes, within timeout_s, which is also the stream's deadline. Once pieces have been
        # written a break is the caller's error: the stream cannot resume mid-file.
        call, piece = await self._call(opened, Deadline(timeout_s))
        try:
            while piece is not aio.EOF:  # type: ignore[attr-defined]
                yield piece.chunk
                piece = await call.read()
        except grpc.RpcError as exc:  # the SDK's errors, as every other call raises them
            raise from_rpc_error(exc) from exc
        finally:
            call.cancel()


async def write_file(pieces: AsyncIterator[bytes], target: str | os.PathLike[str] | BinaryIO) -> int:
    """Writes the pieces to a path or a binary file; the bytes written.

    A path is written whole or not at all: the pieces go to `<path>.part` beside it, renamed over
    the path once the last piece is in, and removed if the stream breaks (a gateway gone mid-way,
    an NPZ output refused at a chunk whose shape differs), so a file at the path is always a
    complete one (curl's and wget's `.part` rule). A path that is a device, a FIFO or a socket
    (`/dev/null`, `/dev/stdout` on a pipe) is written as it is: a file renamed over it would
    replace it. A link is followed (asyncinfer.output_paths): to one of this process's
    descriptors (`/dev/stdout` with the shell's output sent to a file) the pieces go through that
    descriptor, else the file at its end is the one written, the link left as it is."""
    if not isinstance(target, str | os.PathLike):
        return await _write_all(pieces, target, threaded=False)
    where = await asyncio.to_thread(descriptor_or_file, target)
    if isinstance(where, int):
        _flush_streams_on(where)
        out = await asyncio.to_thread(os.fdopen, os.dup(where), "wb")
        try:
            return await _write_all(pieces, out)
        finally:
            await asyncio.to_thread(out.close)
    path = where
    if await asyncio.to_thread(is_special, path):
        out = await asyncio.to_thread(path.open, "wb")
        try:
            return await _write_all(pieces, out)
        finally:
            await asyncio.to_thread(out.close)
    if await asyncio.to_thread(path.is_dir):  # found once the whole file had come, at the rename
        raise IsADirectoryError(errno.EISDIR, "a folder, not a file to write", str(target))
    part = path.with_name(path.name + ".part")
    try:
        out = await asyncio.to_thread(part.open, "wb")
    except OSError as exc:  # said of the path asked for, not of `.part`, a name its caller never gave
        raise type(exc)(exc.errno, exc.strerror, str(target)) from exc
    try:
        try:
            written = await _write_all(pieces, out)
        finally:
            await asyncio.to_thread(out.close)
        await asyncio.to_thread(os.replace, part, path)
    except BaseException:
        await asyncio.to_thread(part.unlink, missing_ok=True)
        raise
    return written


def _flush_streams_on(descriptor: int) -> None:
    """What Python still buffers for stdout or stderr, written before bytes that go to the same
    descriptor directly (a line printed before the download stays before it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream.fileno() == descriptor:
                stream.flush()
        except (AttributeError, OSError, ValueError):  # no stream, or one without a descriptor (Jupyter)
            continue


async def _write_all(pieces: AsyncIterator[bytes], out: BinaryIO, *, threaded: bool = True) -> int:
    """Each piece written in order (a file's writes off the loop); the bytes written."""
    written = 0
    async for piece in pieces:
        if threaded:
            await asyncio.to_thread(out.write, piece)
        else:
            out.write(piece)
        written += len(piece)
    return written
