"""Model backends: where a batch is computed.

A backend takes one batch as numpy arrays keyed by input name (the batch dimension first) and
returns numpy arrays keyed by output name. A synchronous backend's `infer_batch` blocks (the
engine calls it in a worker thread, never on the event loop); an asynchronous one
(`runs_async`, e.g. a remote Triton) is awaited on the event loop. Text models also report each
row's token length so the engine can bucket and count batches in tokens. A backend that
`reports_progress` is called with `infer_batch_reporting`, whose reporter
(services.batcher.progress) takes each row's progress and partial outputs while it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import numpy.typing as npt

from asyncinfer.errors import ModelError
from asyncinfer.tensors import ModelSignature, datatype_of

if TYPE_CHECKING:
    from services.batcher.progress import ProgressReporter

Arrays = dict[str, npt.NDArray[np.generic]]

# The reason of an item a remote backend could not run because its server is out of reach (Triton
# restarting, a rolling update): not the job's fault, so a work order's attempt is given back.
UNREACHABLE_REASON = "TRITON_UNAVAILABLE"
ReachableListener = Callable[[bool], None]


@dataclass(frozen=True, slots=True)
class CallTimes:
    """When the items of a batch stop waiting for its remote call, in loop time (None: none of them
    has an execution timeout, a KServe call's item)."""

    first_end: float | None  # the earliest: an outage is waited out no later (the batch is handed back)
    last_end: float | None  # the latest: the call's own timeout (None: the model's default_execution_timeout_s)


class ModelBackend:
    """The base of every backend; subclasses override `infer_batch` (or `infer_batch_async`
    with `runs_async = True`)."""

    runs_async: ClassVar[bool] = False

    def __init__(self, name: str, signature: ModelSignature) -> None:
        self.name = name
        self._signature = signature

    @property
    def signature(self) -> ModelSignature:
        return self._signature

    def infer_batch(self, inputs: Arrays) -> Arrays:
        """Computes one batch (blocking); raises ModelError when the model fails or answers
        off-signature."""
        raise NotImplementedError

    @property
    def reports_progress(self) -> bool:
        """Whether `infer_batch_reporting` reports progress (else it is `infer_batch`)."""
        return False

    def infer_batch_reporting(self, inputs: Arrays, progress: ProgressReporter) -> Arrays:
        """`infer_batch`, reporting each row's progress to `progress` as it goes (blocking)."""
        return self.infer_batch(inputs)

    async def infer_batch_async(self, inputs: Arrays, times: CallTimes | None = None) -> Arrays:
        """Computes one batch on the event loop (backends with `runs_async`); `times`: when its
        items stop waiting for it."""
        raise NotImplementedError

    @property
    def reachable(self) -> bool:
        """False while a remote backend's server cannot be reached: the model takes no work until
        it answers again."""
        return True

    def watch_reachable(self, listener: ReachableListener) -> None:
        """Calls `listener(reachable)` on the event loop each time `reachable` changes."""

    def token_lengths(self, inputs: Arrays) -> list[int] | None:
        """Each row's length in tokens for text models (None: not a text model). Called on the
        event loop once per item, so it must be quick."""
        return None

    async def start(self) -> None:
        """Connects or warms up after loading; raises ConfigError when the model cannot serve."""

    def close(self) -> None:
        """Releases the model."""

    async def aclose(self) -> None:
        self.close()


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
