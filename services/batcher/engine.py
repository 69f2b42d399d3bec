"""The dynamic-batching engine: per model, a bounded queue of items that are packed into batches,
computed in worker threads (or awaited, for remote backends), and split back per item.

Order: higher priority first, then the earliest deadline, then arrival. The best item's group
(see items.py: shapes, length buckets) forms the batch; items of other groups wait for a batch
of their own, they never fail for that reason. A batch holds at most `max_batch_size` rows and,
when set, `max_batch_cost` cost units (rows, tokens, or a model's cost function); an item that
would overflow it waits for the next one (an item bigger than the cost limit runs alone).

When a batch closes:
- at once when the model is idle (no batch of it computing): waiting can only add latency then,
  since nothing that could join is known to be coming, and a single caller gets unbatched
  latency; the batches computing while others arrive are what lets the queue fill;
- at once when it is full, or a preferred batch size is reached;
- otherwise when its oldest item has waited `max_queue_delay_ms` (batches then overlap, up to
  `max_inflight_batches`).
Every item's future resolves on every path: a result, the model's error (for that batch's items
only), a deadline that passed before it ran (a timer fails it at once), cancellation by its caller
(it is dropped before it runs), or shutdown.

Poison isolation: when a batch of several items fails, its items are re-run in halves (a
bisection, in the same worker thread), so only the items that make the model fail get its error
and the rest of the batch succeeds. A batch with k bad items costs about 2k·log2(n) extra model
calls; a model that fails every call costs 2n-1 calls per batch of n (it fails every item, as
before, just later).

The hot path is kept lean because on a small machine the per-request work, not the model, limits
throughput: no timer for items without a deadline, metric children looked up once and updated
per batch, inputs that match the signature exactly checked without building violations.

Modelled on Ray Serve's `batching.py`; `submit` is synchronous so a caller (the worker client)
can account for a slot in the same step as it takes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from asyncinfer.config import ModelConfig
from asyncinfer.errors import (
    AsyncInferError,
    DeadlineExceeded,
    InvalidArgument,
    ModelError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from asyncinfer.jobs import Priority
from asyncinfer.supervision import Supervisor
from asyncinfer.tensors import NUMPY_DTYPES, ModelSignature, Tensor, validate_inputs
from services.batcher.assemble import assemble, split
from services.batcher.backends import ModelBackend
from services.batcher.items import InferOutcome, ItemShaper, PendingItem
from services.batcher.metrics import BatcherMetrics, ModelMetrics

__all__ = ["SHUTDOWN_REASON", "SHUTTING_DOWN", "BatchingEngine", "InferOutcome", "PendingItem"]

log = structlog.get_logger("asyncinfer.batcher.engine")

SHUTTING_DOWN = "batcher shutting down"
SHUTDOWN_REASON = "BATCHER_SHUTTING_DOWN"

SlotListener = Callable[[str], None]


def _outcome_label(future: asyncio.Future[InferOutcome]) -> str:
    if future.cancelled():
        return "cancelled"
    error = future.exception()
    if error is None:
        return "ok"
    if isinstance(error, ModelError):
        return "model_error"
    if isinstance(error, DeadlineExceeded):
        return "expired"
    if isinstance(error, Unavailable):
        return "shutdown"
    return "error"


class _ModelQueue:
    """The queue, batch former and in-flight batches of one model."""

    def __init__(
        self,
        config: ModelConfig,
        backend: ModelBackend,
        metrics: BatcherMetrics | None,
        on_item_done: SlotListener,
    ) -> None:
        self.config = config
        self.backend = backend
        self.name = config.name
        self.held = 0  # items submitted and not yet resolved (waiting or computing)
        self._shaper = ItemShaper(config, backend)
        self._waiting: list[PendingItem] = []
        self._seq = itertools.count()
        self._metrics: ModelMetrics | None = metrics.for_model(config.name) if metrics is not None else None
        if self._metrics is not None:
            # len() may count items resolved but not yet purged: exact enough for a gauge, and O(1).
            self._metrics.track_queue_depth(lambda: len(self._waiting))
        self._input_names = tuple(spec.name for spec in backend.signature.inputs)
        self._fast_check = _FastCheck(backend.signature, config.max_batch_size)
        self._on_item_done = on_item_done
        self._changed = asyncio.Event()
        self._slots = asyncio.Semaphore(config.max_inflight_batches)
        self._batches: dict[asyncio.Task[None], list[PendingItem]] = {}
        self._former: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._delay_s = config.max_queue_delay_ms / 1000.0
        self._preferred = sorted(set(config.preferred_batch_sizes), reverse=True)

    @property
    def depth(self) -> int:
        return sum(1 for item in self._waiting if not item.future.done())

    @property
    def free_slots(self) -> int:
        return max(self.config.max_queue_size - self.held, 0)

    def start(self, executor: ThreadPoolExecutor, supervisor: Supervisor) -> None:
        self._executor = executor
        self._former = supervisor.start(f"batcher-{self.name}", self._form_batches())

    def submit(self, inputs: Sequence[Tensor], timeout_s: float | None, priority: Priority) -> PendingItem:
        if self.held >= self.config.max_queue_size:
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
        expires_at = None if timeout_s is None else now + timeout_s
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
        outcome = _outcome_label(item.future)  # also marks an error retrieved when nobody awaits it
        if self._metrics is not None and outcome != "ok":  # ok items are counted per batch
            self._metrics.count_items(outcome)
        if not item.started:
            # A dropped item leaves a stale entry in the queue; let the former purge it.
            self._changed.set()
        self._on_item_done(self.name)

    def check(self, inputs: Sequence[Tensor]) -> None:
        """InvalidArgument unless the inputs fit the model's signature."""
        if self._fast_check(inputs):
            return
        violations = validate_inputs(inputs, self.backend.signature, max_batch_size=self.config.max_batch_size)
        if violations:
            first = violations[0]
            raise InvalidArgument(f"invalid inputs: {first.field}: {first.description}", violations)

    # --- forming batches -------------------------------------------------------------------

    async def _form_batches(self) -> None:
        loop = asyncio.get_running_loop()
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
            computing: asyncio.Future[tuple[list[_Ran], float, float]] = (
                asyncio.ensure_future(self._compute_async(batch))
                if self.backend.runs_async
                else loop.run_in_executor(self._executor, self._compute, batch)
            )
            task = asyncio.create_task(self._run_batch(batch, computing, loop.time()), name=f"batch-{self.name}")
            self._batches[task] = batch
            task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._free_slot(task)

    def _free_slot(self, task: asyncio.Task[None]) -> None:
        if self._batches.pop(task, None) is not None:
            self._slots.release()
            self._changed.set()  # the model may be idle now: a waiting batch can start at once

    async def _next_batch(self) -> list[PendingItem]:
        loop = asyncio.get_running_loop()
        while True:
            self._purge()
            if not self._waiting:
                self._changed.clear()
                await self._changed.wait()
                continue
            batch, close_now = self._pick()
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

    def _pick(self) -> tuple[list[PendingItem], bool]:
        """The best item's group in order, within the row and cost limits; and whether the batch
        should close now (it cannot grow, or it reached a preferred size)."""
        max_rows = self.config.max_batch_size
        max_cost = self.config.max_batch_cost
        ordered = sorted(self._waiting, key=_sort_key)
        group = ordered[0].group
        batch: list[PendingItem] = []
        rows = cost = 0
        left_out = False
        for item in ordered:
            if item.group != group:
                continue
            if rows + item.rows > max_rows or (max_cost and batch and cost + item.cost > max_cost):
                left_out = True
                continue
            batch.append(item)
            rows += item.rows
            cost += item.cost
        if left_out or rows >= max_rows or (max_cost and cost >= max_cost):
            return batch, True
        for size in self._preferred:
            if size > rows:
                continue
            prefix: list[PendingItem] = []
            prefix_rows = 0
            for item in batch:
                if prefix_rows + item.rows > size:
                    break
                prefix.append(item)
                prefix_rows += item.rows
            if prefix_rows == size:
                return prefix, True
        return batch, False

    # --- computing batches -----------------------------------------------------------------

    async def _run_batch(
        self,
        batch: list[PendingItem],
        computing: asyncio.Future[tuple[list[_Ran], float, float]],
        started: float,
    ) -> None:
        try:
            ran, compute_s, waste = await computing
        except asyncio.CancelledError:
            _fail(batch, Unavailable(SHUTTING_DOWN, reason=SHUTDOWN_REASON))
            raise
        except Exception as exc:  # assembling failed: not a fault of any one item
            log.exception("batch failed unexpectedly", model=self.name, items=len(batch))
            _fail(batch, ModelError(f"model {self.name!r} failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            # Before answering: the next batch is formed and handed to the model first.
            task = asyncio.current_task()
            if task is not None:
                self._free_slot(task)
        rows = sum(item.rows for item in batch)
        failed = sum(1 for result in ran if result.error is not None)
        if failed:
            first = next(result.error for result in ran if result.error is not None)
            log.warning(
                "batch failed" if len(batch) == 1 else "batch failed; its items were re-run apart",
                model=self.name,
                items=len(batch),
                failed_items=failed,
                error=first.message if first is not None else "",
            )
        if self._metrics is not None:
            self._metrics.observe_batch(
                rows=rows,
                max_rows=self.config.max_batch_size,
                padding_waste=waste,
                queue_wait_s=started - min(item.submitted_at for item in batch),
                compute_s=compute_s,
            )
            ok = sum(
                1 for item, result in zip(batch, ran, strict=True) if result.error is None and not item.future.done()
            )
            if ok:
                self._metrics.count_items("ok", ok)
        for item, result in zip(batch, ran, strict=True):
            if item.future.done():
                continue
            if result.error is not None:
                item.future.set_exception(result.error)
            else:
                item.future.set_result(
                    InferOutcome(
                        outputs=result.outputs or [],
                        batch_size=result.rows,
                        batch_items=result.items,
                        compute_s=compute_s,
                        queue_s=started - item.submitted_at,
                    )
                )

    def _compute(self, batch: list[PendingItem]) -> tuple[list[_Ran], float, float]:
        """Runs in a worker thread: assemble, run the model, split per item; on failure, the
        items again in halves (poison isolation)."""
        started = time.perf_counter()
        signature = self.backend.signature
        assembled = assemble(batch, signature, self._shaper, self.config.pad_value)
        try:
            outputs = self.backend.infer_batch(assembled.arrays)
            ran = _succeeded(batch, split(self.name, batch, outputs, assembled, signature), assembled.rows)
        except Exception as exc:
            error = self._model_error(exc, batch)
            ran = self._isolate(batch, error)
        return ran, time.perf_counter() - started, assembled.padding_waste

    def _isolate(self, batch: list[PendingItem], error: AsyncInferError) -> list[_Ran]:
        if len(batch) == 1:
            return [_Ran(error=error)]
        middle = len(batch) // 2
        return [*self._compute_part(batch[:middle]), *self._compute_part(batch[middle:])]

    def _compute_part(self, batch: list[PendingItem]) -> list[_Ran]:
        signature = self.backend.signature
        try:
            assembled = assemble(batch, signature, self._shaper, self.config.pad_value)
            outputs = self.backend.infer_batch(assembled.arrays)
            return _succeeded(batch, split(self.name, batch, outputs, assembled, signature), assembled.rows)
        except Exception as exc:
            return self._isolate(batch, self._model_error(exc, batch))

    async def _compute_async(self, batch: list[PendingItem]) -> tuple[list[_Ran], float, float]:
        started = time.perf_counter()
        signature = self.backend.signature
        assembled = assemble(batch, signature, self._shaper, self.config.pad_value)
        try:
            outputs = await self.backend.infer_batch_async(assembled.arrays)
            ran = _succeeded(batch, split(self.name, batch, outputs, assembled, signature), assembled.rows)
        except Exception as exc:
            ran = await self._isolate_async(batch, self._model_error(exc, batch))
        return ran, time.perf_counter() - started, assembled.padding_waste

    async def _isolate_async(self, batch: list[PendingItem], error: AsyncInferError) -> list[_Ran]:
        if len(batch) == 1:
            return [_Ran(error=error)]
        middle = len(batch) // 2
        return [*await self._compute_part_async(batch[:middle]), *await self._compute_part_async(batch[middle:])]

    async def _compute_part_async(self, batch: list[PendingItem]) -> list[_Ran]:
        signature = self.backend.signature
        try:
            assembled = assemble(batch, signature, self._shaper, self.config.pad_value)
            outputs = await self.backend.infer_batch_async(assembled.arrays)
            return _succeeded(batch, split(self.name, batch, outputs, assembled, signature), assembled.rows)
        except Exception as exc:
            return await self._isolate_async(batch, self._model_error(exc, batch))

    def _model_error(self, exc: Exception, batch: list[PendingItem]) -> AsyncInferError:
        if isinstance(exc, AsyncInferError):
            return exc
        log.exception("batch failed unexpectedly", model=self.name, items=len(batch))
        return ModelError(f"model {self.name!r} failed: {type(exc).__name__}: {exc}")

    # --- stopping --------------------------------------------------------------------------

    async def stop_intake(self) -> None:
        """Stops forming batches and fails every item still waiting."""
        if self._former is not None:
            self._former.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._former
        _fail(list(self._waiting), Unavailable(SHUTTING_DOWN, reason=SHUTDOWN_REASON))
        self._waiting.clear()

    def running_batches(self) -> list[asyncio.Task[None]]:
        return list(self._batches)


@dataclass(slots=True)
class _Ran:
    """How one item of a batch came out: its outputs and the (sub-)batch it ran in, or an error."""

    outputs: list[Tensor] | None = None
    error: AsyncInferError | None = None
    rows: int = 0
    items: int = 0


def _succeeded(batch: Sequence[PendingItem], per_item: list[list[Tensor]], rows: int) -> list[_Ran]:
    return [_Ran(outputs=outputs, rows=rows, items=len(batch)) for outputs in per_item]


class _FastCheck:
    """True when numeric inputs match the signature exactly (names, datatypes, dimensions, data
    sizes, one batch size within the limit): the common case, checked without building
    violations. False sends the inputs to the full validation, which says what is wrong."""

    def __init__(self, signature: ModelSignature, max_batch_size: int) -> None:
        self._specs = {
            spec.name: (spec.datatype, spec.shape, NUMPY_DTYPES[spec.datatype].itemsize)
            for spec in signature.inputs
            if spec.datatype != "BYTES"
        }
        self._numeric = len(self._specs) == len(signature.inputs)
        self._max_rows = max_batch_size

    def __call__(self, inputs: Sequence[Tensor]) -> bool:
        if not self._numeric or len(inputs) != len(self._specs):
            return False
        rows = -1
        names = set()
        for tensor in inputs:
            spec = self._specs.get(tensor.name)
            if spec is None or tensor.name in names:
                return False
            names.add(tensor.name)
            datatype, dims, itemsize = spec
            shape = tensor.shape
            if tensor.datatype != datatype or len(shape) != len(dims) or not shape:
                return False
            for got, want in zip(shape, dims, strict=True):
                if got < 0 or (want != -1 and got != want):
                    return False
            if len(tensor.data) != math.prod(shape) * itemsize:
                return False
            if rows == -1:
                rows = shape[0]
            elif shape[0] != rows:
                return False
        return rows >= 1 and (self._max_rows <= 0 or rows <= self._max_rows)


def _sort_key(item: PendingItem) -> tuple[int, float, int]:
    return item.sort_key


def _expire(item: PendingItem) -> None:
    if not item.started and not item.future.done():
        item.future.set_exception(DeadlineExceeded("the item's deadline passed before it ran"))


def _fail(items: Sequence[PendingItem], error: AsyncInferError) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(error)


class BatchingEngine:
    """The batching engine of every model the batcher serves.

    Usage: `add_model(...)` for each model, `await start()`, then `submit`/`infer` from the event
    loop, and `await stop(grace_s)` once."""

    def __init__(self, *, metrics: BatcherMetrics | None = None, supervisor: Supervisor | None = None) -> None:
        self._metrics = metrics
        # The batcher app's, which stops the process when a batch former dies; an engine of its own
        # (in tests, benchmarks) still has its formers' deaths logged at once.
        self._supervisor = supervisor or Supervisor("batching-engine")
        self._queues: dict[str, _ModelQueue] = {}
        self._listeners: list[SlotListener] = []
        self._executor: ThreadPoolExecutor | None = None
        self._accepting = False
        self._stopping = False

    def add_model(self, config: ModelConfig, backend: ModelBackend) -> None:
        if self._executor is not None:
            raise RuntimeError("models are added before the engine starts")
        if config.name in self._queues:
            raise ValueError(f"model {config.name!r} added twice")
        self._queues[config.name] = _ModelQueue(config, backend, self._metrics, self._notify_slot_freed)

    @property
    def model_names(self) -> list[str]:
        return list(self._queues)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def model_config(self, model_name: str) -> ModelConfig:
        return self._queue(model_name).config

    def has_model(self, model_name: str) -> bool:
        return model_name in self._queues

    def free_slots(self, model_name: str) -> int:
        """Items this model can take now (its queue limit less the items waiting or computing)."""
        return self._queue(model_name).free_slots if self._accepting else 0

    def queue_depth(self, model_name: str) -> int:
        return self._queue(model_name).depth

    def add_slot_listener(self, listener: SlotListener) -> Callable[[], None]:
        """Calls `listener(model_name)` on the event loop each time an item leaves a model (its
        slot is free again). Returns a function that removes the listener."""
        self._listeners.append(listener)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return remove

    async def start(self) -> None:
        if self._executor is not None:
            return
        workers = max(sum(q.config.max_inflight_batches for q in self._queues.values()), 1)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="batcher-compute")
        for queue in self._queues.values():
            queue.start(self._executor, self._supervisor)
        self._accepting = True

    def submit(
        self,
        model_name: str,
        inputs: Sequence[Tensor],
        *,
        timeout_s: float | None = None,
        priority: Priority = Priority.NORMAL,
    ) -> PendingItem:
        """Validates and queues one item; its future resolves with an InferOutcome or an
        AsyncInferError. Raises at once (nothing queued) for an unknown model, invalid inputs, a
        full queue, a deadline already passed, or a stopping engine."""
        queue = self._queue(model_name)
        if not self._accepting:
            if self._stopping:
                raise Unavailable(SHUTTING_DOWN, reason=SHUTDOWN_REASON)
            raise Unavailable("batcher not started", reason="BATCHER_UNAVAILABLE")
        queue.check(inputs)
        if timeout_s is not None and timeout_s <= 0:
            raise DeadlineExceeded("the item's deadline passed before it was queued")
        return queue.submit(inputs, timeout_s, priority)

    async def infer(
        self,
        model_name: str,
        inputs: Sequence[Tensor],
        *,
        timeout_s: float | None = None,
        priority: Priority = Priority.NORMAL,
    ) -> InferOutcome:
        """Runs one item through its model's batches. Cancelling the caller drops the item if its
        batch has not started."""
        item = self.submit(model_name, inputs, timeout_s=timeout_s, priority=priority)
        try:
            return await item.future
        finally:
            item.future.cancel()  # no-op once resolved; drops the item when the caller is cancelled

    async def stop(self, grace_s: float = 5.0) -> None:
        """Fails waiting items with Unavailable, lets computing batches finish within grace_s,
        then fails and abandons the rest. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._accepting = False
        for queue in self._queues.values():
            await queue.stop_intake()
        running = [task for queue in self._queues.values() for task in queue.running_batches()]
        if running:
            _done, late = await asyncio.wait(running, timeout=grace_s)
            for task in late:
                task.cancel()
            if late:
                log.warning("batches still computing at shutdown were abandoned", batches=len(late))
                await asyncio.gather(*late, return_exceptions=True)
        if self._executor is not None:
            # A computing thread cannot be interrupted; do not wait for abandoned ones.
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _queue(self, model_name: str) -> _ModelQueue:
        try:
            return self._queues[model_name]
        except KeyError:
            raise NotFound(f"model {model_name!r} is not served here", reason="MODEL_NOT_FOUND") from None

    def _notify_slot_freed(self, model_name: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(model_name)
            except Exception:
                log.exception("slot listener failed", model=model_name)
