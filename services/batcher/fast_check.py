"""The input check of the common case, asked before the full validation: on a small machine the
per-request work, not the model, limits throughput, and building violations for inputs that
have none is most of that work."""

from __future__ import annotations

import math
from collections.abc import Sequence

from asyncinfer.tensors import NUMPY_DTYPES, ModelSignature, Tensor


class FastCheck:
    """True when numeric inputs match the signature exactly (names, datatypes, dimensions, data
    sizes, one batch size within the limit): the common case, checked without building
    violations. False sends the inputs to the full validation, which says what is wrong."""

    def __init__(self, signature: ModelSignature, max_batch_size: int) -> None:
        self._specs = {
            spec.name: (spec.datatype, spec.shape, NUMPY_DTYPES[spec.datatype].itemsize)
            for spec in signature.inputs
            if spec.datatype != "BYTES"
        }
        self._numeric = len(self._specs) == len(signature.inputs)
        self._max_rows = max_batch_size

    def __call__(self, inputs: Sequence[Tensor]) -> bool:
        if not self._numeric or len(inputs) != len(self._specs):
            return False
        rows = -1
        names = set()
        for tensor in inputs:
            spec = self._specs.get(tensor.name)
            if spec is None or tensor.name in names:
                return False
            names.add(tensor.name)
            datatype, dims, itemsize = spec
            shape = tensor.shape
            if tensor.datatype != datatype or len(shape) != len(dims) or not shape:
                return False
            for got, want in zip(shape, dims, strict=True):
                if got < 0 or (want != -1 and got != want):
                    return False
            if len(tensor.data) != math.prod(shape) * itemsize:
                return False
            if rows == -1:
                rows = shape[0]
            elif shape[0] != rows:
                return False
        return rows >= 1 and (self._max_rows <= 0 or rows <= self._max_rows)
