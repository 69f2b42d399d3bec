"""A batch's input file into chunks: JSONL lines (one record each) or NPY/NPZ arrays (first
dimension the record) checked against the model's signature, and the valid records gathered into
chunk tensors in input order. Pure (no NATS): the gateway's batch preparation feeds it the file's
bytes and stores what comes out.

A JSONL record is `{"custom_id": "...", "inputs": {"<input>": <JSON value>}}`, each value typed by
the signature with the record's own batch dimension (1: a record is one row) included (`{"x": [[1, 2, 3, 4]]}`
for an input of shape [-1, 4]); a value one dimension short is taken as that one row. BYTES values are
strings. A line that does not fit is one error line, never a failed batch.

Records that may share a chunk have the same non-batch shapes; a record whose shapes differ from
the chunk's closes it, so a chunk's tensors are plain concatenations along the batch dimension.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec
import numpy as np
import numpy.typing as npt

from asyncinfer.batches import ErrorLine, InputFormat
from asyncinfer.tensors import (
    NUMPY_DTYPES,
    RAGGED_REASON,
    ModelSignature,
    Tensor,
    TensorSpec,
    as_one_row,
    booleans_misplaced,
    cast_change,
    typed_as,
)

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
MAX_CUSTOM_ID_BYTES = 512
_DECODER = msgspec.json.Decoder()

Arrays = dict[str, npt.NDArray[Any]]


def detect_format(head: bytes) -> InputFormat:
    if head.startswith(NPY_MAGIC):
        return InputFormat.NPY
    if head.startswith(ZIP_MAGIC):
        return InputFormat.NPZ
    return InputFormat.JSONL


class RecordInvalid(ValueError):
    """Why one record does not fit the signature."""


@dataclass(slots=True)
class IndexEntry:
    """What the output and error files need of a valid record: its line and custom_id."""

    line: int
    custom_id: str


def _typed(spec: TensorSpec, value: Any) -> npt.NDArray[Any]:
    if spec.datatype == "BYTES":
        array = np.asarray(value, dtype=object)
        if array.size and not all(isinstance(v, str) for v in array.reshape(-1)):
            raise RecordInvalid(f"input {spec.name!r} is BYTES: give strings")
        array = np.vectorize(lambda v: v.encode(), otypes=[object])(array) if array.size else array
    else:
        typed = typed_as(value, spec.datatype)
        # [true, 2.5] is a float array to numpy, [true, 2] an integer one: FP32 and INT64 took them
        # as 1.0 and 1, the line's mistake run. Given `typed`, a line of numbers without a 0 or a
        # 1 is not walked (bench/results/json_booleans_check.txt).
        if misplaced := booleans_misplaced(value, spec.datatype, typed):
            raise RecordInvalid(f"input {spec.name!r} {misplaced}")
        if typed is None:
            # With what the model takes, as the CLI's -i and the SDK's refusals say it.
            raise RecordInvalid(
                f"input {spec.name!r} {_not_typed(value, spec.datatype)}; the model takes {spec.summary()}"
            )
        array = typed
    array = as_one_row(array, spec)
    if array.ndim != len(spec.shape) or any(
        want != -1 and got != want for got, want in zip(array.shape, spec.shape, strict=True)
    ):
        raise RecordInvalid(
            f"input {spec.name!r} must have shape {list(spec.shape)} (-1: any; the record's own batch "
            f"dimension first), got {list(array.shape)}"
        )
    if array.shape[0] != 1:
        raise RecordInvalid(
            f"input {spec.name!r} has {array.shape[0]} rows: a record is one row (its batch dimension is 1); "
            "give each row its own line"
        )
    return array


def _not_typed(value: Any, datatype: str) -> str:
    """Why a line's value is not `datatype` numbers, to follow "input 'x' ". It said only "must be
    INT64 numbers", for 1.5 as for 300 to UINT8, which left the writer to guess what was wrong."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        return RAGGED_REASON
    if changed := cast_change(array, datatype, value):
        # "has 1.5, not a whole number: INT64 takes whole numbers", "has 300, past UINT8's range ...",
        # "has 2.0, a float: INT64 takes integers (write 2, not 2.0)": as the CLI's -i and the SDK.
        return changed
    within = " within its range" if datatype.startswith("FP") else ""
    return f"must be {datatype} numbers{within}"


