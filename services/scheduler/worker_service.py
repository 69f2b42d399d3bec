"""WorkerService: the Connect stream batchers hold to the scheduler.

Protobuf stays here: requests become `services.scheduler.messages` types, work orders become
protobuf only on their way out. A session's outbound queue is drained by this method's response
iterator; a reader task handles what the batcher sends. However the stream ends (the batcher
closes it, the connection breaks, a protocol error, the scheduler stops), the session is
unregistered and its in-flight jobs go back to the queue at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
import structlog

from asyncinfer.errors import AsyncInferError, FailedPrecondition, FieldViolation, InvalidArgument
from asyncinfer.jobs import BlobRef, JobError, Priority, ProgressReport
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.supervision import failure_logged
from asyncinfer.tensor_codec import decode_tensors, fill_tensor_proto
from asyncinfer.tensors import ModelSignature, Tensor, TensorSpec
from asyncinfer.v1 import error_pb2, job_pb2, job_service_pb2, worker_service_pb2, worker_service_pb2_grpc
from services.scheduler.batchers import BatcherRegistry, BatcherSession
from services.scheduler.jobs_flow import JobFlow
from services.scheduler.messages import (
    CancelOrder,
    CreditGrant,
    LoadFailure,
    ModelControlOrder,
    ServedModel,
    WorkerHello,
    WorkOrder,
    WorkProgress,
    WorkResult,
)
from services.scheduler.model_controls import ModelControls

# Orders gathered into one WorkOrders message stop at about this many bytes of inputs (a message
# always holds at least one order); the rest go in the next one.
ORDERS_MESSAGE_BYTES = 4 * 1024 * 1024
# Results of one batcher stored at once (each holds one decoded result in memory meanwhile).
RESULTS_STORED_AT_ONCE = 128

log = structlog.get_logger("asyncinfer.scheduler.workers")

PRIORITY_TO_PROTO: dict[Priority, job_pb2.Priority.ValueType] = {
    Priority.HIGH: job_pb2.PRIORITY_HIGH,
    Priority.NORMAL: job_pb2.PRIORITY_NORMAL,
    Priority.LOW: job_pb2.PRIORITY_LOW,
}


# --- protobuf <-> domain ------------------------------------------------------------------------


def hello_from_proto(message: worker_service_pb2.WorkerHello) -> WorkerHello:
    violations: list[FieldViolation] = []
    if not message.batcher_id:
        violations.append(FieldViolation("hello.batcher_id", "a batcher needs an ID"))
    if not message.models and not message.load_failures:
        violations.append(FieldViolation("hello.models", "a batcher must serve at least one model"))
    for index, model in enumerate(message.models):
        if not model.model_name:
            violations.append(FieldViolation(f"hello.models[{index}].model_name", "every model needs a name"))
    if violations:
        raise InvalidArgument(f"invalid hello: {violations[0].field}: {violations[0].description}", violations)
    return WorkerHello(
        batcher_id=message.batcher_id,
        models=served_from_proto(message.models),
        takes_batches=message.takes_batches,
        reads_claim_checks=message.reads_claim_checks,
        times_out_runs=message.times_out_runs,
        load_failures=failures_from_proto(message.load_failures),
    )


def failures_from_proto(failures: Iterable[worker_service_pb2.ModelLoadFailure]) -> tuple[LoadFailure, ...]:
    return tuple(LoadFailure(f.model_name, f.model_version, f.reason[:1024]) for f in failures if f.model_name)


def served_from_proto(models: Iterable[worker_service_pb2.ServedModel]) -> tuple[ServedModel, ...]:
    def specs(tensors: Iterable[job_service_pb2.TensorSpec]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(name=t.name, datatype=t.datatype, shape=tuple(t.shape)) for t in tensors)

    return tuple(
        ServedModel(
            model_name=m.model_name,
            model_version=m.model_version,
            max_batch_size=m.max_batch_size,
            ready=m.state != job_service_pb2.MODEL_VERSION_STATE_LOADING,
            signature=ModelSignature(inputs=specs(m.inputs), outputs=specs(m.outputs)) if m.inputs else None,
        )
        for m in models
        if m.model_name
    )


def credit_from_proto(message: worker_service_pb2.CreditGrant) -> CreditGrant:
    return CreditGrant(model_name=message.model_name, credits=message.credits)


def error_from_proto(message: error_pb2.ErrorStatus) -> JobError:
    return JobError(
        code=message.code,
        reason=message.reason or "UNKNOWN",
        message=message.message,
        violations=tuple(FieldViolation(v.field, v.description) for v in message.field_violations),
        retriable=message.retriable,
        metadata=tuple(sorted(message.metadata.items())),
    )


def result_from_proto(message: worker_service_pb2.WorkResult) -> WorkResult:
    outputs: tuple[Tensor, ...] = ()
    error = error_from_proto(message.error) if message.HasField("error") else None
    if error is None and not message.dropped:
        try:
            outputs = tuple(decode_tensors(message.outputs, "result.outputs"))
        except InvalidArgument as exc:
            # A batcher bug, not the caller's: the job fails with what was wrong.
            error = JobError(
                code=grpc.StatusCode.INTERNAL.value[0],
                reason="INVALID_RESULT",
                message=exc.message,
                violations=exc.violations,
            )
    return WorkResult(
        job_id=message.job_id,
        attempt=message.attempt,
        outputs=outputs,
        error=error,
        batch_size=message.batch_size,
        compute_s=message.compute_duration.seconds + message.compute_duration.nanos / 1e9,
        # Dropped unrun, with the error that says why (cancelled, expired: the proto's contract) or
        # none (a batcher that stops): a drop, not a failed attempt. Read as a failure, a job whose
        # deadline passed in its batcher's queue ended FAILED rather than EXPIRED.
        dropped=message.dropped,
        output_ref=_output_ref(message) if error is None else None,
    )


def _output_ref(message: worker_service_pb2.WorkResult) -> BlobRef | None:
    if not message.HasField("output_ref"):
        return None
    ref = message.output_ref
    return BlobRef(ref=ref.ref, size_bytes=ref.size_bytes, sha256=ref.sha256)


def progress_from_proto(
    message: worker_service_pb2.WorkProgress, lines: RepeatedLines, batcher_id: str
) -> WorkProgress:
    """A batcher's progress report; partial outputs it cannot decode are left out of it. `lines`: the
    service's, for partial outputs that are invalid (`batcher_id`: whose)."""
    progress = message.progress
    try:
        outputs = tuple(decode_tensors(progress.partial_outputs, "progress.partial_outputs"))
    except InvalidArgument as exc:
        # Once per interval per batcher (the rest at debug): a batcher whose model streams invalid
        # partial outputs sends them with every step of every job.
        lines.say(
            log,
            "warning",
            "progress_outputs_invalid",
            kind=batcher_id,
            job_id=message.job_id,
            batcher_id=batcher_id,
            error=exc.message,
        )
        outputs = ()
    report = ProgressReport(
        attempt=message.attempt,
        step=message.step,
        fraction=progress.fraction if progress.fraction >= 0 else None,
        message=progress.message,
        outputs=outputs,
    )
    return WorkProgress(job_id=message.job_id, report=report)


