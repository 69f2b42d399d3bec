"""The batcher's side of the scheduler's WorkerService.Connect stream.

One session per connection: hello (the models served), then credit grants that keep
`unused credits + items held <= max_queue_size` per model (a grant tops up to the engine's free
slots, so each item that leaves the engine earns one more credit), then one WorkResult per
WorkOrder. Orders run concurrently, each in a task the session owns. When the stream breaks, the
session's orders are abandoned (the scheduler re-queues them), and a new session starts after
a short delay (0.1 s, doubling up to `reconnect_delay_s`, so a restarted scheduler is found
at once but a dead one is not hammered) with a fresh hello and fresh credits. Protobuf stays in
this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc
import structlog

from asyncinfer.backoff import retrying
from asyncinfer.errors import (
    AsyncInferError,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from asyncinfer.jobs import Priority
from asyncinfer.supervision import Supervisor
from asyncinfer.tensor_codec import decode_tensors, to_output_proto
from asyncinfer.v1 import error_pb2, job_pb2, worker_service_pb2, worker_service_pb2_grpc
from services.batcher.engine import SHUTDOWN_REASON, BatchingEngine, InferOutcome, PendingItem

log = structlog.get_logger("asyncinfer.batcher.worker")

# Failures that the same order would meet again on any attempt.
_NOT_RETRIABLE = (InvalidArgument, NotFound, FailedPrecondition, DeadlineExceeded, Cancelled)

OrderKey = tuple[str, int]

ORDER_PRIORITIES = {
    job_pb2.PRIORITY_HIGH: Priority.HIGH,
    job_pb2.PRIORITY_NORMAL: Priority.NORMAL,
    job_pb2.PRIORITY_LOW: Priority.LOW,
}


def error_status(error: AsyncInferError) -> error_pb2.ErrorStatus:
    violations = error.violations if isinstance(error, InvalidArgument) else ()
    return error_pb2.ErrorStatus(
        code=error.code.value[0],
        reason=error.reason,
        message=error.message,
        field_violations=[error_pb2.FieldViolation(field=v.field, description=v.description) for v in violations],
        retriable=not isinstance(error, _NOT_RETRIABLE),
    )


# A WorkUpdates message being filled is closed once its outputs pass about this many bytes.
UPDATES_MESSAGE_BYTES = 4 * 1024 * 1024
FIRST_RECONNECT_DELAY_S = 0.1
STABLE_SESSION_S = 5.0


class WorkerClient:
    """Keeps one work stream to the scheduler open, reconnecting after failures."""

    def __init__(
        self,
        *,
        address: str,
        batcher_id: str,
        engine: BatchingEngine,
        reconnect_delay_s: float,
        supervisor: Supervisor,
        work_batches: bool = True,
    ) -> None:
        self._address = address
        self._supervisor = supervisor
        self._work_batches = work_batches
        self._batcher_id = batcher_id
        self._engine = engine
        self._reconnect_delay_s = reconnect_delay_s
        self._task: asyncio.Task[None] | None = None
        self._session: _WorkSession | None = None
        self._stopping = False

    async def start(self) -> None:
        if self._task is None:
            self._task = self._supervisor.start("batcher-worker-client", self._run())

    def stop_granting(self) -> None:
        """Offers no more credits (the first step of shutdown) and does not reconnect."""
        self._stopping = True
        if self._session is not None:
            self._session.stop_granting()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Sends the results of orders still in the engine and half-closes the stream, within
        grace_s; then cancels. Results not sent by then are abandoned (the scheduler re-queues
        those jobs when the stream breaks). Idempotent."""
        self.stop_granting()
        if self._task is None:
            return
        if self._session is not None and not self._task.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s):
                    await self._session.drain()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while not self._stopping:
            await self._reconnecting()

    async def _reconnecting(self) -> None:
        """Opens work streams, backing off from FIRST_RECONNECT_DELAY_S up to reconnect_delay_s
        between them, until one that was up for STABLE_SESSION_S ends (the next failure is a new
        one: the backoff starts again) or the client stops."""
        first_delay_s = min(FIRST_RECONNECT_DELAY_S, self._reconnect_delay_s)
        async for attempt in retrying(
            _StreamEnded, retry_for_s=None, first_delay_s=first_delay_s, max_delay_s=self._reconnect_delay_s
        ):
            with attempt:
                if self._stopping:
                    return
                started = time.monotonic()
                await self._stream_once()
                if time.monotonic() - started > STABLE_SESSION_S:
                    return
                raise _StreamEnded

    async def _stream_once(self) -> None:
        """One work stream, from connecting until it ends (each way it ends is logged)."""
        try:
            # Work orders carry whole inputs (up to the gateway's upload limit); the scheduler,
            # a trusted peer, bounds them with its own server's send limit.
            options = [("grpc.max_receive_message_length", -1)]
            async with grpc.aio.insecure_channel(self._address, options=options) as channel:
                stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
                self._session = _WorkSession(stub, self._batcher_id, self._engine, work_batches=self._work_batches)
                await self._session.run()
            log.warning("work_stream_closed_by_scheduler", scheduler=self._address)
        except grpc.aio.AioRpcError as error:
            log.warning(
                "work_stream_failed",
                scheduler=self._address,
                code=error.code().name,
                details=error.details(),
            )
        except Exception:
            log.exception("work_stream_failed", scheduler=self._address)


