"""The scheduler against a real nats-server, with a fake batcher that is a real gRPC client of
WorkerService.Connect: credits, priority order, results, retries, broken streams, queue stats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from asyncinfer.blob_meta import new_input_ref
from asyncinfer.codecs.envelope import encode_envelope
from asyncinfer.codecs.record import encode_record
from asyncinfer.config import Config
from asyncinfer.contract import cancel_subject, job_work_lookup, job_work_subject, progress_subject
from asyncinfer.declarations import ensure_work_consumer, ensure_work_stream
from asyncinfer.errors import Unavailable
from asyncinfer.ids import new_job_id
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import (
    BlobRef,
    JobRecord,
    JobState,
    Priority,
    WorkEnvelope,
    job_key,
    queued_envelope,
    work_subject,
)
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext, KeyValue, Msg
from asyncinfer.nats.pull_inbox import PullInbox
from asyncinfer.progress_notice import decode_progress_notice
from asyncinfer.queued_notice import announce_queued
from asyncinfer.queues import CancelNotice
from asyncinfer.tensor_codec import decode_tensors, to_output_proto
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import (
    error_pb2,
    job_pb2,
    ops_service_pb2,
    ops_service_pb2_grpc,
    worker_service_pb2,
    worker_service_pb2_grpc,
)
from services.scheduler.app import SchedulerApp
from services.scheduler.job_dispatch import JobDispatch
from tests.kv_helpers import job_record

# Also run with the NATS adapter's fast path off (make pytest-nats-fallback).
pytestmark = pytest.mark.nats_fallback
# The bound on a wait for what the scheduler does at once (an order, a record, a nak): half the
# AckWait these schedulers run with (30 s), so that a job only AckWait would return still fails
# the wait, and room for a loaded machine (it was 2 s and 5 s).
AT_ONCE_S = 15.0

MODEL = "demo"
TENANT = "default"


# --- helpers ----------------------------------------------------------------------------------


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = AT_ONCE_S) -> None:
    """Polls an async condition until it holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def enqueue(
    nc: NatsClient,
    kv: KeyValue,
    *,
    priority: Priority = Priority.NORMAL,
    value: float = 1.0,
    max_attempts: int = 3,
    tenant: str = TENANT,
    deadline: float | None = None,
    execution_timeout_s: float | None = None,
    with_record: bool = True,
    announce: bool = True,
    age_s: float = 0.0,
    legacy: bool = False,
    input_ref: BlobRef | None = None,
    idempotency_key: str = "",
    claim_revision: int = 0,
    job_id: str = "",
) -> str:
    """Queues a job as the gateway does: one work message that is the QUEUED record, then the
    queued notice (`announce=False`: no notice, as from a gateway whose notice was lost).
    `legacy=True`: as a gateway from before messages were records did, a work message on the
    queue's own subject and the record in the bucket (`with_record=False`: none, an orphan).
    `input_ref`: its input claim-checked, as an uploaded object (none inline)."""
    job_id = job_id or new_job_id()
    now = time.time() - age_s
    x = Tensor.from_numpy("x", np.full((1, 4), value, np.float32))
    common: dict[str, Any] = {
        "job_id": job_id,
        "tenant": tenant,
        "model_name": MODEL,
        "model_version": "1",
        "priority": priority,
        "create_time": now,
        "max_attempts": max_attempts,
        "deadline": deadline,
        "execution_timeout_s": execution_timeout_s,
    }
    record = JobRecord(
        **common,
        state=JobState.QUEUED,
        update_time=now,
        result_retention_s=3600.0,
        input_ref=input_ref,
        idempotency_key=idempotency_key,
        claim_revision=claim_revision,
        claim_fingerprint="f" * 64 if claim_revision else "",
    )
    data = encode_record(record)
    if not legacy:
        assert with_record, "a submit's work message is its record"
        envelope = queued_envelope(record, () if input_ref is not None else (x,))
        await nc.jetstream().publish(envelope.subject, encode_envelope(envelope), headers={"Nats-Msg-Id": job_id})
        if announce:
            await announce_queued(nc, [record])
        return job_id
    legacy_envelope = WorkEnvelope(**common, inputs=(x,))
    await nc.jetstream().publish(
        work_subject(MODEL, priority), encode_envelope(legacy_envelope), headers={"Nats-Msg-Id": job_id}
    )
    if with_record:
        revision = await kv.create(job_key(tenant, job_id), data)
        if announce:
            await announce_queued(nc, [record.evolve(revision=revision)])
    return job_id


async def pull_one(inbox: PullInbox, stream: str, consumer: str) -> Msg | None:
    msgs = await inbox.pull(stream, consumer, 1)
    return msgs[0] if msgs else None


async def pull_until(nc: NatsClient, stream: str, consumer: str, timeout_s: float = AT_ONCE_S) -> Msg:
    """Pulls one message until one comes (an ack or nak is applied by the server asynchronously)."""
    pulled: list[Msg] = []
    inbox = PullInbox(nc)

    async def got_one() -> bool:
        msg = await pull_one(inbox, stream, consumer)
        if msg is not None:
            pulled.append(msg)
        return bool(pulled)

    try:
        await until(got_one, timeout_s)
    finally:
        await inbox.close()
    return pulled[0]


async def read_record(js: JetStreamContext, job_id: str) -> JobRecord:
    """The job's record as the gateway reads it: from the bucket, or (queued) its work message."""
    record = await job_record(js, job_key(TENANT, job_id))
    assert record is not None, f"job {job_id} has no record"
    return record


async def wait_state(js: JetStreamContext, job_id: str, state: JobState, timeout_s: float = AT_ONCE_S) -> JobRecord:
    async def reached() -> bool:
        return (await read_record(js, job_id)).state == state

    await until(reached, timeout_s)
    return await read_record(js, job_id)


async def work_messages(js: JetStreamContext, config: Config) -> int:
    return (await js.stream_info(config.nats.work_stream)).state.messages


