"""The batch former's choice of the next batch (services/batcher/model_queue.py forms it): the
order and closing rules engine.py describes, as a function of the waiting items and the model's
limits, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncinfer.config import ModelConfig
from services.batcher.items import PendingItem


def pick_batch(
    waiting: Sequence[PendingItem], config: ModelConfig, preferred: Sequence[int]
) -> tuple[list[PendingItem], bool]:
    """The best waiting item's group in order, within the row and cost limits; and whether the batch
    should close now (it cannot grow, or it reached a preferred size). `preferred`: the model's
    preferred batch sizes, largest first."""
    max_rows = config.max_batch_size
    max_cost = config.max_batch_cost
    ordered = sorted(waiting, key=_sort_key)
    if ordered[0].run_alone:
        # Its previous attempt was lost with its batcher: if it crashes the process again, it
        # takes no other job with it.
        return [ordered[0]], True
    group = ordered[0].group
    batch: list[PendingItem] = []
    rows = cost = 0
    left_out = False
    for item in ordered:
        if item.group != group or item.run_alone:
            continue
        if rows + item.rows > max_rows or (max_cost and batch and cost + item.cost > max_cost):
            left_out = True
            continue
        batch.append(item)
        rows += item.rows
        cost += item.cost
    if left_out or rows >= max_rows or (max_cost and cost >= max_cost):
        return batch, True
    for size in preferred:
        if size > rows:
            continue
        prefix: list[PendingItem] = []
        prefix_rows = 0
        for item in batch:
            if prefix_rows + item.rows > size:
                break
            prefix.append(item)
            prefix_rows += item.rows
        if prefix_rows == size:
            return prefix, True
    return batch, False


def _sort_key(item: PendingItem) -> tuple[int, float, int]:
    return item.sort_key