def check_record(arrays: dict[str, Any], signature: ModelSignature) -> Arrays:
    """The record's inputs as arrays of the signature's types; RecordInvalid when they do not fit."""
    if not isinstance(arrays, dict):
        raise RecordInvalid('"inputs" must be an object of input names to values')
    names = {spec.name for spec in signature.inputs}
    unknown = sorted(set(arrays) - names)
    if unknown:
        raise RecordInvalid(f"unknown input {unknown[0]!r}; the model takes: {', '.join(sorted(names))}")
    typed: Arrays = {}
    for spec in signature.inputs:
        if spec.name not in arrays:
            raise RecordInvalid(f"missing input {spec.name!r}")
        try:
            typed[spec.name] = _typed(spec, arrays[spec.name])
        except (ValueError, TypeError) as exc:
            if isinstance(exc, RecordInvalid):
                raise
            raise RecordInvalid(f"input {spec.name!r}: {exc}") from None
    return typed


def _decoded(text: bytes) -> Any:
    """The line's JSON value: msgspec's decoder (18 against 102 us for a line of 512 floats), and
    Python's json for what msgspec refuses but json takes (NaN and Infinity, which json.dumps writes),
    so a line read before is read now; a line neither takes raises json's error."""
    try:
        return _DECODER.decode(text)
    except msgspec.DecodeError:
        return json.loads(text)


def _check_overflow(text: bytes, arrays: Arrays) -> None:
    """RecordInvalid for a number past FP64's range, which msgspec reads as inf: 1e400 ran as inf
    (its output null) where 1e300 for FP32 is refused. An inf is taken as written only where the
    line writes Infinity (read as inf and kept, as Python's json.dumps writes one)."""
    for name, array in arrays.items():
        if array.dtype.kind == "f" and bool(np.isinf(array).any()) and b"Infinity" not in text:
            raise RecordInvalid(f"input {name!r} has a number past the range of any float (FP64's)")


_LINE_FIELDS = frozenset({"custom_id", "inputs"})
# The longest JSONL line read: four times a SubmitJob request's default limit (4 MiB), room for its
# tensors as JSON text.
MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class LongLine:
    """A line over MAX_LINE_BYTES, of which only its length was kept."""

    length: int


def long_line_error(line: int, length: int) -> ErrorLine:
    return ErrorLine(line, "", "INVALID_ARGUMENT", f"the line is {length} bytes, over {MAX_LINE_BYTES}")


@dataclass(slots=True)
class LineSplitter:
    """A JSONL file's lines as its pieces arrive. A line that spans pieces is gathered in one
    buffer, appended to, until it is over `max_line_bytes`: then only its length is counted
    (LongLine). Joining each piece to all of the line before it (`carry + piece`) copied the line
    again per piece: a 64-MB line without a newline took 17 s of the gateway's event loop, one
    of 1 GiB (an upload's limit, e.g. a JSON array sent as one line) hours, each join holding the
    line twice."""

    max_line_bytes: int = field(default_factory=lambda: MAX_LINE_BYTES)
    _line: bytearray = field(default_factory=bytearray)
    _length: int = 0  # the unfinished line's bytes so far, those not kept included

    def feed(self, piece: bytes) -> list[bytes | LongLine]:
        """The lines that `piece` ends, in order (without their newlines)."""
        parts = piece.split(b"\n")
        last = parts.pop()
        if not parts:
            self._add(last)
            return []
        self._add(parts[0])
        lines: list[bytes | LongLine] = [self._finish()]
        if len(piece) <= self.max_line_bytes:  # a store's pieces (128 KiB): no whole line within can be long
            lines += parts[1:]
        else:
            lines += (p if len(p) <= self.max_line_bytes else LongLine(len(p)) for p in parts[1:])
        self._add(last)
        return lines

    def end(self) -> list[bytes | LongLine]:
        """The last line, where the file does not end with a newline."""
        return [self._finish()] if self._length else []

    def _add(self, part: bytes) -> None:
        self._length += len(part)
        if self._length <= self.max_line_bytes:
            self._line += part
        else:
            self._line.clear()

    def _finish(self) -> bytes | LongLine:
        finished = bytes(self._line) if self._length <= self.max_line_bytes else LongLine(self._length)
        self._line.clear()
        self._length = 0
        return finished


