"""Pipelines in the batcher: a model declared as steps of other models (asyncinfer.pipelines), run
as one item, one step after another, each model step as items of that model's own queue in the
same engine. So the steps of many jobs batch together, with each other and with the model's own
jobs (a step's batch holds items of several jobs), and the tensors between steps never leave the
process. A Triton ensemble runs the same way, inside the server that holds its models.

A job's step becomes one item of the step's model, or several when it has more rows than the
model's max_batch_size (a document cut into many windows); function steps run in a worker thread.
The first step's item carries the job's deadline (a job that never started expires, as any item
does); its priority goes to every step. While it runs, the pipeline reports the share of its steps
done (with the fraction a reporting step model gives). A failing step fails the item, its error
naming the step (a step that does not fit the pipeline's wiring, as a function that gives another
datatype than the next model takes, is FAILED_PRECONDITION: not the caller's input, and no retry
helps); anything else a step raises (a bug, a backend's unexpected exception) fails the item
MODEL_ERROR naming the step, logged once with its traceback (pipeline_step_failed): the item's
future always resolves, or its job would wait out its execution timeout or lease. Each step's item
carries the job's trace, so its compute shows in the job's trace. The execution timeout runs from
the item's arrival (its steps run in several batches) and names the step running. Cancelling the
item (a cancel order, a caller gone, shutdown) cancels the task, which drops the step's items that
have not started; a step model that reports progress and computes the job's step (each of its
items, when it runs as several) then reads `progress.cancelled(row)`, after a cancel or the
execution timeout alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import structlog

from asyncinfer.config import ModelConfig, PipelineStepConfig
from asyncinfer.errors import (
    AsyncInferError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ModelError,
    ResourceExhausted,
    Unavailable,
)
from asyncinfer.jobs import Priority
from asyncinfer.tensors import Tensor, validate_inputs
from services.batcher.batch_compute import SHUTDOWN_REASON, SHUTTING_DOWN, RunTimedOut
from services.batcher.items import InferOutcome, PendingItem
from services.batcher.metrics import BatcherMetrics
from services.batcher.model_queue import outcome_label
from services.batcher.progress import ItemProgress, ProgressUpdate

# A step refused what the pipeline gave it, or did not give what the pipeline takes from it.
STEP_MISMATCH = "PIPELINE_STEP_MISMATCH"


class StepEngine(Protocol):
    """What a pipeline uses of the BatchingEngine that holds it (engine.py imports this module)."""

    def submit(
        self,
        model_name: str,
        inputs: Sequence[Tensor],
        *,
        timeout_s: float | None = None,
        priority: Priority = Priority.NORMAL,
        progress: ItemProgress | None = None,
    ) -> PendingItem: ...

    def model_config(self, model_name: str) -> ModelConfig: ...

    def reports_progress(self, model_name: str) -> bool: ...


log = structlog.get_logger("asyncinfer.batcher.pipeline")

StepFunction = Callable[[dict[str, Any]], dict[str, Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class StepRun:
    """How one step of one job ran: the most items and rows a batch of it held, its compute."""

    batch_items: int
    batch_rows: int
    compute_s: float
    queue_s: float


class PipelineRunner:
    """The items in flight of one pipeline model."""

    def __init__(
        self,
        config: ModelConfig,
        engine: StepEngine,
        on_item_done: Callable[[str], None],
        metrics: BatcherMetrics | None = None,
    ) -> None:
        from services.batcher.backends.torch_backend import import_factory

        self.config = config
        self.name = config.name
        self.held = 0
        self._engine = engine
        self._on_item_done = on_item_done
        # Its jobs by outcome, as a model's (asyncinfer_batcher_items_total{model=<pipeline>}); its
        # steps' batches are their models'.
        self._metrics = metrics.for_model(config.name) if metrics is not None else None
        self._seq = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._functions: dict[int, StepFunction] = {
            index: import_factory(step.function) for index, step in enumerate(config.steps) if step.function
        }
        # The last job's step runs, for tests and logs: what each step's batches held.
        self.last_runs: tuple[StepRun, ...] = ()
        # The step each running item is at (its index), which its errors name.
        self._at_step: dict[PendingItem, int] = {}

    @property
    def free_slots(self) -> int:
        return max(self.config.max_queue_size - self.held, 0)

    def submit(
        self,
        inputs: Sequence[Tensor],
        timeout_s: float | None,
        priority: Priority,
        progress: ItemProgress | None,
        *,
        credited: bool = False,
        run_timeout_s: float | None = None,
    ) -> PendingItem:
        """Starts one item; `run_timeout_s` (its job's execution timeout) is counted from now: its
        steps run in several batches, so not from a batch's start."""
        if self.held >= self.config.max_queue_size and not credited:  # as ModelQueue.submit's
            raise ResourceExhausted(
                f"pipeline {self.name!r} is at its queue limit ({self.config.max_queue_size} items)",
                reason="BATCHER_QUEUE_FULL",
                retry_after_s=0.05,
            )
        violations = validate_inputs(inputs, self.config.signature, max_batch_size=self.config.max_batch_size)
        if violations:
            raise InvalidArgument(f"invalid inputs: {violations[0].field}: {violations[0].description}", violations)
        loop = asyncio.get_running_loop()
        now = loop.time()
        future: asyncio.Future[InferOutcome] = loop.create_future()
        item = PendingItem(
            {t.name: t for t in inputs},
            future,
            submitted_at=now,
            expires_at=None if timeout_s is None else now + timeout_s,
            priority=priority,
            seq=next(self._seq),
        )
        item.progress = progress
        self.held += 1
        task = asyncio.create_task(self._run(item), name=f"pipeline-{self.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        future.add_done_callback(lambda done: self._item_done(item, task, done))
        if run_timeout_s is not None:
            item.ends_by = now + run_timeout_s  # and its steps' items' (a retired version waits for it)
            timer = loop.call_later(run_timeout_s, self._time_out, item, run_timeout_s)
            future.add_done_callback(lambda _done: timer.cancel())
        return item

    def _time_out(self, item: PendingItem, run_timeout_s: float) -> None:
        if item.future.done():
            return
        index = self._at_step.get(item, 0)
        item.future.set_exception(
            RunTimedOut(f"{self._step_name(index)} was running {run_timeout_s:g} s after the job arrived")
        )

    def _item_done(self, item: PendingItem, task: asyncio.Task[None], future: asyncio.Future[InferOutcome]) -> None:
        self.held -= 1
        self._at_step.pop(item, None)
        ended_outside = future.cancelled() or isinstance(future.exception(), RunTimedOut)
        if ended_outside and item.progress is not None:
            # Dropped (a cancel order, its caller gone) or timed out: a step whose batch computes
            # cannot drop its item, but its model reads `progress.cancelled` through its channels'
            # parent, and stops as a model running the job itself would (it computed on to its end).
            item.progress.cancel()
        task.cancel()  # a no-op once it finished; else it was cancelled or failed from outside
        outcome = outcome_label(future)  # also marks an error retrieved when nobody awaits it
        if self._metrics is not None:
            self._metrics.count_items(outcome)
        self._on_item_done(self.name)

    async def close(self) -> None:
        """Shutdown: the items still running fail as the engine's do (UNAVAILABLE, shutting down:
        `_run`), and their tasks are awaited."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- one item ---------------------------------------------------------------------------

    async def _run(self, item: PendingItem) -> None:
        try:
            outcome = await self._steps(item)
        except asyncio.CancelledError:
            if not item.future.done():
                item.future.set_exception(Unavailable(SHUTTING_DOWN, reason=SHUTDOWN_REASON))
            raise
        except AsyncInferError as error:
            if not item.future.done():
                item.future.set_exception(error)
            return
        except Exception as error:
            # Not one of ours: a bug, or a backend raising what nothing maps. Every future resolves
            # (else the job waits out its execution timeout or lease, with nothing said).
            where = self._step_name(self._at_step.get(item, 0))
            log.error("pipeline_step_failed", model=self.name, step=where, exc_info=error)
            if not item.future.done():
                item.future.set_exception(ModelError(f"{where}: the batcher failed: {type(error).__name__}: {error}"))
            return
        if not item.future.done():
            item.future.set_result(outcome)

    async def _steps(self, item: PendingItem) -> InferOutcome:
        tensors: dict[str, Tensor] = dict(item.inputs)
        total = len(self.config.steps)
        runs: list[StepRun] = []
        for index, step in enumerate(self.config.steps):
            self._at_step[item] = index
            self._report(item, index / total, f"step {index + 1} of {total}: {step.label}")
            try:
                if step.model:
                    outputs, run = await self._model_step(item, index, step, tensors)
                else:
                    outputs, run = await self._function_step(index, step, tensors)
            except (DeadlineExceeded, Unavailable):
                raise  # not the step's fault: the job expired, or the batcher is stopping
            except AsyncInferError as error:
                raise _named(error, self.name, index, step) from error
            runs.append(run)
            for output, name in step.outputs.items():
                if output not in outputs:
                    raise FailedPrecondition(
                        f"pipeline {self.name!r} step {index + 1} ({step.label}) gave no output {output!r} "
                        f"(it gave {sorted(outputs)}): the pipeline's configuration does not fit its step",
                        reason=STEP_MISMATCH,
                    )
                tensors[name] = dataclasses.replace(outputs[output], name=name)
        self._report(item, 1.0, f"{total} of {total} steps done")
        self.last_runs = tuple(runs)
        last = runs[-1]
        return InferOutcome(
            outputs=[tensors[spec.name] for spec in self.config.outputs],
            batch_size=last.batch_rows,
            batch_items=last.batch_items,
            compute_s=sum(run.compute_s for run in runs),
            queue_s=runs[0].queue_s,
        )

    async def _model_step(
        self, item: PendingItem, index: int, step: PipelineStepConfig, tensors: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], StepRun]:
        inputs = [dataclasses.replace(tensors[source], name=name) for name, source in step.inputs.items()]
        max_rows = self._engine.model_config(step.model).max_batch_size
        rows = inputs[0].batch_size
        pieces = [inputs] if rows <= max_rows else [_rows(inputs, s, s + max_rows) for s in range(0, rows, max_rows)]
        timeout_s = None
        if index == 0 and item.expires_at is not None:
            timeout_s = item.expires_at - asyncio.get_running_loop().time()
        channels = self._step_progress(item, index, [piece[0].batch_size for piece in pieces])
        submitted: list[PendingItem] = []
        try:
            for piece, channel in zip(pieces, channels, strict=True):
                part = await self._submit(step.model, piece, timeout_s, item.priority, channel)
                part.trace = item.trace  # the job's dispatch span: its trace shows each step's compute
                part.ends_by = item.ends_by  # the job's execution deadline
                submitted.append(part)
            await asyncio.wait([part.future for part in submitted])
            outcomes = [part.future.result() for part in submitted]  # the first error raises
        finally:
            for part in submitted:
                part.future.cancel()  # a no-op once resolved; drops a part not started when cancelled
            for channel in channels:
                if channel is not None:
                    channel.close()
        run = StepRun(
            batch_items=max(o.batch_items for o in outcomes),
            batch_rows=max(o.batch_size for o in outcomes),
            compute_s=sum(o.compute_s for o in outcomes),
            queue_s=max(o.queue_s for o in outcomes),
        )
        if len(outcomes) == 1:
            return {t.name: t for t in outcomes[0].outputs}, run
        joined = {
            t.name: Tensor.from_numpy(
                t.name, np.concatenate([o_t.to_numpy() for o in outcomes for o_t in o.outputs if o_t.name == t.name])
            )
            for t in outcomes[0].outputs
        }
        return joined, run

    async def _submit(
        self,
        model: str,
        inputs: list[Tensor],
        timeout_s: float | None,
        priority: Priority,
        progress: ItemProgress | None,
    ) -> PendingItem:
        """An item of the step's model; while its queue is full, tried again after the delay it
        asks (the pipeline's own queue limit bounds how many wait so)."""
        while True:
            try:
                return self._engine.submit(model, inputs, timeout_s=timeout_s, priority=priority, progress=progress)
            except ResourceExhausted as full:
                await asyncio.sleep(full.retry_after_s)

    async def _function_step(
        self, index: int, step: PipelineStepConfig, tensors: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], StepRun]:
        function = self._functions[index]
        arrays = {name: tensors[source].to_numpy() for name, source in step.inputs.items()}
        started = time.perf_counter()
        try:
            given = await asyncio.to_thread(function, arrays)
            outputs = {name: Tensor.from_numpy(name, value) for name, value in given.items()}
        except AsyncInferError:
            raise
        except Exception as exc:
            raise ModelError(f"{type(exc).__name__}: {exc}") from exc
        return outputs, StepRun(batch_items=1, batch_rows=1, compute_s=time.perf_counter() - started, queue_s=0.0)

    # --- progress ----------------------------------------------------------------------------

    def _report(self, item: PendingItem, fraction: float, message: str) -> None:
        if item.progress is not None:
            item.progress.offer(fraction, message, ())

    def _step_progress(self, item: PendingItem, index: int, part_rows: list[int]) -> list[ItemProgress | None]:
        """A channel per item of the step (its parts' rows in `part_rows`) for a reporting step
        model: its progress folded into the pipeline's (step i of n at fraction f is (i + f) / n
        done; the step's f is its parts' mean weighted by rows), and the pipeline item's cancel
        reaching each part through its parent."""
        step = self.config.steps[index]
        if item.progress is None or not self._engine.reports_progress(step.model):
            return [None] * len(part_rows)
        total = len(self.config.steps)
        prefix = f"step {index + 1} of {total}: {step.label}"
        all_rows = sum(part_rows)
        fractions = [0.0] * len(part_rows)

        def deliver_part(part: int) -> Callable[[ProgressUpdate], None]:
            def deliver(update: ProgressUpdate) -> None:
                fractions[part] = update.fraction or 0.0
                done = index + sum(f * rows for f, rows in zip(fractions, part_rows, strict=True)) / all_rows
                self._report(item, done / total, f"{prefix}: {update.message}" if update.message else prefix)

            return deliver

        return [
            ItemProgress(deliver_part(part), interval_s=0.0, max_bytes=0, parent=item.progress)
            for part in range(len(part_rows))
        ]

    def _step_name(self, index: int) -> str:
        step = self.config.steps[index]
        return f"pipeline {self.name!r} step {index + 1} ({step.label})"  # as _named says it


def _rows(inputs: list[Tensor], start: int, stop: int) -> list[Tensor]:
    return [Tensor.from_numpy(t.name, t.to_numpy()[start:stop], t.datatype) for t in inputs]


def _named(error: AsyncInferError, pipeline: str, index: int, step: PipelineStepConfig) -> AsyncInferError:
    """The step's error with the step named. A step's inputs are the pipeline's own (checked
    against its signature before it ran) or an earlier step's outputs, so a step refusing its
    inputs is the pipeline's configuration, not the caller's request: FAILED_PRECONDITION, which
    no retry changes, rather than the INVALID_ARGUMENT that would blame the caller."""
    message = f"pipeline {pipeline!r} step {index + 1} ({step.label}): {error.message}"
    if isinstance(error, InvalidArgument):
        return FailedPrecondition(message, reason=STEP_MISMATCH)
    if isinstance(error, FailedPrecondition):
        return FailedPrecondition(message, reason=error.reason)
    if isinstance(error, ModelError):
        return ModelError(message, reason=error.reason)
    return ModelError(message)
