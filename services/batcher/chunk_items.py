"""A batch's chunk in the engine: one work order of many records (more rows than the model's
max_batch_size), computed as parts of at most max_batch_size rows that queue beside other items
and form batches like them (docs/BATCHES.md). No per-record message: the parts are engine items of
this process, and the chunk's answer is one result.

For a text model (one that reports token lengths) the chunk's rows are sorted by length before
they are cut into parts, so each part pads to about its own rows' length; the outputs are put back
in input order. Parts go at the chunk's priority (a batch's is LOW by default), so an interactive
item waits at most for the batch in flight, not for the chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncinfer.errors import AsyncInferError, ModelError
from asyncinfer.tensors import Tensor
from services.batcher.items import InferOutcome, PendingItem
from services.batcher.progress import ItemProgress


def take_rows(tensor: Tensor, rows: Sequence[int] | slice) -> Tensor:
    """The tensor's rows (a slice, or rows in any order)."""
    array = tensor.to_numpy()
    return Tensor.from_numpy(tensor.name, array[rows], tensor.datatype)


def part_rows(total: int, max_rows: int, order: Sequence[int] | None) -> list[Sequence[int] | slice]:
    """The rows of each part: consecutive slices, or runs of `order` (rows sorted by length)."""
    if order is None:
        return [slice(start, min(start + max_rows, total)) for start in range(0, total, max_rows)]
    return [list(order[start : start + max_rows]) for start in range(0, total, max_rows)]


class ChunkItem:
    """The parts of one chunk and the future of their joined outcome (what the work session
    awaits, as it does a PendingItem's)."""

    def __init__(self, parts: list[PendingItem], order: Sequence[int] | None) -> None:
        self.parts = parts
        self._order = order
        loop = asyncio.get_running_loop()
        self.future: asyncio.Future[InferOutcome] = loop.create_future()
        self.progress: ItemProgress | None = None
        self._left = len(parts)
        for part in parts:
            part.chunk_parts = parts
            part.future.add_done_callback(self._part_done)

    @property
    def started(self) -> bool:
        return any(part.started for part in self.parts)

    @property
    def trace(self) -> str:
        """The chunk job's traceparent (its dispatch span), carried by every part, so each
        batch a part runs in links the chunk's trace."""
        return self.parts[0].trace if self.parts else ""

    @trace.setter
    def trace(self, traceparent: str) -> None:
        for part in self.parts:
            part.trace = traceparent

    def cancel(self) -> bool:
        """Drops the parts not yet started, and with them the chunk (a part computing finishes
        unanswered); True when the chunk was dropped, False when every part had started."""
        if self.future.done():
            return False
        dropped = [part.cancel() for part in self.parts]
        if any(dropped):
            self.future.cancel()
            return True
        return False

    def _part_done(self, future: asyncio.Future[InferOutcome]) -> None:
        self._left -= 1
        if self._left == 0:
            # Each part names every part (ModelQueue.end_grace reads them while they wait): a cycle,
            # which would keep the parts, their inputs and outputs, until the garbage collector ran.
            for part in self.parts:
                part.chunk_parts = None
        if self.future.done():
            return
        if future.cancelled():
            if not self.future.done():
                self.future.cancel()
            return
        error = future.exception()
        if error is not None:
            for part in self.parts:
                part.cancel()  # the chunk fails as a whole; its driver bisects it
            self.future.set_exception(error)
            return
        if self._left == 0:
            try:
                self.future.set_result(self._joined())
            except AsyncInferError as exc:
                self.future.set_exception(exc)

    def _joined(self) -> InferOutcome:
        outcomes = [part.future.result() for part in self.parts]
        names = [t.name for t in outcomes[0].outputs]
        outputs: list[Tensor] = []
        for index, name in enumerate(names):
            parts = [outcome.outputs[index] for outcome in outcomes]
            if self._order is None and parts[0].datatype != "BYTES":
                outputs.append(_concatenated(name, parts))
                continue
            arrays: list[Any] = [part.to_numpy() for part in parts]
            try:
                joined = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
            except ValueError as exc:
                raise ModelError(f"the chunk's parts gave outputs {name!r} of different shapes: {exc}") from None
            if self._order is not None:
                back = np.empty(len(self._order), dtype=np.int64)
                back[np.asarray(self._order)] = np.arange(len(self._order))
                joined = joined[back]
            outputs.append(Tensor.from_numpy(name, joined, outcomes[0].outputs[index].datatype))
        return InferOutcome(
            outputs=outputs,
            batch_size=max(o.batch_size for o in outcomes),
            batch_items=len(outcomes),
            compute_s=sum(o.compute_s for o in outcomes),
            queue_s=min(o.queue_s for o in outcomes),
        )


def _concatenated(name: str, parts: Sequence[Tensor]) -> Tensor:
    """The parts' rows one after the other, their bytes joined (one copy: numpy's concatenate
    and then the tensor's bytes would be two, of a chunk's megabytes)."""
    rest = parts[0].shape[1:]
    if any(len(part.shape) < 1 or part.shape[1:] != rest or part.datatype != parts[0].datatype for part in parts):
        shapes = [part.shape for part in parts]
        raise ModelError(f"the chunk's parts gave outputs {name!r} of different shapes: {shapes}")
    rows = sum(part.shape[0] for part in parts)
    data = parts[0].data if len(parts) == 1 else b"".join(part.data for part in parts)
    return Tensor(name=name, datatype=parts[0].datatype, shape=(rows, *rest), data=data)
