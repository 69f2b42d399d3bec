"""The dynamic-batching engine: per model, a bounded queue of items that are packed into batches,
computed in worker threads (or awaited, for remote backends), and split back per item. This
module holds the policy and the public BatchingEngine; model_queue.py holds each model's queue
and batch former (batch_picking.py its choice of a batch, batch_timeouts.py the timers of the
batches computing), batch_compute.py running a batch, fast_check.py the common input check.

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

When a batch fails, only the items that make the model fail get its error (poison isolation,
see batch_compute.py).

The hot path is kept lean because on a small machine the per-request work, not the model, limits
throughput: no timer for items without a deadline, metric children looked up once and updated
per batch, inputs that match the signature exactly checked without building violations.

Modelled on Ray Serve's `batching.py`; `submit` is synchronous so a caller (the worker client)
can account for a slot in the same step as it takes one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from asyncinfer.config import ModelConfig, version_order
from asyncinfer.errors import DeadlineExceeded, NotFound, Unavailable
from asyncinfer.jobs import Priority
from asyncinfer.supervision import Supervisor
from asyncinfer.tensors import Tensor
from asyncinfer.tracing import Tracing
from services.batcher.backends import ModelBackend
from services.batcher.batch_compute import SHUTDOWN_REASON, SHUTTING_DOWN, run_timed_out
from services.batcher.batch_timeouts import HungWatch
from services.batcher.chunk_items import ChunkItem, part_rows, take_rows
from services.batcher.items import InferOutcome, PendingItem
from services.batcher.metrics import BatcherMetrics
from services.batcher.model_queue import ModelQueue, SlotListener
from services.batcher.pipeline import PipelineRunner
from services.batcher.progress import ItemProgress

__all__ = ["SHUTDOWN_REASON", "SHUTTING_DOWN", "BatchingEngine", "InferOutcome", "PendingItem"]

log = structlog.get_logger("asyncinfer.batcher.engine")

# A submit naming a version this engine does not serve now (unloaded, or not loaded yet).
VERSION_NOT_SERVED_REASON = "MODEL_VERSION_NOT_SERVED"
# An item a retired version (replaced or unloaded) still held when its retire grace ended, waiting or
# computing with no deadline of its own (a KServe call without one whose model call had not returned),
# or computing past its own deadline unanswered. Not the item's fault: a work order's
# attempt is given back (work_messages.is_shutdown), a KServe caller may retry on what serves now.
VERSION_RETIRED_REASON = "MODEL_VERSION_RETIRED"
# How long past an item's own deadline a retired version waits for the engine's timeout (or the
# call's cancellation) to answer it before answering it VERSION_RETIRED_REASON itself.
DEADLINE_SLACK_S = 1.0


class BatchingEngine:
    """The batching engine of every model (and every version of it) the batcher serves.

    Usage: `add_model(...)` for each model version, `await start()`, then `submit`/`infer` from
    the event loop, and `await stop(grace_s)` once. Versions may be added (`add_model`, started at
    once) and retired (`retire`) while it runs: the versions of one model share its slots (the
    credits the scheduler gets per model), each has its own queue, batches and backend, so a
    batch never mixes versions and a retired version's batches finish on it."""

    def __init__(
        self,
        *,
        metrics: BatcherMetrics | None = None,
        supervisor: Supervisor | None = None,
        tracing: Tracing | None = None,
        hung: HungWatch | None = None,
    ) -> None:
        self._metrics = metrics
        # Told of a batch computing hung.after_s past its items' timeouts (None: nobody is).
        self._hung = hung
        # Spans of the batches that hold traced jobs (batch_tracing.py); off: none, nothing per item.
        self.tracing = tracing or Tracing.off()
        # The batcher app's, which stops the process when a batch former dies; an engine of its own
        # (in tests, benchmarks) still has its formers' deaths logged at once.
        self._supervisor = supervisor or Supervisor("batching-engine")
        # Model name -> version -> its queue; a retiring version leaves `_queues` and waits in
        # `_retiring` until the items it holds resolve.
        self._queues: dict[str, dict[str, ModelQueue]] = {}
        self._retiring: list[ModelQueue] = []
        # Models declared as steps of others (services/batcher/pipeline.py): no queue of their own.
        self._pipelines: dict[str, PipelineRunner] = {}
        self._listeners: list[SlotListener] = []
        self._reachable_listeners: list[Callable[[], None]] = []
        self._executor: ThreadPoolExecutor | None = None
        # The thread pools of versions added while the engine runs, each shut down when its version
        # retires (kept, each hot update left max_inflight_batches idle threads for good).
        self._executors: dict[ModelQueue, ThreadPoolExecutor] = {}
        self._accepting = False
        self._stopping = False

    @property
    def takes_models(self) -> bool:
        """Whether add_model may add a version: not once the engine (or the batcher) is stopping."""
        return not self._stopping and not self._supervisor.stopping

    def add_model(self, config: ModelConfig, backend: ModelBackend) -> None:
        """Adds a model version; once the engine runs, it takes items at once (warm it up first).
        Unavailable (nothing added) once it is stopping: a hot load that ended after stop() left
        the version registered with no batch former (the supervisor refused it) and its thread
        pool never shut down."""
        if not self.takes_models:
            raise Unavailable(
                f"model {config.name!r} version {config.version!r} cannot be added: {SHUTTING_DOWN}",
                reason=SHUTDOWN_REASON,
            )
        versions = self._queues.setdefault(config.name, {})
        if config.version in versions:
            raise ValueError(f"model {config.name!r} version {config.version!r} added twice")
        queue = ModelQueue(config, backend, self._metrics, self._notify_slot_freed, self.tracing, self._hung)
        versions[config.version] = queue
        backend.watch_reachable(lambda _reachable: self._reachable_changed(config.name))
        if self._executor is not None:
            executor = ThreadPoolExecutor(
                max_workers=config.max_inflight_batches, thread_name_prefix=f"batcher-{config.name}"
            )
            self._executors[queue] = executor
            queue.start(executor, self._supervisor)
            self._notify_slot_freed(config.name)

    def add_pipeline(self, config: ModelConfig) -> None:
        """A model declared as steps of models added here (their queues run its steps)."""
        if self._executor is not None:
            raise RuntimeError("pipelines are added before the engine starts")
        if config.name in self._queues or config.name in self._pipelines:
            raise ValueError(f"model {config.name!r} added twice")
        self._pipelines[config.name] = PipelineRunner(config, self, self._notify_slot_freed, self._metrics)

    def withdraw(self, model_name: str, version: str) -> ModelQueue:
        """Takes a version out of service (and out of `versions`) now; `finish_retiring` ends it."""
        versions = self._queues.get(model_name, {})
        queue = versions.pop(version, None)
        if queue is None:
            raise NotFound(f"model {model_name!r} has no version {version!r} here", reason="MODEL_VERSION_NOT_FOUND")
        if not versions:
            del self._queues[model_name]
        self._retiring.append(queue)
        return queue

    async def finish_retiring(self, queue: ModelQueue, *, linger_s: float, grace_s: float | None = None) -> None:
        """Lets a withdrawn version finish what it holds (waiting or computing; an order that names
        it still runs on it meanwhile): once it has held nothing for linger_s, its queue stops.
        grace_s after this began (None: no bound), if it still holds anything, it takes no more
        items: what waits, and what computes with no deadline of its own (a KServe call without
        one: its model's call may never return), is answered UNAVAILABLE VERSION_RETIRED_REASON;
        an item computing within its own deadline (a job's execution timeout, a KServe call's
        gRPC deadline: model_queue.own_deadline) goes on to it, and the engine's timeout (or the
        call's cancellation) ends it there if it has not returned; so do the waiting parts of a
        chunk under way (ModelQueue.end_grace), which go on forming batches. So the version stops at
        the latest DEADLINE_SLACK_S past max(grace, the last of its items' own deadlines)."""
        loop = asyncio.get_running_loop()
        grace_ends = None if grace_s is None else loop.time() + grace_s
        retired: Unavailable | None = None  # set once the grace has ended
        quiet_since: float | None = None
        while True:
            now = loop.time()
            if retired is not None:
                if not queue.held:
                    break
                # A backstop: the engine answers a job at its execution timeout, gRPC cancels a
                # call at its deadline; an item not answered so (a chunk's part computing after
                # its chunk timed out) is, DEADLINE_SLACK_S later.
                overdue = queue.abandon_computing(retired, ended_before=now - DEADLINE_SLACK_S)
                if overdue:
                    self._log_abandoned(queue, overdue, "past its own deadline")
            elif queue.held:
                quiet_since = None
                if grace_ends is not None and now >= grace_ends:
                    assert grace_s is not None
                    retired = await self._end_grace(queue, grace_s)
                    continue
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= linger_s:
                break
            await asyncio.sleep(0.05)
        self._retiring.remove(queue)
        if retired is None:
            await queue.stop_intake()
        else:
            await queue.stop_intake(retired)  # its batch former, kept for a chunk's parts (end_grace)
            # Their items are answered; a model's thread cannot be stopped (it goes on, its answer
            # dropped), a remote call is cancelled with its task.
            await asyncio.gather(*queue.abandon_batches(retired), return_exceptions=True)
        executor = self._executors.pop(queue, None)
        if executor is not None:
            # A call still computing (its items timed out) finishes first; then its threads end.
            executor.shutdown(wait=False)

    async def _end_grace(self, queue: ModelQueue, grace_s: float) -> Unavailable:
        """A retired version's grace has ended and it still holds items: it takes no more (an order
        naming it is refused, retriable), what waits and what computes with no deadline of its own
        is answered with the error returned, the rest computes on to its deadline (with a chunk
        under way, its parts still waiting: ModelQueue.end_grace)."""
        retired = Unavailable(
            f"model {queue.name!r} version {queue.config.version!r} was replaced or unloaded and had not finished "
            f"this item: past batcher.retire_grace_s ({grace_s:g} s) it finishes only what computes within its own "
            "deadline",
            reason=VERSION_RETIRED_REASON,
        )
        waited = await queue.end_grace(retired)  # a chunk under way keeps its waiting parts
        now = asyncio.get_running_loop().time()
        answered = waited + queue.abandon_computing(retired, ended_before=now - DEADLINE_SLACK_S)
        if answered:
            self._log_abandoned(queue, answered, "no deadline of its own")
        last = queue.computing_deadline()
        if last is not None:
            log.info(
                "retired_version_finishing",
                model=queue.name,
                version=queue.config.version,
                items=queue.held,
                grace_s=grace_s,
                until_s=round(last - now, 1),
                hint="past batcher.retire_grace_s, what it computes within its own deadline (a job's execution "
                "timeout) finishes on it",
            )
        return retired

    def _log_abandoned(self, queue: ModelQueue, items: int, why: str) -> None:
        log.warning(
            "retired_version_abandoned",
            model=queue.name,
            version=queue.config.version,
            items=items,
            why=why,
            hint="a retired version's model call had not returned past batcher.retire_grace_s (an item without a "
            "deadline of its own) or past its item's deadline; the items were answered UNAVAILABLE",
        )

    @property
    def model_names(self) -> list[str]:
        return [*self._queues, *self._pipelines]

    def pipeline(self, model_name: str) -> PipelineRunner | None:
        return self._pipelines.get(model_name)

    def pipelines_using(self, model_name: str) -> list[str]:
        """The pipelines served here that have a step on the model."""
        return [
            name for name, runner in self._pipelines.items() if any(s.model == model_name for s in runner.config.steps)
        ]

    def versions(self, model_name: str) -> list[str]:
        """The versions of the model in service here (not those retiring), oldest declared first."""
        pipeline = self._pipelines.get(model_name)
        return [pipeline.config.version] if pipeline is not None else list(self._queues.get(model_name, {}))

    def default_version(self, model_name: str) -> str:
        """The version an item that names none runs on: the model's default_version when served,
        else the highest version served."""
        versions = self._queues.get(model_name)
        if not versions:
            raise NotFound(f"model {model_name!r} is not served here", reason="MODEL_NOT_FOUND")
        first = next(iter(versions.values())).config
        chosen = first.default_among(versions)
        return chosen if chosen in versions else max(versions, key=version_order)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def model_config(self, model_name: str, version: str = "") -> ModelConfig:
        pipeline = self._pipelines.get(model_name)
        return pipeline.config if pipeline is not None else self._queue(model_name, version).config

    def has_model(self, model_name: str, version: str = "") -> bool:
        pipeline = self._pipelines.get(model_name)
        if pipeline is not None:
            return not version or version == pipeline.config.version
        if not version:
            return model_name in self._queues
        return version in self._queues.get(model_name, {}) or self._find_retiring(model_name, version) is not None

    def free_slots(self, model_name: str) -> int:
        """Items this model can take now: the smallest queue limit of its versions less the items
        all of them hold (waiting or computing), so that an order for any version fits."""
        pipeline = self._pipelines.get(model_name)
        if pipeline is not None:
            steps_take_work = all(
                q.takes_work for step in pipeline.config.steps for q in self._queues.get(step.model, {}).values()
            )
            return pipeline.free_slots if self._accepting and steps_take_work else 0
        versions = self._queues.get(model_name)
        if not self._accepting or not versions:
            return 0
        reachable = [q for q in versions.values() if q.backend.reachable]
        if not reachable or not all(q.takes_work for q in reachable):
            # A stuck version takes no work, and credits are per model; every version out of reach
            # neither. A version out of reach alone is announced LOADING (unreachable_versions):
            # the scheduler sends it no orders, so the others' slots are granted.
            return 0
        held = sum(q.places_taken for q in versions.values())
        held += sum(q.places_taken for q in self._retiring if q.name == model_name)
        return max(min(q.config.max_queue_size for q in reachable) - held, 0)

    def reports_progress(self, model_name: str, version: str = "") -> bool:
        """Whether the model reports progress (worth a channel per item: see progress.py); a
        pipeline reports its steps."""
        return model_name in self._pipelines or self._queue(model_name, version).backend.reports_progress

    def queue_depth(self, model_name: str) -> int:
        pipeline = self._pipelines.get(model_name)
        if pipeline is not None:
            return pipeline.held
        return sum(q.depth for q in self._queues.get(model_name, {}).values())

    def add_slot_listener(self, listener: SlotListener) -> Callable[[], None]:
        """Calls `listener(model_name)` on the event loop each time an item leaves a model (its
        slot is free again), and when a model gains a version. Returns a function that removes the
        listener."""
        self._listeners.append(listener)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return remove

    def _all_queues(self) -> list[ModelQueue]:
        return [q for versions in self._queues.values() for q in versions.values()] + list(self._retiring)

    def _find_retiring(self, model_name: str, version: str) -> ModelQueue | None:
        """A retiring version that still takes items (not once its grace has ended)."""
        return next(
            (
                q
                for q in self._retiring
                if q.name == model_name and q.config.version == version and not q.intake_stopped
            ),
            None,
        )

    async def start(self) -> None:
        if self._executor is not None:
            return
        queues = self._all_queues()
        workers = max(sum(q.config.max_inflight_batches for q in queues), 1)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="batcher-compute")
        for queue in queues:
            queue.start(self._executor, self._supervisor)
        self._accepting = True

    def submit(
        self,
        model_name: str,
        inputs: Sequence[Tensor],
        *,
        timeout_s: float | None = None,
        priority: Priority = Priority.NORMAL,
        progress: ItemProgress | None = None,
        version: str = "",
        credited: bool = False,
        run_timeout_s: float | None = None,
        run_alone: bool = False,
    ) -> PendingItem:
        """Validates and queues one item on the version named (empty: the model's default); its
        future resolves with an InferOutcome or an AsyncInferError. Raises at once (nothing
        queued) for an unknown model or version, invalid inputs, a full queue (unless `credited`:
        a scheduler's work order, sent on a credit this batcher granted), a deadline already
        passed, or a stopping engine. The model's progress reports for it go to `progress` (the
        caller closes it when the item ends). `run_timeout_s`: how long its job may compute (its
        work order's execution timeout), by which a batch that hangs is told apart. `run_alone`: in a
        batch of its own (a job whose previous attempt was lost with its batcher)."""
        pipeline = self._pipelines.get(model_name)
        queue = self._queue(model_name, version) if pipeline is None else None
        if not self._accepting:
            if self._stopping:
                raise Unavailable(SHUTTING_DOWN, reason=SHUTDOWN_REASON)
            raise Unavailable("batcher not started", reason="BATCHER_UNAVAILABLE")
        if queue is None:
            assert pipeline is not None
            if timeout_s is not None and timeout_s <= 0:
                raise DeadlineExceeded("the item's deadline passed before it was queued")
            return pipeline.submit(
                inputs, timeout_s, priority, progress, credited=credited, run_timeout_s=run_timeout_s
            )
        queue.check(inputs)
        if timeout_s is not None and timeout_s <= 0:
            raise DeadlineExceeded("the item's deadline passed before it was queued")
        item = queue.submit(inputs, timeout_s, priority, credited=credited)
        item.progress = progress
        item.run_timeout_s = run_timeout_s
        item.run_alone = run_alone
        return item

    def submit_chunk(
        self,
        model_name: str,
        inputs: Sequence[Tensor],
        *,
        timeout_s: float | None = None,
        priority: Priority = Priority.LOW,
        version: str = "",
        run_timeout_s: float | None = None,
    ) -> ChunkItem:
        """A batch's chunk (more rows than max_batch_size) as parts of at most max_batch_size
        rows, queued like items (services.batcher.chunk_items) on the version named (empty: the
        default); raises as `submit` does."""
        queue = self._queue(model_name, version)
        if not self._accepting:
            raise Unavailable(SHUTTING_DOWN, reason=SHUTDOWN_REASON)
        queue.check(inputs, any_rows=True)
        if timeout_s is not None and timeout_s <= 0:
            raise DeadlineExceeded("the item's deadline passed before it was queued")
        rows = inputs[0].batch_size
        order = None
        lengths = queue.backend.token_lengths({t.name: t.to_numpy() for t in inputs})
        if lengths is not None and len(lengths) == rows:
            order = sorted(range(rows), key=lengths.__getitem__)
        parts: list[PendingItem] = []
        # One expiry for every part (cutting the parts takes a while).
        now = asyncio.get_running_loop().time()
        expires_at = None if timeout_s is None else now + timeout_s
        try:
            for part in part_rows(rows, queue.config.max_batch_size, order):
                sliced = [take_rows(t, part) for t in inputs]
                queued_part = queue.submit(sliced, timeout_s, priority, credited=True, expires_at=expires_at)
                # Its job's execution deadline, which a retired version's drain waits for.
                queued_part.ends_by = None if run_timeout_s is None else now + run_timeout_s
                parts.append(queued_part)
        except BaseException:
            for queued in parts:
                queued.cancel()
            raise
        chunk = ChunkItem(parts, order)
        if run_timeout_s is not None:
            # Its parts run in several batches: timed out from its arrival, not a batch's start.
            time_out_from_now(chunk.future, run_timeout_s, parts)
        return chunk

    async def infer(
        self,
        model_name: str,
        inputs: Sequence[Tensor],
        *,
        timeout_s: float | None = None,
        priority: Priority = Priority.NORMAL,
        version: str = "",
    ) -> InferOutcome:
        """Runs one item through its model's batches. Cancelling the caller drops the item if its
        batch has not started."""
        item = self.submit(model_name, inputs, timeout_s=timeout_s, priority=priority, version=version)
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
        queues = self._all_queues()
        for queue in queues:
            await queue.stop_intake()
        running = [task for queue in queues for task in queue.running_batches()]
        # A batch past its items' timeouts (each answered TIMED_OUT already) is a call that does not
        # return: abandoned at once rather than waited for through the grace.
        overrun = {task for queue in queues for task in queue.overrun_batches()}
        if running:
            waited = [task for task in running if task not in overrun]
            late = set(overrun)
            if waited:
                _done, unfinished = await asyncio.wait(waited, timeout=grace_s)
                late |= unfinished
            for task in late:
                task.cancel()
            if late:
                log.warning("batches_abandoned_at_shutdown", batches=len(late), overrun=len(overrun))
                await asyncio.gather(*late, return_exceptions=True)
        await asyncio.gather(*(pipeline.close() for pipeline in self._pipelines.values()))
        if self._executor is not None:
            # A computing thread cannot be interrupted; do not wait for abandoned ones.
            self._executor.shutdown(wait=False, cancel_futures=True)
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)

    def _queue(self, model_name: str, version: str = "") -> ModelQueue:
        versions = self._queues.get(model_name)
        if not version:
            if not versions:
                raise NotFound(f"model {model_name!r} is not served here", reason="MODEL_NOT_FOUND")
            return versions[self.default_version(model_name)]
        queue = (versions or {}).get(version) or self._find_retiring(model_name, version)
        if queue is None:
            served = ", ".join(self.versions(model_name)) or "none"
            # Retriable: an order may name a version that this batcher has just unloaded (or not yet loaded).
            raise Unavailable(
                f"model {model_name!r} version {version!r} is not served here (served: {served})",
                reason=VERSION_NOT_SERVED_REASON,
            )
        return queue

    def add_reachable_listener(self, listener: Callable[[], None]) -> None:
        """Calls `listener()` each time a model's remote server goes out of reach or answers again
        (`unreachable_models` changed)."""
        self._reachable_listeners.append(listener)

    def unreachable_models(self) -> list[str]:
        """The models a version of which has its remote server (Triton) out of reach (ServerReady
        and the batcher's own health say so, as Triton's strict readiness does; the version's ready
        gauge and health too, `version_ready`; its other versions go on taking work)."""
        return [
            name for name, versions in self._queues.items() if any(not q.backend.reachable for q in versions.values())
        ]

    def version_ready(self, model_name: str, version: str = "") -> bool:
        """Whether the version serves here now: in service (loaded, not retiring) and its remote
        server (Triton) within reach. With no version, the one a request naming none runs on (the
        default version: Triton answers a ModelReady naming none for the version such a request
        gets), so a model whose other version is out of reach is ready. A pipeline: while none of its
        steps has a version out of reach."""
        pipeline = self._pipelines.get(model_name)
        if pipeline is not None:
            return version in ("", pipeline.config.version) and model_name not in self.out_of_reach()
        versions = self._queues.get(model_name)
        if not versions:
            return False
        queue = versions.get(version or self.default_version(model_name))
        return queue is not None and queue.backend.reachable

    def unreachable_versions(self) -> set[tuple[str, str]]:
        """The (model, version) whose remote server (Triton) is out of reach: announced to the
        scheduler as loading (services/batcher/work_messages.served_models), so that it sends no
        orders for them here until they answer again. A torch version of the same model beside a
        Triton one keeps taking its work (an outage stopped the whole model until session 34)."""
        return {
            (name, version)
            for name, versions in self._queues.items()
            for version, queue in versions.items()
            if not queue.backend.reachable
        }

    def out_of_reach(self) -> set[str]:
        """The models none of whose versions answers (each one's remote server out of reach), and
        the pipelines with a step on a model a version of which is out of reach: they take no work
        here, and the scheduler drops the credits it holds for them (it keeps a model's while one
        of its versions is READY)."""
        unreachable = self.unreachable_versions()
        names = {
            name
            for name, versions in self._queues.items()
            if versions and all((name, version) in unreachable for version in versions)
        }
        return names.union(*(self.pipelines_using(name) for name in {name for name, _ in unreachable}))

    def _reachable_changed(self, model_name: str) -> None:
        # The pipelines with a step on it take work as it does (their credits are their own).
        for pipeline in self.pipelines_using(model_name):
            self._notify_slot_freed(pipeline)
        for listener in list(self._reachable_listeners):
            try:
                listener()
            except Exception:
                log.exception("reachable_listener_failed", model=model_name)

    def _notify_slot_freed(self, model_name: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(model_name)
            except Exception:
                log.exception("slot_listener_failed", model=model_name)


def time_out_from_now(future: asyncio.Future[InferOutcome], run_timeout_s: float, parts: Sequence[PendingItem]) -> None:
    """Answers `future` TIMED_OUT run_timeout_s from now unless it resolves first, dropping its
    `parts` not yet started (a part computing finishes unanswered)."""

    def time_out() -> None:
        if future.done():
            return
        for part in parts:
            part.cancel()
        future.set_exception(run_timed_out(run_timeout_s, since="it arrived"))

    timer = asyncio.get_running_loop().call_later(run_timeout_s, time_out)
    future.add_done_callback(lambda _done: timer.cancel())
