"""VALIDATING → IN_PROGRESS: a batch's uploaded file read (JSONL in pieces, NPY/NPZ whole), checked
record by record (asyncinfer.batch_inputs) and stored as the batch's own objects: one InferInputs
per chunk (what its job's input_ref names), the index of valid records (line, custom_id, rows:
what the output file is written from) and the validation errors (the error file's first part).
Each object is streamed into the store as it is made, so memory holds one chunk at a time.

Everything here is derived from the input alone, under names derived from the batch
(asyncinfer.batches.derived_ref): a gateway killed half-way leaves objects that the next one
writes again, identically, before the single record write that moves the batch on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from asyncinfer import ranged_inputs
from asyncinfer.batch_inputs import (
    ChunkBuilder,
    ChunkReady,
    IndexEntry,
    LineSplitter,
    LongLine,
    NpyLayout,
    RecordInvalid,
    array_chunks,
    array_inputs,
    detect_format,
    long_line_error,
    npy_layout,
    parse_line,
)
from asyncinfer.batches import (
    BatchRecord,
    BatchState,
    Chunk,
    ChunkStatus,
    ErrorLine,
    InputFormat,
    ReadProgress,
    derived_ref,
    merge_first_errors,
)
from asyncinfer.blobs import BlobStore, parse_inputs
from asyncinfer.config import BatchesConfig, ModelConfig
from asyncinfer.errors import NotFound
from asyncinfer.jobs import BlobRef
from asyncinfer.ranged_inputs import RangedInputs
from asyncinfer.supervision import cancel_and_wait
from asyncinfer.tensor_codec import decode_tensors, to_input_proto
from asyncinfer.tensors import ModelSignature, Tensor
from asyncinfer.tracing import TraceSpan
from asyncinfer.v1 import tensor_pb2

INDEX = "index"
DESCRIPTOR_WINDOW = 16
ERRORS = "errors"
# How often a preparation reports how far it has read (a record write each, so a watch of the
# batch moves): by time, not per line or piece, so a large file's reading costs a write every few
# seconds whatever its size; a file read within the interval reports nothing.
READ_PROGRESS_INTERVAL_S = 2.0

Report = Callable[[ReadProgress], Awaitable[None]]


def chunk_ref(batch_id: str, start: int, end: int) -> str:
    return derived_ref("in", batch_id, f"chunk:{start}:{end}")


def index_ref(batch_id: str) -> str:
    return derived_ref("in", batch_id, INDEX)


def errors_ref(batch_id: str) -> str:
    return derived_ref("in", batch_id, ERRORS)


class StreamedObject:
    """An object written while it is being made: pieces go through a small queue into one put."""

    def __init__(self, store: BlobStore, tenant: str, ref: str, *, expires_at: float, max_bytes: int) -> None:
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=8)
        self._buffer = bytearray()
        self._task = asyncio.ensure_future(
            store.put(tenant, ref, self._pieces(), expires_at=expires_at, max_bytes=max_bytes)
        )

    async def _pieces(self) -> AsyncIterator[bytes]:
        while (piece := await self._queue.get()) is not None:
            yield piece

    async def write(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) >= 64 * 1024:
            await self._put(bytes(self._buffer))
            self._buffer.clear()

    async def _put(self, piece: bytes) -> None:
        put = asyncio.ensure_future(self._queue.put(piece))
        done, _ = await asyncio.wait([put, self._task], return_when=asyncio.FIRST_COMPLETED)
        if put not in done:  # the put failed: say why
            put.cancel()
            await self._task

    async def close(self) -> BlobRef:
        if self._buffer:
            await self._put(bytes(self._buffer))
        await self._queue.put(None)
        return await self._task

    async def abort(self) -> None:
        await cancel_and_wait([self._task])  # its object-store writes can lose one cancellation


@dataclass(slots=True)
class Prepared:
    chunks: list[Chunk] = field(default_factory=list)
    total: int = 0
    invalid: int = 0
    first_errors: tuple[ErrorLine, ...] = ()
    input_format: InputFormat | None = None
    input_bytes: int = 0  # of the upload: read, or (NPY) planned over


class _Reporter:
    """Says how far the reading has come, at most every READ_PROGRESS_INTERVAL_S."""

    def __init__(self, report: Report | None, bytes_total: int) -> None:
        self._report = report
        self._total = bytes_total
        self._started = time.time()
        self._next = time.monotonic() + READ_PROGRESS_INTERVAL_S

    async def read(self, prepared: Prepared) -> None:
        if self._report is None or time.monotonic() < self._next:
            return
        progress = ReadProgress(prepared.input_bytes, self._total, prepared.total, self._started, time.time())
        await self._report(progress)  # BatchConflict (cancelled meanwhile) ends the reading
        self._next = time.monotonic() + READ_PROGRESS_INTERVAL_S


def _content(found: InputFormat) -> str:
    """What a file is by its first bytes, for a refusal."""
    if found is not InputFormat.JSONL:
        return f"{found.value} (by its first bytes)"
    return "not NPY or NPZ (it does not start with either's magic bytes): JSONL, or no array file"


def _index_lines(entries: list[IndexEntry]) -> bytes:
    return "".join(json.dumps([e.line, e.custom_id]) + "\n" for e in entries).encode()


def error_line_bytes(error: ErrorLine) -> bytes:
    line = {"line": error.line, "custom_id": error.custom_id, "code": error.code, "message": error.message}
    return (json.dumps(line) + "\n").encode()


def _chunk_bytes(ready: ChunkReady) -> bytes:
    return tensor_pb2.InferInputs(inputs=[to_input_proto(t) for t in ready.tensors]).SerializeToString()


def _parent_of(record: BatchRecord, chunk: Chunk) -> Chunk | None:
    """The smallest split chunk that holds `chunk` (the one it was cut from)."""
    holders = [
        c
        for c in record.chunks
        if c.status is ChunkStatus.SPLIT and c.start <= chunk.start and chunk.end <= c.end and c != chunk
    ]
    return min(holders, key=lambda c: c.records) if holders else None


def _cut(data: bytearray, first: int, last: int) -> bytes:
    """Records [first, last) of a stored chunk's InferInputs (a record is one row), or of its
    range of an NPY upload."""
    if ranged_inputs.is_ranged(data):
        return ranged_inputs.decode(data).narrowed(first, last).encode()
    message = parse_inputs(data)
    tensors = decode_tensors(message.inputs, "chunk")
    cut = [Tensor.from_numpy(t.name, t.to_numpy()[first:last], t.datatype) for t in tensors]
    return tensor_pb2.InferInputs(inputs=[to_input_proto(t) for t in cut]).SerializeToString()


def _parse_piece(
    lines: list[bytes | LongLine], first_line: int, signature: ModelSignature, builder: ChunkBuilder
) -> tuple[list[ChunkReady], list[ErrorLine], int]:
    """In a worker thread: a run of lines into the chunks they closed, their errors, and how many
    non-blank lines they held."""
    ready: list[ChunkReady] = []
    errors: list[ErrorLine] = []
    counted = 0
    for offset, text in enumerate(lines):
        if isinstance(text, LongLine):
            counted += 1
            errors.append(long_line_error(first_line + offset, text.length))
            continue
        if not text.strip():
            continue
        counted += 1
        parsed = parse_line(first_line + offset, text, signature)
        if isinstance(parsed, ErrorLine):
            errors.append(parsed)
            continue
        closed = builder.add(*parsed)
        if closed is not None:
            ready.append(closed)
    return ready, errors, counted


class Preparer:
    def __init__(self, store: BlobStore, config: BatchesConfig, *, max_upload_bytes: int) -> None:
        self._store = store
        self._config = config
        self._max_bytes = max_upload_bytes

    async def prepare(
        self,
        record: BatchRecord,
        model: ModelConfig,
        *,
        now: float,
        span: TraceSpan | None = None,
        report: Report | None = None,
    ) -> BatchRecord:
        """The record moved on: IN_PROGRESS with its chunk plan, or FAILED (unreadable input, or
        too many invalid lines). `span` (the driver's prepare_batch) is told what was read, once
        the whole file was; `report` how far the reading has come, every READ_PROGRESS_INTERVAL_S
        while it reads (the driver writes it to the record)."""
        tenant, expires = record.tenant, record.kept_until
        index = StreamedObject(self._store, tenant, index_ref(record.batch_id), expires_at=expires, max_bytes=1 << 40)
        errors = StreamedObject(self._store, tenant, errors_ref(record.batch_id), expires_at=expires, max_bytes=1 << 40)
        try:
            prepared = await self._read(record, model, index, errors, report)
            await index.close()
            await errors.close()
        except (RecordInvalid, NotFound) as exc:  # NotFound: the upload is gone (expired)
            await index.abort()
            await errors.abort()
            return record.evolve(state=BatchState.FAILED, failure_message=str(exc), end_time=now)
        except BaseException:
            await index.abort()
            await errors.abort()
            raise
        input_format = prepared.input_format or record.input_format
        if span is not None:
            span.set("asyncinfer.input_bytes", prepared.input_bytes)
            if input_format is not None:
                span.set("asyncinfer.input_format", input_format.value)
            span.set("asyncinfer.records", prepared.total)
            span.set("asyncinfer.invalid_records", prepared.invalid)
            span.set("asyncinfer.chunks", len(prepared.chunks))
        changes = {
            "total": prepared.total,
            "invalid_lines": prepared.invalid,
            "first_errors": merge_first_errors((), prepared.first_errors),
            "input_format": input_format,
        }
        # A batch that fails here never runs: as OpenAI's Batch API's failed validation (failed_at,
        # never in_progress_at), it has no in_progress_time and no chunk plan, which GetBatch and
        # the console showed as "in progress since" its failure and "chunks 0 of 1". Its chunks'
        # objects, written already, expire with the batch's.
        if not prepared.total:
            # As OpenAI's Batch API fails an empty file (`empty_file`): a batch of nothing is
            # almost always the wrong file, and COMPLETED 0/0 would hide it.
            named = input_format.value if input_format is not None else "input"
            message = f"the {named} file holds no records"
            return record.evolve(**changes, state=BatchState.FAILED, failure_message=message, end_time=now)
        if prepared.invalid / prepared.total > self._config.max_invalid_fraction:
            message = (
                f"{prepared.invalid} of {prepared.total} lines failed validation, over the allowed fraction "
                f"{self._config.max_invalid_fraction:g} (batches.max_invalid_fraction); see the error file"
            )
            return record.evolve(**changes, state=BatchState.FAILED, failure_message=message, end_time=now)
        return record.evolve(
            **changes, chunks=tuple(prepared.chunks), in_progress_time=now, state=BatchState.IN_PROGRESS
        )

    async def chunk_blob(self, record: BatchRecord, chunk: Chunk) -> BlobRef:
        """The stored inputs of a chunk; a half of a split chunk is cut from its parent's first."""
        ref = chunk_ref(record.batch_id, chunk.start, chunk.end)
        try:
            return (await self._store.info(record.tenant, ref)).ref
        except NotFound:
            parent = _parent_of(record, chunk)
            if parent is None:
                raise
        parent_ref = chunk_ref(record.batch_id, parent.start, parent.end)
        _, data = await self._store.read(record.tenant, parent_ref, max_bytes=self._max_bytes)
        cut = await asyncio.to_thread(_cut, data, chunk.start - parent.start, chunk.end - parent.start)
        return await self._store.put_bytes(record.tenant, ref, cut, expires_at=record.kept_until)

    async def _store_chunk(self, record: BatchRecord, ready: ChunkReady, index: StreamedObject | None) -> Chunk:
        data = await asyncio.to_thread(_chunk_bytes, ready)
        ref = chunk_ref(record.batch_id, ready.start, ready.end)
        await self._store.put_bytes(record.tenant, ref, data, expires_at=record.kept_until)
        if index is not None:
            await index.write(_index_lines(ready.entries))
        return Chunk(ready.start, ready.end)

    async def _read(
        self,
        record: BatchRecord,
        model: ModelConfig,
        index: StreamedObject,
        errors: StreamedObject,
        report: Report | None,
    ) -> Prepared:
        prepared = Prepared()
        size = (await self._store.info(record.tenant, record.input_ref)).ref.size_bytes if report else 0
        reporter = _Reporter(report, size)
        chunks = self._store.chunks(record.tenant, record.input_ref)
        first = await anext(chunks, b"")
        found = detect_format(first)
        fmt = record.input_format or found
        if fmt is not found:
            # input_format says one thing, the file's first bytes another (an NPY or NPZ magic, or
            # none where one is wanted; a JSONL line cannot start with either): say so, rather
            # than fail every line as JSON or report numpy's parse error.
            await chunks.aclose()
            raise RecordInvalid(f"input_format says {fmt.value}, but the file is {_content(found)}")
        prepared.input_format = fmt
        layout = npy_layout(first, model.signature) if fmt is InputFormat.NPY else None
        if layout is not None:
            await chunks.aclose()  # the header is all it reads
            return await self._plan_npy(record, layout, model, prepared)
        if fmt is not InputFormat.JSONL:
            data = bytearray(first)
            async for piece in chunks:
                data += piece
                prepared.input_bytes = len(data)
                await reporter.read(prepared)
            prepared.input_bytes = len(data)
            arrays = await asyncio.to_thread(array_inputs, bytes(data), fmt, model.signature, max_bytes=self._max_bytes)
            del data
            for ready in array_chunks(arrays, model.signature, self._config.chunk_records):
                # An array file's index is implicit (record i: line i + 1, custom_id "i"): none stored.
                prepared.chunks.append(await self._store_chunk(record, ready, None))
                prepared.total = ready.end
            return prepared
        builder = ChunkBuilder(model.signature, self._config.chunk_records)
        splitter = LineSplitter()
        line = 1

        async def pieces() -> AsyncIterator[bytes]:
            prepared.input_bytes = len(first)
            yield first
            async for piece in chunks:
                await reporter.read(prepared)  # what the pieces before this one held
                prepared.input_bytes += len(piece)
                yield piece

        async for piece in pieces():
            if lines := splitter.feed(piece):
                line = await self._lines(record, model, lines, line, builder, prepared, index, errors)
        if last_line := splitter.end():
            await self._lines(record, model, last_line, line, builder, prepared, index, errors)
        last = builder.close()
        if last is not None:
            prepared.chunks.append(await self._store_chunk(record, last, index))
        return prepared

    async def _plan_npy(
        self, record: BatchRecord, layout: NpyLayout, model: ModelConfig, prepared: Prepared
    ) -> Prepared:
        """An NPY file's chunks as ranges of its rows in the upload (asyncinfer.ranged_inputs):
        its header and size are read, its body is not (nor copied). The upload is kept as long as
        the batch's own objects, since its chunks read it."""
        info = await self._store.info(record.tenant, record.input_ref)
        held = (info.ref.size_bytes - layout.offset) // layout.row_bytes if layout.row_bytes else layout.rows
        if held != layout.rows:
            raise RecordInvalid(f"the NPY file holds {held} of the {layout.rows} records its header says")
        await self._store.extend(record.tenant, record.input_ref, record.kept_until)
        spec = model.signature.inputs[0]
        whole = RangedInputs(
            source=record.input_ref,
            source_sha256=info.ref.sha256,
            offset=layout.offset,
            first=0,
            rows=layout.rows,
            row_shape=layout.row_shape,
            dtype=layout.dtype.str,
            name=spec.name,
            datatype=spec.datatype,
        )
        step = self._config.chunk_records
        ranges = [(start, min(start + step, layout.rows)) for start in range(0, layout.rows, step)]
        expires = record.kept_until
        for window in range(0, len(ranges), DESCRIPTOR_WINDOW):
            # Small objects: a window of puts at once, so a million records' plan takes a moment.
            await asyncio.gather(
                *(
                    self._store.put_bytes(
                        record.tenant,
                        chunk_ref(record.batch_id, a, b),
                        whole.narrowed(a, b).encode(),
                        expires_at=expires,
                    )
                    for a, b in ranges[window : window + DESCRIPTOR_WINDOW]
                )
            )
        prepared.chunks.extend(Chunk(a, b) for a, b in ranges)
        prepared.total = layout.rows
        prepared.input_bytes = info.ref.size_bytes
        return prepared

    async def _lines(
        self,
        record: BatchRecord,
        model: ModelConfig,
        lines: list[bytes | LongLine],
        line: int,
        builder: ChunkBuilder,
        prepared: Prepared,
        index: StreamedObject,
        errors: StreamedObject,
    ) -> int:
        ready, bad, counted = await asyncio.to_thread(_parse_piece, lines, line, model.signature, builder)
        prepared.total += counted
        prepared.invalid += len(bad)
        if bad:
            prepared.first_errors = merge_first_errors(prepared.first_errors, bad)
            await errors.write(b"".join(error_line_bytes(e) for e in bad))
        for closed in ready:
            prepared.chunks.append(await self._store_chunk(record, closed, index))
        return line + len(lines)
