"""Pulls held open while a model's queues are empty: a job is delivered the moment it is stored.

An idle dispatcher used to wait for a queued notice (the gateway sends it after its publish is
acknowledged) and then pull the message: two more trips through NATS between the stream storing a
job and the scheduler holding it. Instead, while a batcher has a credit and the queues are empty,
a pull of one message waits on each priority's consumer (up to `hold_s`, the poll interval): the
server hands the job over as it stores it, before the gateway even has its acknowledgement.

Every held pull is seen to its end (a message, or the server's 408 when it expires): a pull given
up early would leave its message with a listener that is gone, back in the queue only after
AckWait. So a message may arrive when it can no longer run here (no credit left, the model paused,
the scheduler draining or stopping): it is put back at once (a nak), which is also what keeps
priorities in order when jobs of two priorities arrive together for one credit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from asyncinfer.jobs import PRIORITIES_BY_RANK, Priority
from asyncinfer.nats import Msg
from services.scheduler.work_queue import ModelQueues

log = structlog.get_logger("asyncinfer.scheduler.held_pulls")

Deliver = Callable[[Msg, Priority], Awaitable[None]]


class HeldPulls:
    def __init__(self, queues: ModelQueues, *, hold_s: float, deliver: Deliver) -> None:
        self._queues = queues
        self._hold_s = hold_s
        self._deliver = deliver
        self._tasks: dict[Priority, asyncio.Task[None]] = {}

    def holding(self, priority: Priority) -> bool:
        """Whether a pull is held open on the priority's queue (a publish to it will be delivered)."""
        return priority in self._tasks

    def open(self) -> None:
        """Holds a pull open on every priority's queue that has none."""
        for priority in PRIORITIES_BY_RANK:
            if priority not in self._tasks:
                self._tasks[priority] = asyncio.create_task(self._hold(priority), name=f"held-pull-{priority.value}")

    async def settled(self) -> None:
        """Returns once no pull is held open (each ends within hold_s), its messages delivered."""
        while self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _hold(self, priority: Priority) -> None:
        try:
            for msg in await self._queues.hold(priority, self._hold_s):
                await self._deliver(msg, priority)
        except Exception:  # a held pull is an optimisation: the poll finds what it missed
            log.exception("held_pull_failed", model=self._queues.model_name, priority=priority.value)
        finally:
            del self._tasks[priority]
