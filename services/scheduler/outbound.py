"""A batcher session's outbound messages: in order, except that a work order overtakes the work
orders of lower priority queued before it and not yet written.

A file batch's chunk orders carry their rows (megabytes each, when the scheduler moves the bytes),
and the Connect stream writes one message at a time: an interactive job's order queued behind a
window of chunk orders waited for all of them to be written (a quarter of a second at a batch's
start on 2 cores). Now it waits for the message being written at most.

Only work orders move, and only past work orders: a cancel, a model control and the stream's end
keep their place (nothing overtakes them and they overtake nothing), so a cancel is never written
before the order it cancels, and a control never before the orders sent ahead of it.
"""

from __future__ import annotations

import asyncio
from collections import deque

from asyncinfer.jobs import PRIORITIES_BY_RANK, Priority
from services.scheduler.messages import CancelOrder, ModelControlOrder, WorkOrder

Outbound = WorkOrder | CancelOrder | ModelControlOrder | None

_RANK = {priority: rank for rank, priority in enumerate(PRIORITIES_BY_RANK)}


class OutboundQueue:
    """What asyncio.Queue offers the Connect stream (put_nowait, get, get_nowait, empty, qsize),
    with the overtaking above."""

    def __init__(self) -> None:
        self._items: deque[Outbound] = deque()
        self._orders_by_priority = dict.fromkeys(PRIORITIES_BY_RANK, 0)
        self._waiter: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, message: Outbound) -> None:
        self._items.append(message)
        if isinstance(message, WorkOrder):
            self._orders_by_priority[message.priority] += 1
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Outbound:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    def get_nowait(self) -> Outbound:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._take()

    def _take(self) -> Outbound:
        first = self._items[0]
        if not isinstance(first, WorkOrder) or not self._higher_than(first.priority):
            self._items.popleft()
            if isinstance(first, WorkOrder):
                self._orders_by_priority[first.priority] -= 1
            return first
        # The best order in the run of work orders at the head (the first of its priority).
        best_index, best = 0, first
        for index, message in enumerate(self._items):
            if not isinstance(message, WorkOrder):
                break
            if _RANK[message.priority] < _RANK[best.priority]:
                best_index, best = index, message
        del self._items[best_index]
        self._orders_by_priority[best.priority] -= 1
        return best

    def _higher_than(self, priority: Priority) -> bool:
        """Whether any queued work order has a higher priority than `priority`."""
        return any(self._orders_by_priority[p] for p in PRIORITIES_BY_RANK[: _RANK[priority]])
