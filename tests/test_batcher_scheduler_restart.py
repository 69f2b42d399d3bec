"""The batcher's work stream across a restart of its scheduler, while one of its batches computes a
call that hangs until the scheduler is back (real NATS, gateway, scheduler and batcher). Stopped, the
scheduler puts the job back (its attempt given back); killed (SIGKILL, its own process), the new
process returns the job its predecessor held. Either way the batcher reconnects to the new one on the
same address, the job runs again there once the call that was computing returns (its answer went
with the old stream), and ends once, its attempts counted. The batcher's places come back: it grants
the new scheduler as many credits as it has places."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from asyncinfer.codecs.record import decode_record
from asyncinfer.config import DEMO_MODEL, Config, render_default_config
from asyncinfer.embedded_nats import free_port
from asyncinfer.jobs import JobState
from asyncinfer.v1 import job_service_pb2, ops_service_pb2, ops_service_pb2_grpc, tensor_pb2
from services.batcher.app import BatcherApp
from services.batcher.engine import BatchingEngine
from services.scheduler.app import SchedulerApp
from tests.hanging_models import HANG_VALUE, RELEASE
from tests.processes import Service
from tests.stack import Stack, StartStack
from tests.waits import WAIT_S

pytestmark = pytest.mark.timeout(240)

MODEL = "hang"
PLACES = 4
HANGING_MODEL = DEMO_MODEL.model_copy(
    update={
        "name": MODEL,
        "loader": "tests.hanging_models:build_hanging_model",
        "default_execution_timeout_s": 60.0,  # the break must not time it out
        "max_inflight_batches": 1,
        "max_queue_size": PLACES,
        "max_queue_delay_ms": 0.0,
        "warm_up": False,
    }
)
Writes = list[tuple[JobState, int]]


async def until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


@asynccontextmanager
async def job_writes(stack: Stack, config: Config) -> AsyncIterator[Writes]:
    """Every write of the jobs bucket as it comes: (state, attempt)."""
    writes: Writes = []
    kv = await stack.nc.jetstream().key_value(config.nats.jobs_bucket)
    watcher = await kv.watchall()

    async def watch() -> None:
        async for entry in watcher:
            if entry is not None and entry.value is not None:
                record = decode_record(entry.value)
                writes.append((record.state, record.attempt))

    watching = asyncio.create_task(watch())
    try:
        yield writes
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await watcher.stop()


async def run_across_a_restart(
    stack: Stack, engine: BatchingEngine, writes: Writes, restart: Callable[[], Awaitable[None]]
) -> Writes:
    """Submits a job whose call hangs, restarts the scheduler while it computes, releases the call
    once the job was sent again (it waits behind the call); the writes until the job ends."""
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([HANG_VALUE, 1.0, 1.0, 1.0])
    submitted = await stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(model_name=MODEL, inputs=[x]))
    await until(lambda: engine.queue_depth(MODEL) == 0 and engine.free_slots(MODEL) == PLACES - 1, "computing")
    await until(lambda: (JobState.RUNNING, 1) in writes, "RUNNING")
    await restart()
    before = len(writes)
    await until(lambda: any(state == JobState.RUNNING for state, _ in writes[before:]), "dispatched again")
    await until(lambda: engine.queue_depth(MODEL) == 1, "waiting behind the hung call")
    RELEASE.set()
    await until(lambda: writes[-1][0].is_terminal, "ended")
    job = (await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=submitted.job.job_id))).job
    assert list(job.outputs[0].contents.fp32_contents) == [2 * HANG_VALUE + 1, 3.0, 3.0, 3.0]
    assert sum(state.is_terminal for state, _ in writes) == 1, writes
    # Every place free again, the hung call's too.
    await until(lambda: engine.free_slots(MODEL) == PLACES, "the engine's places free")
    return writes


async def test_a_batch_computing_while_the_scheduler_restarts_ends_its_job_once_and_leaks_no_place(
    config: Config, start_stack: StartStack
) -> None:
    RELEASE.clear()
    config = config.replace(scheduler={"port": free_port()}, models=[HANGING_MODEL])  # the same address after
    stack = await start_stack(config)
    assert stack.batcher is not None

    async def restart() -> None:
        await stack.scheduler.stop(grace_s=0.5)  # the call hangs on: its job goes back to the queue
        stack.scheduler = SchedulerApp(config)
        await stack.scheduler.start()

    try:
        async with job_writes(stack, config) as writes:
            await run_across_a_restart(stack, stack.batcher.engine, writes, restart)
        # Two runs, two attempts (the stop gave the first back: max_attempts rose by one).
        expected = [(JobState.RUNNING, 1), (JobState.QUEUED, 1), (JobState.RUNNING, 2), (JobState.SUCCEEDED, 2)]
        assert writes[-4:] == expected, writes  # (the first write, QUEUED, is not always seen)
        restarted = stack.scheduler
        await until(lambda: restarted.batchers.free_credits(MODEL) == PLACES, "credits at the batcher's places")
        assert [session.credits for session in restarted.batchers.sessions] == [{MODEL: PLACES}]
    finally:
        RELEASE.set()


async def test_a_batch_computing_while_the_scheduler_is_killed_and_restarted_ends_its_job_once_and_leaks_no_place(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    RELEASE.clear()
    port = free_port()
    config = config.replace(
        scheduler={"port": port, "ack_wait_s": 60.0, "lease_renew_interval_s": 1.0, "queue_stats_interval_s": 0.2},
        models=[HANGING_MODEL],
    )
    config_file = tmp_path / "asyncinfer.toml"
    config_file.write_text(render_default_config(config))
    scheduler = Service("scheduler", config_file, tmp_path, port)
    await scheduler.start()
    stack = await start_stack(config, scheduler=False, batcher=False)
    batcher = BatcherApp(config.replace(batcher={"scheduler_address": f"127.0.0.1:{port}", "reconnect_delay_s": 0.2}))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    ops = ops_service_pb2_grpc.OpsServiceStub(channel)
    stats: list[ops_service_pb2.ModelQueueStats] = []

    async def restart() -> None:
        scheduler.kill()  # its job RUNNING, leased by a process that is gone
        await scheduler.start()

    try:
        await batcher.start()
        async with job_writes(stack, config) as writes:
            await run_across_a_restart(stack, batcher.engine, writes, restart)
        # Two runs, two attempts spent (the first lost with its scheduler: not given back).
        assert writes[-1] == (JobState.SUCCEEDED, 2), writes
        assert max(attempt for _, attempt in writes) == 2
        deadline = time.monotonic() + WAIT_S
        while True:  # the scheduler's snapshots come every 0.2 s
            stats[:] = (await ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name=MODEL))).models
            if stats and stats[0].free_credits == PLACES and stats[0].in_flight == 0:
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.1)
        assert stats[0].connected_batchers == 1
    finally:
        RELEASE.set()
        await channel.close()
        await batcher.stop(grace_s=1.0)
        scheduler.stop()
