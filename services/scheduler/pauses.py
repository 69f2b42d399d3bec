"""Which models' queues are paused: the `paused.<model>` keys of the queues bucket, watched so
that every scheduler stops and resumes dispatching within moments of an operator's call.

No queue is dispatched until the watch has delivered the stored keys (its initial values, which
nats-py ends with a None): a scheduler started while a queue is paused (a restart, a second
replica) would otherwise pull its jobs before it learnt the pause. A watch that has not delivered
them within STORED_KEYS_WAIT_S is logged and made again; dispatching waits meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from asyncinfer.contract import PAUSED_KEY_PREFIX as PAUSED_PREFIX
from asyncinfer.contract import paused_key
from asyncinfer.nats import KeyValue
from asyncinfer.nats.streams import declaration
from asyncinfer.queues import encode_pause
from asyncinfer.supervision import Supervisor, cancel_and_wait

log = structlog.get_logger("asyncinfer.scheduler.pauses")

# How long a watch has to deliver the stored keys (one round trip and a few messages, normally
# milliseconds) before it is logged and made again, and how long `start` waits for them.
STORED_KEYS_WAIT_S = 5.0
# After a watch could not be made (NATS away), before the next try.
WATCH_RETRY_S = 1.0


class PauseState:
    def __init__(self, kv: KeyValue, supervisor: Supervisor) -> None:
        self._kv = kv
        self._supervisor = supervisor
        self._paused: set[str] = set()
        self._resumed: dict[str, asyncio.Event] = {}
        # Set once the stored keys were read: until then every queue is held (`resumed` unset).
        self._known = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None

    async def start(self) -> None:
        """Starts the watch (a failure to make it raises, as NATS away at start-up does) and waits
        up to STORED_KEYS_WAIT_S for the stored keys, so that the first snapshots say the pauses;
        past that it goes on, every queue held until they come."""
        self._watcher = await declaration(  # a leader election may be under way, as for the declarations
            lambda _timeout_s: self._kv.watch(f"{PAUSED_PREFIX}*"), what="watch the pauses"
        )
        self._task = self._supervisor.start("scheduler-pauses", self._follow(self._watcher))
        known = asyncio.ensure_future(self._known.wait())
        try:  # past the wait, the watch's own line says what is missing (_follow)
            await asyncio.wait({known, self._task}, timeout=STORED_KEYS_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            known.cancel()

    async def stop(self) -> None:
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()  # type: ignore[no-untyped-call]
        if self._task is not None:
            await cancel_and_wait([self._task])

    @property
    def known(self) -> bool:
        """Whether the stored keys have been read (until then every queue is held)."""
        return self._known.is_set()

    def is_paused(self, model_name: str) -> bool:
        return model_name in self._paused

    def resumed(self, model_name: str) -> asyncio.Event:
        """Set while the model is known not to be paused."""
        event = self._resumed.get(model_name)
        if event is None:
            event = self._resumed[model_name] = asyncio.Event()
            if self._known.is_set() and model_name not in self._paused:
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
            if self._known.is_set():
                event.set()

    def _stored_keys_read(self) -> None:
        self._known.set()
        for model_name, event in self._resumed.items():
            if model_name not in self._paused:
                event.set()

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        while not (read := await self._read_stored_keys(watcher)):
            if read is None:
                return  # stopped
            log.warning(
                "pauses_not_read",
                waited_s=STORED_KEYS_WAIT_S,
                note="NATS has not sent the queues' paused keys: watching again; no queue is dispatched until it does",
            )
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]
            self._watcher = watcher = await self._watch_again()
        self._stored_keys_read()
        async for entry in watcher:
            if entry is not None:
                self._apply(entry)

    async def _read_stored_keys(self, watcher: KeyValue.KeyWatcher) -> bool | None:
        """Applies the watch's initial values: True once all came, False if they did not in time,
        None if the watch was stopped."""
        try:
            async with asyncio.timeout(STORED_KEYS_WAIT_S):
                async for entry in watcher:
                    if entry is None:  # the end of the initial values
                        return True
                    self._apply(entry)
        except TimeoutError:
            return False
        return None

    async def _watch_again(self) -> KeyValue.KeyWatcher:
        while True:
            try:
                return await self._kv.watch(f"{PAUSED_PREFIX}*")
            except Exception as exc:  # NATS away: dispatching waits, as it would for the pulls
                log.warning("pauses_watch_failed", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(WATCH_RETRY_S)

    def _apply(self, entry: KeyValue.Entry) -> None:
        model_name = entry.key.removeprefix(PAUSED_PREFIX)
        self._set(model_name, paused=entry.operation not in ("DEL", "PURGE"))
