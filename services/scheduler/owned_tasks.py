"""The scheduler's short-lived background work (a timed-out attempt's record write, a lost
batcher's jobs put back, a tenant counter update): owned, awaited on close, and noticed if it dies."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger("asyncinfer.scheduler.tasks")


class OwnedTasks:
    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=f"{self._name}-{getattr(coro, '__qualname__', 'task')}")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            # Each of these catches what it expects; anything else is a bug, said at once.
            log.error("background_task_failed", task=task.get_name(), exc_info=error)

    async def close(self) -> None:
        """Awaits the work still running (and what it spawns in turn)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
