"""A batch's output and error files, written as they are read (ReadBatchFile): the index of valid
records walked once in order beside the chunks, each DONE chunk's outputs read from its job's
result (inline in the record, or its stored object) one chunk at a time. So the output is in input
order by construction, nothing is copied at finalizing, and memory holds one chunk's outputs.

Output lines: `{"custom_id": "...", "outputs": {"<output>": <JSON value>}}` (each value with the
record's batch dimension of 1). Error lines: `{"line", "custom_id", "code", "message"}`: first the
lines that failed validation (the object written at preparation), then the records of chunks that
failed or never ran, in input order.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import msgspec
import numpy as np

from asyncinfer.batches import BatchRecord, Chunk, ChunkStatus, ErrorLine, InputFormat, chunk_job_id
from asyncinfer.blobs import BlobStore
from asyncinfer.errors import AsyncInferError, NotFound
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobState, job_key
from asyncinfer.tensor_codec import decode_tensors
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import tensor_pb2
from services.gateway.batch_prepare import error_line_bytes, errors_ref, index_ref

PIECE_BYTES = 128 * 1024
_ENCODER = msgspec.json.Encoder()


class DataLoss(AsyncInferError):
    """What a batch's file is written from is gone (its retention passed, or it was deleted)."""

    code = grpc.StatusCode.DATA_LOSS
    default_reason = "BATCH_DATA_LOST"


MAX_RESULT_BYTES = 1 << 34


async def _lines(store: BlobStore, tenant: str, ref: str) -> AsyncIterator[bytes]:
    carry = b""
    async for piece in store.chunks(tenant, ref):
        lines = (carry + piece).split(b"\n")
        carry = lines.pop()
        for line in lines:
            yield line
    if carry:
        yield carry


async def _entries(store: BlobStore, record: BatchRecord) -> AsyncGenerator[tuple[int, str], None]:
    if record.input_format in (InputFormat.NPY, InputFormat.NPZ):
        # An array file's index is implicit: record i is line i + 1, custom_id "i" (none stored).
        for i in range(record.total):
            yield i + 1, str(i)
        return
    async for line in _lines(store, record.tenant, index_ref(record.batch_id)):
        number, custom_id = json.loads(line)
        yield number, custom_id


def _json_value(array: Any) -> Any:
    if array.dtype == object:
        return [_json_value(v) if isinstance(v, np.ndarray) else _text(v) for v in array]
    return array.tolist()


def _text(value: bytes) -> str | dict[str, str]:
    """A BYTES element as its UTF-8 text, or {"b64": ...} when it is not text, as the CLI writes
    it (decoded with "replace", such bytes were lost in the output file, silently)."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(value).decode()}


async def chunk_outputs(store: BlobStore, records: JobStore, record: BatchRecord, chunk: Chunk) -> list[Tensor]:
    job_id = chunk_job_id(record.batch_id, chunk.start, chunk.end)
    job = await records.get(job_key(record.tenant, job_id))
    if job is None or job.state is not JobState.SUCCEEDED:
        raise DataLoss(
            f"the result of chunk {chunk.start}-{chunk.end} (job {job_id}) is gone", reason="BATCH_RESULT_GONE"
        )
    if job.result_ref is None:
        return list(job.outputs)
    _, data = await store.read(record.tenant, job.result_ref.ref, max_bytes=MAX_RESULT_BYTES)
    return decode_tensors(tensor_pb2.InferOutputs.FromString(bytes(data)).outputs, "outputs")


def _row_values(array: Any) -> list[Any]:
    """Each record's value of an output, its batch dimension of 1 kept: the array converted once."""
    if array.dtype == object:
        return [_json_value(array[row : row + 1]) for row in range(len(array))]
    return [[row] for row in array.tolist()]


