"""Model backends: where a batch is computed.

A backend takes one batch as numpy arrays keyed by input name (the batch dimension first) and
returns numpy arrays keyed by output name. `infer_batch` blocks: the engine calls it in a worker
thread, never on the event loop.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from asyncinfer.config import BatcherConfig, ModelConfig
from asyncinfer.errors import ModelError
from asyncinfer.tensors import ModelSignature, datatype_of

Arrays = dict[str, npt.NDArray[np.generic]]


class ModelBackend(Protocol):
    @property
    def signature(self) -> ModelSignature: ...

    def infer_batch(self, inputs: Arrays) -> Arrays:
        """Computes one batch; raises ModelError when the model fails or answers off-signature."""
        ...

    def close(self) -> None: ...


def check_outputs(model_name: str, outputs: Arrays, signature: ModelSignature) -> None:
    """ModelError unless `outputs` has exactly the declared outputs, with their datatypes and
    non-batch dimensions."""
    declared = {spec.name: spec for spec in signature.outputs}
    if set(outputs) != set(declared):
        raise ModelError(
            f"model {model_name!r} returned outputs {sorted(outputs)}, but its signature declares {sorted(declared)}"
        )
    for name, array in outputs.items():
        spec = declared[name]
        try:
            datatype = datatype_of(array)
        except ValueError as exc:
            raise ModelError(f"model {model_name!r} output {name!r}: {exc}") from None
        if datatype != spec.datatype:
            raise ModelError(
                f"model {model_name!r} output {name!r} is {datatype}, but its signature says {spec.datatype}"
            )
        shape = array.shape
        if len(shape) != len(spec.shape) or any(
            want != -1 and got != want for got, want in zip(shape[1:], spec.shape[1:], strict=True)
        ):
            raise ModelError(
                f"model {model_name!r} output {name!r} has shape {list(shape)}, "
                f"but its signature says {list(spec.shape)} (-1: any)"
            )


def load_backend(model: ModelConfig, batcher: BatcherConfig) -> ModelBackend:
    """Loads a configured model (blocking: call it in a thread). ConfigError when it cannot load."""
    if model.backend == "torch":
        from services.batcher.backends.torch_backend import TorchBackend

        return TorchBackend.load(model, torch_threads=batcher.torch_threads)
    raise AssertionError(f"unknown backend {model.backend!r}")  # the config's Literal rules this out