class _StreamEnded(Exception):
    """A work stream ended before it was up for STABLE_SESSION_S: reconnect after a backoff."""


class _WorkSession:
    """One connection: its outbox, credit accounting and orders."""

    def __init__(
        self,
        stub: worker_service_pb2_grpc.WorkerServiceAsyncStub,
        batcher_id: str,
        engine: BatchingEngine,
        *,
        work_batches: bool,
    ) -> None:
        self._stub = stub
        self._work_batches = work_batches
        self._batcher_id = batcher_id
        self._engine = engine
        # None ends the request stream (a half-close).
        self._outbox: asyncio.Queue[worker_service_pb2.ConnectRequest | None] = asyncio.Queue()
        self._unused_credits = dict.fromkeys(engine.model_names, 0)
        self._orders: dict[OrderKey, PendingItem] = {}
        self._order_tasks: set[asyncio.Task[None]] = set()
        self._open = True
        self._granting = True
        self._ended = asyncio.Event()
        # Once the scheduler's welcome says it takes batches, results and credits are added to
        # the WorkUpdates message being filled, which is in the outbox already: whatever is
        # ready when the writer gets to it goes together, and a lone result goes at once.
        self._batches = False
        self._filling: worker_service_pb2.ConnectRequest | None = None
        self._filling_bytes = 0

    def stop_granting(self) -> None:
        self._granting = False

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
        call = self._stub.Connect()  # type: ignore[call-arg]  # the stubs miss the write() style
        writer = asyncio.create_task(self._write(call), name="batcher-work-stream-writer")
        try:
            self._send(worker_service_pb2.ConnectRequest(hello=self._hello()))
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
        """Sends the outbox in order; None half-closes the stream."""
        while (message := await self._outbox.get()) is not None:
            if message is self._filling:
                self._filling = None  # closed: what comes next goes in a new one
            await call.write(message)
        await call.done_writing()

    def _updates(self) -> worker_service_pb2.WorkUpdates:
        """The WorkUpdates message being filled (a new one, queued, when none is open or the open
        one is full)."""
        if self._filling is None or self._filling_bytes > UPDATES_MESSAGE_BYTES:
            self._filling = worker_service_pb2.ConnectRequest(updates=worker_service_pb2.WorkUpdates())
            self._filling_bytes = 0
            self._outbox.put_nowait(self._filling)
        return self._filling.updates

    def _hello(self) -> worker_service_pb2.WorkerHello:
        models = []
        for name in self._engine.model_names:
            config = self._engine.model_config(name)
            models.append(
                worker_service_pb2.ServedModel(
                    model_name=name, model_version=config.version, max_batch_size=config.max_batch_size
                )
            )
        return worker_service_pb2.WorkerHello(
            batcher_id=self._batcher_id, models=models, takes_batches=self._work_batches
        )

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
        elif kind == "welcome":
            self._batches = self._work_batches and response.welcome.takes_batches
            log.info("scheduler_connected", scheduler_id=response.welcome.scheduler_id, batches=self._batches)

    def _top_up(self, model_name: str) -> None:
        """Grants credits up to the model's free slots, counting credits not yet used."""
        if not (self._open and self._granting) or model_name not in self._unused_credits:
            return
        wanted = self._engine.free_slots(model_name) - self._unused_credits[model_name]
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
        job_log = log.bind(job_id=order.job_id, attempt=order.attempt, model=model_name, tenant=order.tenant)
        try:
            item = self._submit(order)
        except AsyncInferError as error:
            job_log.info("work_order_rejected", reason=error.reason, error=error.message)
            if not _is_shutdown(error):  # unanswered: re-queued when the stream closes
                self._send_result(order, error=error)
            self._top_up(model_name)  # the credit it used bought no slot
            return
        key = (order.job_id, order.attempt)
        self._orders[key] = item
        task = asyncio.create_task(self._finish(order, item, job_log), name=f"order-{order.job_id}")
        self._order_tasks.add(task)
        task.add_done_callback(self._order_tasks.discard)

    def _submit(self, order: worker_service_pb2.WorkOrder) -> PendingItem:
        if not self._engine.has_model(order.model_name):
            raise NotFound(f"model {order.model_name!r} is not served here", reason="MODEL_NOT_FOUND")
        version = self._engine.model_config(order.model_name).version
        if order.model_version and order.model_version != version:
            raise NotFound(
                f"model {order.model_name!r} has no version {order.model_version!r} (served: {version!r})",
                reason="MODEL_VERSION_NOT_FOUND",
            )
        if order.input_ref:
            raise FailedPrecondition(
                "claim-check inputs (input_ref) are not supported by this batcher yet", reason="INPUT_REF_UNSUPPORTED"
            )
        inputs = decode_tensors(order.inputs)
        timeout_s = order.deadline.ToNanoseconds() / 1e9 - time.time() if order.HasField("deadline") else None
        return self._engine.submit(
            order.model_name,
            inputs,
            timeout_s=timeout_s,
            priority=ORDER_PRIORITIES.get(order.priority, Priority.NORMAL),
        )

    async def _finish(self, order: worker_service_pb2.WorkOrder, item: PendingItem, job_log: Any) -> None:
        key = (order.job_id, order.attempt)
        try:
            # wait() rather than await: a dropped item must not look like this task's cancellation.
            await asyncio.wait([item.future])
        except asyncio.CancelledError:
            item.cancel()
            raise
        finally:
            self._orders.pop(key, None)
        if item.future.cancelled():
            job_log.info("work_order_dropped_before_run")
            self._send_result(order, error=Cancelled("cancelled before it ran"), dropped=True)
            return
        error = item.future.exception()
        if isinstance(error, AsyncInferError) and _is_shutdown(error):
            # Not the job's fault: it goes back to the queue when the stream closes, without
            # spending an attempt on a failure.
            job_log.info("work_order_abandoned_at_shutdown")
        elif isinstance(error, AsyncInferError):
            job_log.info("work_order_failed", reason=error.reason, error=error.message)
            self._send_result(order, error=error, dropped=isinstance(error, DeadlineExceeded))
        elif error is not None:
            raise error
        else:
            outcome = item.future.result()
            job_log.debug("work_order_done", batch_size=outcome.batch_items, compute_s=outcome.compute_s)
            self._send_result(order, outcome=outcome)

    def _cancel(self, cancel: worker_service_pb2.CancelOrder) -> None:
        item = self._orders.get((cancel.job_id, cancel.attempt))
        # Dropping resolves the item's future; its order task then answers dropped=true.
        if item is not None and item.cancel():
            log.info("work_order_cancelled", job_id=cancel.job_id, attempt=cancel.attempt)

    def _send_result(
        self,
        order: worker_service_pb2.WorkOrder,
        *,
        outcome: InferOutcome | None = None,
        error: AsyncInferError | None = None,
        dropped: bool = False,
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
        if error is not None:
            result.error.CopyFrom(error_status(error))
        if outcome is not None:
            result.outputs.extend(to_output_proto(t, raw=True) for t in outcome.outputs)
            result.batch_size = outcome.batch_items
            result.compute_duration.FromNanoseconds(round(outcome.compute_s * 1e9))
            self._filling_bytes += sum(t.nbytes for t in outcome.outputs)
        if request is not None:
            self._send(request)


def _is_shutdown(error: AsyncInferError) -> bool:
    return isinstance(error, Unavailable) and error.reason == SHUTDOWN_REASON
