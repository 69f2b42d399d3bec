"""Tensors as the domain sees them, and their codecs.

A `Tensor` holds raw little-endian, row-major bytes under a KServe v2 datatype name (BYTES elements
are each prefixed with a 4-byte little-endian length, as Triton does). This one form travels
through NATS, the job record and the work stream; protobuf messages and numpy arrays are converted
at the edges (`asyncinfer.tensor_codec` for protobuf).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from asyncinfer.errors import FieldViolation

# v2 datatype -> numpy dtype (little-endian). BYTES is handled separately.
NUMPY_DTYPES: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
DATATYPES: frozenset[str] = frozenset([*NUMPY_DTYPES, "BYTES"])

_DTYPE_TO_DATATYPE = {np.dtype(dt).newbyteorder("="): name for name, dt in NUMPY_DTYPES.items()}


def datatype_of(array: npt.NDArray[np.generic]) -> str:
    """The v2 datatype name of a numpy array (object / bytes / str arrays are BYTES)."""
    if array.dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return _DTYPE_TO_DATATYPE[array.dtype.newbyteorder("=")]
    except KeyError:
        raise ValueError(f"numpy dtype {array.dtype} has no KServe v2 datatype") from None


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def batch_size(self) -> int:
        """Rows along the first (batch) dimension."""
        return self.shape[0] if self.shape else 1

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def to_numpy(self) -> npt.NDArray[np.generic]:
        if self.datatype == "BYTES":
            return np.array(split_bytes_elements(self.data), dtype=np.object_).reshape(self.shape)
        return np.frombuffer(self.data, dtype=NUMPY_DTYPES[self.datatype]).reshape(self.shape)

    @classmethod
    def from_numpy(cls, name: str, array: npt.ArrayLike, datatype: str | None = None) -> Tensor:
        arr = np.asarray(array)
        dt = datatype or datatype_of(arr)
        if dt == "BYTES":
            elements = [_as_bytes(v) for v in arr.reshape(-1).tolist()]
            return cls(name=name, datatype=dt, shape=tuple(arr.shape), data=join_bytes_elements(elements))
        target = NUMPY_DTYPES[dt]
        return cls(
            name=name,
            datatype=dt,
            shape=tuple(int(d) for d in arr.shape),
            data=np.ascontiguousarray(arr, dtype=target).tobytes(),
        )


def _as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    return str(value).encode("utf-8")


def join_bytes_elements(elements: Iterable[bytes]) -> bytes:
    parts: list[bytes] = []
    for element in elements:
        parts.append(struct.pack("<I", len(element)))
        parts.append(element)
    return b"".join(parts)


def split_bytes_elements(data: bytes) -> list[bytes]:
    """Splits Triton's length-prefixed BYTES serialization; ValueError when malformed."""
    elements: list[bytes] = []
    offset = 0
    view = memoryview(data)
    while offset < len(data):
        if offset + 4 > len(data):
            raise ValueError("truncated BYTES element length")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > len(data):
            raise ValueError("BYTES element runs past the end of the data")
        elements.append(bytes(view[offset : offset + length]))
        offset += length
    return elements


def check_data_size(tensor: Tensor, field: str) -> list[FieldViolation]:
    """Whether the raw data holds exactly as many elements as the shape says."""
    if any(d < 0 for d in tensor.shape):
        return [FieldViolation(f"{field}.shape", f"dimensions must be non-negative, got {list(tensor.shape)}")]
    expected = element_count(tensor.shape)
    if tensor.datatype == "BYTES":
        try:
            got = len(split_bytes_elements(tensor.data))
        except ValueError as exc:
            return [FieldViolation(f"{field}.contents", f"malformed BYTES data: {exc}")]
        if got != expected:
            return [
                FieldViolation(
                    f"{field}.contents",
                    f"shape {list(tensor.shape)} needs {expected} elements, got {got}",
                )
            ]
        return []
    itemsize = NUMPY_DTYPES[tensor.datatype].itemsize
    if len(tensor.data) != expected * itemsize:
        return [
            FieldViolation(
                f"{field}.contents",
                f"shape {list(tensor.shape)} needs {expected} {tensor.datatype} elements "
                f"({expected * itemsize} bytes), got {len(tensor.data) / itemsize:g} ({len(tensor.data)} bytes)",
            )
        ]
    return []


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output of a model's signature. -1 marks a variable dimension; the first
    dimension is the batch dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def summary(self) -> str:
        """What to give for it, as error messages say it: "x: FP32 of shape [-1, 4]"."""
        return f"{self.name}: {self.datatype} of shape {list(self.shape)}"


