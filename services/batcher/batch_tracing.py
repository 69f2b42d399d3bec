"""The batcher's spans (asyncinfer.tracing), made once a batch has computed and only for a batch
that holds traced jobs: `batch`, a trace of its own (a batch serves many jobs, so it belongs to
none of their traces) linking the dispatch span of every traced job it held; and per traced job a
`compute` span, a child of its dispatch span (so the job's own trace shows its compute), linked
back to the batch. Both cover the batch's compute (assemble, model, split)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from asyncinfer.tracing import AttributeValue, Tracing
from services.batcher.items import PendingItem


def trace_batch(
    tracing: Tracing, model_name: str, batch: Sequence[PendingItem], failed: Sequence[bool], compute_s: float
) -> None:
    """`failed`: per item, whether its (sub-)batch failed (see batch_compute.py's poison isolation)."""
    parents = [item.trace for item in batch if item.trace]
    if not parents:
        return
    end_s = time.time()
    start_s = end_s - compute_s
    size: dict[str, AttributeValue] = {
        "asyncinfer.model": model_name,
        "asyncinfer.batch_items": len(batch),
        "asyncinfer.batch_rows": sum(item.rows for item in batch),
    }
    batch_trace = tracing.record("batch", start_s=start_s, end_s=end_s, attributes=size, links=parents)
    for item, item_failed in zip(batch, failed, strict=True):
        if item.trace:
            attributes: dict[str, AttributeValue] = {
                **size,
                "asyncinfer.item_rows": item.rows,
                "asyncinfer.failed": item_failed,
            }
            tracing.record(
                "compute",
                parent=item.trace,
                start_s=start_s,
                end_s=end_s,
                attributes=attributes,
                links=[batch_trace],
                error="its batch failed" if item_failed else "",
            )
