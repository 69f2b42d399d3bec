"""A chunk's inputs named as a byte range of its uploaded NPY file rather than copied (issue 15).

An NPY file's rows are a fixed number of bytes each after its header, so a chunk of records
[start, end) is the bytes [offset + start·row_bytes, offset + end·row_bytes) of the upload. The
batch's preparation stores, per chunk, this small descriptor where it used to store a copy of the
chunk's rows as an InferInputs message; the scheduler, which resolves a job's input_ref before
dispatch, reads the range from the upload (BlobStore.read_range: only the upload's chunks that the
range covers) and builds the input tensor from it. So a record is stored once, and preparing an NPY
batch reads its header, not its body.

The descriptor is its own object, under the chunk's derived name, so everything that named chunk
objects (the job's input_ref, the halves of a split chunk, expiry) is unchanged. It starts with
MAGIC, which no InferInputs message can start with (field 1's tag is 0x0a; 'a' is 0x61, a varint
field 12 that InferInputs does not have), so a reader tells the two apart by their first bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from asyncinfer.errors import InvalidArgument
from asyncinfer.tensors import Tensor, typed_as

MAGIC = b"asyncinfer-range/1\n"


@dataclass(frozen=True, slots=True)
class RangedInputs:
    """Rows [first, first + rows) of an NPY upload, as the model input `name` of `datatype`."""

    source: str  # the upload's ref (same tenant as the job)
    source_sha256: str  # the upload's SHA-256 when the batch was prepared: a changed upload is refused
    offset: int  # where the file's row 0 starts (after the NPY header)
    first: int  # the first row of the range
    rows: int
    row_shape: tuple[int, ...]
    dtype: str  # the file's numpy dtype, e.g. "<f4"
    name: str
    datatype: str

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def byte_offset(self) -> int:
        return self.offset + self.first * self.row_bytes

    @property
    def byte_length(self) -> int:
        return self.rows * self.row_bytes

    def narrowed(self, first: int, last: int) -> RangedInputs:
        """Rows [first, last) of this range (relative to it): a half of a split chunk."""
        if not 0 <= first <= last <= self.rows:
            raise ValueError(f"rows {first}:{last} are not within the range's {self.rows}")
        return replace(self, first=self.first + first, rows=last - first)

    def encode(self) -> bytes:
        fields: dict[str, Any] = {
            "source": self.source,
            "source_sha256": self.source_sha256,
            "offset": self.offset,
            "first": self.first,
            "rows": self.rows,
            "row_shape": list(self.row_shape),
            "dtype": self.dtype,
            "name": self.name,
            "datatype": self.datatype,
        }
        return MAGIC + json.dumps(fields, separators=(",", ":")).encode()

    def tensors(self, data: bytes | bytearray | memoryview) -> list[Tensor]:
        """The range's bytes as the model's input (converted where the file's dtype differs but
        loses nothing, as preparation checked)."""
        if len(data) != self.byte_length:
            raise InvalidArgument(
                f"the range of {self.source!r} holds {len(data)} bytes, not {self.byte_length}",
                reason="INPUT_RANGE_SHORT",
            )
        array = np.frombuffer(data, dtype=np.dtype(self.dtype)).reshape((self.rows, *self.row_shape))
        typed = typed_as(array, self.datatype)
        if typed is None:
            raise InvalidArgument(
                f"the file's {self.dtype} rows do not fit {self.datatype} (a value past its range)",
                reason="INPUT_RANGE_DTYPE",
            )
        if typed is array and isinstance(data, bytes) and self.datatype != "BYTES":
            # Already the model's dtype (typed_as gave the array back): the bytes as they are, not copied again.
            # Not for BYTES: fixed-width text or bytes rows (numpy's <U and S) are no BYTES
            # serialization; from_numpy makes each element one value, text as UTF-8.
            return [Tensor(name=self.name, datatype=self.datatype, shape=typed.shape, data=data)]
        return [Tensor.from_numpy(self.name, typed, self.datatype)]


def is_ranged(data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[: len(MAGIC)]) == MAGIC


def decode(data: bytes | bytearray | memoryview) -> RangedInputs:
    """The descriptor in `data` (which is_ranged); InvalidArgument when it is not readable."""
    try:
        fields = json.loads(bytes(data[len(MAGIC) :]))
        return RangedInputs(
            source=str(fields["source"]),
            source_sha256=str(fields["source_sha256"]),
            offset=int(fields["offset"]),
            first=int(fields["first"]),
            rows=int(fields["rows"]),
            row_shape=tuple(int(d) for d in fields["row_shape"]),
            dtype=str(np.dtype(fields["dtype"]).str),
            name=str(fields["name"]),
            datatype=str(fields["datatype"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(
            f"the chunk's input range is unreadable: {exc}", reason="INPUT_RANGE_UNREADABLE"
        ) from None
