"""Running service apps until a signal: start in order, stop in reverse order, always.

An app is anything with `async start()`, `async stop(grace_s)` and a `port` (the services' XxxApp
classes). Stopping is ordered and bounded: the first SIGINT/SIGTERM stops intake and drains within
the grace period; a second one is ignored while that runs (the bounded grace ends it anyway).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import structlog

log = structlog.get_logger("asyncinfer.runner")


class App(Protocol):
    port: int

    async def start(self) -> None: ...

    async def stop(self, grace_s: float = 5.0) -> None: ...


class StopSignal:
    """An event set by SIGINT or SIGTERM (or by `set()`, for tests and embedding)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._installed: list[signal.Signals] = []

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._installed.append(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self.event.is_set():
            log.info("stopping", signal=sig.name)
        self.event.set()

    def set(self) -> None:
        self.event.set()

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.remove_signal_handler(sig)
        self._installed.clear()

    async def wait(self) -> None:
        await self.event.wait()


async def run_until_stopped(
    starters: Sequence[Callable[[], Awaitable[App]]],
    *,
    grace_s: float,
    on_started: Callable[[Sequence[App]], None] | None = None,
    stop: StopSignal | None = None,
) -> None:
    """Starts each app in order (a starter may use what earlier ones bound, e.g. their ports),
    waits for a stop signal, then stops the started ones in reverse order."""
    stop = stop or StopSignal()
    stop.install()
    started: list[App] = []
    try:
        for starter in starters:
            started.append(await starter())
        if on_started is not None:
            on_started(started)
        await stop.wait()
    finally:
        for app in reversed(started):
            try:
                await app.stop(grace_s)
            except Exception:
                log.exception("stop_failed", app=type(app).__name__)
        stop.uninstall()
