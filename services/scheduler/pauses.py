"""Which models' queues are paused: the `paused.<model>` keys of the queues bucket, watched so
that every scheduler stops and resumes dispatching within moments of an operator's call."""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from asyncinfer.contract import PAUSED_KEY_PREFIX as PAUSED_PREFIX
from asyncinfer.contract import paused_key
from asyncinfer.nats import KeyValue
from asyncinfer.queues import encode_pause
from asyncinfer.supervision import Supervisor, cancel_and_wait

log = structlog.get_logger("asyncinfer.scheduler.pauses")


class PauseState:
    def __init__(self, kv: KeyValue, supervisor: Supervisor) -> None:
        self._kv = kv
        self._supervisor = supervisor
        self._paused: set[str] = set()
        self._resumed: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None

    async def start(self) -> None:
        self._watcher = await self._kv.watch(f"{PAUSED_PREFIX}*")
        self._task = self._supervisor.start("scheduler-pauses", self._follow(self._watcher))

    async def stop(self) -> None:
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()  # type: ignore[no-untyped-call]
        if self._task is not None:
            await cancel_and_wait([self._task])

    def is_paused(self, model_name: str) -> bool:
        return model_name in self._paused

    def resumed(self, model_name: str) -> asyncio.Event:
        """Set while the model is not paused."""
        event = self._resumed.get(model_name)
        if event is None:
            event = self._resumed[model_name] = asyncio.Event()
            if model_name not in self._paused:
                event.set()
        return event

    async def pause(self, model_name: str, *, by: str) -> None:
        value = encode_pause(paused_at=time.time(), by=by)
        await self._kv.put(paused_key(model_name), value)
        self._set(model_name, paused=True)

    async def resume(self, model_name: str) -> None:
        await self._kv.delete(paused_key(model_name))
        self._set(model_name, paused=False)

    def _set(self, model_name: str, *, paused: bool) -> None:
        event = self.resumed(model_name)
        if paused:
            if model_name not in self._paused:
                log.info("queue_paused", model=model_name)
            self._paused.add(model_name)
            event.clear()
        else:
            if model_name in self._paused:
                log.info("queue_resumed", model=model_name)
            self._paused.discard(model_name)
            event.set()

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is None:  # the end of the initial values
                continue
            model_name = entry.key.removeprefix(PAUSED_PREFIX)
            self._set(model_name, paused=entry.operation not in ("DEL", "PURGE"))
