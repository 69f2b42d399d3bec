"""A batch's output as an NPZ archive (ReadBatchFile with BATCH_FILE_OUTPUT_NPZ), for a batch over
an array file (NPY or NPZ input): `succeeded`, a bool per record, then one array per model output
whose first dimension is every record of the input in its order. A record that did not succeed (or
has not run yet) is a row of zeros there, and its reason is in the error file.

Why beside the JSONL output: a numeric output as JSON text is ~5x its bytes and costs the gateway a
`tolist` and a `json.dumps` per record; an array input's user wants arrays back (np.load), the way
SageMaker Batch Transform hands back what the model gave. The rows are the chunks' result bytes as
they are stored, written in order, so nothing is converted.

Written as it is read, like the JSONL files (services.gateway.batch_files): a ZIP archive with each
member stored (not compressed) and its size and CRC after its data (zipfile's streaming form), so
memory holds one chunk's outputs. Each output is one pass over the DONE chunks' results. Every row
of an output must have one shape and a numeric type (checked against the first DONE chunk's, or the
model's signature when none is done); otherwise the archive ends with FAILED_PRECONDITION and the
JSONL output is the one to read.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from asyncinfer.batches import BatchRecord, BatchState, Chunk, ChunkStatus, InputFormat
from asyncinfer.blobs import BlobStore
from asyncinfer.config import ModelConfig
from asyncinfer.errors import FailedPrecondition
from asyncinfer.job_store import JobStore
from asyncinfer.tensors import NUMPY_DTYPES, Tensor
from services.gateway.batch_files import PIECE_BYTES, chunk_outputs

SUCCEEDED = "succeeded"
# Zero rows are written in pieces of at most this (a chunk that failed may be millions of rows).
ZEROS_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class OutputShape:
    name: str
    datatype: str
    row: tuple[int, ...]  # one record's dimensions after the batch dimension

    @property
    def row_bytes(self) -> int:
        return np.dtype(NUMPY_DTYPES[self.datatype]).itemsize * math.prod(self.row)


def refuse_npz(record: BatchRecord) -> FailedPrecondition | None:
    """Why this batch's output cannot be an NPZ archive, or None."""
    if record.state is BatchState.FAILED and not record.chunks:
        return FailedPrecondition(
            f"batch {record.batch_id} FAILED before any record ran ({record.failure_message}): it has no outputs",
            reason="BATCH_FAILED",
            metadata={"batch_id": record.batch_id},
        )
    if record.input_format not in (InputFormat.NPY, InputFormat.NPZ):
        return FailedPrecondition(
            f"batch {record.batch_id} reads a JSONL file: its records are known by custom_id, "
            "so its output is JSONL (BATCH_FILE_OUTPUT); an NPZ output is for a batch over an NPY or NPZ file",
            reason="NPZ_OUTPUT_NEEDS_ARRAY_INPUT",
            metadata={"batch_id": record.batch_id},
        )
    return None


class ArchiveSink:
    """What zipfile writes, kept until it is sent (zipfile writes to it as to an unseekable file)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self.size = 0

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def take(self) -> list[bytes]:
        """What was written since the last take, in pieces of at most PIECE_BYTES (each one
        message of the stream: a chunk's rows are MBs, over gRPC's 4 MiB message limit)."""
        data = memoryview(b"".join(self._parts))
        self._parts.clear()
        self.size = 0
        return [bytes(data[start : start + PIECE_BYTES]) for start in range(0, len(data), PIECE_BYTES)]


def _shape_of(tensor: Tensor, model: str) -> OutputShape:
    if tensor.datatype == "BYTES" or tensor.datatype not in NUMPY_DTYPES:
        raise _unarrayable(model, f"output {tensor.name!r} is {tensor.datatype}, not numeric")
    return OutputShape(tensor.name, tensor.datatype, tuple(tensor.shape[1:]))


def _unarrayable(model: str, why: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"model {model!r}'s {why}: its output cannot be one array per output; read BATCH_FILE_OUTPUT (JSONL)",
        reason="NPZ_OUTPUT_NOT_ARRAYS",
    )


async def _output_shapes(
    store: BlobStore, records: JobStore, record: BatchRecord, model: ModelConfig | None, first: dict[int, list[Tensor]]
) -> list[OutputShape]:
    """Each output's shape, from the first DONE chunk's outputs (kept in `first`, by the chunk's
    start, for its rows: read once) or, with none done, the model's signature."""
    shapes = await _shapes_of_outputs(store, records, record, model, first)
    if any(shape.name == SUCCEEDED for shape in shapes):
        raise _unarrayable(record.model_name, f"output is named {SUCCEEDED!r}, as the archive's mask of records")
    return shapes