def output_lines(tensors: list[Tensor], entries: list[tuple[int, str]]) -> bytes:
    """msgspec's encoder rather than json.dumps: 3-5x less CPU per chunk of 2,048 MLP records
    (512 floats each), the same values (a small float may read 0.00001 rather than 1e-05; a NaN
    is null, as JSON has no NaN)."""
    columns = {t.name: _row_values(t.to_numpy()) for t in tensors}
    lines = [
        _ENCODER.encode({"custom_id": custom_id, "outputs": {name: rows[row] for name, rows in columns.items()}})
        for row, (_, custom_id) in enumerate(entries)
    ]
    return b"\n".join(lines) + b"\n" if lines else b""


async def _take(entries: AsyncIterator[tuple[int, str]], count: int) -> list[tuple[int, str]]:
    taken = []
    for _ in range(count):
        entry = await anext(entries, None)
        if entry is None:
            raise DataLoss("the batch's record index is shorter than its plan", reason="BATCH_INDEX_SHORT")
        taken.append(entry)
    return taken


async def _chunk_lines(
    store: BlobStore,
    record: BatchRecord,
    wanted: Callable[[Chunk], bool],
    lines: Callable[[Chunk, list[tuple[int, str]]], Awaitable[bytes]],
) -> AsyncIterator[bytes]:
    """The lines of the chunks `wanted`, in input order, in pieces of PIECE_BYTES: the index is
    walked beside every live chunk (a chunk not wanted still takes its entries)."""
    if not record.chunks:
        return
    entries = _entries(store, record)
    buffer = bytearray()
    for chunk in sorted(record.live_chunks, key=lambda c: c.start):
        taken = await _take(entries, chunk.records)
        if not wanted(chunk):
            continue
        buffer += await lines(chunk, taken)
        while len(buffer) >= PIECE_BYTES:
            yield bytes(buffer[:PIECE_BYTES])
            del buffer[:PIECE_BYTES]
    if buffer:
        yield bytes(buffer)


def output_file(store: BlobStore, records: JobStore, record: BatchRecord) -> AsyncIterator[bytes]:
    async def lines(chunk: Chunk, taken: list[tuple[int, str]]) -> bytes:
        return output_lines(await chunk_outputs(store, records, record, chunk), taken)

    return _chunk_lines(store, record, lambda chunk: chunk.status is ChunkStatus.DONE, lines)


def _ran_and_failed(chunk: Chunk) -> bool:
    """A chunk whose records are the error file's second part: failed when run, cancelled or expired."""
    return chunk.status in (ChunkStatus.FAILED, ChunkStatus.SKIPPED)


async def first_run_errors(store: BlobStore, record: BatchRecord, limit: int) -> tuple[ErrorLine, ...]:
    """The first `limit` lines of the error file's second part (records that failed when run, were
    cancelled or expired), in input order, with the index walked only as far as they go."""
    chunks = sorted(record.live_chunks, key=lambda c: c.start)
    if limit <= 0 or not any(_ran_and_failed(c) for c in chunks):
        return ()
    found: list[ErrorLine] = []
    async with contextlib.aclosing(_entries(store, record)) as entries:
        for chunk in chunks:
            taken = await _take(entries, chunk.records)
            if _ran_and_failed(chunk):
                found += (ErrorLine(line, custom_id, chunk.code, chunk.message) for line, custom_id in taken)
                if len(found) >= limit:
                    break
    return tuple(found[:limit])


async def error_file(store: BlobStore, record: BatchRecord) -> AsyncIterator[bytes]:
    try:
        async for piece in store.chunks(record.tenant, errors_ref(record.batch_id)):
            yield piece
    except NotFound:
        pass  # a batch that failed before it was read has no validation errors

    async def lines(chunk: Chunk, taken: list[tuple[int, str]]) -> bytes:
        return b"".join(
            error_line_bytes(ErrorLine(line, custom_id, chunk.code, chunk.message)) for line, custom_id in taken
        )

    async for piece in _chunk_lines(store, record, _ran_and_failed, lines):
        yield piece
