"""Queue statistics per model and priority, read from the consumers (for OpsService and metrics)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from asyncinfer.config import Config, ModelConfig
from asyncinfer.jetstream import work_consumer_name
from asyncinfer.jobs import PRIORITIES_BY_RANK, Priority, work_subject
from services.scheduler.batchers import BatcherRegistry


@dataclass(frozen=True, slots=True)
class PriorityQueueSnapshot:
    priority: Priority
    depth: int
    oldest_age_s: float | None


@dataclass(frozen=True, slots=True)
class ModelQueueSnapshot:
    model_name: str
    priorities: tuple[PriorityQueueSnapshot, ...]
    in_flight: int
    connected_batchers: int
    free_credits: int
    desired_batchers: int
    paused: bool = False

    @property
    def depth(self) -> int:
        return sum(q.depth for q in self.priorities)


class QueueStatsReader:
    def __init__(
        self,
        *,
        js: JetStreamContext,
        config: Config,
        batchers: BatcherRegistry,
        in_flight_count: Callable[[str], int],
    ) -> None:
        self._js = js
        self._config = config
        self._batchers = batchers
        self._in_flight_count = in_flight_count

    async def snapshot(self, model_name: str = "") -> list[ModelQueueSnapshot]:
        """Every configured model (or just model_name); unknown names give an empty list."""
        models = [m for m in self._config.models if not model_name or m.name == model_name]
        return list(await asyncio.gather(*(self._model_snapshot(m) for m in models)))

    async def _model_snapshot(self, model: ModelConfig) -> ModelQueueSnapshot:
        queues = await asyncio.gather(*(self._queue(model.name, p) for p in PRIORITIES_BY_RANK))
        sessions = self._batchers.serving(model.name)
        in_flight = self._in_flight_count(model.name)
        # Capacity of one batcher: the batch limit it announced (else the configured one).
        per_batcher = max((s.models[model.name].max_batch_size for s in sessions), default=model.max_batch_size)
        backlog = sum(q.depth for q in queues) + in_flight
        return ModelQueueSnapshot(
            model_name=model.name,
            priorities=tuple(queues),
            in_flight=in_flight,
            connected_batchers=len(sessions),
            free_credits=self._batchers.free_credits(model.name),
            desired_batchers=math.ceil(backlog / max(1, per_batcher)),
        )

    async def _queue(self, model_name: str, priority: Priority) -> PriorityQueueSnapshot:
        stream = self._config.nats.work_stream
        info = await self._js.consumer_info(stream, work_consumer_name(model_name, priority))
        depth = info.num_pending or 0
        oldest_age_s: float | None = None
        if depth and info.delivered is not None:
            # The oldest waiting message is the first on the subject past the delivered sequence.
            try:
                first = await self._js.get_msg(
                    stream,
                    seq=info.delivered.stream_seq + 1,
                    subject=work_subject(model_name, priority),
                    next=True,
                )
            except NotFoundError:
                first = None
            if first is not None and first.time is not None:
                oldest_age_s = max((datetime.now(UTC) - first.time).total_seconds(), 0.0)
        return PriorityQueueSnapshot(priority=priority, depth=depth, oldest_age_s=oldest_age_s)
