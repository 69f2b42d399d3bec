"""The scheduler's batch-size distribution (services.scheduler.completions.BatchSizes): jobs by the
size of the batch each ran in, over the last minute, and the batches that makes."""

from __future__ import annotations

import pytest

from services.scheduler import completions
from services.scheduler.completions import BatchSizes
from services.scheduler.queue_stats import BatchSizeCount

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_jobs_count_by_size_and_batches_are_jobs_over_size(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(completions.time, "monotonic", clock)
    sizes = BatchSizes()
    for _ in range(8):  # two batches of 4
        sizes.add("m", 4)
    sizes.add("m", 1)
    clock.now += 2.5
    for _ in range(3):
        sizes.add("m", 3)
    sizes.add("m", 0)  # a result without a batch (a dropped item): not counted
    sizes.add("other", 2)
    assert sizes.distribution("m") == (
        BatchSizeCount(batch_size=1, batches=1, jobs=1),
        BatchSizeCount(batch_size=3, batches=1, jobs=3),
        BatchSizeCount(batch_size=4, batches=2, jobs=8),
    )
    # One job of a batch of two seen (the other perhaps by another scheduler): still a batch.
    assert sizes.distribution("other") == (BatchSizeCount(batch_size=2, batches=1, jobs=1),)
    assert sizes.distribution("unknown") == ()


def test_only_the_last_minute_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(completions.time, "monotonic", clock)
    sizes = BatchSizes()
    sizes.add("m", 8)
    clock.now += completions.RATE_WINDOW_S / 2
    sizes.add("m", 2)
    clock.now += completions.RATE_WINDOW_S / 2 + 1.5
    assert sizes.distribution("m") == (BatchSizeCount(batch_size=2, batches=1, jobs=1),)
    clock.now += completions.RATE_WINDOW_S
    assert sizes.distribution("m") == ()
