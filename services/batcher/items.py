"""What the engine knows about one queued item: its order (priority, then earliest deadline,
then arrival), which items it may share a batch with (its group), and what it costs.

Items share a batch only when their inputs' datatypes and non-batch dimensions agree. Where a
model allows padding, a variable (-1) numeric dimension only has to fall in the same length
bucket; text models (those that report token lengths) are grouped by the token-length bucket of
their longest row and padded by the model itself. So the padding in any batch is less than one
bucket's width per row.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncinfer.config import ModelConfig
from asyncinfer.errors import ConfigError
from asyncinfer.jobs import Priority
from asyncinfer.tensors import Tensor
from services.batcher.backends import Arrays, ModelBackend
from services.batcher.progress import ItemProgress

PRIORITY_RANK = {Priority.HIGH: 0, Priority.NORMAL: 1, Priority.LOW: 2}

# Hashable; equal groups may share a batch.
Group = tuple[Any, ...]
CostFunction = Callable[[Arrays], int]


@dataclass(frozen=True, slots=True)
class InferOutcome:
    outputs: list[Tensor]
    batch_size: int  # rows in the batch the item ran in
    batch_items: int  # items in that batch
    compute_s: float  # the batch's compute time (assemble, model, split)
    queue_s: float = 0.0  # how long this item waited for its batch to start


DEADLINE_DIGITS = 3  # milliseconds


class PendingItem:
    """One submitted item: the future its caller awaits, and whether its batch has started."""

    __slots__ = (
        "chunk_parts",
        "cost",
        "ends_by",
        "expires_at",
        "future",
        "group",
        "inputs",
        "length",
        "priority",
        "progress",
        "real_units",
        "rows",
        "run_alone",
        "run_timeout_s",
        "sort_key",
        "started",
        "submitted_at",
        "timer",
        "trace",
    )

    def __init__(
        self,
        inputs: dict[str, Tensor],
        future: asyncio.Future[InferOutcome],
        *,
        submitted_at: float,
        expires_at: float | None,
        priority: Priority,
        seq: int,
    ) -> None:
        self.inputs = inputs
        self.future = future
        self.submitted_at = submitted_at
        self.expires_at = expires_at
        self.priority = priority
        self.rows = next(iter(inputs.values())).batch_size
        self.group: Group = ()
        self.cost = self.rows
        self.length = 0  # longest row, in the unit buckets are counted in (0: not variable)
        # The work order's traceparent (its dispatch span) when the batcher traces jobs, else "".
        self.trace = ""
        self.real_units = 0  # elements or tokens of real data (for padding waste)
        self.started = False
        self.timer: asyncio.TimerHandle | None = None
        self.progress: ItemProgress | None = None  # set by a caller that listens to its progress
        # How long its job may compute (its work order's execution timeout; None: no limit known):
        # a batch running past the longest of its items' has overrun (batch_timeouts.RunningBatch).
        self.run_timeout_s: float | None = None
        # When its job's execution timeout ends, in loop time, where that is counted from the job's
        # arrival rather than from the item's batch: a part of a batch's chunk, a pipeline's step.
        # None: none known, or counted from its batch's start (run_timeout_s).
        self.ends_by: float | None = None
        # Computed in a batch of its own (its job's previous attempt was lost with its batcher).
        self.run_alone = False
        # A part of a batch's chunk: every part of that chunk, itself among them, until the chunk
        # has ended (chunk_items).
        self.chunk_parts: list[PendingItem] | None = None
        # Earliest deadline first, then arrival. Deadlines are compared to the millisecond: one
        # absolute deadline (a batch's expiry, shared by all its chunks) turned into loop time at
        # different moments differs by microseconds, which would otherwise order the parts of
        # different chunks at random and leave every chunk half done until the last part.
        deadline = math.inf if expires_at is None else round(expires_at, DEADLINE_DIGITS)
        self.sort_key = (PRIORITY_RANK[priority], deadline, seq)

    def cancel(self) -> bool:
        """Drops the item unless its batch has started; True when it was dropped."""
        if self.started or self.future.done():
            return False
        return self.future.cancel()


def bucket_of(length: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket bound holding `length`; past the last, the next power of two."""
    for bound in buckets:
        if length <= bound:
            return bound
    return 1 << max(length - 1, 0).bit_length()


class ItemShaper:
    """Works out each item's group, cost and length for one model."""

    def __init__(self, config: ModelConfig, backend: ModelBackend) -> None:
        self._buckets = config.length_buckets
        self._backend = backend
        self.text = type(backend).token_lengths is not ModelBackend.token_lengths
        # Input name -> the dimensions (after the batch one) that may be padded.
        self.padded_dims: dict[str, tuple[int, ...]] = {}
        if config.padding:
            for spec in backend.signature.inputs:
                dims = tuple(i for i, d in enumerate(spec.shape) if i > 0 and d == -1)
                if dims and spec.datatype != "BYTES":
                    self.padded_dims[spec.name] = dims
        self._cost_kind = config.cost
        self._cost_function = _resolve_cost(config.cost) if config.cost not in ("rows", "tokens") else None

    @property
    def pads(self) -> bool:
        return bool(self.padded_dims)

    def shape(self, item: PendingItem) -> None:
        """Sets the item's group, length, real units and cost. Raises what a cost function or
        tokenizer raises (the engine turns that into InvalidArgument)."""
        group: list[Any] = []
        length = 0
        real = 0
        for name, tensor in item.inputs.items():
            padded = self.padded_dims.get(name, ())
            if padded:
                dims = tuple(
                    ("bucket", bucket_of(d, self._buckets)) if i in padded else d for i, d in enumerate(tensor.shape)
                )
                length = max([length, *(tensor.shape[i] for i in padded)])
                real += math.prod(tensor.shape)
            else:
                dims = tensor.shape[1:]
            group.append((name, tensor.datatype, dims))
        if self.text:
            lengths = self._backend.token_lengths({name: t.to_numpy() for name, t in item.inputs.items()}) or [0]
            length = max(lengths)
            real = sum(lengths)
            group.append(("tokens", bucket_of(length, self._buckets)))
        item.group = tuple(group)
        item.length = length
        item.real_units = real
        if self._cost_function is not None:
            item.cost = int(self._cost_function({name: t.to_numpy() for name, t in item.inputs.items()}))
        elif self._cost_kind == "tokens":
            item.cost = item.rows * max(length, 1)
        else:
            item.cost = item.rows


def _resolve_cost(spec: str) -> CostFunction:
    from services.batcher.backends.torch_backend import import_factory

    function = import_factory(spec)
    if not callable(function):
        raise ConfigError(f"cost function {spec!r} is not callable")
    return function  # type: ignore[no-any-return]
