"""Turning a batch of items into model inputs and the model's outputs back into per-item
results: concatenate along the batch dimension, pad variable dimensions to the batch's largest
(models that allow it), and cut each item's rows (and padding) back out."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncinfer.errors import ModelError
from asyncinfer.tensors import NUMPY_DTYPES, ModelSignature, Tensor
from services.batcher.backends import Arrays
from services.batcher.items import ItemShaper, PendingItem


@dataclass(slots=True)
class Assembled:
    arrays: Arrays
    rows: int
    padding_waste: float  # share of the batch's elements (or tokens) that are padding
    # Dimension -> the padded size, from the first padded input; outputs with a variable
    # dimension of exactly that size are cut back to each item's own size.
    padded_sizes: dict[int, int] = field(default_factory=dict)


def assemble(
    batch: Sequence[PendingItem], signature: ModelSignature, shaper: ItemShaper, pad_value: float
) -> Assembled:
    rows = sum(item.rows for item in batch)
    arrays: Arrays = {}
    padded_sizes: dict[int, int] = {}
    padded_units = 0
    for spec in signature.inputs:
        parts = [item.inputs[spec.name].to_numpy() for item in batch]
        dims = shaper.padded_dims.get(spec.name)
        if dims and len(parts) > 1:
            target = tuple(max(p.shape[d] for p in parts) for d in range(1, parts[0].ndim))
            if any(p.shape[1:] != target for p in parts):
                out = np.full((rows, *target), pad_value, dtype=parts[0].dtype)
                offset = 0
                for part in parts:
                    out[(slice(offset, offset + part.shape[0]), *(slice(0, n) for n in part.shape[1:]))] = part
                    offset += part.shape[0]
                arrays[spec.name] = out
                if not padded_sizes:
                    padded_sizes = {d: target[d - 1] for d in dims}
                padded_units += out.size
                continue
            padded_units += sum(p.size for p in parts)
        arrays[spec.name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    real = sum(item.real_units for item in batch)
    if shaper.text:
        padded_units = rows * max(item.length for item in batch)
    waste = 1.0 - real / padded_units if (shaper.text or shaper.pads) and padded_units else 0.0
    return Assembled(arrays=arrays, rows=rows, padding_waste=max(waste, 0.0), padded_sizes=padded_sizes)


def split(
    model_name: str, batch: Sequence[PendingItem], outputs: Arrays, assembled: Assembled, signature: ModelSignature
) -> list[list[Tensor]]:
    """Each item's rows of every output; ModelError when an output has the wrong row count."""
    rows = assembled.rows
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != rows:
            raise ModelError(
                f"model {model_name!r} output {name!r} has {array.shape[0] if array.ndim else 0} rows "
                f"for a batch of {rows}"
            )
    if not assembled.padded_sizes and all(spec.datatype != "BYTES" for spec in signature.outputs):
        return _split_raw(batch, outputs, signature)
    per_item: list[list[Tensor]] = []
    offset = 0
    for item in batch:
        tensors = []
        for spec in signature.outputs:
            part: np.ndarray[Any, Any] = outputs[spec.name][offset : offset + item.rows]
            if assembled.padded_sizes:
                part = _unpad(part, spec.shape, assembled.padded_sizes, item)
            tensors.append(Tensor.from_numpy(spec.name, part, spec.datatype))
        per_item.append(tensors)
        offset += item.rows
    return per_item


def _split_raw(batch: Sequence[PendingItem], outputs: Arrays, signature: ModelSignature) -> list[list[Tensor]]:
    """The common case (numeric outputs, no padding): each output converted to bytes once, then
    cut per item, rather than a numpy conversion per item."""
    whole: list[tuple[str, str, tuple[int, ...], int, bytes]] = []
    for spec in signature.outputs:
        array = np.ascontiguousarray(outputs[spec.name], dtype=NUMPY_DTYPES[spec.datatype])
        rest = tuple(int(d) for d in array.shape[1:])
        whole.append((spec.name, spec.datatype, rest, array.itemsize * math.prod(rest), array.tobytes()))
    per_item: list[list[Tensor]] = []
    offset = 0
    for item in batch:
        end = offset + item.rows
        per_item.append(
            [
                Tensor(name, datatype, (item.rows, *rest), data[offset * row_bytes : end * row_bytes])
                for name, datatype, rest, row_bytes, data in whole
            ]
        )
        offset = end
    return per_item


def _unpad(
    part: np.ndarray[Any, Any], declared: tuple[int, ...], padded_sizes: dict[int, int], item: PendingItem
) -> np.ndarray[Any, Any]:
    own = next(iter(item.inputs.values())).shape  # the first input's own dimensions
    for tensor in item.inputs.values():
        if any(d < len(tensor.shape) and tensor.shape[d] != padded_sizes[d] for d in padded_sizes):
            own = tensor.shape
            break
    index: list[slice] = [slice(None)] * part.ndim
    for dim, size in padded_sizes.items():
        if dim < part.ndim and dim < len(declared) and declared[dim] == -1 and part.shape[dim] == size:
            index[dim] = slice(0, own[dim] if dim < len(own) else size)
    return part[tuple(index)]
