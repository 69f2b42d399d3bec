"""The batcher's Prometheus metrics, made per app instance on its own registry.

Items per second is `rate(asyncinfer_batcher_items_total[1m])` (rows: `..._rows_total`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncinfer.metrics import register_build_info
from asyncinfer.rpc_metrics import RpcMetrics

_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class BatcherMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        register_build_info(registry, "batcher")
        self.rpc = RpcMetrics(registry)
        self.batch_size = Histogram(
            "asyncinfer_batch_size",
            "Rows in each batch computed.",
            ["model"],
            buckets=_BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_fill = Histogram(
            "asyncinfer_batch_fill_ratio",
            "Rows in each batch over the model's max_batch_size.",
            ["model"],
            buckets=_RATIO_BUCKETS,
            registry=registry,
        )
        self.padding_waste = Histogram(
            "asyncinfer_batch_padding_waste_ratio",
            "Share of each batch's elements (or tokens) that are padding.",
            ["model"],
            buckets=(0.0, *_RATIO_BUCKETS),
            registry=registry,
        )
        self.batch_compute_seconds = Histogram(
            "asyncinfer_batch_compute_seconds",
            "Time to compute one batch (assemble, run the model, split).",
            ["model"],
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.batch_queue_wait_seconds = Histogram(
            "asyncinfer_batch_queue_wait_seconds",
            "How long the oldest item of each batch waited before the batch started.",
            ["model"],
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.queue_depth = Gauge(
            "asyncinfer_batcher_queue_depth",
            "Items waiting for a batch.",
            ["model"],
            registry=registry,
        )
        self.items = Counter(
            "asyncinfer_batcher_items_total",
            "Items that left the batcher, by outcome (OK, MODEL_ERROR, TIMED_OUT, EXPIRED, CANCELED, SHUTDOWN, ERROR).",
            ["model", "outcome"],
            registry=registry,
        )
        self.rows = Counter(
            "asyncinfer_batcher_rows_total", "Rows computed in batches that succeeded.", ["model"], registry=registry
        )
        self.overrun_batches = Gauge(
            "asyncinfer_batcher_overrun_batches",
            "Batches still computing past their jobs' execution timeouts (a model call that does not return).",
            ["model"],
            registry=registry,
        )
        self.model_ready = Gauge(
            "asyncinfer_batcher_model_ready",
            "1 when the model's version loaded and serves, 0 when it failed to load or its Triton is out of "
            'reach; version="": the model as a request naming no version finds it (its default version).',
            ["model", "version"],
            registry=registry,
        )
        # Per model: the readings of its versions' queues, summed at collection (two versions
        # served side by side share the model's gauge child; each new queue replaced the last's
        # reading, so the gauge showed one version, then a retired one's zero).
        self._depths: dict[str, SummedReading] = {}
        self._overruns: dict[str, SummedReading] = {}

    def depth_reading(self, model: str) -> SummedReading:
        reading = self._depths.get(model)
        if reading is None:
            reading = self._depths[model] = SummedReading(self.queue_depth.labels(model=model))
        return reading

    def overrun_reading(self, model: str) -> SummedReading:
        reading = self._overruns.get(model)
        if reading is None:
            reading = self._overruns[model] = SummedReading(self.overrun_batches.labels(model=model))
        return reading

    def observe_batch(
        self, model: str, *, rows: int, max_rows: int, padding_waste: float, queue_wait_s: float, compute_s: float
    ) -> None:
        self.batch_size.labels(model=model).observe(rows)
        self.batch_fill.labels(model=model).observe(rows / max_rows)
        self.padding_waste.labels(model=model).observe(padding_waste)
        self.batch_queue_wait_seconds.labels(model=model).observe(queue_wait_s)
        self.batch_compute_seconds.labels(model=model).observe(compute_s)
        self.rows.labels(model=model).inc(rows)

    def count_item(self, model: str, outcome: str) -> None:
        self.items.labels(model=model, outcome=outcome).inc()

    def set_model_ready(self, model: str, version: str, ready: bool) -> None:
        """`version` "": the model's own series (its default version's readiness)."""
        self.model_ready.labels(model=model, version=version).set(1 if ready else 0)

    def forget_model_ready(self, model: str, version: str) -> None:
        """A version no longer loaded (unloaded, or dropped from the file) has no series."""
        with contextlib.suppress(KeyError):
            self.model_ready.remove(model, version)

    def for_model(self, model: str) -> ModelMetrics:
        return ModelMetrics(self, model)


class ModelMetrics:
    """One model's metric children, looked up once: the engine updates them per batch (and per
    item), where a label lookup each time would be a measurable share of the work."""

    def __init__(self, metrics: BatcherMetrics, model: str) -> None:
        self._metrics = metrics
        self._model = model
        self._batch_size = metrics.batch_size.labels(model=model)
        self._batch_fill = metrics.batch_fill.labels(model=model)
        self._padding_waste = metrics.padding_waste.labels(model=model)
        self._queue_wait = metrics.batch_queue_wait_seconds.labels(model=model)
        self._compute = metrics.batch_compute_seconds.labels(model=model)
        self._rows = metrics.rows.labels(model=model)
        self._depth = metrics.depth_reading(model)
        self._overrun = metrics.overrun_reading(model)
        self._items: dict[str, Counter] = {}

    def observe_batch(
        self, *, rows: int, max_rows: int, padding_waste: float, queue_wait_s: float, compute_s: float
    ) -> None:
        self._batch_size.observe(rows)
        self._batch_fill.observe(rows / max_rows)
        self._padding_waste.observe(padding_waste)
        self._queue_wait.observe(queue_wait_s)
        self._compute.observe(compute_s)
        self._rows.inc(rows)

    def track_queue_depth(self, depth: Callable[[], float]) -> Callable[[], None]:
        """The queue depth is read when metrics are collected: setting a gauge per item took a
        lock per request on the hot path. One version's queue among the model's; returns the
        function that takes it out (once the version is retired)."""
        return self._depth.add(depth)

    def track_overrun(self, overrun: Callable[[], float]) -> Callable[[], None]:
        """Read when metrics are collected, as the queue depth is; returns its removal too."""
        return self._overrun.add(overrun)

    def count_items(self, outcome: str, count: int = 1) -> None:
        child = self._items.get(outcome)
        if child is None:
            child = self._items[outcome] = self._metrics.items.labels(model=self._model, outcome=outcome)
        child.inc(count)


class SummedReading:
    """A gauge child read at collection as the sum of its sources: one per version of a model
    (the versions' queues come and go while the batcher runs)."""

    def __init__(self, child: Gauge) -> None:
        self._sources: list[Callable[[], float]] = []
        child.set_function(self._read)

    def add(self, source: Callable[[], float]) -> Callable[[], None]:
        self._sources.append(source)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._sources.remove(source)

        return remove

    def _read(self) -> float:
        # A copy: collection runs on the metrics server's thread while the loop adds and removes.
        return float(sum(source() for source in list(self._sources)))
