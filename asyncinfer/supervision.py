"""One owner for a process's background loops (dispatchers, feeds, sweepers, reconnectors).

A `Supervisor` starts named loops as tasks and is the one place that notices when one of them
raises: a loop that dies would otherwise stay dead, silently, until shutdown. It logs the death at
once (with the loop's name and traceback) and tells whoever listens (`on_failure`): the runner
then stops the process with a failure exit code (asyncinfer.runner).

Stopping is ordered and bounded: `stop()` cancels the loops still running in the reverse order of
their start and waits for each, within one deadline for all. Components usually end their own
loops gracefully first (set a flag, let the current round finish); `stop()` is the backstop that
guarantees no task outlives its owner. An owner calls `begin_stop()` when its shutdown begins: a
loop that raises from then on (its connection drained under it, say) is logged, not a failure. A
loop that returns on its own has simply finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger("asyncinfer.supervision")

STOP_TIMEOUT_S = 5.0
# How long a stop waits on a cancelled loop before cancelling it again.
RECANCEL_S = 0.1


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], *, timeout_s: float = STOP_TIMEOUT_S
) -> set[asyncio.Task[Any]]:
    """Cancels the tasks and waits for them to end, within timeout_s in all; those still running
    then (a task that ignores cancellation) are returned, not awaited.

    A cancellation can be lost: Python 3.11's asyncio.wait_for swallows it when the future it
    waits on completes at the same moment (gh-86296; every nats-py request waits so), and a loop
    then goes on as if nothing happened, so a plain `cancel(); await task` can wait for ever (CI
    once hung 120 s stopping the blob sweeper, which makes several requests every 50 ms in tests).
    So each task still running is cancelled again every RECANCEL_S. The exceptions of those that
    ended are retrieved, not raised: a task being stopped has nothing left to say."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        left_s = deadline - loop.time()
        if left_s <= 0:
            break
        _done, pending = await asyncio.wait(pending, timeout=min(left_s, RECANCEL_S))
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()
    return pending


def end_if_cancelled() -> None:
    """Raises CancelledError in the current task if it was cancelled and goes on anyway: a loop
    calls it between rounds. Python 3.11's asyncio.wait_for loses a cancellation that meets its
    future's completion (gh-86296; every nats-py request waits so), and the loop then ran its next
    round until the stop cancelled it again (RECANCEL_S later, stopping a scheduler took 0.1 s
    more). The cancellation is still counted on the task (Task.cancelling: asyncio.timeout and
    TaskGroup take back the ones they consume), so it is not lost for good."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def outcome_seen(task: asyncio.Task[Any]) -> None:
    """A done-callback for a shielded task whose caller may have left: its outcome is read by the
    caller when it waits, and here when it does not (asyncio logs "Task exception was never
    retrieved" with a traceback at error level for each one otherwise: ~170 a minute from the
    gateway's submits whose callers' deadlines passed while NATS elected a leader)."""
    if not task.cancelled():
        task.exception()


def failure_logged(task: asyncio.Task[Any]) -> None:
    """A done-callback for a task its owner awaits only at its end (with gather's
    return_exceptions, which would swallow it): a failure is said at once, with its traceback."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("background_task_failed", task=task.get_name(), exc_info=error)


@dataclass(frozen=True, slots=True)
class LoopDied:
    """A supervised loop raised."""

    owner: str  # the supervisor's name (the service)
    loop: str
    error: Exception

    def __str__(self) -> str:
        return f"{self.owner}: loop {self.loop!r} died: {type(self.error).__name__}: {self.error}"


FailureListener = Callable[[LoopDied], None]
# (reason, exit code): a component asks for its process to stop (asyncinfer.runner).
StopListener = Callable[[str, int], None]


class Supervisor:
    def __init__(self, owner: str, *, stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.owner = owner
        self._stop_timeout_s = stop_timeout_s
        self._running: dict[asyncio.Task[None], str] = {}  # insertion order: the order of start
        self._listeners: list[FailureListener] = []
        self._stop_listeners: list[StopListener] = []
        self._stop_request: tuple[str, int] | None = None
        self._failure: LoopDied | None = None
        self._failed = asyncio.Event()
        self._stopping = False

    @property
    def failure(self) -> LoopDied | None:
        """The first loop that died, if any."""
        return self._failure

    @property
    def stopping(self) -> bool:
        """The owner is shutting down (begin_stop): `start` refuses new loops."""
        return self._stopping

    @property
    def loop_names(self) -> list[str]:
        """The loops running now, in the order they started."""
        return list(self._running.values())

    def start(self, name: str, loop: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Runs `loop` as a task named `name`. The task never raises (a death is reported here),
        so its owner may await it to stop it gracefully."""
        if self._stopping:
            loop.close()
            raise RuntimeError(f"{self.owner}: cannot start {name!r}: the supervisor is stopping")
        task = asyncio.create_task(self._guard(name, loop), name=name)
        self._running[task] = name
        task.add_done_callback(self._running.pop)
        return task

    def on_failure(self, listener: FailureListener) -> None:
        """Calls `listener` when a loop dies (at once if one already has)."""
        self._listeners.append(listener)
        if self._failure is not None:
            listener(self._failure)

    def request_stop(self, reason: str, exit_code: int) -> None:
        """A component of the owner cannot go on and asks for the process to stop, exiting
        `exit_code` (the runner stops every app in order, as for a signal). The first one counts."""
        if self._stop_request is not None:
            return
        self._stop_request = (reason, exit_code)
        for listener in self._stop_listeners:
            listener(reason, exit_code)

    def on_stop_request(self, listener: StopListener) -> None:
        """Calls `listener` when a stop is requested (at once if one already was)."""
        self._stop_listeners.append(listener)
        if self._stop_request is not None:
            listener(*self._stop_request)

    async def wait_failed(self) -> LoopDied:
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    def begin_stop(self) -> None:
        """The owner is shutting down: no new loops; a loop that raises now is not a failure."""
        self._stopping = True

    async def stop(self) -> None:
        """Cancels the loops still running, last started first, and waits for them, within
        stop_timeout_s in all (a loop that ignores cancellation is logged and left). Idempotent."""
        self.begin_stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._stop_timeout_s
        for task, name in reversed(list(self._running.items())):
            if await cancel_and_wait([task], timeout_s=max(0.0, deadline - loop.time())):
                log.warning("loop_did_not_stop", owner=self.owner, loop=name, timeout_s=self._stop_timeout_s)

    async def _guard(self, name: str, loop: Coroutine[Any, Any, None]) -> None:
        try:
            await loop
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._stopping:
                # Torn down mid-way (its connection drained, say): nothing left to stop for.
                log.warning("loop_failed_while_stopping", owner=self.owner, loop=name, exc_info=exc)
                return
            log.error("loop_died", owner=self.owner, loop=name, exc_info=exc)
            if self._failure is None:
                self._failure = LoopDied(owner=self.owner, loop=name, error=exc)
                self._failed.set()
                for listener in list(self._listeners):
                    listener(self._failure)
