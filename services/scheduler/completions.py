"""Bookkeeping beside the lifecycle: completion and submission rates (for queue stats and
autoscaling) and the tenants' queued counters the gateway's admission reads."""

from __future__ import annotations

import time
from collections import deque

import structlog

from asyncinfer.nats import KeyValue
from asyncinfer.queues import take_from_tenant_count
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.owned_tasks import OwnedTasks

log = structlog.get_logger("asyncinfer.scheduler.jobs")

# Completions and submissions are counted over this sliding window (completed_per_s, submitted_per_s).
RATE_WINDOW_S = 60.0
# How long "this tenant has no queued counter" is believed before the key is looked up again.
TENANT_KEY_MISSING_TTL_S = 5.0


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


class TenantQueueCounts:
    """Takes a job off its tenant's queued counter when it first leaves the queue (only where the
    gateway keeps counters: a tenant without one is not asked about again for a while)."""

    def __init__(self, queues_kv: KeyValue | None, tasks: OwnedTasks) -> None:
        self._kv = queues_kv
        self._tasks = tasks
        self._missing: dict[str, float] = {}

    def left_queue(self, tenant: str) -> None:
        if self._kv is None:
            return
        missing_since = self._missing.get(tenant)
        if missing_since is not None and time.monotonic() - missing_since < TENANT_KEY_MISSING_TTL_S:
            return
        self._tasks.spawn(self._take(self._kv, tenant))

    async def _take(self, kv: KeyValue, tenant: str) -> None:
        try:
            if await take_from_tenant_count(kv, tenant) is None:
                self._missing[tenant] = time.monotonic()
            else:
                self._missing.pop(tenant, None)
        except Exception as exc:
            log.warning("tenant_count_not_updated", tenant=tenant, error=str(exc))
