"""Running one batch of a model: its compute (in a worker thread, or awaited for a remote
backend), poison isolation, then each item's answer.

Poison isolation: when a batch of several items fails, its items are re-run in halves (a
bisection, in the same worker thread), so only the items that make the model fail get its error
and the rest of the batch succeeds. A batch with k bad items costs about 2k·log2(n) extra model
calls; a model that fails every call costs 2n-1 calls per batch of n (it fails every item, as
before, just later). A remote backend's server errors (SERVER_ERRORS: Triton out of reach, its
queue full, a call past its timeout) are not the items' fault and fail the whole batch at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import structlog

from asyncinfer.config import ModelConfig
from asyncinfer.errors import AsyncInferError, DeadlineExceeded, ModelError, ResourceExhausted, Unavailable
from asyncinfer.log_throttle import RepeatedLines, Throttle
from asyncinfer.tensors import Tensor
from asyncinfer.tracing import Tracing
from services.batcher.assemble import assemble, split
from services.batcher.backends import Arrays, CallTimes, ModelBackend
from services.batcher.batch_tracing import trace_batch
from services.batcher.items import InferOutcome, ItemShaper, PendingItem
from services.batcher.metrics import ModelMetrics
from services.batcher.progress import ProgressReporter

# The engine's logger, as before the engine was split: its records keep their logger name.
log = structlog.get_logger("asyncinfer.batcher.engine")

SHUTTING_DOWN = "batcher shutting down"
SHUTDOWN_REASON = "BATCHER_SHUTTING_DOWN"
# Every in-flight batch of the model has run past its jobs' execution timeouts (a call that does not
# return): what waits is given back, as at a shutdown (services/batcher/model_queue.py).
MODEL_STUCK_REASON = "MODEL_STUCK"
# The reason of an item answered past its execution timeout, counted from its batch's start: the
# scheduler's job_errors.EXECUTION_TIMEOUT, which it records as TIMED_OUT (WorkerHello.times_out_runs).
EXECUTION_TIMEOUT_REASON = "EXECUTION_TIMEOUT"
# What a remote backend (Triton) raises when its server cannot answer: out of reach past its outage
# wait, its queue full, a call past its timeout. Not an item's fault, so the batch is not bisected:
# each half met it again, waiting the outage out or the call's timeout once more, 2n-1 calls for a
# batch of n (7.5 minutes for 8 items at triton_outage_wait_s = 30 s, past their jobs' execution
# timeouts: answered EXECUTION_TIMEOUT, not this error). Every item gets it at once.
SERVER_ERRORS = (Unavailable, DeadlineExceeded, ResourceExhausted)
# A model's traceback is logged at most this often per distinct failure (a broken deploy fails every
# batch the same way).
TRACEBACK_INTERVAL_S = 60.0


@dataclass(slots=True)
class Ran:
    """How one item of a batch came out: its outputs and the (sub-)batch it ran in, or an error."""

    outputs: list[Tensor] | None = None
    error: AsyncInferError | None = None
    rows: int = 0
    items: int = 0


def succeeded(batch: Sequence[PendingItem], per_item: list[list[Tensor]], rows: int) -> list[Ran]:
    return [Ran(outputs=outputs, rows=rows, items=len(batch)) for outputs in per_item]


# Per item: its outcome; then the batch's compute seconds and padding waste.
Computed = tuple[list[Ran], float, float]


class RunTimedOut(AsyncInferError):
    """An item still computing its execution timeout after its batch started: answered now, its
    batch left to finish (a model call cannot be stopped) and its answer for it dropped."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = EXECUTION_TIMEOUT_REASON


def run_timed_out(run_timeout_s: float, since: str = "its batch started") -> RunTimedOut:
    return RunTimedOut(f"still computing {run_timeout_s:g} s after {since} (its execution timeout)")


def fail(items: Sequence[PendingItem], error: AsyncInferError) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(error)


