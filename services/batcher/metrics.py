"""The batcher's Prometheus metrics, made per app instance on its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_COMPUTE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class BatcherMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batch_size = Histogram(
            "asyncinfer_batch_size",
            "Rows in each batch computed.",
            ["model"],
            buckets=_BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_compute_seconds = Histogram(
            "asyncinfer_batch_compute_seconds",
            "Time to compute one batch (concatenate, run the model, split).",
            ["model"],
            buckets=_COMPUTE_BUCKETS,
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
            "Items that left the batcher, by outcome (ok, model_error, dropped, shutdown, ...).",
            ["model", "outcome"],
            registry=registry,
        )

    def observe_batch(self, model: str, rows: int, compute_s: float) -> None:
        self.batch_size.labels(model=model).observe(rows)
        self.batch_compute_seconds.labels(model=model).observe(compute_s)

    def set_queue_depth(self, model: str, depth: int) -> None:
        self.queue_depth.labels(model=model).set(depth)

    def count_item(self, model: str, outcome: str) -> None:
        self.items.labels(model=model, outcome=outcome).inc()
