"""The gateway's Prometheus metrics, made per app instance on its own registry."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs_submitted = Counter(
            "asyncinfer_jobs_submitted", "Jobs accepted (durably queued).", ["model", "priority"], registry=registry
        )
        self.submit_rejected = Counter(
            "asyncinfer_submit_rejected",
            "SubmitJob calls refused, by status code.",
            ["model", "code"],
            registry=registry,
        )
        self.submit_seconds = Histogram(
            "asyncinfer_submit_seconds", "SubmitJob handling time (validate, record, enqueue).", registry=registry
        )
        self.watchers = Gauge("asyncinfer_watchers", "Open WatchJob streams.", registry=registry)

    def count_watchers(self, count: Callable[[], int]) -> None:
        self.watchers.set_function(count)