def parse_line(line: int, text: bytes, signature: ModelSignature) -> tuple[IndexEntry, Arrays] | ErrorLine:
    """One JSONL line: its record, or its error line."""
    custom_id = ""
    if len(text) > MAX_LINE_BYTES:
        # Not decoded: a line is held about nine times over as Python objects (a 45-MB line took a
        # gateway from 123 to 529 MB), and one record past a SubmitJob's size is no record to run.
        return long_line_error(line, len(text))
    try:
        value = _decoded(text)
        if not isinstance(value, dict):
            raise RecordInvalid("a line must be a JSON object")
        raw_id = value.get("custom_id")
        # Without one (absent, null or ""), the record's line: the output file, which holds only the
        # records that succeeded, is joined to the input by custom_id. An integer reads as its
        # digits; another kind is refused (Python's str() made true "True" and an object "{'a': 1}",
        # which nothing joins back).
        if raw_id is None or raw_id == "":
            custom_id = str(line)
        elif isinstance(raw_id, str):
            custom_id = raw_id
        elif isinstance(raw_id, int) and not isinstance(raw_id, bool):
            custom_id = str(raw_id)
        else:
            custom_id = str(line)
            raise RecordInvalid(
                f"custom_id must be a string (or an integer), got {type(raw_id).__name__}: {raw_id!r}"[:200]
            )
        if len(custom_id.encode()) > MAX_CUSTOM_ID_BYTES:
            custom_id = custom_id[:64]
            raise RecordInvalid(f"custom_id is over {MAX_CUSTOM_ID_BYTES} bytes")
        if unknown := value.keys() - _LINE_FIELDS:
            # A typo ("custom-id") would otherwise pass silently, and a "model" would be taken as
            # choosing one when the batch's model runs every line.
            raise RecordInvalid(f"unknown field {sorted(unknown)[0]!r} (a line has custom_id and inputs)")
        if "inputs" not in value:
            raise RecordInvalid('a line needs "inputs"')
        arrays = check_record(value["inputs"], signature)
        _check_overflow(text, arrays)
    except RecordInvalid as exc:
        return ErrorLine(line, custom_id, "INVALID_ARGUMENT", str(exc))
    except json.JSONDecodeError as exc:  # its "line 1" is within the line: the column says where
        return ErrorLine(
            line, custom_id, "INVALID_ARGUMENT", f"not a JSON line: {exc.msg.removesuffix(' at')} at column {exc.colno}"
        )
    except ValueError as exc:  # UnicodeDecodeError
        return ErrorLine(line, custom_id, "INVALID_ARGUMENT", f"not a JSON line: {exc}")
    except RecursionError:  # nested some thousand levels deep: it escaped, and the batch's preparation
        # failed and started again, hundreds of times a second, never getting past VALIDATING
        return ErrorLine(line, custom_id, "INVALID_ARGUMENT", "not a JSON line: nested too deeply")
    return IndexEntry(line, custom_id), arrays


@dataclass(slots=True)
class ChunkReady:
    """A chunk's records, ready to store: [start, end) and its tensors."""

    start: int
    end: int
    tensors: list[Tensor]
    entries: list[IndexEntry]


@dataclass(slots=True)
class ChunkBuilder:
    """Gathers valid records into chunks of at most chunk_records, in order."""

    signature: ModelSignature
    chunk_records: int
    next_record: int = 0
    _start: int = 0
    _shapes: tuple[tuple[int, ...], ...] | None = None
    _parts: dict[str, list[npt.NDArray[Any]]] = field(default_factory=dict)
    _entries: list[IndexEntry] = field(default_factory=list)

    def add(self, entry: IndexEntry, arrays: Arrays) -> ChunkReady | None:
        """Adds a record; the chunk it closed, if it closed one (by size, or by a change of
        shapes: then the record opens the next chunk)."""
        shapes = tuple(arrays[s.name].shape[1:] for s in self.signature.inputs)
        closed = None
        if self._shapes is not None and shapes != self._shapes:
            closed = self.close()
        if not self._entries:
            self._start = self.next_record
            self._shapes = shapes
        for name, array in arrays.items():
            self._parts.setdefault(name, []).append(array)
        self._entries.append(entry)
        self.next_record += 1
        if closed is None and len(self._entries) >= self.chunk_records:
            closed = self.close()
        return closed

    def close(self) -> ChunkReady | None:
        if not self._entries:
            return None
        tensors = []
        for spec in self.signature.inputs:
            parts = self._parts[spec.name]
            tensors.append(
                Tensor.from_numpy(spec.name, np.concatenate(parts) if len(parts) > 1 else parts[0], spec.datatype)
            )
        ready = ChunkReady(self._start, self.next_record, tensors, self._entries)
        self._parts = {}
        self._entries = []
        self._shapes = None
        return ready


