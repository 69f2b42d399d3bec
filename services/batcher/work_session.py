"""One connection of the batcher's work stream to the scheduler (see worker_client.py for the
reconnect loop around it): hello (the models served), then credit grants that keep
`unused credits + items held <= max_queue_size` per model (a grant tops up to the engine's free
slots, so each item that leaves the engine earns one more credit), then one WorkResult per
WorkOrder. Orders run concurrently, each in a task the session owns; when the stream breaks they
are cancelled, unanswered (the scheduler re-queues them).

Results and credits are written into the WorkUpdates message being filled while it waits in the
outbox, so the per-result path is a few field writes, with no queue or task of its own. So is the
progress of orders whose model reports it (services.batcher.progress: at most one per order per
progress interval, the latest report; an order's last one goes in before its result). Progress
goes only to a scheduler whose welcome takes batches.

With `claim_checks` (batcher.claim_check_io) an order that names its input by reference is read
from the object store in its own task first (its credit counts as used meanwhile), and outputs
over the order's threshold are stored there; the result then carries their reference.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import structlog

from asyncinfer.config import ModelConfig
from asyncinfer.errors import AsyncInferError, Cancelled, DeadlineExceeded, FailedPrecondition
from asyncinfer.jobs import BlobRef
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.tensor_codec import fill_tensor_proto, to_output_proto
from asyncinfer.tensors import Tensor
from asyncinfer.tracing import trace_fields
from asyncinfer.v1 import worker_service_pb2, worker_service_pb2_grpc
from services.batcher.chunk_items import ChunkItem
from services.batcher.claim_checks import ClaimChecks
from services.batcher.engine import BatchingEngine, InferOutcome, PendingItem
from services.batcher.model_control import ModelControl
from services.batcher.progress import ItemProgress, LeftOutLog, ProgressUpdate
from services.batcher.work_messages import (
    error_status,
    is_handed_back,
    is_out_of_reach,
    is_shutdown,
    load_failures,
    run_control,
    served_models,
    submit_order,
    worker_hello,
)

log = structlog.get_logger("asyncinfer.batcher.worker")

OrderKey = tuple[str, int]

# A WorkUpdates message being filled is closed once its outputs pass about this many bytes.
UPDATES_MESSAGE_BYTES = 4 * 1024 * 1024


class WorkSession:
    """One connection: its outbox, credit accounting and orders."""

    def __init__(
        self,
        stub: worker_service_pb2_grpc.WorkerServiceAsyncStub,
        batcher_id: str,
        engine: BatchingEngine,
        *,
        work_batches: bool,
        metadata: tuple[tuple[str, str], ...] = (),
        progress_interval_s: float = 0.15,
        progress_max_bytes: int = 256 * 1024,
        loading: Iterable[ModelConfig] = (),
        models: ModelControl | None = None,
        claim_checks: ClaimChecks | None = None,
        max_result_bytes: int = 0,
        on_welcome: Callable[[], None] | None = None,
        failed_orders: RepeatedLines | None = None,
    ) -> None:
        """`on_welcome`: called when the scheduler answers the hello (the stream is up).
        `failed_orders`: the lines said of each of many orders (failed, rejected, handed back,
        cancelled), the batcher's own, so that a reconnect does not start their interval again."""
        self._failed_orders = failed_orders or RepeatedLines()
        self._on_welcome = on_welcome
        self._claim_checks = claim_checks
        # The most output bytes one result may carry inline: the scheduler's limit for a stream
        # message (asyncinfer.worker_stream) less the WorkUpdates it may share (0: no check).
        self._max_result_bytes = max_result_bytes
        # Orders whose inputs are being read (claim_checks), per model, and those cancelled meanwhile.
        self._reading: dict[str, set[OrderKey]] = {}
        self._cancelled_while_reading: set[OrderKey] = set()
        self._loading = tuple(loading)
        self._models = models
        self._stub = stub
        self._progress_interval_s = progress_interval_s
        self._progress_max_bytes = progress_max_bytes
        self._progress_left_out = LeftOutLog()
        self._metadata = metadata
        self._work_batches = work_batches
        self._batcher_id = batcher_id
        self._engine = engine
        # None ends the request stream (a half-close).
        self._outbox: asyncio.Queue[worker_service_pb2.ConnectRequest | None] = asyncio.Queue()
        self._unused_credits = dict.fromkeys(engine.model_names, 0)
        # The models announced LOADING whole while their Triton is out of reach (engine.out_of_reach:
        # every version's; a model with a version still READY keeps its credits): the scheduler
        # dropped their credits and refuses a grant for them, so none is offered until one of their
        # versions is announced READY again.
        self._out_of_reach: set[str] = set()
        self._orders: dict[OrderKey, PendingItem | ChunkItem] = {}
        self._order_tasks: set[asyncio.Task[None]] = set()
        self._open = True
        self._granting = True
        self._ended = asyncio.Event()
        # Once the scheduler's welcome says it takes batches, results and credits are added to
        # the WorkUpdates message being filled, which is in the outbox already: whatever is
        # ready when the writer gets to it goes together, and a lone result goes at once.
        self._batches = False
        self.welcomed = False  # the scheduler answered the hello: the stream was up
        self._welcome = asyncio.Event()
        self._filling: worker_service_pb2.ConnectRequest | None = None
        self._filling_bytes = 0

    def stop_granting(self) -> None:
        """The batcher stops: no more credits, and the scheduler is told that it serves nothing
        now, so that it drops the credits it holds here and sends no more orders (one already on
        its way is answered dropped, its attempt given back). Its orders in flight still end here."""
        self._granting = False
        if self._open:
            self._send(worker_service_pb2.ConnectRequest(models=worker_service_pb2.ServedModels()))

    def models_changed(self, loading: Iterable[ModelConfig] = ()) -> None:
        """Tells the scheduler the versions served now (and those loading), then offers credits for
        any model that is new here. Sent before the engine retires a version, so that the
        scheduler stops sending it orders while its last ones still run."""
        out_of_reach = self._engine.out_of_reach()
        self._send(
            worker_service_pb2.ConnectRequest(
                models=worker_service_pb2.ServedModels(
                    models=served_models(self._engine, loading), load_failures=load_failures(self._models)
                )
            )
        )
        # Credits granted from now on go in a message after this one: the scheduler refuses a grant
        # for a model it has not been told it serves (INVALID_ARGUMENT, the stream ends).
        self._filling = None
        for model_name in out_of_reach - self._out_of_reach:
            self._unused_credits[model_name] = 0  # the scheduler drops them
        self._out_of_reach = out_of_reach
        served = self._engine.model_names
        for model_name in [name for name in self._unused_credits if name not in served]:
            # The scheduler drops a model's credits when no version of it is served any more.
            del self._unused_credits[model_name]
        for model_name in served:
            self._unused_credits.setdefault(model_name, 0)
            self._top_up(model_name)

    async def drain(self) -> None:
        """Waits for every order to be answered, half-closes, and waits for the scheduler to end
        the stream."""
        self._granting = False
        while self._order_tasks:
            await asyncio.wait(set(self._order_tasks))
        if self._open:
            self._outbox.put_nowait(None)
        await self._ended.wait()

    async def run(self) -> None:
        """Returns when the scheduler ends the stream; raises when it breaks."""
        remove_listener = self._engine.add_slot_listener(self._top_up)
        # Requests are written by a task this session owns, not pulled from an async generator
        # by grpc's own consumer task: that task and generator cannot be stopped from here, and
        # were left pending (then destroyed by the garbage collector) each time the stream broke.
        call = self._stub.Connect(metadata=self._metadata or None)  # type: ignore[call-arg]  # the stubs miss the write() style
        writer = asyncio.create_task(self._write(call), name="batcher-work-stream-writer")
        try:
            self._out_of_reach = self._engine.out_of_reach()  # the hello announces them LOADING
            hello = worker_hello(
                self._engine,
                self._batcher_id,
                takes_batches=self._work_batches,
                loading=self._loading,
                reads_claim_checks=self._claim_checks is not None,
                models=self._models,
            )
            self._send(worker_service_pb2.ConnectRequest(hello=hello))
            for model_name in self._unused_credits:
                self._top_up(model_name)
            async for response in call:
                self._handle(response)
        finally:
            self._open = False
            self._ended.set()
            remove_listener()
            call.cancel()
            writer.cancel()
            tasks = [writer, *self._order_tasks]
            for task in self._order_tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _write(self, call: Any) -> None:
        """Sends the outbox in order, nothing after the hello until the scheduler's welcome; None
        half-closes the stream."""
        hello_sent = False
        while (message := await self._outbox.get()) is not None:
            if hello_sent and not self._welcome.is_set():
                # The scheduler answers the hello with its welcome or its refusal (a key it does not
                # take, UNAUTHENTICATED). A write in flight when a refusal lands fails, and grpc's aio
                # client then reports the call as INTERNAL "Internal error from Core", overwriting
                # the status the scheduler sent (grpc/grpc#36066): the operator read INTERNAL, not
                # that this batcher's key was refused. Credits and the rest wait for the welcome.
                await self._welcome.wait()
            if message is self._filling:
                # One loop iteration before it closes, for what the same step made ready: a
                # finished item frees its credit a step before its order task answers it, and
                # the answer then rides with the credit instead of waiting for its write.
                await asyncio.sleep(0)
                self._filling = None  # closed: what comes next goes in a new one
            await call.write(message)
            hello_sent = True
        await call.done_writing()

    def _updates(self) -> worker_service_pb2.WorkUpdates:
        """The WorkUpdates message being filled (a new one, queued, when none is open or the open
        one is full)."""
        if self._filling is None or self._filling_bytes > UPDATES_MESSAGE_BYTES:
            self._filling = worker_service_pb2.ConnectRequest(updates=worker_service_pb2.WorkUpdates())
            self._filling_bytes = 0
            self._outbox.put_nowait(self._filling)
        return self._filling.updates

    def _send(self, message: worker_service_pb2.ConnectRequest) -> None:
        if self._open:
            self._outbox.put_nowait(message)

    def _handle(self, response: worker_service_pb2.ConnectResponse) -> None:
        kind = response.WhichOneof("message")
        if kind == "orders":
            for order in response.orders.orders:
                self._accept(order)
            for cancel in response.orders.cancels:
                self._cancel(cancel)
        elif kind == "order":
            self._accept(response.order)
        elif kind == "cancel":
            self._cancel(response.cancel)
        elif kind == "control":
            self._spawn(self._control(response.control), f"control-{response.control.model_name}")
        elif kind == "welcome":
            self.welcomed = True
            self._welcome.set()
            self._batches = self._work_batches and response.welcome.takes_batches
            log.info("scheduler_connected", scheduler_id=response.welcome.scheduler_id, batches=self._batches)
            if self._on_welcome is not None:
                self._on_welcome()

    def _top_up(self, model_name: str) -> None:
        """Grants credits up to the model's free slots, counting credits not yet used."""
        if not (self._open and self._granting) or model_name not in self._unused_credits:
            return
        if model_name in self._out_of_reach:
            return
        reading = len(self._reading.get(model_name, ()))  # orders that will take a slot once read
        wanted = self._engine.free_slots(model_name) - self._unused_credits[model_name] - reading
        if wanted > 0:
            self._unused_credits[model_name] += wanted
            if self._batches:
                self._updates().credits.add(model_name=model_name, credits=wanted)
                return
            grant = worker_service_pb2.CreditGrant(model_name=model_name, credits=wanted)
            self._send(worker_service_pb2.ConnectRequest(credit=grant))

    def _accept(self, order: worker_service_pb2.WorkOrder) -> None:
        model_name = order.model_name
        if model_name in self._unused_credits:
            self._unused_credits[model_name] = max(self._unused_credits[model_name] - 1, 0)
        if order.input_ref and self._claim_checks is not None:
            self._reading.setdefault(model_name, set()).add((order.job_id, order.attempt))
            self._spawn(self._read_then_submit(order, self._claim_checks), f"order-{order.job_id}")
            return
        self._submit(order)

    async def _read_then_submit(self, order: worker_service_pb2.WorkOrder, claim_checks: ClaimChecks) -> None:
        key = (order.job_id, order.attempt)
        try:
            inputs = await claim_checks.read(order)
        except AsyncInferError as error:
            self._reading_done(order)
            self._failed_orders.say(
                log,
                "info",
                "work_order_input_unreadable",
                kind=(order.model_name, error.reason),
                reason=error.reason,
                error=error.message,
                **_about(order),
            )
            self._send_result(order, error=error)
            self._top_up(order.model_name)
            return
        except BaseException:
            self._reading_done(order)
            raise
        self._reading_done(order)
        if key in self._cancelled_while_reading:
            self._cancelled_while_reading.discard(key)
            self._failed_orders.say(
                log, "info", "work_order_dropped_before_run", kind=order.model_name, **_about(order)
            )
            self._send_result(order, error=Cancelled("cancelled before it ran"), dropped=True)
            self._top_up(order.model_name)
            return
        item = self._submit(order, inputs, spawn=False)  # in the same step: its slot is taken at once
        if item is not None:
            await self._finish(order, item)

    def _reading_done(self, order: worker_service_pb2.WorkOrder) -> None:
        self._reading.get(order.model_name, set()).discard((order.job_id, order.attempt))

    def _submit(
        self,
        order: worker_service_pb2.WorkOrder,
        read_inputs: tuple[Tensor, ...] | None = None,
        *,
        spawn: bool = True,
    ) -> PendingItem | ChunkItem | None:
        """Puts the order in the engine (its answer awaited by a task of its own when `spawn`);
        the item, or None when the engine refused it (answered here)."""
        model_name = order.model_name
        progress = None
        version = order.model_version
        if (
            self._batches
            and self._engine.has_model(model_name, version)
            and self._engine.reports_progress(model_name, version)
        ):
            progress = ItemProgress(
                lambda update: self._send_progress(order, update),
                interval_s=self._progress_interval_s,
                max_bytes=self._progress_max_bytes,
                left_out=self._progress_left_out,
            )
        try:
            item = submit_order(self._engine, order, progress, read_inputs)
            if self._engine.tracing.enabled:
                item.trace = order.traceparent
        except AsyncInferError as error:
            if is_handed_back(error):  # it never ran: back to the queue with its attempt given back
                self._failed_orders.say(
                    log,
                    "info",
                    "work_order_handed_back",
                    kind=(order.model_name, error.reason),
                    reason=error.reason,
                    error=error.message,
                    **_about(order),
                )
                self._send_result(order, dropped=True)
            else:
                self._failed_orders.say(
                    log,
                    "info",
                    "work_order_rejected",
                    kind=(order.model_name, error.reason),
                    reason=error.reason,
                    error=error.message,
                    **_about(order),
                )
                self._send_result(order, error=error)
            self._top_up(model_name)  # the credit it used bought no slot
            return None
        self._orders[(order.job_id, order.attempt)] = item
        if spawn:
            self._spawn(self._finish(order, item), f"order-{order.job_id}")
        return item

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """A task of this session (cancelled when the stream breaks, awaited by drain)."""
        task = asyncio.create_task(work, name=name)
        self._order_tasks.add(task)
        task.add_done_callback(self._order_tasks.discard)

    async def _control(self, control: worker_service_pb2.ModelControl) -> None:
        self._send(await run_control(self._models, control))

    async def _finish(self, order: worker_service_pb2.WorkOrder, item: PendingItem | ChunkItem) -> None:
        key = (order.job_id, order.attempt)
        try:
            # wait() rather than await: a dropped item must not look like this task's cancellation.
            await asyncio.wait([item.future])
        except asyncio.CancelledError:
            item.cancel()
            raise
        finally:
            self._orders.pop(key, None)
            if item.progress is not None:
                item.progress.close()  # its last report goes before the result
        if item.future.cancelled():
            self._failed_orders.say(
                log, "info", "work_order_dropped_before_run", kind=order.model_name, **_about(order)
            )
            self._send_result(order, error=Cancelled("cancelled before it ran"), dropped=True)
            return
        error = item.future.exception()
        if isinstance(error, AsyncInferError) and is_shutdown(error):
            # Unrun (the engine stops): answered as dropped, so that the scheduler puts it back
            # with its attempt given back. Left unanswered, the stream's end put it back as
            # its batcher lost, spending the attempt: a job of max_attempts 1 failed at a rollout.
            self._failed_orders.say(
                log,
                "info",
                "work_order_abandoned_at_shutdown",
                kind=order.model_name,
                started=item.started,
                **_about(order),
            )
            # No error: one would count as the attempt's. One abandoned mid-batch (its grace ran
            # out) is given back too: left to the stream's end it was WORKER_LOST, its attempt
            # spent, so a job longer than the grace was dead-lettered by three Ctrl-Cs of `up`.
            self._send_result(order, dropped=True)
        elif isinstance(error, AsyncInferError) and is_out_of_reach(error):
            # Its model's Triton is out of reach: given back unrun, as a shutdown's (no error).
            self._failed_orders.say(
                log,
                "info",
                "work_order_handed_back",
                kind=(order.model_name, error.reason),
                reason=error.reason,
                started=item.started,
                **_about(order),
            )
            self._send_result(order, dropped=True)
        elif isinstance(error, AsyncInferError):
            # The first of a model's failures, then one per interval (the rest at debug): a model
            # that always fails fails every order.
            self._failed_orders.say(
                log,
                "info",
                "work_order_failed",
                kind=(order.model_name, error.reason),
                reason=error.reason,
                error=error.message,
                **_about(order),
            )
            self._send_result(order, error=error, dropped=isinstance(error, DeadlineExceeded))
        elif error is not None:
            raise error
        else:
            outcome = item.future.result()
            if self._claim_checks is not None and self._claim_checks.stores(order, outcome.outputs):
                try:
                    stored = await self._claim_checks.store(order, outcome.outputs)
                except AsyncInferError as store_error:
                    self._failed_orders.say(
                        log,
                        "warning",
                        "work_order_outputs_not_stored",
                        kind=(order.model_name, store_error.reason),
                        error=store_error.message,
                        **_about(order),
                    )
                    self._send_result(order, error=store_error)
                    return
                self._send_result(order, outcome=outcome, stored=stored)
                return
            self._send_result(order, outcome=outcome)

    def _cancel(self, cancel: worker_service_pb2.CancelOrder) -> None:
        key = (cancel.job_id, cancel.attempt)
        if any(key in reading for reading in self._reading.values()):
            self._cancelled_while_reading.add(key)  # answered dropped once its read ends
            return
        item = self._orders.get(key)
        if item is None:
            return
        # Dropping resolves the item's future; its order task then answers dropped=true.
        if item.cancel():
            self._failed_orders.say(
                log, "info", "work_order_cancelled", kind="cancelled", job_id=cancel.job_id, attempt=cancel.attempt
            )
        elif item.progress is not None:
            # Its batch runs: a model that reports progress may stop working on it (progress.py).
            item.progress.cancel()
            self._failed_orders.say(
                log,
                "info",
                "work_order_cancel_signalled",
                kind="signalled",
                job_id=cancel.job_id,
                attempt=cancel.attempt,
            )

    def _send_progress(self, order: worker_service_pb2.WorkOrder, update: ProgressUpdate) -> None:
        if not (self._open and self._batches):
            return
        sent = self._updates().progress.add(job_id=order.job_id, attempt=order.attempt, step=update.step)
        report = sent.progress
        report.fraction = -1.0 if update.fraction is None else update.fraction
        report.message = update.message
        report.partial_outputs.extend(to_output_proto(t, raw=True) for t in update.outputs)
        self._filling_bytes += sum(t.nbytes for t in update.outputs)

    def _send_result(
        self,
        order: worker_service_pb2.WorkOrder,
        *,
        outcome: InferOutcome | None = None,
        error: AsyncInferError | None = None,
        dropped: bool = False,
        stored: BlobRef | None = None,
    ) -> None:
        if not self._open:
            return
        request: worker_service_pb2.ConnectRequest | None = None
        if self._batches:
            result = self._updates().results.add()
        else:
            request = worker_service_pb2.ConnectRequest()
            result = request.result
        result.job_id = order.job_id
        result.attempt = order.attempt
        result.dropped = dropped
        if outcome is not None and stored is None and self._max_result_bytes:
            size = sum(t.nbytes for t in outcome.outputs)
            if size > self._max_result_bytes:
                # Sent, it would end the stream (RESOURCE_EXHAUSTED on the scheduler's side) and every
                # other job on it with WORKER_LOST; as the same output again, the job's next attempt.
                error, outcome = output_too_large(size, self._max_result_bytes), None
                self._failed_orders.say(
                    log,
                    "warning",
                    "work_result_too_large",
                    kind=order.model_name,
                    bytes=size,
                    limit=self._max_result_bytes,
                    **_about(order),
                )
        if error is not None:
            result.error.CopyFrom(error_status(error))
        if outcome is not None:
            if stored is not None:
                result.output_ref.ref = stored.ref
                result.output_ref.size_bytes = stored.size_bytes
                result.output_ref.sha256 = stored.sha256
            else:
                for tensor in outcome.outputs:
                    fill_tensor_proto(result.outputs.add(), tensor, raw=True)
                self._filling_bytes += sum(t.nbytes for t in outcome.outputs)
            result.batch_size = outcome.batch_items
            result.compute_duration.FromNanoseconds(round(outcome.compute_s * 1e9))
        if request is not None:
            self._send(request)


def output_too_large(size: int, limit: int) -> FailedPrecondition:
    """Final: the model's answer to the same input would be as large the next time."""
    return FailedPrecondition(
        f"the model's outputs are {size} bytes, over the {limit} a work stream message may carry (set by "
        "gateway.max_upload_bytes); turn batcher.claim_check_io on to store large outputs apart",
        reason="OUTPUT_TOO_LARGE",
    )


def _about(order: worker_service_pb2.WorkOrder) -> dict[str, object]:
    """What a log line about an order names. Not log.bind() per order: binding costs on every order
    even when nothing is logged (a successful order logs nothing at info)."""
    about = {"job_id": order.job_id, "attempt": order.attempt, "model": order.model_name, "tenant": order.tenant}
    return {**about, **trace_fields(order.traceparent)}
