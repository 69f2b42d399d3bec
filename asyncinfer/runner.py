"""Running service apps until a signal: start in order, stop in reverse order, always.

An app is anything with `async start()`, `async stop(grace_s)`, a `port` and the `supervisor` that
owns its background loops (the services' XxxApp classes). Stopping is ordered and bounded: the
first SIGINT/SIGTERM stops intake and drains within the grace period; a second one is ignored while
that runs (the bounded grace ends it anyway). A background loop that dies stops the process the
same way, and the process exits with EXIT_LOOP_DIED: a service with a dead dispatcher or feed
looks alive but does nothing, so it is better restarted (by systemd, Kubernetes, compose). An
app may ask for the same stop with an exit code of its own (`Supervisor.request_stop`: a batcher
whose model call hangs exits EXIT_MODEL_HUNG). A
process the apps depend on that exits (the embedded nats-server of `asyncinfer up`) stops it the
same way, with EXIT_UNAVAILABLE (`StopSignal.abort`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import structlog

from asyncinfer.supervision import LoopDied, Supervisor

log = structlog.get_logger("asyncinfer.runner")

EXIT_STOPPED = 0
# sysexits.h's EX_SOFTWARE: an internal error, here a background loop that raised.
EXIT_LOOP_DIED = 70
# sysexits.h's EX_UNAVAILABLE: a process the apps need (the embedded nats-server) exited.
EXIT_UNAVAILABLE = 69
# sysexits.h's EX_TEMPFAIL: a batcher whose model call does not return stopped to be started afresh
# (batcher.exit_after_overrun_s).
EXIT_MODEL_HUNG = 75
# A second Ctrl-C while `up` stops: at once, as a shell's SIGINT exit (128 + 2).
EXIT_FORCED = 130


class App(Protocol):
    port: int
    supervisor: Supervisor

    async def start(self) -> None: ...

    async def stop(self, grace_s: float = 5.0) -> None: ...


class StopSignal:
    """An event set by SIGINT or SIGTERM, or by a loop that died (`fail`), or by a dependency that
    went away (`abort`), or by `set()` (for tests and embedding). `exit_code` is the process's."""

    def __init__(
        self,
        *,
        hangup: bool = False,
        on_force: Callable[[], None] | None = None,
        on_stopping: Callable[[], None] | None = None,
    ) -> None:
        """`hangup`: SIGHUP stops too (`asyncinfer up`, whose terminal may close; a batcher run
        alone with its file reloads on SIGHUP instead). `on_force`: a second SIGINT while stopping
        ends the process at once, after calling it (`up`: its nats-server told to stop); the first
        says so. Without it a second Ctrl-C was ignored while batches in flight had their grace.
        `on_stopping`: called once, after the line saying why the stop began (`up` quiets its
        terminal's info lines from there: logs.QuietStop)."""
        self._on_force = on_force
        self._on_stopping = on_stopping
        # When the stop began (time.monotonic()), None before: `up` says how long its stop took.
        self.began_at: float | None = None
        self.event = asyncio.Event()
        self.failure: LoopDied | None = None
        self.exit_code = EXIT_STOPPED
        self._installed: list[signal.Signals] = []
        self._signals = (signal.SIGINT, signal.SIGTERM, *((signal.SIGHUP,) if hangup else ()))

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._installed.append(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self.event.is_set():
            if self._on_force is not None:
                log.info(
                    "stopping", signal=sig.name, hint="batches in flight may finish first; Ctrl-C again stops at once"
                )
            else:
                log.info("stopping", signal=sig.name)
            self._begin()
        elif self._on_force is not None and sig is signal.SIGINT:
            self._on_force()
            log.warning("stopped_at_once", why="a second Ctrl-C", jobs_in_flight="run again once it starts again")
            sys.stderr.flush()
            os._exit(EXIT_FORCED)
        self.event.set()

    def set(self) -> None:
        self._begin()
        self.event.set()

    def fail(self, failure: LoopDied) -> None:
        if self.failure is None:
            self.failure = failure
            if self.exit_code == EXIT_STOPPED:  # not already stopping for an abort's reason
                self.exit_code = EXIT_LOOP_DIED
                log.error("stopping", reason=str(failure))
        self._begin()
        self.event.set()

    def abort(self, reason: str, *, exit_code: int = EXIT_UNAVAILABLE) -> None:
        """Stops for a reason outside the apps' loops (one error line); the first reason wins."""
        if self.exit_code == EXIT_STOPPED:
            self.exit_code = exit_code
            log.error("stopping", reason=reason)
        self._begin()
        self.event.set()

    def _begin(self) -> None:
        if self.began_at is None:
            self.began_at = time.monotonic()
            if self._on_stopping is not None:
                self._on_stopping()

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.remove_signal_handler(sig)
        self._installed.clear()

    async def wait(self) -> None:
        await self.event.wait()


async def _unless_stopped(starting: Awaitable[App], stop: StopSignal) -> App | None:
    """The started app, or None when the stop signal comes first: the start is cancelled (an app's
    start undoes what it began when cancelled), so a start-up that hangs (an unreachable
    dependency) still honours SIGTERM and SIGINT."""
    task = asyncio.ensure_future(starting)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopping), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        stopping.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled() and task.exception() is None:
        return task.result()  # it finished as it was cancelled: stopped with the others
    return None


async def run_until_stopped(
    starters: Sequence[Callable[[], Awaitable[App]]],
    *,
    grace_s: float,
    on_started: Callable[[Sequence[App]], None] | None = None,
    stop: StopSignal | None = None,
) -> int:
    """Starts each app in order (a starter may use what earlier ones bound, e.g. their ports),
    waits for a stop signal or a dead loop, then stops the started ones in reverse order. The
    process's exit code: EXIT_STOPPED after a signal, EXIT_LOOP_DIED after a dead loop, the
    abort's code after `stop.abort`."""
    stop = stop or StopSignal()
    stop.install()
    started: list[App] = []
    try:
        for starter in starters:
            app = await _unless_stopped(starter(), stop)
            if app is None:  # a signal came while it started: it undid its own start
                break
            started.append(app)
            app.supervisor.on_failure(stop.fail)
            app.supervisor.on_stop_request(lambda reason, code: stop.abort(reason, exit_code=code))
        if on_started is not None and not stop.event.is_set():  # no banner for a process already stopping
            on_started(started)
        await stop.wait()
    finally:
        for app in reversed(started):
            try:
                await app.stop(grace_s)
            except Exception:
                log.exception("stop_failed", app=type(app).__name__)
        stop.uninstall()
    return stop.exit_code
