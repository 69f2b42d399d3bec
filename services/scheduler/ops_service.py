"""OpsService: queue statistics for operators and autoscalers (dead letters, pause/resume and
drain come with issue #3)."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
from google.protobuf import duration_pb2

from asyncinfer.errors import NotFound, Unimplemented
from asyncinfer.v1 import ops_service_pb2, ops_service_pb2_grpc
from services.scheduler.queue_stats import ModelQueueSnapshot, QueueStatsReader
from services.scheduler.worker_service import PRIORITY_TO_PROTO

Context = grpc.aio.ServicerContext[Any, Any]


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


def snapshot_to_proto(snapshot: ModelQueueSnapshot) -> ops_service_pb2.ModelQueueStats:
    priorities = []
    for queue in snapshot.priorities:
        stats = ops_service_pb2.PriorityQueueStats(priority=PRIORITY_TO_PROTO[queue.priority], depth=queue.depth)
        if queue.oldest_age_s is not None:
            stats.oldest_age.CopyFrom(_duration(queue.oldest_age_s))
        priorities.append(stats)
    return ops_service_pb2.ModelQueueStats(
        model_name=snapshot.model_name,
        priorities=priorities,
        in_flight=snapshot.in_flight,
        connected_batchers=snapshot.connected_batchers,
        free_credits=snapshot.free_credits,
        desired_batchers=snapshot.desired_batchers,
        paused=snapshot.paused,
    )


def _later(rpc: str) -> NoReturn:
    raise Unimplemented(f"{rpc} comes with issue #3")


class OpsService(ops_service_pb2_grpc.OpsServiceServicer):
    def __init__(self, *, stats: QueueStatsReader, model_names: frozenset[str]) -> None:
        self._stats = stats
        self._model_names = model_names

    async def GetQueueStats(
        self, request: ops_service_pb2.GetQueueStatsRequest, context: Context
    ) -> ops_service_pb2.GetQueueStatsResponse:
        if request.model_name and request.model_name not in self._model_names:
            raise NotFound(f"model {request.model_name!r} is not configured", reason="MODEL_NOT_FOUND")
        snapshots = await self._stats.snapshot(request.model_name)
        return ops_service_pb2.GetQueueStatsResponse(models=[snapshot_to_proto(s) for s in snapshots])

    async def ListDeadLetters(
        self, request: ops_service_pb2.ListDeadLettersRequest, context: Context
    ) -> ops_service_pb2.ListDeadLettersResponse:
        _later("ListDeadLetters")

    async def GetDeadLetter(
        self, request: ops_service_pb2.GetDeadLetterRequest, context: Context
    ) -> ops_service_pb2.GetDeadLetterResponse:
        _later("GetDeadLetter")

    async def ReplayDeadLetters(
        self, request: ops_service_pb2.ReplayDeadLettersRequest, context: Context
    ) -> ops_service_pb2.ReplayDeadLettersResponse:
        _later("ReplayDeadLetters")

    async def PurgeDeadLetters(
        self, request: ops_service_pb2.PurgeDeadLettersRequest, context: Context
    ) -> ops_service_pb2.PurgeDeadLettersResponse:
        _later("PurgeDeadLetters")

    async def PauseQueue(
        self, request: ops_service_pb2.PauseQueueRequest, context: Context
    ) -> ops_service_pb2.PauseQueueResponse:
        _later("PauseQueue")

    async def ResumeQueue(
        self, request: ops_service_pb2.ResumeQueueRequest, context: Context
    ) -> ops_service_pb2.ResumeQueueResponse:
        _later("ResumeQueue")

    async def Drain(self, request: ops_service_pb2.DrainRequest, context: Context) -> ops_service_pb2.DrainResponse:
        _later("Drain")
