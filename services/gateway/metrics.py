"""The gateway's Prometheus metrics, made per app instance on its own registry."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncinfer.jobs import JobRecord, Priority
from asyncinfer.metrics import JobTimings, register_build_info
from asyncinfer.rpc_metrics import RpcMetrics


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        register_build_info(registry, "gateway")
        self.rpc = RpcMetrics(registry)
        # The jobs the gateway ends: a cancel of a queued job, an expiry found on a read.
        self.job_timings = JobTimings(registry)
        self.jobs_submitted = Counter(
            "asyncinfer_jobs_submitted", "Jobs accepted (durably queued).", ["model", "priority"], registry=registry
        )
        self.submit_rejected = Counter(
            "asyncinfer_submit_rejected",
            "SubmitJob calls refused, by status code and reason (QUEUE_FULL, TENANT_QUOTA_EXCEEDED, ...).",
            ["model", "code", "reason"],
            registry=registry,
        )
        self.cancels = Counter(
            "asyncinfer_cancels",
            "CancelJob calls, by outcome: CANCELED (was queued), CANCELLING (was running), "
            "JOB_ALREADY_FINISHED, JOB_NOT_FOUND, UNAVAILABLE.",
            ["model", "outcome"],
            registry=registry,
        )
        self.expired_on_read = Counter(
            "asyncinfer_jobs_expired_on_read",
            "Queued jobs found past their deadline by a read and marked EXPIRED by the gateway.",
            ["model"],
            registry=registry,
        )
        self.submit_seconds = Histogram(
            "asyncinfer_submit_seconds", "SubmitJob handling time (validate, record, enqueue).", registry=registry
        )
        self.submit_waits = Counter(
            "asyncinfer_submit_waits",
            "SubmitJob calls that held their answer for the job (the wait field), by how the wait ended: "
            "ended (the answer is the finished job) or wait_passed (the job as it stood).",
            ["outcome"],
            registry=registry,
        )
        self.list_jobs_listings = Counter(
            "asyncinfer_list_jobs_listings",
            "ListJobs listings run (each reads the tenant's records); identical concurrent calls share one.",
            registry=registry,
        )
        self.watchers = Gauge("asyncinfer_watchers", "Open WatchJob streams.", registry=registry)

    def count_models(self, models: Iterable[str]) -> None:
        """The counters that panels and alerts take rate() or increase() of, at 0 for each model from
        the start: Prometheus sees no increase in a series whose first sample is already 1 (the
        first refusals for a full store, a burst of submits between two scrapes)."""
        for model in models:
            for priority in Priority:
                self.jobs_submitted.labels(model=model, priority=priority.value)
            self.submit_rejected.labels(model=model, code="RESOURCE_EXHAUSTED", reason="STORE_FULL")

    def expired_on_read_of(self, record: JobRecord) -> None:
        self.expired_on_read.labels(model=record.model_name).inc()
        self.job_timings.observe(record)

    def count_watchers(self, count: Callable[[], int]) -> None:
        self.watchers.set_function(count)