class BatchRunner:
    """Computes and answers the batches of one model."""

    def __init__(
        self,
        config: ModelConfig,
        backend: ModelBackend,
        shaper: ItemShaper,
        metrics: ModelMetrics | None,
        free_slot: Callable[[asyncio.Task[None]], None],
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        self._tracing = tracing or Tracing.off()
        self.backend = backend
        self.name = config.name
        self._shaper = shaper
        self._metrics = metrics
        self._free_slot = free_slot
        self._tracebacks = Throttle(TRACEBACK_INTERVAL_S)
        self._failed_batches = RepeatedLines()

    async def run(
        self,
        batch: list[PendingItem],
        computing: asyncio.Future[Computed],
        started: float,
    ) -> None:
        try:
            ran, compute_s, waste = await computing
        except asyncio.CancelledError:
            fail(batch, Unavailable(SHUTTING_DOWN, reason=SHUTDOWN_REASON))
            raise
        except Exception as exc:  # assembling failed: not a fault of any one item
            self._unexpected_failure(exc, batch)
            fail(batch, ModelError(f"model {self.name!r} failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            # Before answering: the next batch is formed and handed to the model first.
            task = asyncio.current_task()
            if task is not None:
                self._free_slot(task)
        if self._tracing.enabled:
            trace_batch(self._tracing, self.name, batch, [result.error is not None for result in ran], compute_s)
        rows = sum(item.rows for item in batch)
        failed = sum(1 for result in ran if result.error is not None)
        if failed:
            first = next(result.error for result in ran if result.error is not None)
            # At most one a model per interval: a model that always fails fails every batch.
            self._failed_batches.say(
                log,
                "warning",
                "batch_failed" if len(batch) == 1 else "batch_failed_items_rerun_apart",
                kind=self.name,
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
                self._metrics.count_items("OK", ok)
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

    def compute(self, batch: list[PendingItem]) -> Computed:
        """Runs in a worker thread: assemble, run the model, split per item; on failure, the
        items again in halves (poison isolation).

        THREAD_FAILURES: anything a model's call raises in this thread is its items' ModelError,
        SystemExit too (a model calling sys.exit or exit() on bad input): it escaped as it is,
        the executor's future carried it to the event loop, which re-raises SystemExit, and one
        item's input stopped the batcher with every batch of every model in it. Nothing else
        raises a BaseException in a worker thread (no cancellation; KeyboardInterrupt goes to the
        main thread)."""
        started = time.perf_counter()
        signature = self.backend.signature
        assembled = assemble(batch, signature, self._shaper, self.config.pad_value)
        try:
            outputs = self._infer(batch, assembled.arrays)
            ran = succeeded(batch, split(self.name, batch, outputs, assembled, signature), assembled.rows)
        except BaseException as exc:  # a model call in this thread: see compute
            error = self._model_error(exc, batch)
            self._say_where(exc, batch)
            ran = self._isolate(batch, error)
        return ran, time.perf_counter() - started, assembled.padding_waste

    def _say_where(self, exc: BaseException, batch: list[PendingItem]) -> None:
        """The model's own traceback, once per failed batch (not per half of its isolation), at
        most once per TRACEBACK_INTERVAL_S per distinct failure (its exception's type and the line
        that raised it), so that a second bug is not hidden behind a first that repeats: its
        message alone reached the logs, and the model's author could not see where in their code
        it failed. At warning, not error: a model failing a job is the job's outcome (FAILED, or
        dead-lettered at warning), not the service's fault; the line is for the model's author."""
        cause = exc.__cause__ if isinstance(exc.__cause__, BaseException) else exc
        held = self._tracebacks.allow(_failure_of(self.name, cause))
        if held is not None:
            more = {"more_since_last": held} if held else {}
            log.warning("model_raised", model=self.name, items=len(batch), exc_info=cause, **more)

    def _isolate(self, batch: list[PendingItem], error: AsyncInferError) -> list[Ran]:
        if len(batch) == 1:
            return [Ran(error=error)]
        middle = len(batch) // 2
        return [*self._compute_part(batch[:middle]), *self._compute_part(batch[middle:])]

    def _compute_part(self, batch: list[PendingItem]) -> list[Ran]:
        signature = self.backend.signature
        try:
            assembled = assemble(batch, signature, self._shaper, self.config.pad_value)
            outputs = self._infer(batch, assembled.arrays)
            return succeeded(batch, split(self.name, batch, outputs, assembled, signature), assembled.rows)
        except BaseException as exc:  # a model call in this thread: see compute
            return self._isolate(batch, self._model_error(exc, batch))

    def _infer(self, batch: list[PendingItem], arrays: Arrays) -> Arrays:
        """The model's call on one (sub-)batch, with a reporter of its items' progress when the
        model reports any."""
        if not self.backend.reports_progress:
            return self.backend.infer_batch(arrays)
        reporter = ProgressReporter([(item.progress, item.rows) for item in batch])
        return self.backend.infer_batch_reporting(arrays, reporter)

    async def compute_async(self, batch: list[PendingItem], started_at: float) -> Computed:
        """A remote backend's batch, started at `started_at` (loop time, its items' execution
        timeouts count from it)."""
        started = time.perf_counter()
        signature = self.backend.signature
        times = call_times(batch, started_at, self.config.default_execution_timeout_s)
        assembled = assemble(batch, signature, self._shaper, self.config.pad_value)
        try:
            outputs = await self.backend.infer_batch_async(assembled.arrays, times)
            ran = succeeded(batch, split(self.name, batch, outputs, assembled, signature), assembled.rows)
        except Exception as exc:
            error = self._model_error(exc, batch)
            if not isinstance(error, SERVER_ERRORS):
                # The server's errors are not the model's: the backend said an outage once
                # (triton_unreachable), and batch_failed says the batch's.
                self._say_where(exc, batch)
            ran = await self._isolate_async(batch, error, times)
        return ran, time.perf_counter() - started, assembled.padding_waste

    async def _isolate_async(self, batch: list[PendingItem], error: AsyncInferError, times: CallTimes) -> list[Ran]:
        if len(batch) == 1 or isinstance(error, SERVER_ERRORS):
            return [Ran(error=error) for _ in batch]
        middle = len(batch) // 2
        return [
            *await self._compute_part_async(batch[:middle], times),
            *await self._compute_part_async(batch[middle:], times),
        ]

    async def _compute_part_async(self, batch: list[PendingItem], times: CallTimes) -> list[Ran]:
        signature = self.backend.signature
        try:
            assembled = assemble(batch, signature, self._shaper, self.config.pad_value)
            outputs = await self.backend.infer_batch_async(assembled.arrays, times)
            return succeeded(batch, split(self.name, batch, outputs, assembled, signature), assembled.rows)
        except Exception as exc:
            return await self._isolate_async(batch, self._model_error(exc, batch), times)

    def _unexpected_failure(self, exc: BaseException, batch: list[PendingItem]) -> None:
        """A bug's traceback, the first of its kind at once, then one per interval (the rest at
        debug): a bug that fires per batch wrote a traceback per batch, rendered on the event loop."""
        self._failed_batches.say(
            log,
            "error",
            "batch_failed_unexpectedly",
            kind=type(exc).__name__,
            model=self.name,
            items=len(batch),
            exc_info=exc,
        )

    def _model_error(self, exc: BaseException, batch: list[PendingItem]) -> AsyncInferError:
        if isinstance(exc, AsyncInferError):
            return exc
        self._unexpected_failure(exc, batch)
        return ModelError(f"model {self.name!r} failed: {type(exc).__name__}: {exc}")


def call_times(batch: Sequence[PendingItem], started_at: float, default_s: float) -> CallTimes:
    """When the batch's items stop waiting for its remote call, from its start: each at its
    execution timeout (an item without one, a KServe call's, at the model's default). The call
    lasts until the last of them: cut at the model's default, an item allowed longer failed
    DEADLINE_EXCEEDED there, its attempt spent, on every attempt; once no item waits, the call is
    cancelled (model_queue.py). An outage is waited out until the first of them."""
    known = [item.run_timeout_s for item in batch if item.run_timeout_s is not None]
    longest = max(known) if len(known) == len(batch) else max([*known, default_s])
    return CallTimes(
        first_end=started_at + min(known) if known else None,
        last_end=started_at + longest,
    )


def _failure_of(model: str, exc: BaseException) -> tuple[str, str, str, int]:
    """What makes two failures of a model the same one: the exception's type and where it was
    raised (the innermost frame), not its message, which often carries the input's values."""
    innermost = exc.__traceback__
    while innermost is not None and innermost.tb_next is not None:
        innermost = innermost.tb_next
    if innermost is None:
        return model, type(exc).__qualname__, "", 0
    return model, type(exc).__qualname__, innermost.tb_frame.f_code.co_filename, innermost.tb_lineno