def order_to_proto(order: WorkOrder) -> worker_service_pb2.WorkOrder:
    message = worker_service_pb2.WorkOrder()
    fill_order(message, order)
    return message


def fill_order(message: worker_service_pb2.WorkOrder, order: WorkOrder) -> None:
    """Fills an empty message in place (so an order added to a WorkOrders is not copied)."""
    message.job_id = order.job_id
    message.attempt = order.attempt
    message.model_name = order.model_name
    message.model_version = order.model_version
    message.priority = PRIORITY_TO_PROTO[order.priority]
    for tensor in order.inputs:
        fill_tensor_proto(message.inputs.add(), tensor, raw=True)
    message.tenant = order.tenant
    if order.input_ref is not None:
        message.input_ref = order.input_ref.ref
    if order.deadline is not None:
        message.deadline.FromNanoseconds(round(order.deadline * 1e9))
    if order.execution_timeout_s is not None:
        message.execution_timeout.FromNanoseconds(round(order.execution_timeout_s * 1e9))
    if order.traceparent:
        message.traceparent = order.traceparent
    if order.run_alone:
        message.run_alone = True
    if order.store_outputs_over_bytes:
        message.store_outputs_over_bytes = order.store_outputs_over_bytes
        message.output_name = order.output_name
        message.result_retention.FromNanoseconds(round(order.result_retention_s * 1e9))


