"""A watcher's queue that keeps only the newest update of each job.

A watcher that reads slowly (or not at all) must not make the gateway hold every copy of every
record written meanwhile: each update the hub queues replaces a waiting one for the same key and
kind (its type: a record change does not replace an update of another kind), and moves to the back,
so the queue holds at most one update per (kind, key) and a slow watcher reads the latest record,
not every revision in between. The close marker (None) is kept apart and read after what is
waiting. The interface is asyncio.Queue's, as much of it as the hub and its watches use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Keyed(Protocol):
    @property
    def key(self) -> str: ...


T = TypeVar("T", bound=Keyed)


class LatestQueue(Generic[T]):
    def __init__(self) -> None:
        self._waiting: dict[tuple[type, str], T] = {}
        self._closed = False
        self._readable = asyncio.Event()

    def put_nowait(self, item: T | None, *, keeps: Callable[[T, T], bool] | None = None) -> None:
        """Queue the item in place of the one waiting in its slot, unless `keeps(waiting, item)`
        says the waiting one is to stay (it is newer: updates that come by different paths, such
        as progress notices, can arrive out of their order)."""
        if item is None:
            self._closed = True
        else:
            slot = (type(item), item.key)
            waiting = self._waiting.get(slot)
            if waiting is not None and keeps is not None and keeps(waiting, item):
                return
            self._waiting.pop(slot, None)  # the newest goes to the back
            self._waiting[slot] = item
        self._readable.set()

    def empty(self) -> bool:
        return not self._waiting and not self._closed

    def qsize(self) -> int:
        return len(self._waiting) + self._closed

    def get_nowait(self) -> T | None:
        """The oldest waiting update, then None once closed; QueueEmpty when there is neither."""
        if self._waiting:
            slot = next(iter(self._waiting))
            item = self._waiting.pop(slot)
        elif self._closed:
            item = None  # stays readable: every later get sees the close too
        else:
            raise asyncio.QueueEmpty
        if self.empty():
            self._readable.clear()
        return item

    async def get(self) -> T | None:
        while self.empty():
            await self._readable.wait()
        return self.get_nowait()
