"""One model's queue: intake (a slot per item, held until its future resolves), the batch
former (a task that picks the next batch by the order and closing rules in engine.py: its choice
is batch_picking.py's), and the batches in flight, each given to a BatchRunner (batch_compute.py)
and watched by their timers (batch_timeouts.py: execution timeouts, overrun, a hung batch).

An item's deadline is a timer only when it has one; an item that resolves while waiting
(dropped, expired) is purged by the former, not searched for in the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from asyncinfer.config import ModelConfig
from asyncinfer.errors import (
    AsyncInferError,
    DeadlineExceeded,
    InvalidArgument,
    ModelError,
    ResourceExhausted,
    Unavailable,
)
from asyncinfer.jobs import Priority
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.supervision import Supervisor
from asyncinfer.tensors import Tensor, validate_inputs
from asyncinfer.tracing import Tracing
from services.batcher.backends import UNREACHABLE_REASON, ModelBackend
from services.batcher.batch_compute import (
    MODEL_STUCK_REASON,
    SHUTDOWN_REASON,
    SHUTTING_DOWN,
    BatchRunner,
    Computed,
    RunTimedOut,
    fail,
)
from services.batcher.batch_picking import pick_batch
from services.batcher.batch_timeouts import BatchTimeouts, HungWatch, RunningBatch, on_its_thread
from services.batcher.fast_check import FastCheck
from services.batcher.items import InferOutcome, ItemShaper, PendingItem
from services.batcher.metrics import BatcherMetrics, ModelMetrics

log = structlog.get_logger("asyncinfer.batcher.model_queue")

SlotListener = Callable[[str], None]


def outcome_label(future: asyncio.Future[InferOutcome]) -> str:
    if future.cancelled():
        return "CANCELED"
    error = future.exception()
    if error is None:
        return "OK"
    if isinstance(error, ModelError):
        return "MODEL_ERROR"
    if isinstance(error, RunTimedOut):
        return "TIMED_OUT"
    if isinstance(error, DeadlineExceeded):
        return "EXPIRED"
    if isinstance(error, Unavailable):
        return "SHUTDOWN"
    return "ERROR"


class ModelQueue:
    """The queue, batch former and in-flight batches of one model."""

    def __init__(
        self,
        config: ModelConfig,
        backend: ModelBackend,
        metrics: BatcherMetrics | None,
        on_item_done: SlotListener,
        tracing: Tracing | None = None,
        hung: HungWatch | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.name = config.name
        self.held = 0  # items submitted and not yet resolved (waiting or computing)
        self._shaper = ItemShaper(config, backend)
        self._waiting: list[PendingItem] = []
        self._seq = itertools.count()
        self._metrics: ModelMetrics | None = metrics.for_model(config.name) if metrics is not None else None
        # The model's gauges read this version's queue until it has stopped and its last batch
        # has returned (an overrunning call on a retired version still counts).
        self._untrack: list[Callable[[], None]] = []
        if self._metrics is not None:
            # len() may count items resolved but not yet purged: exact enough for a gauge, and O(1).
            # A scrape reads these on the metrics server's thread while the loop changes the dict:
            # list() copies its values in one step under the GIL, where a generator over the view
            # could meet "dictionary changed size during iteration" and fail the scrape.
            self._untrack = [
                self._metrics.track_queue_depth(lambda: len(self._waiting)),
                self._metrics.track_overrun(
                    lambda: sum(1 for running in list(self._running.values()) if running.overran)
                ),
            ]
        self._intake_stopped = False
        self._input_names = tuple(spec.name for spec in backend.signature.inputs)
        self._fast_check = FastCheck(backend.signature, config.max_batch_size)
        self._on_item_done = on_item_done
        self._changed = asyncio.Event()
        self._slots = asyncio.Semaphore(config.max_inflight_batches)
        self._batches: dict[asyncio.Task[None], list[PendingItem]] = {}
        self._running: dict[asyncio.Task[None], RunningBatch] = {}
        self._timeouts = BatchTimeouts(self.name, self._running, hung, self._update_stuck)
        # A batch's lines, once per interval per kind (the rest at debug): a model that hangs has
        # every batch's call cancelled, and a bug past the call fails every batch.
        self._batch_lines = RepeatedLines()
        self._stuck = False
        self._former: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._delay_s = config.max_queue_delay_ms / 1000.0
        self._preferred = sorted(set(config.preferred_batch_sizes), reverse=True)
        self._runner = BatchRunner(config, backend, self._shaper, self._metrics, self._free_slot, tracing)
        backend.watch_reachable(self._reachable_changed)

    @property
    def depth(self) -> int:
        return sum(1 for item in self._waiting if not item.future.done())

    @property
    def free_slots(self) -> int:
        # A stuck model takes no work (no credits): the scheduler's jobs wait in the queue, or go
        # to a batcher whose model answers, rather than time out here one after another.
        return max(self.config.max_queue_size - self.places_taken, 0) if self.takes_work else 0

    @property
    def takes_work(self) -> bool:
        """Neither stuck nor its remote server out of reach (the backend's `reachable`)."""
        return not self._stuck and self.backend.reachable

    @property
    def places_taken(self) -> int:
        """Queue places in use: the items held (waiting or computing), and while every slot computes
        a call none of whose items waits for it any more (all timed out or cancelled), those calls'
        items too. Their places come back when a call returns, not as its items time out: until
        then the model can run nothing, and what was sent on them waited for the overrun (0.5 s
        later) to be given back. With a slot that can still run work, they are free."""
        abandoned = [
            running
            for task, running in self._running.items()
            if task in self._batches and all(item.future.done() for item in running.items)
        ]
        if len(abandoned) < self.config.max_inflight_batches:
            return self.held
        return self.held + sum(len(running.items) for running in abandoned)

    @property
    def stuck(self) -> bool:
        """Every in-flight batch has run past its items' execution deadlines."""
        return self._stuck

    def start(self, executor: ThreadPoolExecutor, supervisor: Supervisor) -> None:
        self._executor = executor
        self._former = supervisor.start(f"batcher-{self.name}", self._form_batches())

    def submit(
        self,
        inputs: Sequence[Tensor],
        timeout_s: float | None,
        priority: Priority,
        *,
        credited: bool = False,
        expires_at: float | None = None,
    ) -> PendingItem:
        """Queues one item; it expires timeout_s from now, or at `expires_at` (loop time) when
        given: the parts of one chunk share the chunk's expiry, so none of them sorts after the
        parts of a chunk that came later."""
        # `credited`: a work order the scheduler sent on a credit this batcher granted (a slot
        # promised), or a part of a chunk's order (its parts were bought with one credit). Either
        # may pass the limit, which then holds back further credits until they are done; refused,
        # a plain order sent on a credit granted before a chunk filled the queue was failed and
        # spent the job's attempt. The limit refuses KServe ModelInfer calls, which come uncredited.
        if self._stuck:
            # Given back (a credited order is answered dropped, its attempt refunded).
            raise self._stuck_error()
        if not self.backend.reachable:
            raise self._unreachable_error()  # given back as well
        if self.places_taken >= self.config.max_queue_size and not credited:
            raise ResourceExhausted(
                f"model {self.name!r} is at its queue limit ({self.config.max_queue_size} items)",
                reason="BATCHER_QUEUE_FULL",
                retry_after_s=max(self._delay_s, 0.05),
            )
        loop = asyncio.get_running_loop()
        now = loop.time()
        if len(inputs) == 1:
            ordered = {inputs[0].name: inputs[0]}
        else:
            by_name = {t.name: t for t in inputs}
            ordered = {name: by_name[name] for name in self._input_names}
        future: asyncio.Future[InferOutcome] = loop.create_future()
        if expires_at is None and timeout_s is not None:
            expires_at = now + timeout_s
        item = PendingItem(
            ordered, future, submitted_at=now, expires_at=expires_at, priority=priority, seq=next(self._seq)
        )
        try:
            self._shaper.shape(item)
        except AsyncInferError:
            raise
        except Exception as exc:
            raise InvalidArgument(f"model {self.name!r} cannot size these inputs: {type(exc).__name__}: {exc}") from exc
        if expires_at is not None:
            item.timer = loop.call_at(expires_at, _expire, item)
        self.held += 1
        future.add_done_callback(lambda _f: self._item_done(item))
        self._waiting.append(item)
        self._changed.set()
        return item

    def _item_done(self, item: PendingItem) -> None:
        self.held -= 1
        if item.timer is not None:
            item.timer.cancel()
        outcome = outcome_label(item.future)  # also marks an error retrieved when nobody awaits it
        if self._metrics is not None and outcome != "OK":  # OK items are counted per batch
            self._metrics.count_items(outcome)
        if not item.started:
            # A dropped item leaves a stale entry in the queue; let the former purge it.
            self._changed.set()
        elif self.backend.runs_async:
            self._cancel_unwaited_call(item)
        self._on_item_done(self.name)

    def _cancel_unwaited_call(self, item: PendingItem) -> None:
        """Cancels a remote call none of whose items waits for it any more (each timed out, or its
        caller cancelled): unlike a model's thread it can be stopped, and gRPC's cancel reaches
        Triton. It went on to the model's default_execution_timeout_s, Triton computing for nobody
        and the slot taken; past the overrun the model was stuck here."""
        for running in self._running.values():
            call = running.call
            if call is None or call.done() or item not in running.items:
                continue
            if all(other.future.done() for other in running.items):
                self._batch_lines.say(
                    log,
                    "info",
                    "batch_call_cancelled",
                    kind="cancelled",
                    model=self.name,
                    items=len(running.items),
                    reason="no item waits for it",
                )
                call.cancel()
            return

    def check(self, inputs: Sequence[Tensor], *, any_rows: bool = False) -> None:
        """InvalidArgument unless the inputs fit the model's signature (with any number of rows
        for a batch's chunk)."""
        if not any_rows and self._fast_check(inputs):
            return
        max_rows = 0 if any_rows else self.config.max_batch_size
        violations = validate_inputs(inputs, self.backend.signature, max_batch_size=max_rows)
        if violations:
            first = violations[0]
            raise InvalidArgument(f"invalid inputs: {first.field}: {first.description}", violations)

    # --- forming batches -------------------------------------------------------------------

    async def _form_batches(self) -> None:
        loop = asyncio.get_running_loop()
        runner = self._runner
        while True:
            await self._slots.acquire()
            try:
                batch = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            for item in batch:
                item.started = True
            # The compute is handed to its thread here, in this step, not in the task's first
            # one: that would run only after every callback already queued (answers of the
            # batch that just finished, each a gRPC send), leaving the model idle meanwhile.
            now = loop.time()
            timeouts = [item.run_timeout_s for item in batch]
            known = [t for t in timeouts if t is not None]
            longest = None if len(known) < len(timeouts) else max(known)
            running = RunningBatch(batch, now, None if longest is None else now + longest)
            # The thread runs in a copy of this task's context, as asyncio.to_thread's do: what the
            # model's call logs (model_raised) names the service (`up` binds it per service), which
            # run_in_executor alone left out. A copy per batch: one context cannot be entered by
            # two threads at once.
            computing: asyncio.Future[Computed] = (
                asyncio.ensure_future(runner.compute_async(batch, now))
                if self.backend.runs_async
                else loop.run_in_executor(
                    self._executor, contextvars.copy_context().run, on_its_thread, running, runner.compute
                )
            )
            if self.backend.runs_async:
                running.call = computing
            task = asyncio.create_task(runner.run(batch, computing, loop.time()), name=f"batch-{self.name}")
            self._batches[task] = batch
            self._running[task] = running
            if known:
                # One timer a batch, as before: first at its items' earliest timeout, then (when
                # they have all timed out) at the overrun; cancelled when the batch returns.
                first = now + min(known)
                running.timer = loop.call_at(first, self._timeouts.time_out_items, task, first)
            task.add_done_callback(functools.partial(self._batch_done, batch))

    def _batch_done(self, batch: list[PendingItem], task: asyncio.Task[None]) -> None:
        self._free_slot(task)  # freed already when the run got past the model's call
        running = self._running.pop(task, None)
        if self._intake_stopped:
            self._untrack_when_idle()
        if running is not None:
            if running.timer is not None:
                running.timer.cancel()
            if running.overran:
                log.warning(
                    "batch_overrun_ended",
                    model=self.name,
                    items=len(batch),
                    running_s=round(asyncio.get_running_loop().time() - running.started_at, 1),
                )
                self._update_stuck()
        if task.cancelled() or (error := task.exception()) is None:
            return
        # A bug past the model's call (answering, metrics, tracing): every item still gets an
        # answer, or its caller would wait out its execution timeout with nothing logged.
        self._batch_lines.say(
            log,
            "error",
            "batch_run_failed",
            kind=type(error).__name__,
            model=self.name,
            items=len(batch),
            exc_info=error,
        )
        fail(batch, ModelError(f"the batcher failed to answer the batch: {type(error).__name__}: {error}"))

    def _free_slot(self, task: asyncio.Task[None]) -> None:
        if self._batches.pop(task, None) is not None:
            self._slots.release()
            self._changed.set()  # the model may be idle now: a waiting batch can start at once
            running = self._running.get(task)
            if running is not None and all(item.future.done() for item in running.items):
                self._on_item_done(self.name)  # the places its items kept (places_taken) are free

    def _update_stuck(self) -> None:
        """The model is stuck while every in-flight batch has overrun: its waiting items are given
        back and it takes no work (no credits, no calls) until one of them returns. Before, the
        scheduler kept sending it work that timed out here, never started, with nothing logged."""
        overran = sum(1 for running in self._running.values() if running.overran)
        stuck = overran >= self.config.max_inflight_batches
        if stuck == self._stuck:
            return
        self._stuck = stuck
        if stuck:
            log.error(
                "model_stuck",
                model=self.name,
                waiting=self.depth,
                hint="its model call has not returned past its jobs' execution timeouts; it takes no work until it "
                "does, and what waits goes back to the queue (see batch_overran for where it is)",
            )
            fail(self._waiting, self._stuck_error())
        else:
            log.warning("model_unstuck", model=self.name)
        self._changed.set()
        self._on_item_done(self.name)  # credits follow free_slots

    def _reachable_changed(self, reachable: bool) -> None:
        """A remote backend's server went out of reach, or answers again. Out of reach, the model
        takes no work (no credits, orders refused) and what waits is handed back: each item would
        meet the outage, and a work order's attempt was spent on it (TRITON_UNAVAILABLE after the
        outage wait), so a Triton restarting for two minutes could dead-letter jobs. The batches
        computing wait the outage out (triton_backend.py), then are handed back too."""
        if not reachable:
            waiting = [item for item in self._waiting if not item.future.done()]
            if waiting:
                log.info("model_unreachable_items_handed_back", model=self.name, items=len(waiting))
            fail(waiting, self._unreachable_error())
        self._changed.set()
        self._on_item_done(self.name)  # credits follow free_slots

    def _unreachable_error(self) -> Unavailable:
        return Unavailable(
            f"model {self.name!r}: its Triton server is out of reach; it takes work again once it answers",
            reason=UNREACHABLE_REASON,
        )

    def _stuck_error(self) -> Unavailable:
        return Unavailable(
            f"model {self.name!r} is stuck: its batches have run past their execution timeouts",
            reason=MODEL_STUCK_REASON,
        )

    async def _next_batch(self) -> list[PendingItem]:
        loop = asyncio.get_running_loop()
        while True:
            self._purge()
            if not self._waiting:
                self._changed.clear()
                await self._changed.wait()
                continue
            batch, close_now = pick_batch(self._waiting, self.config, self._preferred)
            wait_s = min(item.submitted_at for item in batch) + self._delay_s - loop.time()
            if close_now or wait_s <= 0 or not self._batches:
                started = {id(item) for item in batch}
                self._waiting = [item for item in self._waiting if id(item) not in started]
                return batch
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._changed.wait()

    def _purge(self) -> None:
        """Removes items that resolved while waiting (dropped, expired, failed)."""
        if any(item.future.done() for item in self._waiting):
            self._waiting = [item for item in self._waiting if not item.future.done()]

    # --- stopping --------------------------------------------------------------------------

    async def stop_intake(self, error: AsyncInferError | None = None) -> None:
        """Stops forming batches and fails every item still waiting (with `error`; by default,
        the batcher is shutting down)."""
        if self._former is not None:
            self._former.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._former
        fail(list(self._waiting), error or Unavailable(SHUTTING_DOWN, reason=SHUTDOWN_REASON))
        self._waiting.clear()
        self._intake_stopped = True
        self._untrack_when_idle()

    async def end_grace(self, error: AsyncInferError) -> int:
        """A retired version's grace has ended: it takes no more items (`intake_stopped`), and
        what waits is failed with `error`, but for the waiting parts of a chunk under way (one of
        its parts has started) that has its own deadline (its job's execution timeout, `ends_by`,
        at which the chunk is answered TIMED_OUT and its parts not started dropped): they go on
        forming batches here until the chunk ends, as its computing parts do. Failed, they failed
        the chunk, whose order was handed back and computed whole again on the version serving now,
        its parts already computed here thrown away; a chunk's result is one version's, so those
        could not be kept with the rest computed there. How many items were failed."""
        kept = [item for item in self._waiting if not item.future.done() and _chunk_under_way(item)]
        if not kept:
            waiting = self.depth
            await self.stop_intake(error)
            return waiting
        kept_ids = {id(item) for item in kept}
        failed = [item for item in self._waiting if not item.future.done() and id(item) not in kept_ids]
        fail(failed, error)
        self._waiting = kept
        self._intake_stopped = True
        self._changed.set()
        return len(failed)

    def _untrack_when_idle(self) -> None:
        if self._running:
            return
        for untrack in self._untrack:
            untrack()
        self._untrack = []

    def running_batches(self) -> list[asyncio.Task[None]]:
        return list(self._batches)

    @property
    def intake_stopped(self) -> bool:
        """It takes no more items (stop_intake, end_grace): an item given to it would not run."""
        return self._intake_stopped

    def computing_deadline(self) -> float | None:
        """The latest own deadline (own_deadline) of the unanswered items its batches compute, and
        of the chunks' parts that wait to (end_grace kept them); None when none is computing,
        math.inf when one has no deadline of its own."""
        ends = [
            own_deadline(item, running.started_at)
            for running in self._running.values()
            for item in running.items
            if not item.future.done()
        ]
        if self._intake_stopped:
            ends += [item.ends_by for item in self._waiting if not item.future.done()]
        if not ends:
            return None
        return max(math.inf if end is None else end for end in ends)

    def abandon_computing(self, error: AsyncInferError, *, ended_before: float) -> int:
        """Fails with `error` the unanswered items its batches compute that have no deadline of
        their own, or whose deadline (own_deadline) was before `ended_before`; the batches go on
        for the others (a remote call none of whose items waits any more is cancelled). How many
        were failed."""
        failed = 0
        for running in self._running.values():
            for item in running.items:
                if item.future.done():
                    continue
                end = own_deadline(item, running.started_at)
                if end is None or end < ended_before:
                    item.future.set_exception(error)
                    failed += 1
        return failed

    def abandon_batches(self, error: AsyncInferError) -> list[asyncio.Task[None]]:
        """Fails the unanswered items of every batch computing with `error` and cancels the
        batches' tasks (a remote call with them; a model's thread goes on, its answer dropped):
        the tasks, for the caller to await."""
        tasks = list(self._batches)
        for task in tasks:
            fail(self._batches[task], error)
            task.cancel()
        return tasks

    def overrun_batches(self) -> list[asyncio.Task[None]]:
        """The batches computing past every one of their items' execution timeouts (batch_overran)."""
        return [task for task, running in self._running.items() if running.overran and task in self._batches]


def own_deadline(item: PendingItem, started_at: float) -> float | None:
    """When a computing item (its batch started at `started_at`) ends by its own limits, in loop
    time: its job's execution deadline (run_timeout_s from its batch's start, or its `ends_by`),
    at which the engine answers it TIMED_OUT; else its caller's deadline (`expires_at`: a KServe
    call's gRPC deadline, which cancels the call); None when it has neither (a KServe call without
    a deadline waits for its model's call for good)."""
    ends: list[float] = []
    if item.ends_by is not None:
        ends.append(item.ends_by)
    if item.run_timeout_s is not None:
        ends.append(started_at + item.run_timeout_s)
    return min(ends) if ends else item.expires_at


def _chunk_under_way(item: PendingItem) -> bool:
    """Whether the item is a part of a chunk with a deadline of its own, one of whose parts started."""
    parts = item.chunk_parts
    return item.ends_by is not None and parts is not None and any(part.started for part in parts)


def _expire(item: PendingItem) -> None:
    if not item.started and not item.future.done():
        item.future.set_exception(DeadlineExceeded("the item's deadline passed before it ran"))