def _check_array(
    spec: TensorSpec, array: npt.NDArray[Any], fmt: InputFormat, *, file_shape: tuple[int, ...] | None = None
) -> npt.NDArray[Any]:
    """The array typed by the signature; RecordInvalid when it does not fit. `file_shape`: the
    whole array's, named in the refusal where `array` is a part of it (its header's rows, none read)."""
    if spec.datatype == "BYTES":
        array = array.astype(object) if array.dtype.kind in ("U", "S", "O") else array
        array = np.vectorize(lambda v: v.encode() if isinstance(v, str) else v, otypes=[object])(array)
    else:
        typed = typed_as(array, spec.datatype)
        if typed is None:
            row = _first_record_out_of_range(array, spec.datatype)
            if row is not None:
                raise RecordInvalid(
                    f"array {spec.name!r} ({array.dtype}) has a value past {spec.datatype}'s range, in record {row}"
                )
            raise RecordInvalid(f"array {spec.name!r} must be {spec.datatype}, got {array.dtype}")
        array = typed
    if array.ndim != len(spec.shape) or any(
        want != -1 and got != want for got, want in zip(array.shape[1:], spec.shape[1:], strict=True)
    ):
        raise RecordInvalid(
            f"array {spec.name!r} of the {fmt.value} file must have shape {list(spec.shape)} (first dimension "
            f"the record), got {list(array.shape if file_shape is None else file_shape)}"
        )
    return array


def _first_record_out_of_range(array: npt.NDArray[Any], datatype: str) -> int | None:
    """The first record holding a value that typed_as refused for its range rather than its kind
    (a float64 of 1e300 for FP32, an int64 of 300 for INT8), or None: the refusal then named a
    dtype that was not at fault ("must be FP32, got float64", which typed_as converts)."""
    target = NUMPY_DTYPES.get(datatype)
    if target is None or array.ndim == 0 or array.dtype.kind not in "iuf":
        return None
    if target.kind == "f":
        with np.errstate(over="ignore"):
            past = np.isinf(array.astype(target)) & ~np.isinf(array)
    elif target.kind in "iu" and array.dtype.kind in "iu":
        info = np.iinfo(target.str)
        past = (array < info.min) | (array > info.max)
    else:
        return None
    found = np.flatnonzero(past)
    return int(np.unravel_index(found[0], array.shape)[0]) if found.size else None


def _single_input(signature: ModelSignature) -> TensorSpec:
    if len(signature.inputs) != 1:
        names = ", ".join(s.name for s in signature.inputs)
        raise RecordInvalid(f"an NPY file holds one array; the model takes several inputs ({names}): use NPZ")
    return signature.inputs[0]


@dataclass(frozen=True, slots=True)
class NpyLayout:
    """Where an NPY file's rows are: after `offset` bytes, `row_bytes` each, `rows` of them."""

    offset: int
    rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    def array(self, data: bytes | bytearray | memoryview, rows: int) -> npt.NDArray[Any]:
        return np.frombuffer(data, dtype=self.dtype, count=rows * int(np.prod(self.row_shape, dtype=np.int64))).reshape(
            (rows, *self.row_shape)
        )


def _npy_header(stream: IO[bytes]) -> tuple[tuple[int, ...], bool, Any]:
    """An NPY header's shape, Fortran order and dtype (ValueError, OSError or EOFError if it is not one)."""
    # numpy's format helpers are untyped.
    version = np.lib.format.read_magic(stream)  # type: ignore[no-untyped-call]
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read_header(stream)  # type: ignore[no-untyped-call]
    return tuple(shape), bool(fortran_order), dtype


def npy_layout(head: bytes, signature: ModelSignature) -> NpyLayout | None:
    """The layout of an NPY file from its first bytes, checked against the signature, for reading
    its rows as they stream in; None where it cannot be streamed (Fortran order, an object dtype, a
    header past `head`): read it whole then. RecordInvalid when it does not fit the model."""
    spec = _single_input(signature)
    buffer = io.BytesIO(head)
    try:
        shape, fortran_order, dtype = _npy_header(buffer)
    except (ValueError, OSError, EOFError):
        return None
    if fortran_order or dtype.hasobject or not shape:
        return None
    _check_array(spec, np.zeros((0, *shape[1:]), dtype=dtype), InputFormat.NPY, file_shape=tuple(shape))
    return NpyLayout(offset=buffer.tell(), rows=int(shape[0]), row_shape=tuple(shape[1:]), dtype=dtype)


