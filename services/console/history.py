"""The last minutes of GetQueueStats, sampled by the console itself (no Prometheus needed) and kept
in memory for the throughput and queue-depth plots. A console restart starts them afresh."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from asyncinfer.client.errors import AsyncInferClientError
from services.console.backend import ModelQueues

log = structlog.get_logger("asyncinfer.console")


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # time.time()
    depth: int
    submitted_per_second: float
    completed_per_second: float


class QueueHistory:
    """Samples per model, oldest first, none older than `keep_s`; `latest` is the last answer
    (or the last error, as text, when the scheduler did not answer)."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self.models: dict[str, deque[Sample]] = {}
        self.latest: list[ModelQueues] = []
        self.error = ""

    def add(self, queues: list[ModelQueues], at: float | None = None) -> None:
        now = time.time() if at is None else at
        self.latest, self.error = queues, ""
        for model in queues:
            samples = self.models.setdefault(model.model_name, deque())
            samples.append(Sample(now, model.depth, model.submitted_per_second, model.completed_per_second))
        for samples in self.models.values():
            while samples and samples[0].at < now - self.keep_s:
                samples.popleft()

    async def sample_forever(self, read: Callable[[], Awaitable[list[ModelQueues]]], interval_s: float) -> None:
        """The console's one background loop: a failed read is shown, never fatal."""
        while True:
            try:
                self.add(await read())
            except AsyncInferClientError as error:
                if self.error != str(error):
                    log.warning("console_queue_stats_failed", error=str(error))
                self.error = str(error)
            await asyncio.sleep(interval_s)
