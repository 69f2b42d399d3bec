"""Wire forms shared by several stored types (tensors, errors, blob references), and their
conversions."""

from __future__ import annotations

import msgspec

from asyncinfer.errors import FieldViolation
from asyncinfer.jobs import BlobRef, JobError, ProgressReport
from asyncinfer.tensors import Tensor


class TensorWire(msgspec.Struct):
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes  # base64 in JSON


class BlobRefWire(msgspec.Struct):
    ref: str
    size_bytes: int
    sha256: str


class ErrorWire(msgspec.Struct):
    # Every field is written (as version 0 did): an error is rare, and its bytes say what it was.
    code: int
    reason: str
    message: str
    violations: tuple[tuple[str, str], ...] = ()
    retriable: bool = False


class ProgressWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    attempt: int
    step: int
    fraction: float | None = None
    message: str = ""
    outputs: tuple[TensorWire, ...] = ()


def tensors_to_wire(tensors: tuple[Tensor, ...]) -> tuple[TensorWire, ...]:
    return tuple(TensorWire(t.name, t.datatype, t.shape, t.data) for t in tensors)


def tensors_from_wire(wires: tuple[TensorWire, ...]) -> tuple[Tensor, ...]:
    return tuple(Tensor(w.name, w.datatype, w.shape, w.data) for w in wires)


def blob_to_wire(blob: BlobRef | None) -> BlobRefWire | None:
    return None if blob is None else BlobRefWire(blob.ref, blob.size_bytes, blob.sha256)


def blob_from_wire(wire: BlobRefWire | None) -> BlobRef | None:
    return None if wire is None else BlobRef(wire.ref, wire.size_bytes, wire.sha256)


def error_to_wire(error: JobError | None) -> ErrorWire | None:
    if error is None:
        return None
    violations = tuple((v.field, v.description) for v in error.violations)
    return ErrorWire(error.code, error.reason, error.message, violations, error.retriable)


def error_from_wire(wire: ErrorWire | None) -> JobError | None:
    if wire is None:
        return None
    violations = tuple(FieldViolation(f, d) for f, d in wire.violations)
    return JobError(wire.code, wire.reason, wire.message, violations, wire.retriable)


def progress_to_wire(report: ProgressReport | None) -> ProgressWire | None:
    if report is None:
        return None
    return ProgressWire(
        attempt=report.attempt,
        step=report.step,
        fraction=report.fraction,
        message=report.message,
        outputs=tensors_to_wire(report.outputs),
    )


def progress_from_wire(wire: ProgressWire | None) -> ProgressReport | None:
    if wire is None:
        return None
    return ProgressReport(
        attempt=wire.attempt,
        step=wire.step,
        fraction=wire.fraction,
        message=wire.message,
        outputs=tensors_from_wire(wire.outputs),
    )