class FakeBatcher:
    """A batcher as the scheduler sees it: a real Connect stream, driven by the test."""

    def __init__(self, port: int, batcher_id: str) -> None:
        self.batcher_id = batcher_id
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self._stub = worker_service_pb2_grpc.WorkerServiceStub(self._channel)
        # No request iterator: the test writes each request with call.write().
        self._call = self._stub.Connect()  # type: ignore[call-arg]
        self.orders: asyncio.Queue[worker_service_pb2.WorkOrder] = asyncio.Queue()
        self.cancels: asyncio.Queue[worker_service_pb2.CancelOrder] = asyncio.Queue()
        self.order_messages: list[worker_service_pb2.WorkOrders] = []  # batches received (takes_batches)
        self.welcome: asyncio.Future[worker_service_pb2.WorkerWelcome] = asyncio.get_running_loop().create_future()
        self._reader: asyncio.Task[None] | None = None

    async def connect(
        self,
        max_batch_size: int = 8,
        *,
        takes_batches: bool = False,
        reads_claim_checks: bool = False,
        times_out_runs: bool = False,
        version: str = "1",
    ) -> worker_service_pb2.WorkerWelcome:
        hello = worker_service_pb2.WorkerHello(
            batcher_id=self.batcher_id,
            models=[
                worker_service_pb2.ServedModel(model_name=MODEL, model_version=version, max_batch_size=max_batch_size)
            ],
            takes_batches=takes_batches,
            reads_claim_checks=reads_claim_checks,
            times_out_runs=times_out_runs,
        )
        await self._call.write(worker_service_pb2.ConnectRequest(hello=hello))
        self._reader = asyncio.create_task(self._read())
        return await asyncio.wait_for(self.welcome, AT_ONCE_S)

    async def _read(self) -> None:
        async for response in self._call:
            kind = response.WhichOneof("message")
            if kind == "welcome":
                self.welcome.set_result(response.welcome)
            elif kind == "order":
                self.orders.put_nowait(response.order)
            elif kind == "cancel":
                self.cancels.put_nowait(response.cancel)
            elif kind == "orders":
                self.order_messages.append(response.orders)
                for order in response.orders.orders:
                    self.orders.put_nowait(order)
                for cancel in response.orders.cancels:
                    self.cancels.put_nowait(cancel)

    async def grant(self, credits: int = 1, *, model_name: str = MODEL) -> None:
        credit = worker_service_pb2.CreditGrant(model_name=model_name, credits=credits)
        await self._call.write(worker_service_pb2.ConnectRequest(credit=credit))

    async def next_order(self, timeout_s: float = AT_ONCE_S) -> worker_service_pb2.WorkOrder:
        return await asyncio.wait_for(self.orders.get(), timeout_s)

    async def answer(self, order: worker_service_pb2.WorkOrder, *, job_id: str = "", attempt: int = 0) -> None:
        """Computes y = 2x and returns it (for the order's job and attempt unless overridden)."""
        (x,) = decode_tensors(order.inputs)
        y = Tensor.from_numpy("y", np.asarray(x.to_numpy(), dtype=np.float32) * 2)
        result = worker_service_pb2.WorkResult(
            job_id=job_id or order.job_id,
            attempt=attempt or order.attempt,
            outputs=[to_output_proto(y, raw=True)],
            batch_size=3,
        )
        result.compute_duration.FromMilliseconds(5)
        await self._call.write(worker_service_pb2.ConnectRequest(result=result))

    async def answer_together(self, orders: list[worker_service_pb2.WorkOrder], credits: int) -> None:
        """y = 2x for every order, in one WorkUpdates message with `credits` more credits."""
        updates = worker_service_pb2.WorkUpdates()
        for order in orders:
            (x,) = decode_tensors(order.inputs)
            y = Tensor.from_numpy("y", np.asarray(x.to_numpy(), dtype=np.float32) * 2)
            updates.results.add(
                job_id=order.job_id,
                attempt=order.attempt,
                outputs=[to_output_proto(y, raw=True)],
                batch_size=len(orders),
            )
        updates.credits.add(model_name=MODEL, credits=credits)
        await self._call.write(worker_service_pb2.ConnectRequest(updates=updates))

    async def report(self, order: worker_service_pb2.WorkOrder, message: str, *, step: int = 1) -> None:
        """One progress report of the order's attempt."""
        updates = worker_service_pb2.WorkUpdates()
        sent = updates.progress.add(job_id=order.job_id, attempt=order.attempt, step=step)
        sent.progress.fraction = 0.5
        sent.progress.message = message
        await self._call.write(worker_service_pb2.ConnectRequest(updates=updates))

    async def answer_stored(self, order: worker_service_pb2.WorkOrder, ref: job_pb2.BlobRef) -> None:
        """A result whose outputs the batcher stored itself (batcher.claim_check_io)."""
        result = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, output_ref=ref, batch_size=1)
        await self._call.write(worker_service_pb2.ConnectRequest(result=result))

    async def fail(self, order: worker_service_pb2.WorkOrder, error: error_pb2.ErrorStatus) -> None:
        result = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, error=error)
        await self._call.write(worker_service_pb2.ConnectRequest(result=result))

    async def final_code(self) -> grpc.StatusCode:
        """Waits for the stream to end; its status code."""
        return await asyncio.wait_for(self._call.code(), AT_ONCE_S)

    async def break_stream(self) -> None:
        self._call.cancel()
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self._channel.close(None)


OpenBatcher = Callable[[str], Awaitable[FakeBatcher]]


@pytest.fixture
async def app(config: Config) -> AsyncIterator[SchedulerApp]:
    scheduler = SchedulerApp(config)
    await scheduler.start()
    try:
        yield scheduler
    finally:
        await scheduler.stop(grace_s=1.0)


@pytest.fixture
async def kv(app: SchedulerApp, nc: NatsClient, config: Config) -> KeyValue:
    return await nc.jetstream().key_value(config.nats.jobs_bucket)


@pytest.fixture
def js(nc: NatsClient) -> JetStreamContext:
    return nc.jetstream()


@pytest.fixture
async def batchers(app: SchedulerApp) -> AsyncIterator[OpenBatcher]:
    opened: list[FakeBatcher] = []

    async def open_batcher(batcher_id: str) -> FakeBatcher:
        batcher = FakeBatcher(app.port, batcher_id)
        opened.append(batcher)
        await batcher.connect()
        return batcher

    yield open_batcher
    for batcher in opened:
        await batcher.close()


# --- tests ------------------------------------------------------------------------------------


async def test_a_pull_returns_an_ackable_message_or_nothing(nc: NatsClient, config: Config) -> None:
    js = nc.jetstream()
    await ensure_work_stream(js, config.nats)
    consumer = await ensure_work_consumer(js, config.nats, model_name=MODEL, priority=Priority.LOW, ack_wait_s=30)
    stream = config.nats.work_stream
    inbox = PullInbox(nc)
    assert await pull_one(inbox, stream, consumer) is None
    await js.publish(work_subject(MODEL, Priority.LOW), b"payload")
    # The consumer hears of a stored message asynchronously: a no-wait pull at once may still find
    # nothing (it did once in CI), so pull until it comes.
    first = await pull_until(nc, stream, consumer)
    assert first.data == b"payload"
    assert first.metadata.num_delivered == 1
    assert await pull_one(inbox, stream, consumer) is None  # in flight: not handed out twice
    await first.in_progress()
    await first.nak()
    again = await pull_until(nc, stream, consumer)
    assert again.metadata.num_delivered == 2
    assert again.metadata.sequence.stream == first.metadata.sequence.stream
    await again.ack()

    async def emptied() -> bool:
        return await work_messages(js, config) == 0

    await until(emptied)
    await inbox.close()


async def test_nothing_is_dispatched_without_a_credit(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, batchers: OpenBatcher, nc: NatsClient
) -> None:
    batcher = await batchers("b1")
    job_id = await enqueue(nc, kv)
    # Several poll intervals pass with the job queued and a batcher connected, but no credit.
    with pytest.raises(TimeoutError):
        await batcher.next_order(timeout_s=0.4)
    info = await js.consumer_info(config.nats.work_stream, "work-demo-normal")
    assert info.num_pending == 1  # not even pulled: no prefetch
    assert (await read_record(js, job_id)).state == JobState.QUEUED
    await batcher.grant(1)
    order = await batcher.next_order()
    assert order.job_id == job_id


async def test_a_batcher_that_takes_batches_gets_orders_together_and_answers_together(
    app: SchedulerApp, nc: NatsClient, js: JetStreamContext, kv: KeyValue, config: Config
) -> None:
    """Orders travel in WorkOrders messages; results and the credits they free come back in one
    WorkUpdates, and every job still ends once."""
    batcher = FakeBatcher(app.port, "batching")
    try:
        welcome = await batcher.connect(takes_batches=True)
        assert welcome.takes_batches
        job_ids = [await enqueue(nc, kv, value=float(i)) for i in range(6)]
        await batcher.grant(6)
        orders = [await batcher.next_order() for _ in job_ids]
        assert sorted(o.job_id for o in orders) == sorted(job_ids)
        assert batcher.order_messages, "a batching batcher gets WorkOrders messages"
        # Every order came in a WorkOrders message (how many share one depends on what was ready
        # while the last write was in flight: the bench measures that, not this test).
        assert sum(len(m.orders) for m in batcher.order_messages) == 6
        await batcher.answer_together(orders, credits=6)
        for order in orders:
            done = await wait_state(js, order.job_id, JobState.SUCCEEDED)
            (value,) = {v for row in done.outputs[0].to_numpy().tolist() for v in row}
            assert value == 2 * float(job_ids.index(order.job_id))
            assert done.batch is not None
            assert done.batch.batch_size == 6

        async def acked() -> bool:
            return await work_messages(js, config) == 0

        await until(acked)
        # The credits rode on the results: the next job is dispatched without a separate grant.
        later = await enqueue(nc, kv)
        assert (await batcher.next_order()).job_id == later
    finally:
        await batcher.close()