def specs_summary(specs: Iterable[TensorSpec]) -> str:
    """Each spec's `summary`, then what -1 means: "x: FP32 of shape [-1, 4]; -1: any size"."""
    return "; ".join([*(spec.summary() for spec in specs), "-1: any size"])


@dataclass(frozen=True, slots=True)
class ModelSignature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


def as_one_row(array: npt.NDArray[Any], spec: TensorSpec) -> npt.NDArray[Any]:
    """`array` with a batch dimension of 1 added where it has one dimension fewer than `spec`'s
    shape (one row given without the dimension that counts rows: `[1, 2, 3, 4]` for [-1, 4],
    "hello" for [-1]); as it is otherwise. The one rule of the CLI's -i, a request file, the SDK's
    inputs and a JSONL batch line: the model's signature decides where a batch dimension is added."""
    return array[np.newaxis, ...] if array.ndim == len(spec.shape) - 1 else array


def _lacks_batch_dimension(got: Sequence[int], want: Sequence[int]) -> bool:
    """Whether a shape is the signature's without its first (batch) dimension: one item sent
    without the dimension that counts items, the commonest shape mistake."""
    return len(got) == len(want) - 1 and all(w == -1 or g == w for g, w in zip(got, want[1:], strict=True))


def validate_inputs(
    tensors: Sequence[Tensor],
    signature: ModelSignature,
    *,
    max_batch_size: int,
    field: str = "inputs",
) -> list[FieldViolation]:
    """Every way `tensors` can fail to fit `signature`, as field violations (empty when they fit)."""
    violations: list[FieldViolation] = []
    specs = {spec.name: spec for spec in signature.inputs}
    seen: dict[str, int] = {}
    batch_sizes: set[int] = set()
    for index, tensor in enumerate(tensors):
        path = f"{field}[{index}]"
        if tensor.name in seen:
            violations.append(FieldViolation(f"{path}.name", f"input {tensor.name!r} is given twice"))
            continue
        seen[tensor.name] = index
        spec = specs.get(tensor.name)
        if spec is None:
            expected = ", ".join(sorted(specs)) or "none"
            violations.append(
                FieldViolation(f"{path}.name", f"unknown input {tensor.name!r}; the model takes: {expected}")
            )
            continue
        if tensor.datatype != spec.datatype:
            violations.append(
                FieldViolation(
                    f"{path}.datatype", f"input {spec.name!r} must be {spec.datatype}, got {tensor.datatype!r}"
                )
            )
            continue
        if len(tensor.shape) != len(spec.shape) or any(
            want != -1 and got != want for got, want in zip(tensor.shape, spec.shape, strict=False)
        ):
            message = f"input {spec.name!r} must have shape {list(spec.shape)} (-1: any), got {list(tensor.shape)}"
            if _lacks_batch_dimension(tensor.shape, spec.shape):
                one = [1, *tensor.shape]
                message += f": the first dimension counts the items; one item is shape {one}"
            violations.append(FieldViolation(f"{path}.shape", message))
            continue
        size_violations = check_data_size(tensor, path)
        violations.extend(size_violations)
        if not size_violations and tensor.shape:
            batch_sizes.add(tensor.shape[0])
    for name, spec in specs.items():
        if name not in seen:  # with what to give: the caller may not know the signature
            violations.append(
                FieldViolation(field, f"missing input {name!r} ({spec.datatype} of shape {list(spec.shape)})")
            )
    if len(batch_sizes) > 1:
        violations.append(FieldViolation(field, f"inputs disagree on the batch dimension: {sorted(batch_sizes)}"))
    elif batch_sizes:
        (rows,) = batch_sizes
        if rows < 1:
            violations.append(FieldViolation(field, "the batch dimension must be at least 1"))
        elif max_batch_size > 0 and rows > max_batch_size:
            violations.append(
                FieldViolation(field, f"batch dimension {rows} exceeds the model's max_batch_size {max_batch_size}")
            )
    return violations


