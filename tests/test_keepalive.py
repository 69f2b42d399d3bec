"""A peer that vanishes without closing its connection (its host lost, a network that drops the
flow) is noticed by keepalive pings (asyncinfer/grpc_keepalive.py), on each long-lived stream:
the scheduler's to a batcher, a batcher's to its scheduler, the gateway's to a watcher, and the
SDK's to the gateway. Each test puts a SilentProxy (tests/silent_proxy.py) in the connection and
silences it; before keepalive, each side waited for good."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from asyncinfer.client import AsyncClient, JobState
from asyncinfer.config import Config
from asyncinfer.jobs import JobState as RecordState
from asyncinfer.nats import Client as NatsClient
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc
from services.batcher.app import BatcherApp
from services.scheduler.app import SchedulerApp
from tests.processes import until
from tests.silent_proxy import SilentProxy
from tests.stack import StartStack
from tests.test_scheduler import MODEL, FakeBatcher, enqueue, wait_state
from tests.test_watch_scale import demo_request

KEEPALIVE_S = 1.0
NOTICED_WITHIN_S = 15.0  # pings every 1 s, each answered within 1 s: gone within ~2 s, on a busy machine more


@pytest.fixture
def config(config: Config) -> Config:
    return config.replace(
        gateway={"keepalive_s": KEEPALIVE_S},
        scheduler={"keepalive_s": KEEPALIVE_S},
        batcher={"keepalive_s": KEEPALIVE_S},
    )


async def proxy_to(port: int) -> SilentProxy:
    proxy = SilentProxy(port)
    await proxy.start()
    return proxy


@pytest.fixture
async def scheduler(config: Config) -> AsyncIterator[SchedulerApp]:
    app = SchedulerApp(config)
    await app.start()
    try:
        yield app
    finally:
        await app.stop(grace_s=1.0)


async def test_a_batcher_gone_silent_has_its_job_run_again_on_another(
    scheduler: SchedulerApp, nc: NatsClient, config: Config
) -> None:
    """The scheduler pings its batchers: one whose connection went silent with a job (its node
    lost) is dropped as a crashed one is, and the job runs again on another batcher. Before, the
    stream looked open for ever and the job stayed RUNNING, its lease renewed."""
    js = nc.jetstream()
    kv = await js.key_value(config.nats.jobs_bucket)
    proxy = await proxy_to(scheduler.port)
    lost = FakeBatcher(proxy.port, "lost")  # a raw channel: no pings of its own
    other: FakeBatcher | None = None
    try:
        await lost.connect()
        await lost.grant(1)
        job_id = await enqueue(nc, kv, value=1.0)
        order = await lost.next_order()
        await wait_state(js, job_id, RecordState.RUNNING)
        proxy.silence()
        queued = await wait_state(js, job_id, RecordState.QUEUED, timeout_s=NOTICED_WITHIN_S)
        assert queued.last_error is not None
        assert queued.last_error.reason == "WORKER_LOST"
        other = FakeBatcher(scheduler.port, "other")
        await other.connect()
        await other.grant(1)
        again = await other.next_order()
        assert (again.job_id, again.attempt) == (order.job_id, 2)
        await other.answer(again)
        done = await wait_state(js, job_id, RecordState.SUCCEEDED)
        assert done.batch is not None
        assert done.batch.batcher_id == "other"
    finally:
        await proxy.stop()
        await lost.close()
        if other is not None:
            await other.close()


async def test_a_batcher_whose_scheduler_went_silent_connects_again(
    scheduler: SchedulerApp, nc: NatsClient, config: Config
) -> None:
    """A batcher pings its scheduler: when the connection goes silent (the scheduler's pod
    replaced on another node, behind the same Service address) it connects again and takes work
    there. Before, it waited for orders on the dead connection for ever."""
    proxy = await proxy_to(scheduler.port)
    batcher = BatcherApp(config.replace(batcher={"scheduler_address": f"127.0.0.1:{proxy.port}", "batcher_id": "b1"}))
    await batcher.start()
    try:
        await until(lambda: scheduler.batchers.free_credits(MODEL) > 0, timeout_s=10.0)
        assert proxy.connections == 1
        proxy.silence()
        await until(lambda: proxy.connections == 2, timeout_s=NOTICED_WITHIN_S)
        js = nc.jetstream()
        kv = await js.key_value(config.nats.jobs_bucket)
        job_id = await enqueue(nc, kv, value=1.0)
        done = await wait_state(js, job_id, RecordState.SUCCEEDED, timeout_s=10.0)
        assert done.batch is not None
        assert done.batch.batcher_id == "b1"
    finally:
        await batcher.stop(1.0)
        await proxy.stop()


async def test_a_watcher_gone_silent_frees_its_watch(start_stack: StartStack) -> None:
    """The gateway pings its clients: a watcher whose connection went silent (a laptop closed, a
    NAT that forgot the flow) has its watch ended, so it no longer counts against the tenant's
    and the connection's watches (TOO_MANY_WATCHES) nor holds the gateway's memory."""
    stack = await start_stack(batcher=False)
    submitted = await stack.jobs.SubmitJob(demo_request(1.0))
    proxy = await proxy_to(stack.gateway.port)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}")  # a raw channel: no pings of its own
    try:
        watch = job_service_pb2_grpc.JobServiceStub(channel).WatchJob(
            job_service_pb2.WatchJobRequest(job_id=submitted.job.job_id)
        )
        await watch.read()  # the current record: the watch is registered
        hub = stack.gateway.watch_hub
        assert hub.watcher_count == 1
        proxy.silence()
        await until(lambda: hub.watcher_count == 0, timeout_s=NOTICED_WITHIN_S)
    finally:
        await proxy.stop()
        await channel.close(None)


async def test_the_sdk_resumes_a_wait_whose_connection_went_silent(start_stack: StartStack) -> None:
    """The SDK pings the gateway while a call is in flight: a wait whose connection went silent
    (the gateway's host lost behind a load balancer) breaks, is resumed on a new connection as
    after any break, and ends with the job. Before, it waited for ever."""
    stack = await start_stack(batcher=False)
    proxy = await proxy_to(stack.gateway.port)
    try:
        async with AsyncClient(f"127.0.0.1:{proxy.port}", keepalive_s=KEEPALIVE_S) as client:
            job = await client.submit("demo", {"x": np.ones((1, 4), np.float32)})
            waiting = asyncio.create_task(client.wait(job, timeout_s=60.0))
            await until(lambda: stack.gateway.watch_hub.watcher_count == 1, timeout_s=10.0)
            proxy.silence()
            await until(lambda: proxy.connections == 2, timeout_s=NOTICED_WITHIN_S)
            await stack.start_batcher()
            done = await asyncio.wait_for(waiting, 30.0)
            assert done.state is JobState.SUCCEEDED
            np.testing.assert_allclose(done.outputs["y"], np.full((1, 4), 3.0, np.float32))
    finally:
        await proxy.stop()