async def _shapes_of_outputs(
    store: BlobStore, records: JobStore, record: BatchRecord, model: ModelConfig | None, first: dict[int, list[Tensor]]
) -> list[OutputShape]:
    done = next((c for c in sorted(record.live_chunks, key=lambda c: c.start) if c.status is ChunkStatus.DONE), None)
    if done is not None:
        first[done.start] = await chunk_outputs(store, records, record, done)
        return [_shape_of(t, record.model_name) for t in first[done.start]]
    if model is None:
        return []  # nothing ran and the model is gone: `succeeded` alone says so
    shapes = []
    for spec in model.signature.outputs:
        row = tuple(spec.shape[1:])
        if spec.datatype == "BYTES" or any(d < 0 for d in row):
            raise _unarrayable(record.model_name, f"output {spec.name!r} has no fixed shape ({spec.shape})")
        shapes.append(OutputShape(spec.name, spec.datatype, row))
    return shapes


def _header(member: IO[bytes], dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    descr = np.lib.format.dtype_to_descr(dtype)  # type: ignore[no-untyped-call]
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(member, header)  # type: ignore[no-untyped-call]


def _write_zeros(member: IO[bytes], count: int) -> None:
    zeros = bytes(min(count, ZEROS_BYTES))
    while count > 0:
        piece = zeros if count >= len(zeros) else zeros[:count]
        member.write(piece)
        count -= len(piece)


async def output_npz(
    store: BlobStore, records: JobStore, record: BatchRecord, model: ModelConfig | None
) -> AsyncIterator[bytes]:
    """The archive's bytes in pieces of at most PIECE_BYTES (see the module)."""
    first: dict[int, list[Tensor]] = {}
    shapes = await _output_shapes(store, records, record, model, first)
    chunks = sorted(record.live_chunks, key=lambda c: c.start)
    sink = ArchiveSink()
    archive = zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
    with archive.open(f"{SUCCEEDED}.npy", "w", force_zip64=True) as member:
        _header(member, np.dtype(np.bool_), (record.total,))
        mask = np.zeros(record.total, dtype=np.bool_)
        for chunk in chunks:
            if chunk.status is ChunkStatus.DONE:
                mask[chunk.start : chunk.end] = True
        member.write(mask.tobytes())
    for index, shape in enumerate(shapes):
        with archive.open(f"{shape.name}.npy", "w", force_zip64=True) as member:
            _header(member, np.dtype(NUMPY_DTYPES[shape.datatype]), (record.total, *shape.row))
            written = 0  # rows
            for chunk in chunks:
                if chunk.start > written:  # rows no chunk holds (none should): zeros
                    _write_zeros(member, (chunk.start - written) * shape.row_bytes)
                if chunk.status is ChunkStatus.DONE:
                    outputs = first.get(chunk.start) or await chunk_outputs(store, records, record, chunk)
                    member.write(_rows(record, chunk, outputs, index, shape))
                else:
                    _write_zeros(member, chunk.records * shape.row_bytes)
                written = max(written, chunk.end)
                if sink.size >= PIECE_BYTES:
                    for piece in sink.take():
                        yield piece
            if written < record.total:
                _write_zeros(member, (record.total - written) * shape.row_bytes)
    archive.close()
    for piece in sink.take():
        yield piece


def _rows(record: BatchRecord, chunk: Chunk, outputs: list[Tensor], index: int, shape: OutputShape) -> bytes:
    tensor = outputs[index] if index < len(outputs) else None
    if (
        tensor is None
        or tensor.name != shape.name
        or tensor.datatype != shape.datatype
        or tuple(tensor.shape) != (chunk.records, *shape.row)
    ):
        got = "none" if tensor is None else f"{tensor.name!r} {tensor.datatype} {tuple(tensor.shape)}"
        raise _unarrayable(
            record.model_name,
            f"chunk {chunk.start}-{chunk.end} gave output {got} where {shape.name!r} {shape.datatype} "
            f"{(chunk.records, *shape.row)} was written",
        )
    return tensor.data