_FLOAT_DATATYPES = frozenset({"FP16", "FP32", "FP64"})
_INT_DATATYPES = frozenset({"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"})
# Why a value is no array, in words to follow "input 'x' ": its rows differ in length (numpy's
# "setting an array element with a sequence. The requested array has an inhomogeneous shape ...").
RAGGED_REASON = "is not a rectangular array: its rows are not all the same length"
_BOOLEAN_TYPES = (bool, np.bool_)
_NUMBER_TYPES = (int, float, np.number)
# Up to this many values, walking them costs less than numpy's look for a 0 or a 1.
_WALKED_AT_ONCE = 64


def _leaf_types(value: Any, found: set[type]) -> set[type]:
    """The types of the values in `value`'s nested lists and tuples."""
    types = set(map(type, value))
    nested = types & {list, tuple}
    if nested:
        types -= nested
        for item in value:
            if isinstance(item, list | tuple):
                _leaf_types(item, found)
    found |= types
    return found


def booleans_misplaced(value: Any, datatype: str | None, array: npt.NDArray[Any] | None = None) -> str:
    """Why `value` (JSON's or Python's lists, or one value) puts booleans where `datatype` takes
    numbers, or numbers where it takes booleans, in words to follow "input 'x' "; "" when it does
    not. numpy decides silently: np.asarray([True, 2.5]) is [1.0, 2.5], a float array any float
    input takes, and np.array([2, 0], dtype=bool) is [True, False]; a user who wrote either most
    likely made a mistake. `datatype` None (not known): booleans beside numbers are refused. A numpy
    array is taken as it is (its dtype was chosen). `array`: `value` as converted, when the caller
    has it: a number array without a 0 or a 1 held no boolean, and its values are not walked (the
    common case of a JSONL line's floats)."""
    if isinstance(value, np.ndarray | np.generic) or not (datatype is None or datatype in NUMPY_DTYPES):
        return ""
    if array is not None:
        if array.dtype.kind == "b" and datatype in (None, "BOOL"):
            return ""  # numpy makes a bool array of booleans alone
        numeric = array.dtype.kind in ("i", "u", "f") and datatype != "BOOL"
        if numeric and array.size > _WALKED_AT_ONCE and not bool(((array == 0) | (array == 1)).any()):
            return ""
    types = _leaf_types(value, set()) if isinstance(value, list | tuple) else {type(value)}
    booleans = any(issubclass(t, _BOOLEAN_TYPES) for t in types)
    numbers = any(issubclass(t, _NUMBER_TYPES) and not issubclass(t, _BOOLEAN_TYPES) for t in types)
    if datatype == "BOOL":
        return "is BOOL: give booleans (true or false), not numbers" if numbers else ""
    if booleans and numbers:
        takes = f": {datatype} takes numbers only" if datatype else ""
        return f"mixes booleans (true/false) with numbers, which would run as 1 and 0{takes}"
    if booleans and datatype is not None:
        return f"is {datatype}: give numbers, not booleans (true/false)"
    return ""


