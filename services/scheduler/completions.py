"""Bookkeeping beside the lifecycle: completion and submission rates (for queue stats and
autoscaling)."""

from __future__ import annotations

import time
from collections import deque

import structlog

from services.scheduler.metrics import SchedulerMetrics

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


class CompletionRates(EventRates):
    def __init__(self, metrics: SchedulerMetrics) -> None:
        super().__init__()
        self._metrics = metrics

    def completed(self, model_name: str) -> None:
        self.add(model_name)
        self._metrics.completed.labels(model=model_name).inc()
