"""The timers of one model's computing batches (services/batcher/model_queue.py forms and starts
them): each item's execution timeout, counted from its batch's start, then the batch's overrun past
the longest of them (said once, with where its thread is), then, when a HungWatch is set, the
notice of a batch that hangs (batcher.exit_after_overrun_s).

One timer a batch at a time, re-armed by each firing and cancelled by the queue when the batch
returns; each firing finds its batch in the queue's table of computing batches (`running`) or,
the batch gone, does nothing.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from asyncinfer.log_throttle import RepeatedLines
from services.batcher.batch_compute import Computed, run_timed_out
from services.batcher.items import PendingItem

# The queue's logger: what these timers say (batch_timed_out, batch_overran) is said of its queue.
log = structlog.get_logger("asyncinfer.batcher.model_queue")

# A batch is overrunning this long past the longest execution timeout of its items, from its start.
OVERRUN_GRACE_S = 0.5
STACK_LINES = 12


@dataclass(slots=True)
class RunningBatch:
    """A batch computing: since when, until when its items may compute (its start plus the longest
    of their execution timeouts; None: one has none, a KServe call), and the thread computing it
    (for its stack, if it overruns)."""

    items: list[PendingItem]
    started_at: float
    deadline: float | None
    thread: int | None = None
    overran: bool = False
    timer: asyncio.TimerHandle | None = None
    # A remote backend's call (runs_async), cancelled once none of its items waits for it.
    call: asyncio.Future[Computed] | None = None


@dataclass(frozen=True, slots=True)
class HungBatch:
    """A batch still computing `past_timeout_s` past its items' longest execution timeout."""

    model: str
    items: int
    running_s: float
    past_timeout_s: float
    stack: str


@dataclass(frozen=True, slots=True)
class HungWatch:
    """Who is told (`on_hung`, once per batch) of a batch computing `after_s` past the longest
    execution timeout of its items: a model call that does not return (batcher.exit_after_overrun_s)."""

    after_s: float
    on_hung: Callable[[HungBatch], None]


class BatchTimeouts:
    """The timers of one model's computing batches. `running` is its queue's table of them (the
    queue adds a batch as it starts and removes it as it returns); `on_overran` is called when a
    batch has overrun (the queue decides whether the model is stuck)."""

    def __init__(
        self,
        model: str,
        running: dict[asyncio.Task[None], RunningBatch],
        hung: HungWatch | None,
        on_overran: Callable[[], None],
    ) -> None:
        self.model = model
        self._running = running
        self._hung = hung
        self._on_overran = on_overran
        # Once per interval (the rest at debug): a model that hangs times out every batch.
        self._timed_out_lines = RepeatedLines()

    def time_out_items(self, task: asyncio.Task[None], when: float) -> None:
        """Answers the batch's items whose execution timeouts, counted from its start, ended by
        `when` (TIMED_OUT: their scheduler records it; a model that reports progress is told, as
        of a cancel), then waits for the next item's, or for the
        overrun. Counted from the batch's start, not from the order's arrival: an item that waited
        behind a slow or hung batch has not used any of its timeout (it timed out with it before)."""
        running = self._running.get(task)
        if running is None:
            return
        loop = asyncio.get_running_loop()
        now = max(loop.time(), when)
        later: list[float] = []
        ended = 0
        for item in running.items:
            if item.run_timeout_s is None or item.future.done():
                continue
            ends = running.started_at + item.run_timeout_s
            if ends <= now:
                if item.progress is not None:
                    # It cannot leave its batch, but a model that reports progress reads
                    # `progress.cancelled(row)` and may stop; its order is forgotten once answered,
                    # so the scheduler's cancel that follows finds nothing to signal.
                    item.progress.cancel()
                item.future.set_exception(run_timed_out(item.run_timeout_s))
                ended += 1
            else:
                later.append(ends)
        if ended:
            self._timed_out_lines.say(
                log,
                "warning",
                "batch_timed_out",
                kind=self.model,
                model=self.model,
                items=ended,
                running_s=round(now - running.started_at, 1),
            )
        if later:
            next_at = min(later)
            running.timer = loop.call_at(next_at, self.time_out_items, task, next_at)
        elif running.deadline is not None:
            running.timer = loop.call_at(running.deadline + OVERRUN_GRACE_S, self._overran, task)
        else:
            running.timer = None

    def _overran(self, task: asyncio.Task[None]) -> None:
        """A batch still computing past the longest execution timeout of its items (each has timed
        out): a model call that hangs. Said once, with where its thread is."""
        running = self._running.get(task)
        if running is None:
            return
        running.overran = True
        loop = asyncio.get_running_loop()
        log.warning(
            "batch_overran",
            model=self.model,
            items=len(running.items),
            running_s=round(loop.time() - running.started_at, 1),
            past_deadline_s=round(loop.time() - (running.deadline or loop.time()), 1),
            stack=_stack_of(running.thread),
        )
        self._on_overran()
        if self._hung is not None and running.deadline is not None:
            running.timer = loop.call_at(running.deadline + self._hung.after_s, self._hung_long, task)

    def _hung_long(self, task: asyncio.Task[None]) -> None:
        running = self._running.get(task)
        if running is None or self._hung is None:
            return
        now = asyncio.get_running_loop().time()
        self._hung.on_hung(
            HungBatch(
                model=self.model,
                items=len(running.items),
                running_s=round(now - running.started_at, 1),
                past_timeout_s=round(now - (running.deadline or now), 1),
                stack=_stack_of(running.thread),
            )
        )


def on_its_thread(running: RunningBatch, compute: Callable[[list[PendingItem]], Computed]) -> Computed:
    """The batch's compute on the executor's thread, that thread noted (its stack is logged if the batch overruns)."""
    running.thread = threading.get_ident()
    return compute(running.items)


def _stack_of(thread: int | None) -> str:
    """Where the thread is now (its innermost STACK_LINES lines), for a batch that overran."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    if frame is None:
        return ""
    return "".join(traceback.format_stack(frame)[-STACK_LINES:])