async def test_job_runs_to_succeeded_and_its_message_is_acked(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, batchers: OpenBatcher, nc: NatsClient
) -> None:
    batcher = await batchers("b1")
    assert batcher.welcome.result().scheduler_id == app.instance_name
    await batcher.grant(1)
    job_id = await enqueue(nc, kv, priority=Priority.HIGH, value=1.5)
    order = await batcher.next_order()
    assert (order.job_id, order.attempt, order.model_name, order.tenant) == (job_id, 1, MODEL, TENANT)
    assert order.priority == job_pb2.PRIORITY_HIGH
    assert order.execution_timeout.ToSeconds() == 60
    running = await wait_state(js, job_id, JobState.RUNNING)  # the order may go out before the write lands
    assert running.attempt == 1
    assert running.queue_duration_s is not None
    await batcher.answer(order)
    done = await wait_state(js, job_id, JobState.SUCCEEDED)
    assert done.attempt == 1
    assert [t.to_numpy().tolist() for t in done.outputs] == [[[3.0, 3.0, 3.0, 3.0]]]
    assert done.batch is not None
    assert (done.batch.batcher_id, done.batch.batch_size) == ("b1", 3)
    assert done.batch.compute_s == pytest.approx(0.005)
    assert done.end_time is not None
    assert done.run_duration_s is not None

    async def acked() -> bool:
        return await work_messages(js, config) == 0

    await until(acked)
    assert len(app.flow.in_flight) == 0
    exposition = generate_latest(app.metrics.registry).decode()
    assert 'asyncinfer_jobs_total{model="demo",state="RUNNING"} 1.0' in exposition
    assert 'asyncinfer_jobs_total{model="demo",state="SUCCEEDED"} 1.0' in exposition


async def test_a_batcher_that_reads_claim_checks_is_told_where_to_store_outputs_and_its_ref_is_checked(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, nc: NatsClient
) -> None:
    """To a batcher whose hello says it reads claim checks, an order says over how many bytes its
    outputs are stored and under which name (the attempt's); a result naming that object ends the
    job with it as result_ref, and one naming any other object fails the attempt: a batcher cannot
    point a job at an object its order did not name."""
    batcher = FakeBatcher(app.port, "reader")
    try:
        await batcher.connect(reads_claim_checks=True)
        await batcher.grant(2)
        stored_id = await enqueue(nc, kv)
        order = await batcher.next_order()
        assert order.job_id == stored_id
        assert order.store_outputs_over_bytes == config.scheduler.inline_result_max_bytes
        assert order.output_name == f"out/{stored_id}.1"
        assert order.result_retention.ToSeconds() == 3600
        await wait_state(js, stored_id, JobState.RUNNING)
        ref = job_pb2.BlobRef(ref=order.output_name, size_bytes=1_000_000, sha256="ab" * 32)
        await batcher.answer_stored(order, ref)
        done = await wait_state(js, stored_id, JobState.SUCCEEDED)
        assert done.result_ref is not None
        assert (done.result_ref.ref, done.result_ref.size_bytes) == (f"out/{stored_id}.1", 1_000_000)
        assert not done.outputs

        elsewhere_id = await enqueue(nc, kv)
        order = await batcher.next_order()
        await wait_state(js, elsewhere_id, JobState.RUNNING)
        other = job_pb2.BlobRef(ref=f"out/{stored_id}.1", size_bytes=10, sha256="cd" * 32)
        await batcher.answer_stored(order, other)
        failed = await wait_state(js, elsewhere_id, JobState.FAILED)
        assert failed.error is not None
        assert failed.error.reason == "INVALID_RESULT"
        assert failed.result_ref is None
    finally:
        await batcher.close()


