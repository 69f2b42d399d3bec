"""The scheduler's Prometheus metrics, on a registry of its own (several apps share a process).

Rates are counters' (`rate(asyncinfer_results_total[1m])` is the results per second), not gauges:
the per-second figures GetQueueStats and the `stats` screen show are the queue snapshot's."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from asyncinfer import job_errors
from asyncinfer.jobs import JobRecord, JobState
from asyncinfer.metrics import JobTimings, register_build_info
from asyncinfer.rpc_metrics import RpcMetrics
from asyncinfer.work_summary import WorkSummary
from services.scheduler.queue_stats import ModelQueueSnapshot
from services.scheduler.store_usage import StoreUsage

# What jobs_summary calls a record the scheduler wrote, by its new state: made once, not per job.
SUMMARY_NAMES = {
    state: {JobState.RUNNING: "dispatched", JobState.QUEUED: "requeued"}.get(state, state.value.lower())
    for state in JobState
}


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry, *, summary: WorkSummary | None = None) -> None:
        self.registry = registry
        self.summary = summary
        self._models_counted: set[str] = set()
        register_build_info(registry, "scheduler")
        self.rpc = RpcMetrics(registry)
        self.job_timings = JobTimings(registry)
        self.jobs = Counter(
            "asyncinfer_jobs",
            "Job state transitions made by the scheduler.",
            ["model", "state"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "asyncinfer_queue_depth",
            "Jobs waiting, per model and priority, in the whole cluster (every scheduler's put-backs counted).",
            ["model", "priority"],
            registry=registry,
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

        self.retries = Counter(
            "asyncinfer_retries",
            "Attempts that failed retriably and were put back in the queue, by reason.",
            ["model", "reason"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "asyncinfer_dead_letters",
            "Jobs moved to dead letters for an operator to replay or purge (a file batch's chunk jobs are "
            "counted apart: asyncinfer_batch_chunk_dead_letters).",
            ["model", "reason"],
            registry=registry,
        )
        # A chunk job's letter is not replayable: its records are in its batch's error file, for
        # the batch's user. Counted here, an alert on dead letters fired for a batch's bad records.
        self.chunk_dead_letters = Counter(
            "asyncinfer_batch_chunk_dead_letters",
            "A file batch's chunk jobs moved to dead letters (their records are in the batch's error file; "
            "not replayable).",
            ["model"],
            registry=registry,
        )
        self.lease_expiries = Counter(
            "asyncinfer_lease_expiries",
            "Jobs redelivered while their record was RUNNING in an earlier attempt (a scheduler died).",
            ["model"],
            registry=registry,
        )
        self.dispatch_lingers = Counter(
            "asyncinfer_dispatch_lingers",
            "Dispatch rounds followed by a short wait (scheduler.dispatch_linger_ms) so that a steady stream "
            "of jobs is dispatched together.",
            ["model"],
            registry=registry,
        )
        self.completed = Counter(
            "asyncinfer_results", "Results received from batchers (any outcome).", ["model"], registry=registry
        )
        self.desired_batchers = Gauge(
            "asyncinfer_desired_batchers",
            "Batchers wanted to clear the whole cluster's backlog at the measured throughput (the autoscaling signal).",
            ["model"],
            registry=registry,
        )
        self.free_credits = Gauge(
            "asyncinfer_free_credits",
            "Work orders the connected batchers would accept now.",
            ["model"],
            registry=registry,
        )
        self.paused = Gauge(
            "asyncinfer_queue_paused", "1 while the model's queue is paused.", ["model"], registry=registry
        )

        # The JetStream store, which every scheduler reads whole (max() them over schedulers).
        self.store_used = Gauge(
            "asyncinfer_store_used_bytes",
            "JetStream storage the account uses, by storage (file, memory).",
            ["storage"],
            registry=registry,
        )
        self.store_limit = Gauge(
            "asyncinfer_store_limit_bytes",
            "The account's JetStream limit, by storage (file, memory); 0: the account has none (the server's "
            "max_file_store still applies: asyncinfer_nats_server_store_limit_bytes).",
            ["storage"],
            registry=registry,
        )
        self.stream_used = Gauge(
            "asyncinfer_stream_used_bytes",
            "Bytes stored in each of the stack's streams that has a byte limit (max_bytes).",
            ["stream"],
            registry=registry,
        )
        self.stream_limit = Gauge(
            "asyncinfer_stream_limit_bytes",
            "The byte limit (max_bytes) of each of the stack's streams that has one.",
            ["stream"],
            registry=registry,
        )
        self._limited_streams: set[str] = set()
        # Each server's own store (scheduler.nats_monitor_urls, their /jsz): of every account and
        # replica it holds, against its max_file_store / max_memory_store.
        self.server_store_used = Gauge(
            "asyncinfer_nats_server_store_used_bytes",
            "JetStream storage a NATS server uses (every account and replica it holds), by server (its monitoring "
            "endpoint, scheduler.nats_monitor_urls) and storage (file, memory).",
            ["server", "storage"],
            registry=registry,
        )
        self.server_store_limit = Gauge(
            "asyncinfer_nats_server_store_limit_bytes",
            "A NATS server's own JetStream limit (max_file_store, max_memory_store), by server and storage.",
            ["server", "storage"],
            registry=registry,
        )
        self._servers: set[str] = set()
        self.dead_letters_stored = Gauge(
            "asyncinfer_dead_letters_stored",
            "Dead letters stored now, by model: the backlog to replay or purge (read every "
            "scheduler.store_usage_interval_s).",
            ["model"],
            registry=registry,
        )

        self.draining = Gauge(
            "asyncinfer_scheduler_draining",
            "1 while this scheduler is draining (it dispatches nothing until undrained).",
            registry=registry,
        )

    def count_models(self, models: Iterable[str]) -> None:
        """The per-model counters that alerts and panels take increase() or rate() of, at 0 from the
        moment the model is known: Prometheus sees no increase in a series whose first sample is
        already 1, so a model's first dead letters (every one of a burst between two scrapes) were
        not seen, and a model that never finished a job had no results series to alert on."""
        for model in models:
            if model in self._models_counted:
                continue
            self._models_counted.add(model)
            for state in JobState:
                self.jobs.labels(model=model, state=state.value)
            self.dead_letters.labels(model=model, reason=job_errors.MAX_ATTEMPTS)
            self.chunk_dead_letters.labels(model=model)
            self.dead_letters_stored.labels(model=model)
            self.completed.labels(model=model)
            self.lease_expiries.labels(model=model)

    def job_transition(self, record: JobRecord) -> None:
        """A record the scheduler wrote: counted by its new state (for the metric and for the
        log's jobs_summary), and timed once terminal."""
        self.jobs.labels(model=record.model_name, state=record.state.value).inc()
        self.job_timings.observe(record)
        if self.summary is not None:
            self.summary.count(record.model_name, SUMMARY_NAMES[record.state])

    def observe(self, snapshots: Iterable[ModelQueueSnapshot]) -> None:
        for snapshot in snapshots:
            model = snapshot.model_name
            self.count_models((model,))
            for queue in snapshot.priorities:
                labels = {"model": model, "priority": queue.priority.value}
                self.queue_depth.labels(**labels).set(queue.depth)
                self.queue_oldest_age.labels(**labels).set(queue.oldest_age_s or 0.0)
            self.jobs_in_flight.labels(model=model).set(snapshot.in_flight)
            self.connected_batchers.labels(model=model).set(snapshot.connected_batchers)
            self.desired_batchers.labels(model=model).set(snapshot.desired_batchers)
            self.free_credits.labels(model=model).set(snapshot.free_credits)
            self.paused.labels(model=model).set(1 if snapshot.paused else 0)
            self.draining.set(1 if snapshot.draining else 0)

    def observe_store(self, usage: StoreUsage) -> None:
        for storage, used, limit in (
            ("file", usage.file_used_bytes, usage.file_limit_bytes),
            ("memory", usage.memory_used_bytes, usage.memory_limit_bytes),
        ):
            self.store_used.labels(storage=storage).set(used)
            self.store_limit.labels(storage=storage).set(limit)
        limited = {stream.stream for stream in usage.streams}
        for gone in self._limited_streams - limited:  # its limit lifted, or the stream deleted
            self.stream_used.remove(gone)
            self.stream_limit.remove(gone)
        self._limited_streams = limited
        for stream in usage.streams:
            self.stream_used.labels(stream=stream.stream).set(stream.used_bytes)
            self.stream_limit.labels(stream=stream.stream).set(stream.limit_bytes)
        servers = {server.server for server in usage.servers}
        for gone in self._servers - servers:  # not answering: no stale reading to alert on
            for storage in ("file", "memory"):
                self.server_store_used.remove(gone, storage)
                self.server_store_limit.remove(gone, storage)
        self._servers = servers
        for server in usage.servers:
            for storage, used, limit in (
                ("file", server.file_used_bytes, server.file_limit_bytes),
                ("memory", server.memory_used_bytes, server.memory_limit_bytes),
            ):
                self.server_store_used.labels(server=server.server, storage=storage).set(used)
                self.server_store_limit.labels(server=server.server, storage=storage).set(limit)
        if usage.dead_letters is not None:
            self.count_models(usage.dead_letters)
            for model in self._models_counted:  # replayed or purged: back to 0
                self.dead_letters_stored.labels(model=model).set(usage.dead_letters.get(model, 0))