def npy_chunk(
    layout: NpyLayout, data: bytes | bytearray | memoryview, start: int, signature: ModelSignature
) -> ChunkReady:
    """The rows in `data` (whole rows of an NPY file, from record `start`) as a chunk."""
    spec = signature.inputs[0]
    rows = len(data) // layout.row_bytes
    array = _check_array(spec, layout.array(data, rows), InputFormat.NPY)
    entries = [IndexEntry(i + 1, str(i)) for i in range(start, start + rows)]
    return ChunkReady(start, start + rows, [Tensor.from_numpy(spec.name, array, spec.datatype)], entries)


def _check_declared(stream: IO[bytes], held: int, what: str) -> None:
    """RecordInvalid when an NPY header declares more bytes of array than the `held` bytes it
    comes with: numpy allocates the declared array before it reads a byte (a header of 10^12 rows
    in a file of a kilobyte left a batch VALIDATING on MemoryError, tried again for its whole
    window)."""
    try:
        shape, _fortran, dtype = _npy_header(stream)
    except (ValueError, OSError, EOFError) as exc:
        raise RecordInvalid(f"{what} is not an NPY array: {exc}") from None
    declared = math.prod(shape) * dtype.itemsize
    if declared > held - stream.tell():
        raise RecordInvalid(f"{what} declares shape {list(shape)} of {dtype} ({declared} bytes) but holds fewer")


def _check_npz(data: bytes, max_bytes: int) -> None:
    """RecordInvalid for an NPZ file whose arrays would be larger than `max_bytes` uncompressed, or
    whose headers declare more than their members hold, before numpy decompresses anything: a
    199-KiB archive grew the gateway by 201 MiB (a deflate bomb)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
        total = sum(member.file_size for member in members)
        if total > max_bytes:
            raise RecordInvalid(
                f"the NPZ file's arrays are {total} bytes uncompressed; at most {max_bytes} (gateway.max_upload_bytes)"
            )
        for member in members:
            with archive.open(member) as stream:
                _check_declared(stream, member.file_size, f"the NPZ member {member.filename!r}")


def array_inputs(data: bytes, fmt: InputFormat, signature: ModelSignature, *, max_bytes: int) -> Arrays:
    """The arrays of an NPY or NPZ file, checked against the signature as a whole (first
    dimension the record); RecordInvalid when they do not fit, or when they would take more than
    `max_bytes` (NPZ, uncompressed) or more than the file holds (a header's shape)."""
    try:
        if fmt is InputFormat.NPY:
            _check_declared(io.BytesIO(data), len(data), "the NPY file")
            loaded: dict[str, Any] = {_single_input(signature).name: np.load(io.BytesIO(data), allow_pickle=False)}
        else:
            _check_npz(data, max_bytes)
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                loaded = {name: npz[name] for name in npz.files}
    except RecordInvalid:
        raise
    except Exception as exc:
        # Whatever numpy and zipfile make of a caller's bytes (BadZipFile, a CRC mismatch, an
        # unsupported compression, a header numpy refuses) is the file's fault: the batch fails
        # with it. (Only ValueError, OSError and EOFError were caught: the others were taken for a
        # passing failure and the preparation tried again until the batch's window ended.)
        raise RecordInvalid(f"not a readable {fmt.value} file: {type(exc).__name__}: {exc}") from None
    # An array the model does not take is refused, as an unknown input on a JSONL line or a job is
    # (Triton refuses one too): ignored, a misnamed array's data was silently not what ran.
    extra = sorted(set(loaded) - {spec.name for spec in signature.inputs})
    if extra:
        raise RecordInvalid(
            f"the {fmt.value} file has arrays the model does not take: {', '.join(map(repr, extra))}; "
            f"the model takes: {', '.join(spec.name for spec in signature.inputs)}"
        )
    arrays: Arrays = {}
    for spec in signature.inputs:
        if spec.name not in loaded:
            raise RecordInvalid(f"the {fmt.value} file has no array {spec.name!r}")
        arrays[spec.name] = _check_array(spec, loaded[spec.name], fmt)
    if len({a.shape[0] for a in arrays.values()}) > 1:
        raise RecordInvalid("the arrays disagree on the number of records")
    return arrays


def array_chunks(arrays: Arrays, signature: ModelSignature, chunk_records: int) -> Iterator[ChunkReady]:
    """The records of checked arrays as chunks (custom_id: the record's index)."""
    count = next(iter(arrays.values())).shape[0]
    for start in range(0, count, chunk_records):
        end = min(start + chunk_records, count)
        tensors = [Tensor.from_numpy(s.name, arrays[s.name][start:end], s.datatype) for s in signature.inputs]
        entries = [IndexEntry(i + 1, str(i)) for i in range(start, end)]
        yield ChunkReady(start, end, tensors, entries)