# --- batches of outbound messages -----------------------------------------------------------------


def _single(message: WorkOrder | CancelOrder) -> worker_service_pb2.ConnectResponse:
    if isinstance(message, CancelOrder):
        cancel = worker_service_pb2.CancelOrder(job_id=message.job_id, attempt=message.attempt)
        return worker_service_pb2.ConnectResponse(cancel=cancel)
    return worker_service_pb2.ConnectResponse(order=order_to_proto(message))


def _control(message: ModelControlOrder) -> worker_service_pb2.ConnectResponse:
    action = CONTROL_ACTIONS[message.action]
    control = worker_service_pb2.ModelControl(
        request_id=message.request_id,
        model_name=message.model_name,
        action=action,
        config_json=message.config_json,
        model_version=message.model_version,
    )
    return worker_service_pb2.ConnectResponse(control=control)


CONTROL_ACTIONS = {
    "LOAD": worker_service_pb2.MODEL_CONTROL_ACTION_LOAD,
    "UNLOAD": worker_service_pb2.MODEL_CONTROL_ACTION_UNLOAD,
}


def _add_to_batch(batch: worker_service_pb2.WorkOrders, message: WorkOrder | CancelOrder | None) -> bool:
    """Adds one outbound message; True when it was the end of the stream."""
    if message is None:
        return True
    if isinstance(message, CancelOrder):
        batch.cancels.add(job_id=message.job_id, attempt=message.attempt)
    else:
        fill_order(batch.orders.add(), message)
    return False


def _order_bytes(message: WorkOrder | CancelOrder | None) -> int:
    return sum(t.nbytes for t in message.inputs) if isinstance(message, WorkOrder) else 0


# --- the servicer -------------------------------------------------------------------------------


