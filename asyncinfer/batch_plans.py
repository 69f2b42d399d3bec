"""A batch's planned chunks not yet queued as jobs, carried as a header on every write of its
record in the batches bucket, so the scheduler's autoscaling signal can count them from a
headers-only watch (services/scheduler/batch_plans.py) without reading the records (a record
holds its whole chunk list). Shared: the gateway writes the header, the scheduler reads it."""

from __future__ import annotations

from dataclasses import dataclass

from asyncinfer.batches import BatchRecord, BatchState, ChunkStatus

PLANNED_HEADER = "Asyncinfer-Batch-Planned"
# The batches bucket is declared by the gateway and the scheduler alike, with this description.
BATCHES_BUCKET_DESCRIPTION = "asyncinfer batch records, keyed <tenant>.<batch_id>"


@dataclass(frozen=True, slots=True)
class PlannedChunks:
    model_name: str
    chunks: int  # waiting in the plan: neither queued nor ended


def planned_chunks(record: BatchRecord) -> PlannedChunks:
    """Zero once the batch is terminal or stopping (cancelled or past its window: nothing more is
    submitted) and while it is VALIDATING (its plan is not made yet)."""
    if record.state is not BatchState.IN_PROGRESS:
        return PlannedChunks(record.model_name, 0)
    return PlannedChunks(record.model_name, sum(1 for c in record.chunks if c.status is ChunkStatus.WAITING))


def encode_planned(planned: PlannedChunks) -> str:
    return f"{planned.chunks} {planned.model_name}"


def decode_planned(value: str) -> PlannedChunks:
    """Raises ValueError when the header is not one this release wrote."""
    count, _, model_name = value.partition(" ")
    if not model_name:
        raise ValueError(f"not a planned-chunks header: {value!r}")
    return PlannedChunks(model_name, int(count))
