"""Fakes the gateway's QueueView unit tests share: its clocks, the work consumers' counts, a view
over them, and a queued job's record."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

from asyncinfer.jobs import JobRecord, JobState, Priority
from asyncinfer.nats import Client, JetStreamContext
from services.gateway.queue_view import QueueView

BUCKET = "queues"
MODEL = "demo"


@dataclass
class Clocks:
    """The gateway's wall and monotonic clocks, and nats-server's wall clock `gateway_ahead_s`
    behind the gateway's."""

    wall: float = 1_800_000_000.0
    mono: float = 1_000.0
    gateway_ahead_s: float = 0.0

    @property
    def server(self) -> float:
        return self.wall - self.gateway_ahead_s

    def pass_s(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


class Consumers:
    """The work consumers' counts as `_read_depth` reads them: `pending` in all."""

    def __init__(self) -> None:
        self.pending = 0

    async def consumer_info(self, _stream: str, name: str) -> Any:
        first = name.endswith(Priority.HIGH.value.lower())
        return SimpleNamespace(num_pending=self.pending if first else 0, num_ack_pending=0)


def view_with(clocks: Clocks, consumers: Consumers | None = None) -> QueueView:
    return QueueView(
        cast(JetStreamContext, consumers),
        cast(Client, None),
        bucket=BUCKET,
        work_stream="WORK",
        clock=lambda: clocks.wall,
        monotonic=lambda: clocks.mono,
    )


def queued_job(create_time: float, *, work_message_time: float | None = None, job_id: str = "j") -> JobRecord:
    return JobRecord(
        job_id=job_id,
        tenant="default",
        model_name=MODEL,
        model_version="1",
        state=JobState.QUEUED,
        priority=Priority.NORMAL,
        create_time=create_time,
        update_time=create_time,
        max_attempts=3,
        result_retention_s=60.0,
        work_message_time=work_message_time,
    )


def position(view: QueueView, job: JobRecord) -> int:
    standing = view.standing(job)
    assert standing is not None
    return standing.position