async def test_a_nak_for_a_live_attempts_message_does_not_run_the_job_again(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """nats-server applies a nak by stream sequence, to whichever delivery is pending: a reclaim
    sweep's nak sent for a delivery that has since been redelivered (services.scheduler.lease_reclaim)
    sends the running attempt's message back. The scheduler holding the attempt adopts it: no second
    order, the attempt ends as attempt 1, and its ack goes to the delivery pending."""
    batcher = await batchers("b1")
    await batcher.grant(2)  # a credit to spare: without the adoption the redelivery runs at once
    job_id = await enqueue(nc, kv)
    order = await batcher.next_order()
    running = await wait_state(js, job_id, JobState.RUNNING)
    with capture_logs() as logs:
        await nc.publish(running.lease_subject, b"-NAK")  # as a sweep's would
        await nc.flush()

        async def handled() -> bool:  # adopted, or (without the adoption) run as attempt 2
            adopted = any(entry["event"] == "live_attempt_redelivered" for entry in logs)
            return adopted or (await read_record(js, job_id)).attempt > 1

        await until(handled)
    assert (await read_record(js, job_id)).attempt == 1, "the redelivery of a live attempt is not a new attempt"
    assert batcher.orders.empty()
    await batcher.answer(order)
    done = await wait_state(js, job_id, JobState.SUCCEEDED)
    assert done.attempt == 1

    async def acked() -> bool:
        return await work_messages(js, config) == 0

    await until(acked)
    assert batcher.orders.empty()


async def test_redeliveries_of_every_live_attempt_after_a_stall_log_one_warning(
    app: SchedulerApp,
    js: JetStreamContext,
    kv: KeyValue,
    batchers: OpenBatcher,
    nc: NatsClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scheduler frozen past AckWait (SIGSTOP, a paused VM, a laptop's suspend) has every message
    it holds redelivered as it wakes, and adopts each: one warning line for the model, the rest at
    debug (a freeze with 175 jobs in flight logged 166 warnings, its whole log)."""
    batcher = await batchers("b1")
    await batcher.grant(8)  # credits to spare: a redelivery is pulled only with a free credit
    job_ids = [await enqueue(nc, kv) for _ in range(4)]
    orders = [await batcher.next_order() for _ in job_ids]
    running = [await wait_state(js, job_id, JobState.RUNNING) for job_id in job_ids]
    adopted: list[str] = []
    adopts = JobDispatch._adopts_redelivery

    def counted(self: JobDispatch, msg: Msg, record: JobRecord, job_log: Any) -> bool:
        if adopts(self, msg, record, job_log):
            adopted.append(record.job_id)
            return True
        return False

    monkeypatch.setattr(JobDispatch, "_adopts_redelivery", counted)
    with capture_logs() as logs:
        for record in running:
            await nc.publish(record.lease_subject, b"-NAK")  # as AckWait's redelivery would
        await nc.flush()

        async def adopted_all() -> bool:
            return sorted(adopted) == sorted(job_ids)

        await until(adopted_all)
    levels = [entry["log_level"] for entry in logs if entry["event"] == "live_attempt_redelivered"]
    assert levels.count("warning") == 1, levels
    for order in orders:
        await batcher.answer(order)
    for job_id in job_ids:
        done = await wait_state(js, job_id, JobState.SUCCEEDED)
        assert done.attempt == 1


async def test_high_priority_goes_first_with_one_credit(
    app: SchedulerApp, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    batcher = await batchers("b1")
    low = await enqueue(nc, kv, priority=Priority.LOW)
    high = await enqueue(nc, kv, priority=Priority.HIGH)
    await batcher.grant(1)
    first = await batcher.next_order()
    assert first.job_id == high
    with pytest.raises(TimeoutError):  # one credit, one order
        await batcher.next_order(timeout_s=0.2)
    await batcher.answer(first)
    await batcher.grant(1)
    second = await batcher.next_order()
    assert second.job_id == low


async def test_jobs_one_at_a_time_are_not_held_by_the_dispatch_linger(
    config: Config, js: JetStreamContext, nc: NatsClient
) -> None:
    """The linger (scheduler.dispatch_linger_ms) is for a stream of jobs that outpaces the rounds:
    a client that queues each job once the one before it has ended (a round trip) finds every job
    dispatched at once, with a linger of a second configured, and no round lingers."""
    scheduler = SchedulerApp(config.replace(scheduler={"dispatch_linger_ms": 1000.0}))
    await scheduler.start()
    batcher = FakeBatcher(scheduler.port, "b1")
    try:
        await batcher.connect()
        await batcher.grant(20)
        kv = await nc.jetstream().key_value(config.nats.jobs_bucket)
        for _ in range(8):
            job_id = await enqueue(nc, kv)
            order = await batcher.next_order(timeout_s=0.5)  # a linger would hold it for up to 1 s
            assert order.job_id == job_id
            await batcher.answer(order)
            await wait_state(js, job_id, JobState.SUCCEEDED)
        exposition = generate_latest(scheduler.metrics.registry).decode()
        assert "asyncinfer_dispatch_lingers_total{" not in exposition
    finally:
        await batcher.close()
        await scheduler.stop(grace_s=1.0)


async def test_a_stream_of_jobs_outpacing_the_rounds_is_dispatched_with_lingers_and_each_job_once(
    config: Config, js: JetStreamContext, nc: NatsClient
) -> None:
    """Jobs queued one at a time faster than the dispatcher's rounds (a burst of unary submits):
    rounds find them waiting, the dispatcher lingers between small rounds (counted), and every job
    is still dispatched once."""
    scheduler = SchedulerApp(config.replace(scheduler={"dispatch_linger_ms": 5.0}))
    await scheduler.start()
    batcher = FakeBatcher(scheduler.port, "b1")
    try:
        await batcher.connect(takes_batches=True)
        await batcher.grant(400)
        kv = await nc.jetstream().key_value(config.nats.jobs_bucket)
        job_ids = [await enqueue(nc, kv) for _ in range(300)]
        orders = [await batcher.next_order() for _ in job_ids]
        assert sorted(order.job_id for order in orders) == sorted(job_ids)
        assert batcher.orders.empty()
        exposition = generate_latest(scheduler.metrics.registry).decode()
        lingers = [line for line in exposition.splitlines() if line.startswith("asyncinfer_dispatch_lingers_total{")]
        assert lingers, exposition
        assert float(lingers[0].rsplit(" ", 1)[1]) > 0
    finally:
        await batcher.close()
        await scheduler.stop(grace_s=1.0)


async def test_a_chunks_input_read_does_not_hold_back_a_job_queued_behind_it(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """A dispatcher round waits for its dispatches, but not for one that goes on to read a
    claim-checked input (a file batch's chunk: megabytes; here a read the test holds): a job
    queued meanwhile is dispatched at once on another credit, rather than after the read
    (session 17: an interactive job waited 0.18 s for a round of eight chunks' reads). The held
    dispatch then ends as it would have: its input, never uploaded, fails the job."""
    claim_check: Any = app.flow._dispatch._claim_check
    real_resolve = claim_check.resolve
    entered, release = asyncio.Event(), asyncio.Event()

    async def held_resolve(envelope: WorkEnvelope) -> Any:
        entered.set()
        await release.wait()
        return await real_resolve(envelope)

    claim_check.resolve = held_resolve
    batcher = await batchers("b1")
    unread = BlobRef(ref=new_input_ref(), size_bytes=16, sha256="00" * 32)  # never uploaded
    by_ref = await enqueue(nc, kv, priority=Priority.LOW, input_ref=unread)
    await batcher.grant(2)
    await asyncio.wait_for(entered.wait(), AT_ONCE_S)
    queued_behind = await enqueue(nc, kv, priority=Priority.NORMAL)
    order = await batcher.next_order()
    assert order.job_id == queued_behind
    assert not release.is_set()
    await batcher.answer(order)
    await wait_state(js, queued_behind, JobState.SUCCEEDED)
    release.set()
    failed = await wait_state(js, by_ref, JobState.FAILED)
    assert failed.error is not None
    assert failed.error.reason == "INPUT_NOT_FOUND"
    # Its credit came back: the next job runs on it.
    after = await enqueue(nc, kv)
    assert (await batcher.next_order()).job_id == after


async def test_broken_stream_returns_its_job_and_a_late_result_is_discarded(
    js: JetStreamContext, app: SchedulerApp, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    first = await batchers("b1")
    await first.grant(1)
    job_id = await enqueue(nc, kv, value=1.0)
    order1 = await first.next_order()
    assert order1.attempt == 1
    await first.break_stream()
    # Back in the queue at once (no AckWait), with why.
    queued = await wait_state(js, job_id, JobState.QUEUED, timeout_s=AT_ONCE_S)
    assert queued.last_error is not None
    assert queued.last_error.reason == "WORKER_LOST"
    assert queued.attempt == 1

    second = await batchers("b2")
    await second.grant(1)
    order2 = await second.next_order(timeout_s=AT_ONCE_S)
    assert (order2.job_id, order2.attempt) == (job_id, 2)
    # Lost with its batcher once: every job in flight at a crash is, so it is batched as before.
    assert not order1.run_alone
    assert not order2.run_alone

    # The first batcher comes back and delivers its stale result, then a credit: results and
    # credits on one stream are handled in order, so once the credit counts the result was seen.
    returning = await batchers("b1")
    await returning.answer(order1)
    await returning.grant(1)

    async def credit_counted() -> bool:
        return app.batchers.free_credits(MODEL) == 1

    await until(credit_counted)
    record = await read_record(js, job_id)
    assert (record.state, record.attempt) == (JobState.RUNNING, 2)

    await second.answer(order2)
    done = await wait_state(js, job_id, JobState.SUCCEEDED)
    assert done.attempt == 2
    assert done.batch is not None
    assert done.batch.batcher_id == "b2"


async def test_a_job_lost_with_its_batcher_twice_runs_alone(
    js: JetStreamContext, app: SchedulerApp, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """A job whose input crashes the model's process took the jobs batched with it down on every
    attempt; lost twice in a row, its next attempt is computed in a batch of its own."""
    job_id = await enqueue(nc, kv, max_attempts=3)
    for attempt, name in ((1, "b1"), (2, "b2")):
        batcher = await batchers(name)
        await batcher.grant(1)
        order = await batcher.next_order(timeout_s=AT_ONCE_S)
        assert (order.job_id, order.attempt, order.run_alone) == (job_id, attempt, False)
        await batcher.break_stream()
        await wait_state(js, job_id, JobState.QUEUED, timeout_s=AT_ONCE_S)
    third = await batchers("b3")
    await third.grant(1)
    order = await third.next_order(timeout_s=AT_ONCE_S)
    assert (order.attempt, order.run_alone) == (3, True)
    await third.answer(order)
    assert (await wait_state(js, job_id, JobState.SUCCEEDED)).attempt == 3


async def test_a_requeue_waits_out_a_failed_write_rather_than_spend_the_attempt(
    js: JetStreamContext,
    app: SchedulerApp,
    kv: KeyValue,
    batchers: OpenBatcher,
    nc: NatsClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A requeue whose record write failed (a leader election) left the record RUNNING; the message,
    back at once, was taken for a lapsed lease and the attempt spent: a job on its last attempt that
    its batcher gave back unrun was dead-lettered. The write is tried again."""
    real_transition = JobStore.transition
    failures = 0

    async def failing_once(self: JobStore, record: JobRecord, decide: Any) -> Any:
        nonlocal failures
        decided = decide(record)
        if failures == 0 and decided is not None and decided.state is JobState.QUEUED:
            failures += 1
            raise Unavailable("no responders: the bucket's leader is being elected")
        return await real_transition(self, record, decide)

    monkeypatch.setattr(JobStore, "transition", failing_once)
    job_id = await enqueue(nc, kv, max_attempts=1)
    batcher = await batchers("b1")
    await batcher.grant(1)
    order = await batcher.next_order()
    given_back = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, dropped=True)
    await batcher._call.write(worker_service_pb2.ConnectRequest(result=given_back))
    await batcher.grant(1)
    again = await batcher.next_order(timeout_s=AT_ONCE_S)
    assert (again.job_id, again.attempt, failures) == (job_id, 2, 1)  # refunded: a second attempt
    await batcher.answer(again)
    assert (await wait_state(js, job_id, JobState.SUCCEEDED)).max_attempts == 2


async def test_non_retriable_error_fails_the_job(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, batchers: OpenBatcher, nc: NatsClient
) -> None:
    batcher = await batchers("b1")
    await batcher.grant(1)
    job_id = await enqueue(nc, kv)
    order = await batcher.next_order()
    error = error_pb2.ErrorStatus(
        code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
        reason="INVALID_INPUT",
        message="x must be finite",
        field_violations=[error_pb2.FieldViolation(field="inputs[0]", description="NaN")],
        retriable=False,
    )
    await batcher.fail(order, error)
    failed = await wait_state(js, job_id, JobState.FAILED)
    assert failed.error is not None
    assert (failed.error.code, failed.error.reason, failed.error.message) == (3, "INVALID_INPUT", "x must be finite")
    assert [v.field for v in failed.error.violations] == ["inputs[0]"]
    assert failed.outputs == ()

    async def acked() -> bool:
        return await work_messages(js, config) == 0

    await until(acked)


async def test_a_run_its_batcher_timed_out_is_timed_out_and_a_silent_one_by_the_backstop(
    config: Config, js: JetStreamContext, nc: NatsClient
) -> None:
    """A batcher that times runs out itself (from its batch's start: WorkerHello.times_out_runs)
    answers EXECUTION_TIMEOUT, recorded TIMED_OUT with the scheduler's message; one that says nothing
    is timed out by the scheduler's own timer, from dispatch: at once past the timeout for a batcher
    of the release before, the backstop later for one that times runs out."""
    backstop_s = 1.0
    app = SchedulerApp(config.replace(scheduler={"execution_timeout_backstop_s": backstop_s}))
    await app.start()
    kv = await nc.jetstream().key_value(config.nats.jobs_bucket)
    timing = FakeBatcher(app.port, "timing")
    older = FakeBatcher(app.port, "older")
    try:
        await timing.connect(times_out_runs=True)
        await timing.grant(2)
        answered = await enqueue(nc, kv, execution_timeout_s=0.5)
        order = await timing.next_order()
        assert order.execution_timeout.ToNanoseconds() == 500_000_000
        error = error_pb2.ErrorStatus(
            code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
            reason="EXECUTION_TIMEOUT",
            message="still computing 0.5 s after its batch started (its execution timeout)",
        )
        await timing.fail(order, error)
        ended = await wait_state(js, answered, JobState.TIMED_OUT)
        assert ended.error is not None
        assert (ended.error.reason, ended.error.message) == (
            "EXECUTION_TIMEOUT",
            "attempt 1 ran longer than its execution timeout of 0.5 s",
        )

        silent = await enqueue(nc, kv, execution_timeout_s=0.5)
        await timing.next_order()  # never answered: its batcher's loop stopped, say
        ended = await wait_state(js, silent, JobState.TIMED_OUT, timeout_s=10.0)
        assert ended.error is not None
        assert ended.error.message == (
            "attempt 1 was not answered within its execution timeout of 0.5 s plus 1 s from its dispatch "
            "(its batcher stopped answering)"
        )
        assert ended.start_time is not None
        assert ended.end_time is not None
        assert ended.end_time - ended.start_time >= 0.5 + backstop_s
        await timing.break_stream()

        await older.connect()
        await older.grant(1)
        old_silent = await enqueue(nc, kv, execution_timeout_s=0.5)
        await older.next_order()
        ended = await wait_state(js, old_silent, JobState.TIMED_OUT)
        assert ended.error is not None
        assert ended.error.message == "attempt 1 ran longer than its execution timeout of 0.5 s"
        assert ended.start_time is not None
        assert ended.end_time is not None
        assert ended.end_time - ended.start_time < 0.5 + backstop_s
    finally:
        await older.close()
        await timing.close()
        await app.stop(grace_s=1.0)


async def test_retriable_error_requeues_with_backoff_then_runs_again(
    js: JetStreamContext, app: SchedulerApp, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    batcher = await batchers("b1")
    await batcher.grant(2)
    job_id = await enqueue(nc, kv, max_attempts=2)
    order1 = await batcher.next_order()
    error = error_pb2.ErrorStatus(code=14, reason="MODEL_ERROR", message="CUDA hiccup", retriable=True)
    failed_at = time.monotonic()
    await batcher.fail(order1, error)
    queued = await wait_state(js, job_id, JobState.QUEUED)
    assert queued.last_error is not None
    assert queued.last_error.reason == "MODEL_ERROR"
    order2 = await batcher.next_order(timeout_s=AT_ONCE_S)
    assert time.monotonic() - failed_at >= 0.45  # waited out the 1 s backoff (with equal jitter: 0.5-1 s)
    assert (order2.job_id, order2.attempt) == (job_id, 2)
    await batcher.fail(order2, error)  # the last attempt: no more retries
    failed = await wait_state(js, job_id, JobState.FAILED)
    assert failed.error is not None
    assert failed.error.reason == "MODEL_ERROR"
    assert failed.attempt == 2


async def test_orphan_message_is_dropped_after_its_grace(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """A message of an older gateway whose record never came (it died between publish and record)
    is dropped once older than orphan_message_grace_s, without using up the credit."""
    batcher = await batchers("b1")
    await batcher.grant(1)
    await enqueue(nc, kv, legacy=True, with_record=False, age_s=config.scheduler.orphan_message_grace_s + 1)

    async def removed() -> bool:
        return await work_messages(js, config) == 0

    await until(removed)
    job_id = await enqueue(nc, kv)  # the credit was not used up by the orphan
    order = await batcher.next_order()
    assert order.job_id == job_id


async def test_young_message_waits_for_its_record(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """An older gateway published before it wrote the record: a message that arrives first is kept
    and runs once its record exists (a rolling upgrade runs both kinds of gateway)."""
    batcher = await batchers("b1")
    await batcher.grant(1)
    job_id = await enqueue(nc, kv, legacy=True, with_record=False)

    async def pulled() -> bool:
        info = await js.consumer_info(config.nats.work_stream, "work-demo-normal")
        return (info.delivered.consumer_seq or 0) >= 1

    await until(pulled)
    assert await work_messages(js, config) == 1, "a young message is not dropped"
    now = time.time()
    record = JobRecord(
        job_id=job_id,
        tenant=TENANT,
        model_name=MODEL,
        model_version="1",
        state=JobState.QUEUED,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        max_attempts=3,
        result_retention_s=3600.0,
    )
    await kv.create(job_key(TENANT, job_id), encode_record(record))
    order = await batcher.next_order()
    assert order.job_id == job_id
    assert order.attempt == 1


async def test_first_message_must_be_hello(app: SchedulerApp) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        call = worker_service_pb2_grpc.WorkerServiceStub(channel).Connect()  # type: ignore[call-arg]
        credit = worker_service_pb2.CreditGrant(model_name=MODEL, credits=1)
        await call.write(worker_service_pb2.ConnectRequest(credit=credit))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_queue_stats_report_depth_per_priority_and_batchers(
    app: SchedulerApp, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    await batchers("b1")
    await enqueue(nc, kv, priority=Priority.HIGH)
    await enqueue(nc, kv, priority=Priority.HIGH)
    await enqueue(nc, kv, priority=Priority.LOW)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        ops = ops_service_pb2_grpc.OpsServiceStub(channel)
        response = await ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))
        (stats,) = response.models
        depths = {q.priority: q.depth for q in stats.priorities}
        assert depths == {job_pb2.PRIORITY_HIGH: 2, job_pb2.PRIORITY_NORMAL: 0, job_pb2.PRIORITY_LOW: 1}
        high = next(q for q in stats.priorities if q.priority == job_pb2.PRIORITY_HIGH)
        assert high.HasField("oldest_age")
        normal = next(q for q in stats.priorities if q.priority == job_pb2.PRIORITY_NORMAL)
        assert not normal.HasField("oldest_age")
        assert (stats.connected_batchers, stats.free_credits, stats.in_flight) == (1, 0, 0)
        assert stats.desired_batchers == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert (await ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest())).dead_letters == []

        async def nats_gone(model_name: str = "") -> Any:
            raise TimeoutError("nats: timeout")  # what a read gives while NATS is away

        app._stats.snapshot = nats_gone  # type: ignore[method-assign]
        with pytest.raises(grpc.aio.AioRpcError) as info:  # was UNKNOWN, with a traceback in the log
            await ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "cannot read the queues: nats: timeout" in (info.value.details() or "")


async def test_stop_returns_in_flight_jobs_to_the_queue(config: Config, js: JetStreamContext, nc: NatsClient) -> None:
    scheduler = SchedulerApp(config)
    await scheduler.start()
    kv = await js.key_value(config.nats.jobs_bucket)
    batcher = FakeBatcher(scheduler.port, "b1")
    try:
        await batcher.connect()
        await batcher.grant(1)
        job_id = await enqueue(nc, kv)
        await batcher.next_order()
        await scheduler.stop(grace_s=0.1)
        await scheduler.stop(grace_s=0.1)  # idempotent
    finally:
        await batcher.close()
    record = await read_record(js, job_id)
    assert record.state == JobState.QUEUED
    assert record.last_error is not None
    assert record.last_error.reason == "SCHEDULER_STOPPING"
    # Nak'ed, not left to AckWait: the next scheduler gets it at once.
    redelivered = await pull_until(nc, config.nats.work_stream, "work-demo-normal", timeout_s=AT_ONCE_S)
    assert redelivered.metadata.num_delivered == 2


async def test_credit_for_a_model_not_announced_ends_the_stream(app: SchedulerApp, batchers: OpenBatcher) -> None:
    batcher = await batchers("b1")
    await batcher.grant(1, model_name="other")
    assert await batcher.final_code() == grpc.StatusCode.INVALID_ARGUMENT

    async def unregistered() -> bool:
        return not app.batchers.sessions

    await until(unregistered)


async def noted(records: Any, key: str) -> bool:
    return key in records


async def test_a_job_without_a_queued_notice_is_found_by_the_poll(
    js: JetStreamContext, app: SchedulerApp, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """The notice is a hint: a job whose notice was lost runs all the same (the poll interval
    finds it and the record is read)."""
    batcher = await batchers("b1")
    await batcher.grant(1)
    job_id = await enqueue(nc, kv, announce=False)
    order = await batcher.next_order()
    assert (order.job_id, order.attempt) == (job_id, 1)
    await wait_state(js, job_id, JobState.RUNNING)  # the order may go out before the write lands


async def test_the_message_is_the_record_and_a_cancel_that_won_is_read(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """A submit's work message is its QUEUED record: dispatched without reading anything, the
    RUNNING write being the record's create. A job cancelled while queued (the cancel created the
    record first, and announced it as the gateway does) loses that create; the dispatch reads
    what won and runs nothing. (The announced cancel also drops the message: here that drop is
    held back, as when a dispatch pulls the message first.)"""
    store: Any = app.flow._store
    reads: list[str] = []
    dropped: list[str] = []
    for name in ("get", "recorded", "queued"):
        real = getattr(store, name)

        async def counting(key: str, real: Any = real) -> JobRecord | None:
            reads.append(key)
            return await real(key)

        setattr(store, name, counting)

    async def held_back(record: JobRecord) -> None:
        dropped.append(record.key)

    store.drop_work_message = held_back
    batcher = await batchers("b1")
    fresh = await enqueue(nc, kv)
    await batcher.grant(1)
    order = await batcher.next_order()
    assert order.job_id == fresh
    assert reads == []
    running = await wait_state(js, fresh, JobState.RUNNING)  # the order may go out before the write lands
    assert running.attempt == 1
    stale = await enqueue(nc, kv)
    key = job_key(TENANT, stale)
    queued = await read_record(js, stale)
    assert (queued.state, queued.revision) == (JobState.QUEUED, 0)
    now = time.time()
    await kv.create(key, encode_record(queued.evolve(state=JobState.CANCELED, end_time=now, update_time=now)))
    await nc.publish(cancel_subject(MODEL), CancelNotice(job_id=stale, tenant=TENANT, model_name=MODEL).encode())

    async def heard() -> bool:
        return app.flow.cancel_heard(stale)

    await until(heard)
    reads.clear()
    await batcher.grant(1)

    async def acked() -> bool:
        info = await js.consumer_info(config.nats.work_stream, "work-demo-normal")
        return info.num_ack_pending == 1 and info.num_pending == 0  # only `fresh` still held

    await until(acked)
    assert key in reads

    async def drop_asked() -> bool:
        return dropped == [key]

    await until(drop_asked)
    assert (await read_record(js, stale)).state == JobState.CANCELED
    with pytest.raises(TimeoutError):
        await batcher.next_order(timeout_s=0.2)


async def test_an_order_sent_before_a_refused_running_write_is_cancelled_and_its_answer_dropped(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """A queued job's order goes out before its RUNNING write is answered. When the write loses
    (here: a cancel that won without its notice, as from a gateway that predates it, or a notice
    core NATS lost), the order is cancelled, the batcher's answer is dropped, and the job stays
    CANCELED with its message acked; the credit it took is spent, and the next job runs."""
    batcher = await batchers("b1")
    stale = await enqueue(nc, kv)
    queued = await read_record(js, stale)
    now = time.time()
    canceled = queued.evolve(state=JobState.CANCELED, end_time=now, update_time=now)
    await kv.create(job_key(TENANT, stale), encode_record(canceled))
    await batcher.grant(1)
    order = await batcher.next_order()
    assert order.job_id == stale
    cancel = await asyncio.wait_for(batcher.cancels.get(), AT_ONCE_S)
    assert (cancel.job_id, cancel.attempt) == (stale, order.attempt)
    await batcher.answer(order)  # computed anyway (it had started): dropped

    async def acked() -> bool:
        info = await js.consumer_info(config.nats.work_stream, "work-demo-normal")
        return info.num_ack_pending == 0 and info.num_pending == 0

    await until(acked)
    after = await read_record(js, stale)
    assert (after.state, after.outputs) == (JobState.CANCELED, canceled.outputs)
    fresh = await enqueue(nc, kv)
    await batcher.grant(1)  # what the batcher gives back once the dropped order's slot is free
    next_order = await batcher.next_order()
    assert next_order.job_id == fresh
    await batcher.answer(next_order)

    async def succeeded() -> bool:
        return (await read_record(js, fresh)).state == JobState.SUCCEEDED

    await until(succeeded)


async def test_progress_reported_before_the_running_write_is_answered_is_relayed(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """The order goes out before the RUNNING write is answered, so a batcher can report progress
    inside that window: the report waits for the write (as a result does) and is relayed, and
    the attempt's terminal write keeps it."""
    store: Any = app.flow._store
    real_transition = store.transition
    held = asyncio.Event()
    release = asyncio.Event()

    async def holding_the_first_write(*args: Any, **kwargs: Any) -> Any:
        if not held.is_set():
            held.set()
            await release.wait()
        return await real_transition(*args, **kwargs)

    store.transition = holding_the_first_write
    batcher = await batchers("b1")
    job_id = await enqueue(nc, kv)
    relayed: asyncio.Queue[str] = asyncio.Queue()

    async def heard(msg: Msg) -> None:
        relayed.put_nowait(decode_progress_notice(msg.data)[1].message)

    await nc.subscribe(progress_subject(TENANT, job_id), cb=heard)
    await nc.flush()
    await batcher.grant(1)
    order = await batcher.next_order()
    assert order.job_id == job_id
    await asyncio.wait_for(held.wait(), AT_ONCE_S)  # the RUNNING write is still unanswered
    await batcher.report(order, "before the write")
    await batcher.answer(order)
    release.set()
    assert await asyncio.wait_for(relayed.get(), AT_ONCE_S) == "before the write"

    async def succeeded() -> bool:
        return (await read_record(js, job_id)).state == JobState.SUCCEEDED

    await until(succeeded)
    done = await read_record(js, job_id)
    assert done.progress is not None
    assert done.progress.message == "before the write"


async def test_a_stale_notice_is_not_taken_for_a_redelivered_replay(
    js: JetStreamContext, app: SchedulerApp, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """A replay's notice is published after its message, so the replay may be dispatched (on a
    read) before the notice comes; the notice then stayed, and the job's retry took it: an early
    order for an attempt the write had moved past, run by the batcher and then refused, its
    attempt refunded (seen under `up`: a replayed job ran 5 attempts of a budget of 4, the third
    twice). A redelivery now reads the record, and only a submit's own message sends early."""
    announced: Any = app.flow._queued_records
    batcher = await batchers("b1")
    job_id = await enqueue(nc, kv, legacy=True, max_attempts=2)  # its record in the bucket, as a replay's
    key = job_key(TENANT, job_id)
    queued = await read_record(js, job_id)
    await until(lambda: noted(announced, key))
    await batcher.grant(2)
    first = await batcher.next_order()
    assert (first.job_id, first.attempt) == (job_id, 1)
    announced.put(key, queued.revision, encode_record(queued))  # the late notice: attempt 0, QUEUED
    error = error_pb2.ErrorStatus(code=14, reason="MODEL_ERROR", message="CUDA hiccup", retriable=True)
    await batcher.fail(first, error)
    second = await batcher.next_order(timeout_s=AT_ONCE_S)
    assert (second.job_id, second.attempt) == (job_id, 2)
    await batcher.answer(second)
    done = await wait_state(js, job_id, JobState.SUCCEEDED)
    assert (done.attempt, done.max_attempts) == (2, 2)  # no attempt refunded for a refused early order
    assert key not in announced


async def test_an_order_goes_early_only_on_a_submits_own_record(
    js: JetStreamContext, app: SchedulerApp, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """A notice's record may be older than the bucket's on the first delivery too (a job replayed
    again, whose earlier notice came late): the dispatch writes first and orders the attempt the
    write made, instead of an early order the write refuses."""
    announced: Any = app.flow._queued_records
    batcher = await batchers("b1")
    job_id = await enqueue(nc, kv, legacy=True, max_attempts=3)
    key = job_key(TENANT, job_id)
    await until(lambda: noted(announced, key))  # the notice's record: attempt 0
    queued = await read_record(js, job_id)
    await kv.update(key, encode_record(queued.evolve(attempt=1)), last=queued.revision)  # the bucket moved on
    await batcher.grant(1)
    order = await batcher.next_order()
    assert (order.job_id, order.attempt) == (job_id, 2)
    await batcher.answer(order)
    done = await wait_state(js, job_id, JobState.SUCCEEDED)
    assert (done.attempt, done.max_attempts) == (2, 3)


async def test_a_job_cancelled_while_queued_leaves_the_queue_at_once(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, nc: NatsClient
) -> None:
    """Its work message was left until a dispatch pulled it: counted meanwhile as queued (the
    queue's depth, the desired batchers, the tenant's queued jobs), for as long as its queue was
    paused or backed up. On the cancel's notice the scheduler drops it; a job still CANCELLING
    (running on another scheduler's batcher) keeps its message. No batcher: nothing dispatches."""
    cancelled, cancelling, kept = [await enqueue(nc, kv) for _ in range(3)]
    assert await work_messages(js, config) == 3
    for job_id, state in ((cancelled, JobState.CANCELED), (cancelling, JobState.CANCELLING)):
        record = await read_record(js, job_id)
        await kv.create(job_key(TENANT, job_id), encode_record(record.evolve(state=state, update_time=time.time())))
        await nc.publish(cancel_subject(MODEL), CancelNotice(job_id=job_id, tenant=TENANT, model_name=MODEL).encode())

    async def one_dropped() -> bool:
        return await work_messages(js, config) == 2

    await until(one_dropped)
    queued = await js.stream_info(config.nats.work_stream, subjects_filter=job_work_lookup(TENANT, "*"))
    assert set(queued.state.subjects or {}) == {
        job_work_subject(MODEL, Priority.NORMAL, TENANT, job_id) for job_id in (cancelling, kept)
    }
    assert (await read_record(js, cancelled)).state is JobState.CANCELED  # the record stays


async def test_a_stopping_scheduler_says_not_serving_while_it_waits_for_its_jobs(
    app: SchedulerApp, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """Its stop waits up to its grace for the jobs in flight, and only then stops its server;
    health said SERVING for that whole wait (an operator's pass: ~10 s), so probes and load
    balancers kept sending to it. It says NOT_SERVING from the stop's start."""
    batcher = await batchers("b1")
    await batcher.grant(1)
    await enqueue(nc, kv)
    order = await batcher.next_order()  # held unanswered: the stop waits for it
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest()
        assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.create_task(app.stop(grace_s=5.0))

        async def not_serving() -> bool:
            return (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING

        await until(not_serving)
        assert not stopping.done()  # still waiting for the job in flight
        await batcher.answer(order)
        await asyncio.wait_for(stopping, 10)


async def test_a_result_not_stored_while_nats_is_away_is_one_warning(
    app: SchedulerApp, kv: KeyValue, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """An outage is expected: each result it could not store was an error with a traceback (an
    operator's pass: 48 of them in a 10-s outage). It is a warning saying why, once, while the
    result is tried again (session 24: for up to 120 s, the message kept meanwhile)."""
    batcher = await batchers("b1")
    await batcher.grant(1)
    await enqueue(nc, kv)
    order = await batcher.next_order()
    tries = 0

    async def nats_away(job: Any, result: Any) -> None:
        nonlocal tries
        tries += 1
        raise Unavailable("cannot update the job record: nats: timeout")

    app.flow._settlement.result = nats_away  # type: ignore[method-assign]
    with capture_logs() as logs:
        await batcher.answer(order)

        async def tried_again() -> bool:
            return tries >= 3

        await until(tried_again)
    (entry,) = [e for e in logs if e["event"] == "result_not_stored_yet"]
    assert entry["log_level"] == "warning"
    assert entry["error"] == "cannot update the job record: nats: timeout"
    assert "exc_info" not in entry
    assert not [e for e in logs if e["event"] == "result_not_stored"], "not given up yet"


async def test_a_replays_notice_spares_the_read(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """A message whose record is in the bucket (a replay's, an older gateway's) is dispatched on
    the record its queued notice carried, without reading it."""
    store: Any = app.flow._store
    real_recorded = store.recorded
    reads: list[str] = []

    async def counting(key: str) -> JobRecord | None:
        reads.append(key)
        return await real_recorded(key)

    store.recorded = counting
    announced: Any = app.flow._queued_records
    batcher = await batchers("b1")
    job_id = await enqueue(nc, kv, legacy=True)
    await until(lambda: noted(announced, job_key(TENANT, job_id)))
    await batcher.grant(1)
    assert (await batcher.next_order()).job_id == job_id
    assert job_key(TENANT, job_id) not in reads


async def test_a_dispatch_whose_running_write_nats_refused_is_one_warning_and_runs_later(
    app: SchedulerApp, js: JetStreamContext, kv: KeyValue, config: Config, batchers: OpenBatcher, nc: NatsClient
) -> None:
    """While the jobs bucket's leader is elected, its writes are answered "no responders", which the
    store raises as Unavailable. A dispatch failed so logged an error with a traceback per job (one
    with locals, rendered on the event loop: 65 of them held a CI run's whole process for 100 s
    after a node was killed). It is a warning in a line; the message comes back and the job runs."""
    bucket = f"KV_{config.nats.jobs_bucket}"
    info = await js.stream_info(bucket)
    subjects = list(info.config.subjects or [])
    # Nothing listens on the bucket's subjects any more: a write is answered "no responders", as
    # one sent while the bucket has no leader is.
    info.config.subjects = [f"elsewhere.{config.nats.jobs_bucket}.>"]
    await js.update_stream(info.config)
    batcher = await batchers("b1")
    with capture_logs() as logs:
        job_id = await enqueue(nc, kv)
        await batcher.grant(1)
        first = await batcher.next_order()
        cancel = await asyncio.wait_for(batcher.cancels.get(), AT_ONCE_S)
        assert (cancel.job_id, cancel.attempt) == (job_id, first.attempt)  # its write failed: withdrawn

        async def failure_logged() -> bool:
            return any(e["event"] == "dispatch_failed" for e in logs)

        await until(failure_logged)
        info.config.subjects = subjects
        await js.update_stream(info.config)
        await batcher.grant(1)
        again = await batcher.next_order(timeout_s=10.0)
        assert again.job_id == job_id
        await batcher.answer(again)
        await wait_state(js, job_id, JobState.SUCCEEDED)
    failures = [e for e in logs if e["event"] == "dispatch_failed"]
    assert failures[0]["log_level"] == "warning"
    for entry in failures:  # any more within the interval are held back, at debug (RepeatedLines)
        assert entry["log_level"] in ("warning", "debug")
        assert "exc_info" not in entry
        assert entry["error"].startswith("cannot update the job record: nats: no response from stream")


async def test_a_timeout_whose_write_nats_refused_is_one_warning_and_the_job_comes_back(
    config: Config, js: JetStreamContext, nc: NatsClient
) -> None:
    """A job timed out while the jobs bucket's leader is elected: its TIMED_OUT write is refused,
    which was an error with a traceback (a line per job, drawn on the event loop as dispatch_failed
    was). It is a warning in a line; the message comes back after its AckWait and the job runs."""
    app = SchedulerApp(config.replace(scheduler={"ack_wait_s": 2.0, "lease_renew_interval_s": 0.5}))
    await app.start()
    kv = await js.key_value(config.nats.jobs_bucket)
    batcher = FakeBatcher(app.port, "older")  # times no run out itself: the scheduler's timer does
    bucket = f"KV_{config.nats.jobs_bucket}"
    try:
        await batcher.connect()
        await batcher.grant(1)
        # Room to move the bucket away between its RUNNING write and its timeout.
        job_id = await enqueue(nc, kv, execution_timeout_s=3.0)
        first = await batcher.next_order()
        await wait_state(js, job_id, JobState.RUNNING)
        info = await js.stream_info(bucket)
        subjects = list(info.config.subjects or [])
        info.config.subjects = [f"elsewhere.{config.nats.jobs_bucket}.>"]  # writes: "no responders"
        await js.update_stream(info.config)
        with capture_logs() as logs:
            cancel = await asyncio.wait_for(batcher.cancels.get(), AT_ONCE_S)
            assert (cancel.job_id, cancel.attempt) == (job_id, first.attempt)

            async def failure_logged() -> bool:
                return any(e["event"] == "timeout_not_stored" for e in logs)

            await until(failure_logged)
        info.config.subjects = subjects
        await js.update_stream(info.config)
        (entry,) = [e for e in logs if e["event"] == "timeout_not_stored"]
        assert entry["log_level"] == "warning"
        assert "exc_info" not in entry
        assert entry["error"].startswith("cannot update the job record: nats: no response from stream")
        await batcher.grant(1)
        again = await batcher.next_order(timeout_s=10.0)  # AckWait's redelivery: the job was kept
        assert (again.job_id, again.attempt) == (job_id, 2)
        await batcher.answer(again)
        await wait_state(js, job_id, JobState.SUCCEEDED)
    finally:
        await batcher.close()
        await app.stop(grace_s=1.0)


async def test_a_scheduler_starting_during_a_leader_election_waits_for_its_heartbeat_and_pauses_watch(
    config: Config, nc: NatsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler started just after a node was lost (a pod restarted during a failover) met the
    queues bucket with no leader yet: its first heartbeat write failed with 'no response from
    stream' and the start with it (tests/test_cluster.py, 1 run in ~10 on 2 busy cores). Its first
    heartbeat and its pauses' watch now wait out the election as its declarations do. The election
    is the one part played here: the first try of each answers as a leaderless stream does."""
    from nats.js.errors import NoStreamResponseError

    from services.scheduler.instances import SchedulerInstance

    failed: list[str] = []
    beat = SchedulerInstance.beat
    watch = KeyValue.watch

    async def beat_after_an_election(self: SchedulerInstance) -> None:
        if "beat" not in failed:
            failed.append("beat")
            raise NoStreamResponseError
        await beat(self)

    async def watch_after_an_election(self: KeyValue, keys: str, **options: Any) -> Any:
        if "watch" not in failed:
            failed.append("watch")
            raise NoStreamResponseError
        return await watch(self, keys, **options)

    monkeypatch.setattr(SchedulerInstance, "beat", beat_after_an_election)
    monkeypatch.setattr(KeyValue, "watch", watch_after_an_election)
    scheduler = SchedulerApp(config)
    await scheduler.start()
    try:
        assert failed == ["beat", "watch"]
        queues = await nc.jetstream().key_value(config.nats.queues_bucket)
        heartbeats = [key for key in await queues.keys() if key.startswith("scheduler.")]
        assert len(heartbeats) == 1, heartbeats
    finally:
        await scheduler.stop(grace_s=1.0)
