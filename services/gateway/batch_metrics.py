"""The batch driver's Prometheus metrics (on the gateway's registry). Record counts are counted by
the gateway whose write moved them (each change of a batch is won by exactly one driver), so the
sum over gateways is exact; the gauges describe the batches this gateway drives."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from asyncinfer.batches import BatchRecord, ChunkStatus, progress_rate


class _DrivenBatches(Collector):
    """Per model: the chunks of running batches by status (waiting in the plan, queued or running
    as jobs), and their records done per second (each batch's rate since it started, summed)."""

    def __init__(self, driven: Callable[[], Iterable[BatchRecord]]) -> None:
        self._driven = driven

    def collect(self) -> Iterable[GaugeMetricFamily]:
        chunks = GaugeMetricFamily(
            "asyncinfer_batch_chunks",
            "Chunks of the running batches this gateway drives: WAITING in the plan, QUEUED as jobs (queued or running).",
            labels=["model", "status"],
        )
        rates = GaugeMetricFamily(
            "asyncinfer_batch_records_per_second",
            "Records done per second by the running batches this gateway drives (each since it started), summed.",
            labels=["model"],
        )
        counts: dict[tuple[str, str], int] = {}
        per_model: dict[str, float] = {}
        now = time.time()
        for record in self._driven():
            for status in (ChunkStatus.WAITING, ChunkStatus.QUEUED):
                key = (record.model_name, status.name)
                counts[key] = counts.get(key, 0) + sum(1 for c in record.chunks if c.status is status)
            per_model[record.model_name] = per_model.get(record.model_name, 0.0) + progress_rate(record, now=now)[0]
        for (model, status_name), value in sorted(counts.items()):
            chunks.add_metric([model, status_name], value)
        for model, rate in sorted(per_model.items()):
            rates.add_metric([model], rate)
        yield chunks
        yield rates


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.records = Counter(
            "asyncinfer_batch_records",
            "Batch records ended, by outcome: completed, failed (invalid lines and failed records), or not_run "
            "(cancelled or expired before they ran).",
            ["model", "outcome"],
            registry=registry,
        )
        self.ended = Counter(
            "asyncinfer_batches_ended", "Batches ended, by terminal state.", ["model", "state"], registry=registry
        )
        self.driven = Gauge("asyncinfer_batches_driven", "Running batches this gateway drives.", registry=registry)

    def watch(self, driven: Callable[[], Iterable[BatchRecord]]) -> None:
        self._registry.register(_DrivenBatches(driven))
        self.driven.set_function(lambda: sum(1 for _ in driven()))

    def wrote(self, before: BatchRecord, after: BatchRecord) -> None:
        """A write of this gateway moved the batch from `before` to `after`."""
        old, new = before.counts, after.counts
        if new.completed > old.completed:
            self.records.labels(model=after.model_name, outcome="completed").inc(new.completed - old.completed)
        if new.failed > old.failed:
            self.records.labels(model=after.model_name, outcome="failed").inc(new.failed - old.failed)
        if new.not_run > old.not_run:
            self.records.labels(model=after.model_name, outcome="not_run").inc(new.not_run - old.not_run)
        if after.state.is_terminal and not before.state.is_terminal:
            self.ended.labels(model=after.model_name, state=after.state.value).inc()