class WorkerService(worker_service_pb2_grpc.WorkerServiceServicer):
    def __init__(
        self,
        *,
        scheduler_id: str,
        batchers: BatcherRegistry,
        flow: JobFlow,
        on_models: Callable[[BatcherSession], None] | None = None,
        controls: ModelControls | None = None,
    ) -> None:
        """`on_models(session)`: told when a session starts, changes what it serves, and ends."""
        self._scheduler_id = scheduler_id
        self._batchers = batchers
        self._flow = flow
        self._on_models = on_models
        self._controls = controls
        # Partial outputs a batcher sent that are invalid: once per interval per batcher.
        self._progress_lines = RepeatedLines()

    async def Connect(
        self,
        request_iterator: AsyncIterator[worker_service_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext[worker_service_pb2.ConnectRequest, worker_service_pb2.ConnectResponse],
    ) -> AsyncIterator[worker_service_pb2.ConnectResponse]:
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("message") != "hello":
            raise FailedPrecondition("the first message on the Connect stream must be a WorkerHello")
        session = BatcherSession(hello_from_proto(first.hello))
        self._batchers.register(session)
        session_log = log.bind(batcher_id=session.batcher_id, session=session.session_number)
        session_log.info("batcher_connected", versions={n: sorted(v) for n, v in session.versions.items()})
        if self._on_models is not None:
            self._on_models(session)
        reader = asyncio.create_task(self._read(session, requests), name=f"worker-reader-{session.batcher_id}")
        try:
            yield worker_service_pb2.ConnectResponse(
                welcome=worker_service_pb2.WorkerWelcome(scheduler_id=self._scheduler_id, takes_batches=True)
            )
            while (message := await session.outbound.get()) is not None:
                if isinstance(message, ModelControlOrder):
                    yield _control(message)
                    continue
                if not session.takes_batches:
                    yield _single(message)
                    continue
                # Whatever else is ready now goes in the same message (gathered while the last
                # write was in flight); nothing waits for more.
                batch = worker_service_pb2.WorkOrders()
                ended = _add_to_batch(batch, message)
                budget_bytes = ORDERS_MESSAGE_BYTES - _order_bytes(message)
                control = None
                while not ended and budget_bytes > 0 and not session.outbound.empty():
                    message = session.outbound.get_nowait()
                    if message is None:
                        ended = True
                        break
                    if isinstance(message, ModelControlOrder):
                        control = message  # goes on its own, after the orders before it
                        break
                    _add_to_batch(batch, message)
                    budget_bytes -= _order_bytes(message)
                yield worker_service_pb2.ConnectResponse(orders=batch)
                if control is not None:
                    yield _control(control)
                if ended:
                    break
        finally:
            self._batchers.unregister(session)
            self._flow.batcher_lost(session)
            if self._on_models is not None:
                self._on_models(session)
            if self._controls is not None:
                self._controls.session_ended(session)
            reader.cancel()
            outcome = (await asyncio.gather(reader, return_exceptions=True))[0]
            session_log.info("batcher_disconnected")
        if isinstance(outcome, AsyncInferError):
            raise outcome

    async def _read(self, session: BatcherSession, requests: AsyncIterator[worker_service_pb2.ConnectRequest]) -> None:
        """Handles the batcher's messages until its side ends; then ends the session.

        Results are stored concurrently (each is a compare-and-set and an ack, a few NATS round
        trips): one at a time, the round trips would cap a batcher's rate. They are independent
        jobs, handle_result never raises, and the session ends only after every one is handled,
        so none is re-queued by the session's end while its result is being stored."""
        storing: set[asyncio.Task[None]] = set()
        slots = asyncio.Semaphore(RESULTS_STORED_AT_ONCE)

        async def store(result: WorkResult) -> None:
            try:
                await self._flow.handle_result(session, result)
            finally:
                slots.release()

        try:
            async for request in requests:
                kind = request.WhichOneof("message")
                if kind == "credit":
                    credit = credit_from_proto(request.credit)
                    self._batchers.grant(session, credit.model_name, credit.credits)
                elif kind == "result":
                    await slots.acquire()
                    task = asyncio.create_task(store(result_from_proto(request.result)))
                    storing.add(task)
                    task.add_done_callback(storing.discard)
                    task.add_done_callback(failure_logged)
                elif kind == "updates":
                    # Progress first: an item's last report is published before its result is stored.
                    for progress in request.updates.progress:
                        await self._flow.handle_progress(
                            session, progress_from_proto(progress, self._progress_lines, session.batcher_id)
                        )
                    for result in request.updates.results:
                        await slots.acquire()
                        task = asyncio.create_task(store(result_from_proto(result)))
                        storing.add(task)
                        task.add_done_callback(storing.discard)
                        task.add_done_callback(failure_logged)
                    for grant in request.updates.credits:
                        credit = credit_from_proto(grant)
                        self._batchers.grant(session, credit.model_name, credit.credits)
                elif kind == "models":
                    session.load_failures = failures_from_proto(request.models.load_failures)
                    self._batchers.serve(session, served_from_proto(request.models.models))
                    log.info(
                        "batcher_models_changed",
                        batcher_id=session.batcher_id,
                        versions={n: sorted(v) for n, v in session.versions.items()},
                    )
                    if self._on_models is not None:
                        self._on_models(session)
                elif kind == "control_result":
                    answer = request.control_result
                    error = error_from_proto(answer.error) if answer.HasField("error") else None
                    if self._controls is not None:
                        self._controls.answered(session, answer.request_id, error)
                elif kind == "hello":
                    raise FailedPrecondition("hello was already received on this stream")
                else:
                    raise InvalidArgument("empty ConnectRequest")
        finally:
            if storing:
                await asyncio.gather(*storing, return_exceptions=True)
            self._batchers.unregister(session)
