"""The batcher's work-stream client against a tiny fake scheduler (a real gRPC WorkerService in
this file): hello, credits, results, errors, cancellation and reconnection."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import structlog

from asyncinfer.config import DEMO_MODEL, Config, ModelVersionConfig
from asyncinfer.tensor_codec import decode_tensors, to_input_proto
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import worker_service_pb2, worker_service_pb2_grpc
from services.batcher import worker_client
from services.batcher.app import BatcherApp
from services.batcher.models.demo import FAILING_MODEL_MESSAGE, GATE
from tests.certs import TestCA
from tests.waits import WAIT_S

ABORT = "abort"


@dataclass
class Connection:
    """What the fake scheduler saw on one Connect stream, and a way to send it orders."""

    hello: worker_service_pb2.WorkerHello
    # None ends the stream cleanly; ABORT breaks it with UNAVAILABLE.
    outbox: asyncio.Queue[worker_service_pb2.ConnectResponse | str | None] = field(default_factory=asyncio.Queue)
    credits: dict[str, int] = field(default_factory=dict)
    results: dict[tuple[str, int], worker_service_pb2.WorkResult] = field(default_factory=dict)
    answers: int = 0  # results received, counting repeats
    update_sizes: list[int] = field(default_factory=list)  # results per WorkUpdates message
    update_credits: list[int] = field(default_factory=list)  # credits granted per WorkUpdates message
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def send(self, message: worker_service_pb2.ConnectResponse) -> None:
        self.outbox.put_nowait(message)

    def close(self) -> None:
        self.outbox.put_nowait(None)

    def abort(self) -> None:
        self.outbox.put_nowait(ABORT)

    async def wait_for(self, predicate: Any) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(predicate), WAIT_S)

    async def result(self, job_id: str, attempt: int = 1) -> worker_service_pb2.WorkResult:
        await self.wait_for(lambda: (job_id, attempt) in self.results)
        return self.results[(job_id, attempt)]


class FakeScheduler(worker_service_pb2_grpc.WorkerServiceServicer):
    def __init__(self, *, takes_batches: bool = False) -> None:
        self.takes_batches = takes_batches
        self.connections: list[Connection] = []
        self.connected = asyncio.Condition()
        self.server: grpc.aio.Server | None = None

    async def next_connection(self, count: int) -> Connection:
        async with self.connected:
            await asyncio.wait_for(self.connected.wait_for(lambda: len(self.connections) >= count), WAIT_S)
        return self.connections[count - 1]

    async def Connect(
        self, request_iterator: AsyncIterator[worker_service_pb2.ConnectRequest], context: Any
    ) -> AsyncIterator[worker_service_pb2.ConnectResponse]:
        first = await anext(aiter(request_iterator))
        assert first.WhichOneof("message") == "hello"
        connection = Connection(hello=first.hello)
        async with self.connected:
            self.connections.append(connection)
            self.connected.notify_all()
        reader = asyncio.create_task(self._read(request_iterator, connection))
        try:
            welcome = worker_service_pb2.WorkerWelcome(scheduler_id="fake", takes_batches=self.takes_batches)
            yield worker_service_pb2.ConnectResponse(welcome=welcome)
            while (message := await connection.outbox.get()) is not None:
                if message == ABORT:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler going away")
                assert isinstance(message, worker_service_pb2.ConnectResponse)
                yield message
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(
        self, request_iterator: AsyncIterator[worker_service_pb2.ConnectRequest], connection: Connection
    ) -> None:
        async for request in request_iterator:
            kind = request.WhichOneof("message")
            async with connection.changed:
                if kind == "credit":
                    name = request.credit.model_name
                    connection.credits[name] = connection.credits.get(name, 0) + request.credit.credits
                elif kind == "result":
                    connection.results[(request.result.job_id, request.result.attempt)] = request.result
                    connection.answers += 1
                elif kind == "updates":
                    assert self.takes_batches, "WorkUpdates sent to a scheduler that did not take them"
                    connection.update_sizes.append(len(request.updates.results))
                    connection.update_credits.append(sum(grant.credits for grant in request.updates.credits))
                    for result in request.updates.results:
                        connection.results[(result.job_id, result.attempt)] = result
                        connection.answers += 1
                    for grant in request.updates.credits:
                        connection.credits[grant.model_name] = (
                            connection.credits.get(grant.model_name, 0) + grant.credits
                        )
                connection.changed.notify_all()
        connection.close()  # the batcher half-closed: end the stream, as a scheduler does


@contextlib.asynccontextmanager
async def serving(fake: FakeScheduler) -> AsyncIterator[tuple[FakeScheduler, int]]:
    """The fake scheduler on a port of its own, for the time of the block."""
    server = grpc.aio.server()
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    fake.server = server
    await server.start()
    try:
        yield fake, port
    finally:
        await server.stop(0)


@pytest.fixture
async def scheduler(request: pytest.FixtureRequest) -> AsyncIterator[tuple[FakeScheduler, int]]:
    """A fake scheduler; parametrized indirectly with True, one whose welcome takes batches."""
    async with serving(FakeScheduler(takes_batches=getattr(request, "param", False))) as served:
        yield served


def batcher_under_test(port: int) -> dict[str, object]:
    """The batcher section of a batcher served by the fake scheduler on `port`."""
    return {
        "port": 0,
        "metrics_port": 0,
        "scheduler_address": f"127.0.0.1:{port}",
        "batcher_id": "batcher-under-test",
        "reconnect_delay_s": 0.05,
    }


@pytest.fixture
async def app(scheduler: tuple[FakeScheduler, int]) -> AsyncIterator[BatcherApp]:
    _, port = scheduler
    config = Config().replace(
        batcher=batcher_under_test(port),
        logging={"level": "warning", "format": "console"},
        models=[
            DEMO_MODEL,
            DEMO_MODEL.model_copy(
                update={"name": "failing", "loader": "services.batcher.models.demo:build_failing_model"}
            ),
            DEMO_MODEL.model_copy(update={"name": "slow", "loader": "services.batcher.models.demo:build_slow_model"}),
            # One batch at a time, held at the gate, so the next order stays queued (cancellable).
            DEMO_MODEL.model_copy(
                update={
                    "name": "patient",
                    "loader": "services.batcher.models.demo:build_gated_model",
                    "max_inflight_batches": 1,
                    "max_queue_delay_ms": 60_000.0,
                }
            ),
        ],
    )
    batcher = BatcherApp(config)
    await batcher.start()
    try:
        yield batcher
    finally:
        GATE.set()
        await batcher.stop(grace_s=1.0)


async def hold_patient_busy(connection: Connection, app: BatcherApp) -> None:
    """Starts a batch of the patient model that computes until GATE is set."""
    GATE.clear()
    connection.send(order("blocker", np.zeros((1, 4), dtype=np.float32), model="patient"))
    await poll(
        lambda: (
            app.engine.queue_depth("patient") == 0
            and app.engine.free_slots("patient") < app.config.models[0].max_queue_size
        )
    )


async def poll(predicate: Any) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def order(
    job_id: str,
    x: np.ndarray[Any, Any],
    *,
    attempt: int = 1,
    name: str = "x",
    model: str = "demo",
    version: str = "",
) -> worker_service_pb2.ConnectResponse:
    work = worker_service_pb2.WorkOrder(
        job_id=job_id,
        attempt=attempt,
        model_name=model,
        model_version=version,
        inputs=[to_input_proto(Tensor.from_numpy(name, x))],
        tenant="default",
    )
    return worker_service_pb2.ConnectResponse(order=work)


async def test_hello_lists_models_and_credits_cover_the_queue(
    scheduler: tuple[FakeScheduler, int], app: BatcherApp
) -> None:
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    assert connection.hello.batcher_id == "batcher-under-test"
    assert [(m.model_name, m.model_version, m.max_batch_size) for m in connection.hello.models] == [
        ("demo", "1", 32),
        ("failing", "1", 32),
        ("slow", "1", 32),
        ("patient", "1", 32),
    ]
    max_queue_size = app.config.models[0].max_queue_size
    await connection.wait_for(
        lambda: connection.credits == dict.fromkeys(("demo", "failing", "slow", "patient"), max_queue_size)
    )


async def test_a_work_order_returns_its_result(scheduler: tuple[FakeScheduler, int], app: BatcherApp) -> None:
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    max_queue_size = app.config.models[0].max_queue_size
    await connection.wait_for(lambda: connection.credits.get("demo") == max_queue_size)
    xs = {f"job-{i}": np.full((i + 1, 4), float(i), dtype=np.float32) for i in range(3)}
    for job_id, x in xs.items():
        connection.send(order(job_id, x, attempt=2))
    for job_id, x in xs.items():
        result = await connection.result(job_id, attempt=2)
        assert result.job_id == job_id
        assert result.attempt == 2
        assert not result.HasField("error")
        assert not result.dropped
        (y,) = decode_tensors(result.outputs, "outputs")
        assert y.name == "y"
        np.testing.assert_array_equal(y.to_numpy(), 2 * x + 1)
        assert result.batch_size >= 1
        assert result.compute_duration.ToNanoseconds() > 0
    # Each finished item earned its credit back.
    await connection.wait_for(lambda: connection.credits["demo"] == max_queue_size + 3)


@pytest.mark.parametrize("scheduler", [True], indirect=True)
async def test_orders_in_one_message_are_answered_once_each_in_batches(
    scheduler: tuple[FakeScheduler, int], app: BatcherApp
) -> None:
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    assert connection.hello.takes_batches
    max_queue_size = app.config.models[0].max_queue_size
    await connection.wait_for(lambda: connection.credits.get("demo") == max_queue_size)
    await hold_patient_busy(connection, app)
    xs = {f"job-{i}": np.full((1, 4), float(i), dtype=np.float32) for i in range(8)}
    batch = worker_service_pb2.WorkOrders()
    for job_id, x in xs.items():
        batch.orders.append(order(job_id, x).order)
    # Queued behind the blocker on the one-batch-at-a-time model, then cancelled in the same message.
    batch.orders.append(order("cancelled", np.zeros((1, 4), dtype=np.float32), model="patient").order)
    batch.cancels.add(job_id="cancelled", attempt=1)
    connection.send(worker_service_pb2.ConnectResponse(orders=batch))
    for job_id, x in xs.items():
        result = await connection.result(job_id)
        (y,) = decode_tensors(result.outputs, "outputs")
        np.testing.assert_array_equal(y.to_numpy(), 2 * x + 1)
    dropped = await connection.result("cancelled")
    assert dropped.dropped
    GATE.set()
    assert not (await connection.result("blocker")).HasField("error")
    assert connection.answers == len(xs) + 2, "every order answered exactly once"
    assert connection.update_sizes, "results went in WorkUpdates messages"
    # The eight demo items ran as one batch and their results were ready together.
    assert max(connection.update_sizes) > 1
    await connection.wait_for(lambda: connection.credits["demo"] == max_queue_size + len(xs))


@pytest.mark.parametrize("scheduler", [True], indirect=True)
async def test_a_result_rides_with_the_credit_its_item_freed(
    scheduler: tuple[FakeScheduler, int], app: BatcherApp
) -> None:
    """A finished item frees its slot a step before its order task answers it; the answer goes in
    the same WorkUpdates message as the credit rather than in a second one written after it (a
    round trip's result would wait for that write)."""
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    max_queue_size = app.config.models[0].max_queue_size
    await connection.wait_for(lambda: connection.credits.get("demo") == max_queue_size)
    for round_number in range(3):
        seen = len(connection.update_sizes)
        connection.send(order(f"alone-{round_number}", np.ones((1, 4), dtype=np.float32)))
        await connection.result(f"alone-{round_number}")
        granted = max_queue_size + round_number + 1
        await connection.wait_for(lambda granted=granted: connection.credits["demo"] == granted)
        assert connection.update_sizes[seen:] == [1]
        assert connection.update_credits[seen:] == [1]


async def test_an_invalid_order_fails_without_retry(scheduler: tuple[FakeScheduler, int], app: BatcherApp) -> None:
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    connection.send(order("bad-shape", np.zeros((1, 3), dtype=np.float32)))
    connection.send(order("bad-name", np.zeros((1, 4), dtype=np.float32), name="q"))
    for job_id, field_name in (("bad-shape", "inputs[0].shape"), ("bad-name", "inputs[0].name")):
        result = await connection.result(job_id)
        assert result.HasField("error")
        assert result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert not result.error.retriable
        assert field_name in [v.field for v in result.error.field_violations]
        assert not result.outputs


async def test_an_order_for_a_version_unloaded_here_is_handed_back_unrun(
    scheduler: tuple[FakeScheduler, int],
) -> None:
    """An order that reaches the batcher after it unloaded the order's version (or the whole
    model) and its 1-s linger ended, sent before the scheduler heard the unload, is answered
    dropped with no error: the scheduler puts the job back with its attempt given back and routes
    it by what the batchers serve now. It was answered UNAVAILABLE MODEL_VERSION_NOT_SERVED (NOT_FOUND
    MODEL_NOT_FOUND for the model), taken as the attempt's failure: a retry spent, or the job failed."""
    fake, port = scheduler
    config = Config().replace(
        batcher=batcher_under_test(port),
        logging={"level": "warning", "format": "console"},
        models=[
            DEMO_MODEL.model_copy(update={"versions": (ModelVersionConfig(version="2"),)}),
            DEMO_MODEL.model_copy(update={"name": "spare"}),
        ],
    )
    app = BatcherApp(config)
    await app.start()
    try:
        connection = await fake.next_connection(1)
        await app.models.unload_model("demo", "2")
        await app.models.unload_model("spare")
        await app.models.drained()  # their linger is over: the queues are closed
        assert not app.engine.has_model("demo", "2")
        assert not app.engine.has_model("spare")
        x = np.ones((1, 4), dtype=np.float32)
        connection.send(order("late-version", x, version="2"))
        connection.send(order("late-model", x, model="spare", version="1"))
        connection.send(order("served", x, version="1"))
        for job_id in ("late-version", "late-model"):
            result = await connection.result(job_id)
            assert (result.dropped, result.HasField("error")) == (True, False), (job_id, result.error)
            assert not result.outputs
        served = await connection.result("served")
        assert not served.HasField("error")
        (y,) = decode_tensors(served.outputs, "outputs")
        np.testing.assert_array_equal(y.to_numpy(), 2 * x + 1)
    finally:
        await app.stop(grace_s=1.0)


async def test_a_broken_stream_reconnects_with_a_new_hello(
    scheduler: tuple[FakeScheduler, int], app: BatcherApp
) -> None:
    fake, _ = scheduler
    first = await fake.next_connection(1)
    first.close()  # the scheduler ends the stream
    second = await fake.next_connection(2)
    assert second.hello.batcher_id == "batcher-under-test"
    max_queue_size = app.config.models[0].max_queue_size
    await second.wait_for(lambda: second.credits.get("demo") == max_queue_size)
    x = np.ones((1, 4), dtype=np.float32)
    second.send(order("after-reconnect", x))
    result = await second.result("after-reconnect")
    (y,) = decode_tensors(result.outputs, "outputs")
    np.testing.assert_array_equal(y.to_numpy(), 2 * x + 1)


async def test_a_model_error_is_retriable(scheduler: tuple[FakeScheduler, int], app: BatcherApp) -> None:
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    connection.send(order("fails", np.zeros((1, 4), dtype=np.float32), model="failing"))
    result = await connection.result("fails")
    assert result.error.reason == "MODEL_ERROR"
    assert FAILING_MODEL_MESSAGE in result.error.message
    assert result.error.retriable
    assert not result.dropped


async def test_cancel_order_drops_an_item_that_has_not_started(
    scheduler: tuple[FakeScheduler, int], app: BatcherApp
) -> None:
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    await hold_patient_busy(connection, app)
    connection.send(order("waits", np.zeros((1, 4), dtype=np.float32), model="patient", attempt=3))
    await poll(lambda: app.engine.queue_depth("patient") == 1)  # the engine holds the order
    connection.send(
        worker_service_pb2.ConnectResponse(cancel=worker_service_pb2.CancelOrder(job_id="waits", attempt=3))
    )
    result = await connection.result("waits", attempt=3)
    assert result.dropped
    assert result.error.code == grpc.StatusCode.CANCELLED.value[0]
    assert not result.outputs
    assert app.engine.queue_depth("patient") == 0
    GATE.set()
    assert not (await connection.result("blocker")).HasField("error")


async def test_orders_in_flight_on_a_broken_stream_are_abandoned(
    scheduler: tuple[FakeScheduler, int], app: BatcherApp
) -> None:
    fake, _ = scheduler
    first = await fake.next_connection(1)
    await hold_patient_busy(first, app)
    first.send(order("stranded", np.zeros((1, 4), dtype=np.float32), model="patient"))
    await poll(lambda: app.engine.queue_depth("patient") == 1)  # the engine holds the order
    first.abort()
    GATE.set()
    second = await fake.next_connection(2)
    max_queue_size = app.config.models[0].max_queue_size
    # The stranded item left the engine, so the new stream is offered every slot again.
    await second.wait_for(lambda: second.credits.get("patient") == max_queue_size)
    assert app.engine.queue_depth("patient") == 0
    assert not first.results
    assert not second.results


async def test_stop_answers_orders_in_flight_and_leaves_queued_ones_unanswered(
    scheduler: tuple[FakeScheduler, int], app: BatcherApp
) -> None:
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    x = np.full((2, 4), 3.0, dtype=np.float32)
    connection.send(order("in-flight", x, model="slow"))
    max_queue_size = app.config.models[0].max_queue_size
    await poll(lambda: app.engine.free_slots("slow") < max_queue_size and app.engine.queue_depth("slow") == 0)
    await hold_patient_busy(connection, app)
    connection.send(order("queued", x, model="patient"))
    await poll(lambda: app.engine.queue_depth("patient") == 1)
    stopping = asyncio.create_task(app.stop(grace_s=5.0))
    await poll(lambda: app.engine.queue_depth("patient") == 0)  # "queued" failed without starting
    GATE.set()  # the blocker finishes within the grace period
    await asyncio.wait_for(stopping, timeout=WAIT_S)
    assert not (await connection.result("blocker")).HasField("error")
    result = await connection.result("in-flight")
    (y,) = decode_tensors(result.outputs, "outputs")
    np.testing.assert_array_equal(y.to_numpy(), 2 * x + 1)
    queued = await connection.result("queued")
    assert queued.dropped  # it never ran: the scheduler puts it back with its attempt given back
    assert not queued.HasField("error")  # an error would be taken as the attempt's outcome
    assert len(fake.connections) == 1  # no reconnect after stop


async def test_stop_keeps_to_the_configured_grace_when_the_caller_allows_more(
    scheduler: tuple[FakeScheduler, int], app: BatcherApp
) -> None:
    """`batcher.shutdown_grace_s` bounds a stop: the process runner gives every service the same
    grace (10 s), and a batch still computing when the batcher's own runs out is abandoned, and
    answered dropped: the scheduler puts it back with its attempt given back (it was left to the
    stream's end, WORKER_LOST, the attempt spent)."""
    fake, _ = scheduler
    connection = await fake.next_connection(1)
    app.config = app.config.replace(batcher={"shutdown_grace_s": 0.05})
    await hold_patient_busy(connection, app)
    try:
        await asyncio.wait_for(app.stop(grace_s=3_600.0), timeout=WAIT_S)
    finally:
        GATE.set()
    abandoned = await connection.result("blocker")
    assert abandoned.dropped
    assert not abandoned.HasField("error")


async def test_a_scheduler_restart_leaves_no_pending_task_behind(
    scheduler: tuple[FakeScheduler, int], app: BatcherApp
) -> None:
    """The scheduler process dies (its server stops) and a new one binds the same port: the
    batcher reconnects, and the broken session's request writer ends with it rather than being
    left pending for the garbage collector ("Task was destroyed but it is pending")."""
    fake, port = scheduler
    first = await fake.next_connection(1)
    await first.wait_for(lambda: first.credits.get("demo", 0) > 0)
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        assert fake.server is not None
        await fake.server.stop(0)
        restarted = FakeScheduler()
        server = grpc.aio.server()
        worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(restarted, server)
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        await server.start()
        try:
            second = await restarted.next_connection(1)
            await second.wait_for(lambda: second.credits.get("demo", 0) > 0)
            gc.collect()
            await asyncio.sleep(0)
        finally:
            await server.stop(0)
    finally:
        loop.set_exception_handler(previous)
    assert not [c for c in reported if "destroyed" in str(c.get("message", ""))], reported


class RefusingScheduler(FakeScheduler):
    """Answers every Connect with `code` (having read the hello), counting them: a scheduler that
    cannot serve, or refuses this batcher."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__()
        self.code = code
        self.refused = 0

    async def Connect(  # type: ignore[override]
        self, request_iterator: AsyncIterator[worker_service_pb2.ConnectRequest], context: Any
    ) -> AsyncIterator[worker_service_pb2.ConnectResponse]:
        self.refused += 1
        await anext(aiter(request_iterator))
        await context.abort(self.code, "refused")
        yield worker_service_pb2.ConnectResponse()  # pragma: no cover (a generator; never reached)


class ListeningRefuser(FakeScheduler):
    """Reads the hello, then what the batcher sends before any answer (for up to LISTEN_S: nothing
    more may come), then refuses UNAUTHENTICATED."""

    LISTEN_S = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.before_answer: list[str] = []

    async def Connect(  # type: ignore[override]
        self, request_iterator: AsyncIterator[worker_service_pb2.ConnectRequest], context: Any
    ) -> AsyncIterator[worker_service_pb2.ConnectResponse]:
        requests = aiter(request_iterator)
        await anext(requests)
        with contextlib.suppress(TimeoutError, StopAsyncIteration):
            async with asyncio.timeout(self.LISTEN_S):
                while True:
                    self.before_answer.append((await anext(requests)).WhichOneof("message"))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "refused")
        yield worker_service_pb2.ConnectResponse()  # pragma: no cover (a generator; never reached)


async def test_the_batcher_writes_nothing_after_its_hello_until_the_scheduler_answers() -> None:
    # A write in flight when the refusal lands turns the call's status into grpc's INTERNAL
    # "Internal error from Core" (grpc/grpc#36066): the batcher then logged a refused key as INTERNAL
    # (1 time in 15 under load). Nothing written between the hello and the answer, nothing can fail.
    async with serving(ListeningRefuser()) as (refuser, port):
        batcher = BatcherApp(Config().replace(batcher=batcher_under_test(port), models=[DEMO_MODEL]))
        with structlog.testing.capture_logs() as logs:
            await batcher.start()
            try:
                await poll(lambda: any(e["event"] == "work_stream_failed" for e in logs))
            finally:
                await batcher.stop(grace_s=1.0)
    assert isinstance(refuser, ListeningRefuser)
    assert refuser.before_answer == [], "only the hello goes before the scheduler's answer"
    (first,) = [e for e in logs if e["event"] == "work_stream_failed"][:1]
    assert first["code"] == "UNAUTHENTICATED"


async def test_a_scheduler_that_stays_unreachable_is_logged_once_then_now_and_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Reconnecting every 50 ms here (every second by default), a line per failure would flood the log.
    monkeypatch.setattr(worker_client, "FAILURE_LOG_INTERVAL_S", 0.5)
    async with serving(RefusingScheduler()) as (refusing, port):
        config = Config().replace(batcher=batcher_under_test(port), models=[DEMO_MODEL])
        batcher = BatcherApp(config)
        with structlog.testing.capture_logs() as logs:
            await batcher.start()
            try:

                def failures() -> list[dict[str, Any]]:
                    return [entry for entry in logs if entry["event"] == "work_stream_failed"]

                await poll(lambda: len(failures()) >= 2)
                attempts = refusing.refused
            finally:
                await batcher.stop(grace_s=1.0)
    first, second = failures()[:2]
    assert "attempts" not in first, "the first failure is logged at once, as it is"
    assert first["scheduler"] == f"127.0.0.1:{port}"
    assert second["attempts"] > 2, "the next says how many failed since"
    assert second["failing_for_s"] >= 0.5
    assert len(failures()) < attempts / 2


async def test_scheduler_connected_waits_for_the_first_welcome() -> None:
    """What `up` waits for before its banner (services.up.stack): a batcher refused by its
    scheduler is not connected, one welcomed is, and a batcher without a scheduler has nothing
    to wait for."""
    async with serving(RefusingScheduler()) as (refusing, port):
        batcher = BatcherApp(Config().replace(batcher=batcher_under_test(port), models=[DEMO_MODEL]))
        await batcher.start()
        try:
            assert not await batcher.scheduler_connected(0.5)
            assert refusing.refused >= 1
        finally:
            await batcher.stop(grace_s=1.0)
    async with serving(FakeScheduler()) as (fake, port):
        batcher = BatcherApp(Config().replace(batcher=batcher_under_test(port), models=[DEMO_MODEL]))
        await batcher.start()
        try:
            assert await batcher.scheduler_connected(WAIT_S)
            assert len(fake.connections) == 1
        finally:
            await batcher.stop(grace_s=1.0)
    alone = BatcherApp(
        Config().replace(batcher={"port": 0, "metrics_port": 0, "scheduler_address": ""}, models=[DEMO_MODEL])
    )
    await alone.start()
    try:
        assert await alone.scheduler_connected(0.0)
    finally:
        await alone.stop(grace_s=1.0)


async def test_a_scheduler_that_refuses_this_batchers_key_is_said_to() -> None:
    async with serving(RefusingScheduler(grpc.StatusCode.UNAUTHENTICATED)) as (_refusing, port):
        batcher = BatcherApp(Config().replace(batcher=batcher_under_test(port), models=[DEMO_MODEL]))
        with structlog.testing.capture_logs() as logs:
            await batcher.start()
            try:
                await poll(lambda: any(e["event"] == "work_stream_failed" for e in logs))
            finally:
                await batcher.stop(grace_s=1.0)
    (first,) = [e for e in logs if e["event"] == "work_stream_failed"][:1]
    assert first["code"] == "UNAUTHENTICATED"
    assert "set batcher.api_key" in first["hint"]


async def test_a_mutual_tls_scheduler_that_closes_the_connection_names_the_client_certificate_settings(
    tmp_path: Path,
) -> None:
    """A scheduler with tls_client_ca_file closes a connection that presented no client certificate,
    which reaches the batcher as gRPC's "Socket closed" and nothing more: the batcher, which knows
    it sent none, names batcher.scheduler_cert_file and scheduler_key_file. With a certificate (one
    the scheduler's CA did not sign, refused the same way) it says nothing of them."""
    ca = TestCA(tmp_path / "pki")
    pem = ca.issue("scheduler")
    credentials = grpc.ssl_server_credentials(
        [(Path(pem.key_file).read_bytes(), Path(pem.cert_file).read_bytes())],  # noqa: ASYNC240
        root_certificates=Path(ca.ca_file).read_bytes(),  # noqa: ASYNC240
        require_client_auth=True,
    )
    server = grpc.aio.server()
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(FakeScheduler(), server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    stranger = TestCA(tmp_path / "stranger").issue("batcher")
    try:
        hints = []
        for certificate in ({}, {"scheduler_cert_file": stranger.cert_file, "scheduler_key_file": stranger.key_file}):
            section = {**batcher_under_test(port), "scheduler_ca_file": ca.ca_file, **certificate}
            batcher = BatcherApp(Config().replace(batcher=section, models=[DEMO_MODEL]))
            with structlog.testing.capture_logs() as logs:
                await batcher.start()
                try:
                    await poll(lambda: any(e["event"] == "work_stream_failed" for e in logs))
                finally:
                    await batcher.stop(grace_s=1.0)
            (first,) = [e for e in logs if e["event"] == "work_stream_failed"][:1]
            assert first["code"] == "UNAVAILABLE", first
            assert "Socket closed" in first["details"], first
            hints.append(first.get("hint"))
    finally:
        await server.stop(0)
    assert "set batcher.scheduler_cert_file and batcher.scheduler_key_file" in (hints[0] or ""), hints
    assert hints[1] is None, hints


async def test_a_model_that_always_fails_logs_its_first_failure_then_holds_back_the_rest(
    scheduler: tuple[FakeScheduler, int],
) -> None:
    """Twenty orders of the failing model, each its own batch: a `batch_failed` warning and a
    `work_order_failed` info line per batch and per order (hundreds a second at 100 jobs/s). Now the
    first of each says it, naming the job; the rest, within the interval, are at debug only."""
    fake, port = scheduler
    failing = DEMO_MODEL.model_copy(
        update={"name": "failing", "loader": "services.batcher.models.demo:build_failing_model"}
    )
    batcher = BatcherApp(Config().replace(batcher=batcher_under_test(port), models=[failing]))
    jobs = [f"fails-{n}" for n in range(20)]
    with structlog.testing.capture_logs() as logs:
        await batcher.start()
        try:
            connection = await fake.next_connection(1)
            for job_id in jobs:  # one at a time: a batch each
                connection.send(order(job_id, np.zeros((1, 4), dtype=np.float32), model="failing"))
                assert (await connection.result(job_id)).error.reason == "MODEL_ERROR"
        finally:
            await batcher.stop(grace_s=1.0)

    def lines(event: str) -> list[dict[str, Any]]:
        return [e for e in logs if e["event"] == event and e["log_level"] != "debug"]

    (first_order,) = lines("work_order_failed")
    assert (first_order["job_id"], first_order["model"], first_order["reason"]) == (jobs[0], "failing", "MODEL_ERROR")
    assert FAILING_MODEL_MESSAGE in first_order["error"]
    (first_batch,) = lines("batch_failed")
    assert (first_batch["model"], first_batch["log_level"]) == ("failing", "warning")
    assert FAILING_MODEL_MESSAGE in first_batch["error"]
    held = [e["job_id"] for e in logs if e["event"] == "work_order_failed" and e["log_level"] == "debug"]
    assert held == jobs[1:], "each job's line is still there at debug"


async def test_orders_refused_alike_log_the_first_refusal_then_hold_back_the_rest(
    scheduler: tuple[FakeScheduler, int],
) -> None:
    """Twelve orders whose input the model refuses (a client sending a wrong shape, at the job
    rate): a `work_order_rejected` info line per order. Now the first says it, naming its job; the
    rest within the interval are at debug only, each still there."""
    fake, port = scheduler
    batcher = BatcherApp(Config().replace(batcher=batcher_under_test(port), models=[DEMO_MODEL]))
    jobs = [f"refused-{n}" for n in range(12)]
    with structlog.testing.capture_logs() as logs:
        await batcher.start()
        try:
            connection = await fake.next_connection(1)
            for job_id in jobs:
                connection.send(order(job_id, np.zeros((1, 3), dtype=np.float32)))  # the demo's is 4 wide
                assert (await connection.result(job_id)).error.reason == "INVALID_ARGUMENT"
        finally:
            await batcher.stop(grace_s=1.0)
    said = [e for e in logs if e["event"] == "work_order_rejected" and e["log_level"] != "debug"]
    assert len(said) == 1, said
    assert (said[0]["log_level"], said[0]["job_id"], said[0]["reason"]) == ("info", jobs[0], "INVALID_ARGUMENT")
    held = [e["job_id"] for e in logs if e["event"] == "work_order_rejected" and e["log_level"] == "debug"]
    assert held == jobs[1:]
