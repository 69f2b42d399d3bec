"""Pulls held open while a model's queues are empty: a job is delivered the moment it is stored.

An idle dispatcher used to wait for a queued notice (the gateway sends it after its publish is
acknowledged) and then pull the message: two more trips through NATS between the stream storing a
job and the scheduler holding it. Instead, while a batcher has a credit and the queues are empty,
a pull of one message waits on each priority's consumer (up to `HOLD_S`): the server hands the job
over as it stores it, before the gateway even has its acknowledgement. Whatever a queue gets next
reaches its held pull (a job, a redelivery after AckWait, a retry whose delay passed), so while
every priority's pull is held open the dispatcher does not poll; it asks the queues again when one
ends. A pull lasts HOLD_S rather than the poll interval: 3 requests per model every 10 s while idle,
not 12 a second (and no polls: another 12). Not longer: a scheduler whose host hangs (no connection
closed) may be handed a job per priority for as long as its pulls last, each back after AckWait.

A pull sent on a connection that was lost since may be gone with it (a server restarted) or still
there (the client alone reconnected; its inbox is subscribed again on the new connection, so what
it brings still arrives): `holding` says no for it, so queued notices ring again and the dispatcher
polls (the connection's callbacks wake it), and the pull is still seen to its end, its expiry or
its timeout. Every held pull is seen to its end (a message, or the server's 408 when it expires)
except at a stop (`close`: a stop cannot wait out a hold): a pull given up early leaves a message
the server was sending it at that moment with a listener that is gone, back in the queue after
AckWait, as with a scheduler killed at that moment. A drain
or a pause does not end them: a message may arrive when it can no longer run here (no credit left,
the model paused, the scheduler draining or stopping), and is put back at once (a nak). So is one
of a priority whose higher priorities are not all held open (their queues may hold jobs it must not
overtake: the held pull was opened when every queue was empty, possibly long before); the round
that then chooses asks those queues even if one found them empty lately.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

import structlog

from asyncinfer.failure_lines import FailureLines
from asyncinfer.jobs import PRIORITIES_BY_RANK, Priority
from asyncinfer.nats import Msg
from asyncinfer.nats.pull_inbox import PullEnd
from services.scheduler.work_queue import ModelQueues

log = structlog.get_logger("asyncinfer.scheduler.held_pulls")

Deliver = Callable[[Msg, Priority], Awaitable[None]]
# How long a pull is held open: a request per priority this often while idle. A scheduler whose
# host hangs (no connection closed) may be handed a job per priority meanwhile (back after AckWait):
# 10 s rather than the 30 s first measured (0.21 requests a second per model), a third of that window.
HOLD_S = 10.0
# How often an idle dispatcher looks at its held pulls' connection besides being told of a change
# (asyncinfer.nats.connection.ConnectionChanges; no request). It looked every second, a wake-up per
# model a second.
CONNECTION_CHECK_S = 10.0


class HeldPulls:
    def __init__(
        self, queues: ModelQueues, *, deliver: Deliver, failures: FailureLines, hold_s: float | None = None
    ) -> None:
        self._queues = queues
        self._failures = failures
        self._hold_s = HOLD_S if hold_s is None else hold_s
        self._deliver = deliver
        self._tasks: dict[Priority, asyncio.Task[None]] = {}
        # The priorities whose pull is out (not yet answered), by the connection it was sent on.
        self._out: dict[Priority, int] = {}
        self._closed = False
        # How the pulls held open when `close` began ended: interrupted, not waited out (lost, or
        # expired empty), as the stop's log line says (the scheduler's held_pulls_ended_at_stop).
        self.ended_at_close: Counter[PullEnd] = Counter()
        # Set when a held pull ends (whatever brought it to an end), cleared by `open`.
        self.one_ended = asyncio.Event()
        # Since the last `open`: whether every pull that ended expired with nothing, on the
        # connection it was sent on (see `only_expired`).
        self._only_expired = True

    def holding(self, priority: Priority) -> bool:
        """Whether a pull is held open on the priority's queue (a publish to it will be delivered)."""
        connection = self._queues.connection()
        return connection >= 0 and self._out.get(priority) == connection

    def holding_all(self) -> bool:
        return all(self.holding(priority) for priority in PRIORITIES_BY_RANK)

    def open(self) -> None:
        """Holds a pull open on every priority's queue that has none."""
        if self._closed:
            return
        self.one_ended.clear()
        self._only_expired = True
        for priority in PRIORITIES_BY_RANK:
            if priority not in self._tasks:
                self._out[priority] = self._queues.connection()
                self._tasks[priority] = asyncio.create_task(self._hold(priority), name=f"held-pull-{priority.value}")

    def only_expired(self) -> bool:
        """Whether the pulls that ended since `open` all expired with nothing on their connection:
        their queues had nothing for them (a job, a redelivery, a retry) while they were held, so a
        round would find nothing either: holding them again is all there is to do. A measurement
        pass (100 idle models) saw a round of no-wait pulls after each expiry, doubling the idle
        requests: 6 per model every 10 s rather than 3."""
        return self.one_ended.is_set() and self._only_expired

    async def settled(self) -> None:
        """Returns once no pull is held open, its messages delivered."""
        while self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def close(self) -> Counter[PullEnd]:
        """Ends the pulls held open now and opens no more; returns once what they brought is
        delivered (put back: the dispatcher is stopping), with how they ended (`ended_at_close`)."""
        self._closed = True
        await self._queues.interrupt_holds()
        await self.settled()
        return self.ended_at_close

    async def _hold(self, priority: Priority) -> None:
        try:
            try:
                msgs = await self._queues.hold(priority, self._hold_s)
            finally:
                sent_on = self._out.pop(priority, None)
                if self._closed:
                    self.ended_at_close[self._queues.hold_ended(priority)] += 1
            if msgs or not self._queues.hold_expired(priority) or sent_on != self._queues.connection():
                self._only_expired = False
            for msg in msgs:
                await self._deliver(msg, priority)
        except Exception as exc:  # a held pull is an optimisation: the poll finds what it missed
            self._only_expired = False
            self._failures.failed(log, "held_pull_failed", exc, model=self._queues.model_name, priority=priority.value)
        finally:
            del self._tasks[priority]
            self.one_ended.set()
