"""A hung model call's queue places, against the fake scheduler of tests/test_batcher_worker.py (a
real gRPC WorkerService) that spends every credit the batcher grants at once, as a scheduler with a
backlog does. The items of a call that hangs time out at their execution timeout; their places stay
taken until the call returns while no other slot can take work (session 28's note: they were freed
at the time-out, and the orders sent on them were given back half a second later, when the batcher
found the call overran), and are freed at once where another slot can run what comes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
from google.protobuf import duration_pb2

from asyncinfer.config import DEMO_MODEL, Config, ModelConfig
from asyncinfer.tensor_codec import to_input_proto
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import worker_service_pb2
from services.batcher.app import BatcherApp
from tests.hanging_models import HANG_VALUE, RELEASE
from tests.test_batcher_worker import Connection, FakeScheduler, batcher_under_test, poll, serving

pytestmark = pytest.mark.timeout(60)

MODEL = "hang"
PLACES = 4
RUN_TIMEOUT_S = 0.3
HUNG = "hung"


def hanging_model(slots: int) -> ModelConfig:
    return DEMO_MODEL.model_copy(
        update={
            "name": MODEL,
            "loader": "tests.hanging_models:build_hanging_model",
            "max_inflight_batches": slots,
            "max_batch_size": 1,  # a batch per order: the hung one computes alone
            "max_queue_size": PLACES,
            "max_queue_delay_ms": 0.0,
            "warm_up": False,
        }
    )


def timed_order(job_id: str, first: float) -> worker_service_pb2.ConnectResponse:
    x = np.full((1, 4), 1.0, dtype=np.float32)
    x[0, 0] = first
    work = worker_service_pb2.WorkOrder(
        job_id=job_id,
        attempt=1,
        model_name=MODEL,
        inputs=[to_input_proto(Tensor.from_numpy("x", x))],
        tenant="default",
        execution_timeout=duration_pb2.Duration(nanos=int(RUN_TIMEOUT_S * 1e9)),
    )
    return worker_service_pb2.ConnectResponse(order=work)


class Spender:
    """Sends an order for every credit granted, up to `most` orders in all (the hung one first)."""

    def __init__(self, connection: Connection, most: int) -> None:
        self.connection = connection
        self.most = most
        self.sent: list[str] = [HUNG]
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._spend())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _spendable(self) -> int:
        return min(self.connection.credits.get(MODEL, 0), self.most) - len(self.sent)

    async def _spend(self) -> None:
        connection = self.connection
        while True:
            async with connection.changed:
                await connection.changed.wait_for(lambda: self._spendable() > 0)
            for _ in range(self._spendable()):
                job_id = f"job-{len(self.sent)}"
                self.sent.append(job_id)
                connection.send(timed_order(job_id, float(len(self.sent))))


@asynccontextmanager
async def hung_call(slots: int, most: int) -> AsyncIterator[tuple[BatcherApp, Connection, Spender]]:
    """A batcher whose hang model has `slots` slots, one of them computing an order that hangs (until
    RELEASE), and the spender sending orders for every credit, up to `most` orders in all."""
    RELEASE.clear()
    async with serving(FakeScheduler()) as (fake, port):
        config = Config().replace(
            batcher=batcher_under_test(port),
            logging={"level": "warning", "format": "console"},
            models=[hanging_model(slots)],
        )
        app = BatcherApp(config)
        await app.start()
        spender: Spender | None = None
        try:
            connection = await fake.next_connection(1)
            await connection.wait_for(lambda: connection.credits.get(MODEL) == PLACES)
            connection.send(timed_order(HUNG, HANG_VALUE))
            await poll(lambda: app.engine.queue_depth(MODEL) == 0 and app.engine.free_slots(MODEL) == PLACES - 1)
            spender = Spender(connection, most)
            spender.start()
            yield app, connection, spender
        finally:
            RELEASE.set()
            if spender is not None:
                await spender.stop()
            await app.stop(grace_s=1.0)


def ran(result: worker_service_pb2.WorkResult) -> bool:
    """Computed and answered (neither given back nor failed)."""
    return not result.dropped and not result.HasField("error")


def given_back(connection: Connection) -> list[str]:
    return sorted(job_id for (job_id, _), result in connection.results.items() if result.dropped)


async def test_a_hung_calls_timed_out_item_keeps_its_place_until_the_call_returns() -> None:
    """One slot: the jobs behind the hung call are given back once it is found overrun (they were
    sent before anything could tell), and nothing more is sent until the call returns. Before, the
    time-out freed the hung item's place, one more order was sent on it and given back 0.5 s later."""
    async with hung_call(slots=1, most=2 * PLACES) as (app, connection, spender):
        behind = [f"job-{n}" for n in range(1, PLACES)]
        timed_out = await connection.result(HUNG)
        assert timed_out.error.reason == "EXECUTION_TIMEOUT"
        await connection.wait_for(lambda: set(behind) <= set(given_back(connection)))
        await poll(lambda: app.engine.queue_depth(MODEL) == 0)  # stuck: all that waited went back
        # The stream is ordered: a credit granted at the time-out came before the answers given
        # back at the overrun, 0.5 s later (before: 5 credits, job-4 sent on the fifth and given
        # back too).
        assert connection.credits[MODEL] == PLACES
        assert spender.sent == [HUNG, *behind]
        assert given_back(connection) == behind
        RELEASE.set()  # the call returns: its place and the model's come back
        await connection.wait_for(lambda: connection.credits[MODEL] == 2 * PLACES)
        for job_id in [f"job-{n}" for n in range(PLACES, 2 * PLACES)]:
            result = await connection.result(job_id)
            assert ran(result), result
        assert given_back(connection) == behind


async def test_with_another_slot_a_timed_out_items_place_is_offered_at_once() -> None:
    """Two slots, one hung: the other runs what comes, so the hung item's place is offered as it
    times out, and an order sent on it runs while the call still hangs."""
    async with hung_call(slots=2, most=PLACES) as (_app, connection, spender):
        timed_out = await connection.result(HUNG)
        assert timed_out.error.reason == "EXECUTION_TIMEOUT"
        for job_id in spender.sent[1:]:
            result = await connection.result(job_id)
            assert ran(result), result
        # Every place free again, the hung item's too: the four orders received and four more.
        await connection.wait_for(lambda: connection.credits[MODEL] == 2 * PLACES)
        connection.send(timed_order("on-its-place", 2.0))
        result = await connection.result("on-its-place")
        assert ran(result), result
        assert not RELEASE.is_set()  # it ran beside the hung call
        assert given_back(connection) == []
