"""The scheduler's Prometheus metrics, on a registry of its own (several apps share a process)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.scheduler.queue_stats import ModelQueueSnapshot


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.jobs = Counter(
            "asyncinfer_jobs",
            "Job state transitions made by the scheduler.",
            ["model", "state"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "asyncinfer_queue_depth", "Jobs waiting, per model and priority.", ["model", "priority"], registry=registry
        )
        self.queue_oldest_age = Gauge(
            "asyncinfer_queue_oldest_age_seconds",
            "Age of the oldest waiting job, per model and priority (0 when none waits).",
            ["model", "priority"],
            registry=registry,
        )
        self.jobs_in_flight = Gauge(
            "asyncinfer_jobs_in_flight", "Jobs dispatched to batchers and not finished.", ["model"], registry=registry
        )
        self.connected_batchers = Gauge(
            "asyncinfer_connected_batchers", "Batchers connected that serve the model.", ["model"], registry=registry
        )

    def job_transition(self, model_name: str, state: str) -> None:
        self.jobs.labels(model=model_name, state=state).inc()

    def observe(self, snapshots: Iterable[ModelQueueSnapshot]) -> None:
        for snapshot in snapshots:
            model = snapshot.model_name
            for queue in snapshot.priorities:
                labels = {"model": model, "priority": queue.priority.value}
                self.queue_depth.labels(**labels).set(queue.depth)
                self.queue_oldest_age.labels(**labels).set(queue.oldest_age_s or 0.0)
            self.jobs_in_flight.labels(model=model).set(snapshot.in_flight)
            self.connected_batchers.labels(model=model).set(snapshot.connected_batchers)