def typed_as(value: npt.ArrayLike, datatype: str) -> npt.NDArray[Any] | None:
    """`value` (a numpy array, a list, a scalar) as an array of the signature's `datatype`, where
    that loses nothing but precision: integers and floats to FP16/FP32/FP64 within the type's
    range (rounded to its precision, as any float is), integers to an integer type they fit in, booleans to BOOL, strings and bytes to BYTES (as they are). None where it would (a
    float to INT64, a value out of range) or where `value` is no array at all: leave it as it is,
    for the gateway to refuse or accept. Shared by the SDK and the CLI."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        return None
    kind = array.dtype.kind
    if array.size == 0 and kind == "f" and array.dtype == np.float64 and datatype == "BYTES":
        # An empty list is float64 to numpy: typed, the gateway names the real problem (no item).
        return np.asarray(value, dtype=np.bytes_)
    if datatype == "BYTES":
        return array if kind in ("U", "S") else None
    target = NUMPY_DTYPES.get(datatype)
    if target is None:
        return None
    if array.dtype == target:
        return array
    if datatype in _FLOAT_DATATYPES and kind in ("i", "u", "f"):
        with np.errstate(over="ignore"):  # measured below: a value past the type's range
            cast = array.astype(target)
        if array.size and bool(np.any(np.isinf(cast) & ~np.isinf(array))):
            return None  # 1e300 as FP32 is inf: that loses the value (a model would compute on inf)
        return cast
    if datatype in _INT_DATATYPES and kind in ("i", "u"):
        info = np.iinfo(target.str)
        if array.size and (int(array.min()) < info.min or int(array.max()) > info.max):
            return None
        return array.astype(target)
    return None


def cast_change(array: npt.NDArray[Any], datatype: str, written: Any = None) -> str:
    """What converting `array` (numpy's reading of JSON numbers: int64, uint64, float64, or objects
    for integers past 64 bits) to `datatype` would change, in words to follow "input 'x' " ("has
    1.5, not a whole number: INT64 takes whole numbers"); "" where it changes nothing but a float's
    precision (1.1 as FP32), or where `array` holds no numbers (booleans and text are refused
    elsewhere). numpy converts silently: np.array([1.5], dtype=int64) is [1], [300.0] as UINT8 is
    [44], [300] and [-1] are [44] and [255] (a DeprecationWarning), and 1e300 as FP32 is inf. A
    whole float (2.0) for an integer type is named too ("has 2.0, a float: INT64 takes integers
    (write 2, not 2.0)"): an integer input takes integers alone, as Triton's JSON (rapidjson's
    IsInt64, false for 2.0) and numpy's same_kind casting (float64 to int64 refused) do, in the
    CLI's -i, a JSONL batch line and the SDK alike. `written`: the values as given (nested lists),
    where the caller has them: the whole float named is the first one written as a float (numpy
    makes [1, 4.0] [1.0, 4.0], and "has 1.0" would name a value written 1). A null is named too
    (null_held), for BOOL as well."""
    target = NUMPY_DTYPES.get(datatype)
    if target is None:
        return ""
    if null := null_held(array, datatype):
        return null
    if target.kind == "b" or array.dtype.kind not in "iufO":
        return ""
    values = array.ravel().tolist() if array.dtype.kind == "O" else None
    if values is not None and not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return ""  # mixed kinds: numpy's own error (or booleans_misplaced's) names them
    if target.kind == "f":
        limit = float(np.finfo(target.str).max)
        if values is not None:
            past = [v for v in values if not (isinstance(v, float) and math.isinf(v)) and abs(v) > limit]
        else:
            with np.errstate(over="ignore"):
                mask = np.isinf(array.astype(target)) & ~np.isinf(array)
            past = array[mask].ravel()[:1].tolist() if mask.any() else []
        return f"has {_shown(past[0])}, past {datatype}'s range (±{limit:.8g})" if past else ""
    info = np.iinfo(target.str)
    if values is None and array.dtype.kind == "f":
        whole = np.isfinite(array) & (array == np.floor(array))
        if not whole.all():
            values = array[~whole].ravel()[:1].tolist()
        elif array.size and (float(array.min()) < info.min or float(array.max()) >= float(info.max + 1)):
            values = array.ravel().tolist()
        elif array.size:
            first = _first_float(written) if written is not None else None
            return _whole_float(float(array.flat[0]) if first is None else first, datatype)
        else:
            return ""
    elif values is None:
        if not array.size or (info.min <= int(array.min()) and int(array.max()) <= info.max):
            return ""
        values = array.ravel().tolist()
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):
            return f"has {v!r}, which {datatype} cannot hold: it takes whole numbers"
        if isinstance(v, float) and v != math.floor(v):
            return f"has {v!r}, not a whole number: {datatype} takes whole numbers"
        if not info.min <= v <= info.max:
            return f"has {_shown(v)}, past {datatype}'s range ({info.min} to {info.max})"
    whole_float = next((v for v in values if isinstance(v, float)), None)
    return "" if whole_float is None else _whole_float(whole_float, datatype)


def null_held(array: npt.NDArray[Any], datatype: str) -> str:
    """Why `array` (numpy's reading of JSON or Python values) does not fit a number or boolean
    `datatype` when it holds a null (None), in words to follow "input 'x' "; "" when it holds none.
    numpy made a null NaN for a float type (`-i 'x=[[1,2,3,null]]'` ran on NaN, exit 0) and False
    for BOOL, each sent as if written so."""
    target = NUMPY_DTYPES.get(datatype)
    if target is None or array.dtype.kind != "O" or not any(v is None for v in array.ravel().tolist()):
        return ""
    takes = "booleans (true or false)" if target.kind == "b" else "numbers"
    return f"has a null (None in Python), which {datatype} cannot hold: give {takes}"


def _first_float(value: Any) -> float | None:
    """The first float in `value`'s nested lists and tuples (or `value` itself), or None."""
    if isinstance(value, float):
        return value
    if isinstance(value, list | tuple):
        for item in value:
            if (found := _first_float(item)) is not None:
                return found
    return None


def _whole_float(value: float, datatype: str) -> str:
    """A whole float for an integer `datatype`, in words to follow "input 'x' "."""
    return f"has {value!r}, a float: {datatype} takes integers (write {int(value)}, not {value!r})"


def _shown(value: float) -> str:
    """A value as a refusal names it: an integer of hundreds of digits by its length."""
    text = repr(value)
    return text if len(text) <= 24 else f"an integer of {len(str(abs(int(value))))} digits"


def untyped_reason(array: npt.NDArray[Any], datatype: str, written: Any = None) -> str | None:
    """Why `typed_as` left `array` as it is for a signature's `datatype`, as a refusal of it says it
    after the input's name ("has 1e+300, past FP32's range (±3.4028235e+38)"); None where it typed
    it, or for a datatype the SDK does not type. The gateway's own words name only the dtype numpy
    gave: a list of floats past FP32's was "must be FP32, got 'FP64'", integers past 64 bits
    (Python ints numpy keeps as objects) "must be FP32, got 'BYTES'"."""
    if datatype not in DATATYPES or typed_as(array, datatype) is not None:
        return None
    kind = array.dtype.kind
    if datatype == "BYTES":
        return None if kind in "OUS" else f"is {array.dtype}, not text (str or bytes)"
    if kind == "O":
        return null_held(array, datatype) or "holds no one numpy type (integers past 64 bits, or items of mixed types)"
    if kind in "US":
        return "is text, not numbers"
    if kind == "b" or datatype == "BOOL":
        return f"is {array.dtype}, not {'numbers' if kind == 'b' else 'booleans (True or False)'}"
    target = NUMPY_DTYPES[datatype]
    if target.kind in "iu" and kind == "f":
        if written is not None and not isinstance(written, list | tuple | float):
            # An array (numpy's, torch's) has a dtype its owner chose: "write 2, not 2.0" is no help.
            torch = type(written).__module__.split(".")[0] == "torch"
            convert = f".to(torch.{target.name})" if torch else f".astype(np.{target.name})"
            return (
                f"is {array.dtype}: {datatype} takes integers (convert it with {convert}, which drops fractions, "
                "where that is meant)"
            )
        # Whole or not, named: "has 2.0, a float: INT64 takes integers (write 2, not 2.0)".
        return cast_change(array, datatype, written) or f"is {array.dtype}: {datatype} takes integers"
    if target.kind == "f":
        with np.errstate(over="ignore"):
            past = np.isinf(array.astype(target)) & ~np.isinf(array)
        limits = f"±{float(np.finfo(target.str).max):.8g}"
    else:
        info = np.iinfo(target.str)
        past = (array < info.min) | (array > info.max)
        limits = f"{info.min} to {info.max}"
    if past.any():
        return f"has {array[past].flat[0].item()!r}, past {datatype}'s range ({limits})"
    return f"is {array.dtype}, not {datatype}"
