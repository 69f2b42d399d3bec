"""Sends drain and undrain orders to every scheduler, and carries out those addressed to this one
(asyncinfer.drain_orders says why and what). An order's drain waits up to its timeout for the
jobs in flight, so each is carried out in a task of its own, owned here: the subscription's
callback returns at once, and an undrain that follows is not held behind a drain's wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection

import structlog

from asyncinfer.contract import DRAIN_SUBJECT
from asyncinfer.drain_orders import (
    DrainAction,
    DrainAnswer,
    DrainOrder,
    SchedulerOutcome,
    decode_answer,
    decode_order,
    encode_answer,
    encode_order,
    expected,
    outcomes,
)
from asyncinfer.errors import NotFound
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats import Client, Msg, Subscription

log = structlog.get_logger("asyncinfer.scheduler.cluster_drains")


class ClusterDrains:
    def __init__(
        self,
        nc: Client,
        *,
        name: str,
        drain: Callable[[float], Awaitable[int]],
        undrain: Callable[[], bool],
        is_draining: Callable[[], bool],
        reporting: Callable[[], Collection[str]],
    ) -> None:
        self._nc = nc
        self._name = name  # this scheduler's instance name, as its snapshots carry it
        self._drain = drain
        self._undrain = undrain
        self._is_draining = is_draining
        self._reporting = reporting  # the schedulers whose snapshots are fresh, this one included
        self._subscription: Subscription | None = None
        self._orders: set[asyncio.Task[None]] = set()  # carried out now

    async def start(self) -> None:
        self._subscription = await self._nc.subscribe(DRAIN_SUBJECT, cb=self._on_order)

    async def stop(self) -> None:
        """Stops hearing orders; an order being carried out is cancelled (the scheduler stops:
        its answer would say nothing that holds)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            with contextlib.suppress(*NATS_FAILURES):  # the connection may be gone: nothing to free
                await subscription.unsubscribe()
        for task in self._orders:
            task.cancel()
        await asyncio.gather(*self._orders, return_exceptions=True)

    async def send(self, order: DrainOrder) -> tuple[SchedulerOutcome, ...]:
        """Sends `order` to every scheduler and returns each addressed one's answer (none for one
        that did not answer within `order.answer_wait_s`). NotFound (SCHEDULER_NOT_FOUND) for a
        named scheduler that does not report."""
        reporting = {*self._reporting(), self._name}
        if order.scheduler and order.scheduler not in reporting:
            known = ", ".join(sorted(reporting))
            raise NotFound(
                f"no scheduler {order.scheduler!r} reports; the schedulers are: {known}",
                reason="SCHEDULER_NOT_FOUND",
                metadata={"scheduler": order.scheduler, "schedulers": known},
            )
        waiting_for = expected(order, reporting)
        answers: dict[str, DrainAnswer] = {}
        everyone = asyncio.Event()

        async def on_answer(msg: Msg) -> None:
            try:
                answer = decode_answer(msg.data)
            except ValueError as exc:
                log.error("drain_answer_unreadable", error=str(exc))
                return
            answers[answer.scheduler] = answer
            if waiting_for <= answers.keys():
                everyone.set()

        inbox = self._nc.new_inbox()
        subscription = await self._nc.subscribe(inbox, cb=on_answer)
        try:
            await self._nc.publish(DRAIN_SUBJECT, encode_order(order), reply=inbox)
            await self._nc.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(everyone.wait(), order.answer_wait_s)
        finally:
            with contextlib.suppress(*NATS_FAILURES):
                await subscription.unsubscribe()
        return outcomes(waiting_for, answers)

    async def _on_order(self, msg: Msg) -> None:
        try:
            order = decode_order(msg.data)
        except ValueError as exc:
            log.error("drain_order_unreadable", error=str(exc))
            return
        if not order.addresses(self._name):
            return
        task = asyncio.create_task(self._carry_out(order, msg.reply), name=f"drain-order-{order.action}")
        self._orders.add(task)
        task.add_done_callback(self._carried_out)

    def _carried_out(self, task: asyncio.Task[None]) -> None:
        self._orders.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("drain_order_failed", exc_info=error)

    async def _carry_out(self, order: DrainOrder, reply: str) -> None:
        was_draining = self._is_draining()
        log.info("drain_order", action=str(order.action), scheduler=self._name, addressed=order.scheduler or "all")
        if order.action is DrainAction.DRAIN:
            answer = DrainAnswer(
                scheduler=self._name, in_flight=await self._drain(order.timeout_s), was_draining=was_draining
            )
        else:
            answer = DrainAnswer(scheduler=self._name, was_draining=self._undrain())
        if not reply:
            return
        try:
            await self._nc.publish(reply, encode_answer(answer))
        except NATS_FAILURES as exc:  # the sender reports this scheduler as not answering
            log.warning("drain_answer_not_sent", error=str(exc))
