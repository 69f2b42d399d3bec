"""Bookkeeping beside the lifecycle: completion and submission rates (for queue stats and
autoscaling), and the sizes of the batches the jobs completed in (for the console's plot)."""

from __future__ import annotations

import time
from collections import deque

import structlog

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.queue_stats import BatchSizeCount

log = structlog.get_logger("asyncinfer.scheduler.jobs")

# Completions and submissions are counted over this sliding window (completed_per_s, submitted_per_s).
RATE_WINDOW_S = 60.0


class EventRates:
    """Events per model per second over a sliding window of RATE_WINDOW_S."""

    def __init__(self) -> None:
        self._events: dict[str, deque[float]] = {}
        self._started = time.monotonic()

    def add(self, model_name: str) -> None:
        self._events.setdefault(model_name, deque()).append(time.monotonic())

    def per_s(self, model_name: str) -> float:
        """Events per second over the last RATE_WINDOW_S (or since start, if shorter)."""
        now = time.monotonic()
        times = self._events.get(model_name)
        if not times:
            return 0.0
        while times and times[0] < now - RATE_WINDOW_S:
            times.popleft()
        span = min(RATE_WINDOW_S, max(now - self._started, 1.0))
        return len(times) / span


class BatchSizes:
    """Per model, the jobs completed over the last RATE_WINDOW_S by the size of the batch each ran
    in, kept as one count per size per whole second (memory bounded by the window, not the rate)."""

    def __init__(self) -> None:
        self._seconds: dict[str, deque[tuple[int, dict[int, int]]]] = {}

    def add(self, model_name: str, batch_size: int) -> None:
        if batch_size <= 0:
            return
        second = int(time.monotonic())
        buckets = self._seconds.setdefault(model_name, deque())
        if not buckets or buckets[-1][0] != second:
            buckets.append((second, {}))
        counts = buckets[-1][1]
        counts[batch_size] = counts.get(batch_size, 0) + 1

    def distribution(self, model_name: str) -> tuple[BatchSizeCount, ...]:
        """Smallest size first."""
        buckets = self._seconds.get(model_name)
        if not buckets:
            return ()
        oldest = int(time.monotonic() - RATE_WINDOW_S)
        while buckets and buckets[0][0] < oldest:
            buckets.popleft()
        jobs: dict[int, int] = {}
        for _, counts in buckets:
            for size, n in counts.items():
                jobs[size] = jobs.get(size, 0) + n
        return tuple(
            BatchSizeCount(batch_size=size, batches=max(1, round(n / size)), jobs=n) for size, n in sorted(jobs.items())
        )


class CompletionRates(EventRates):
    def __init__(self, metrics: SchedulerMetrics) -> None:
        super().__init__()
        self._metrics = metrics
        self.batch_sizes = BatchSizes()

    def completed(self, model_name: str, batch_size: int = 0) -> None:
        self.add(model_name)
        self.batch_sizes.add(model_name, batch_size)
        self._metrics.completed.labels(model=model_name).inc()
