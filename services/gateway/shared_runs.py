"""Identical concurrent calls answered by one run that starts after each of them arrived.

After a gateway restart every label watch reconnects and lists its labels' jobs at once (ListJobs,
the SDK's catch-up): 200 watches of 4 runs' labels made 200 scans of the tenant's records, 65-140 ms
of the event loop each (session 30). Their answers differ only by when each listing read.

A call joins the run of its key that has not started yet, or makes one; a run starts once the
previous run of its key (if any) ended, so at most one runs per key and the next gathers every
call that arrives meanwhile. A run never starts before a call it answers arrived: what a caller
changed before calling (a job submitted, a watch opened) is in its answer, as if it had run alone;
a single flight that let a call join a run already under way would miss it.

A caller that leaves (cancelled, its deadline passed) leaves the run to the others; the last one to
leave cancels it (else a hung listing would hold up every later call of its key). The runs are
this object's tasks, awaited by `close`; memory is the runs in flight (`max_runs` at most: past it
a call runs alone), nothing is kept after a run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Runs in flight (each one key's, waiting or running): as many keys as concurrent distinct calls.
MAX_RUNS = 1000


class _Run(Generic[V]):
    __slots__ = ("answer", "callers", "task")

    def __init__(self, answer: asyncio.Future[V]) -> None:
        self.answer = answer
        self.callers = 0
        self.task: asyncio.Task[None] | None = None


class SharedRuns(Generic[K, V]):
    def __init__(self, *, max_runs: int = MAX_RUNS) -> None:
        self._max_runs = max_runs
        self._waiting: dict[K, _Run[V]] = {}  # not started: a call of its key joins it
        self._running: dict[K, asyncio.Task[None]] = {}  # started: a call of its key waits for the next
        self._runs: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def in_flight(self) -> int:
        return len(self._runs)

    async def run(self, key: K, make: Callable[[], Awaitable[V]]) -> V:
        """`make()`'s answer, from a run that starts after this call (shared with the identical calls
        that come before it starts). `make` must not depend on which of them made it."""
        run = self._waiting.get(key)
        if run is None:
            if self._closed or len(self._runs) >= self._max_runs:
                return await make()
            run = _Run[V](asyncio.get_running_loop().create_future())
            self._waiting[key] = run
            run.task = asyncio.create_task(self._start(key, run, make), name="shared-run")
            self._runs.add(run.task)
            run.task.add_done_callback(self._runs.discard)
        run.callers += 1
        try:
            # shield: a caller that leaves does not cancel the run the others wait for.
            return await asyncio.shield(run.answer)
        except asyncio.CancelledError:
            run.callers -= 1
            if not run.callers and not run.answer.done():
                # Nobody waits for it: a run under way would hold up the next one of its key (one
                # runs at a time), a hung one for ever.
                if self._waiting.get(key) is run:
                    del self._waiting[key]  # a call from now on makes a new run
                assert run.task is not None
                run.task.cancel()
            raise

    async def _start(self, key: K, run: _Run[V], make: Callable[[], Awaitable[V]]) -> None:
        previous = self._running.get(key)
        try:
            if previous is not None:
                await asyncio.wait([previous])  # its callers came before ours did; ours after it started
            else:
                await asyncio.sleep(0)  # the identical calls that came in the same turn of the loop
        except asyncio.CancelledError:
            if self._waiting.get(key) is run:
                del self._waiting[key]
            run.answer.cancel()
            raise
        # Started from here: a later call of the key waits for the next run.
        if self._waiting.get(key) is run:
            del self._waiting[key]
        this = asyncio.current_task()
        assert this is not None
        self._running[key] = this
        try:
            run.answer.set_result(await make())
        except asyncio.CancelledError:
            run.answer.cancel()
            raise
        except Exception as error:  # every caller gets it
            run.answer.set_exception(error)
            run.answer.exception()  # retrieved: when every caller left, asyncio need not log it
        finally:
            if self._running.get(key) is this:
                del self._running[key]

    async def close(self) -> None:
        """Cancels the runs in flight and waits for them; later calls run alone. Idempotent."""
        self._closed = True
        runs = list(self._runs)
        for task in runs:
            task.cancel()
        for task in runs:
            with contextlib.suppress(asyncio.CancelledError):
                await task
