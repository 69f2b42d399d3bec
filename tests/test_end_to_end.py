"""One job through all three services, in one process: gateway -> NATS -> scheduler -> batcher."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from asyncinfer.client import AsyncClient, JobState
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.v1 import job_pb2, job_service_pb2, ops_service_pb2, ops_service_pb2_grpc, tensor_pb2
from services.batcher.models.demo import GATE, GATE_ENTERED
from tests.stack import Stack, StartStack


def demo_request(rows: list[list[float]]) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[len(rows), 4])
    x.contents.fp32_contents.extend(v for row in rows for v in row)
    return job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])


async def test_job_travels_queued_running_succeeded(config: Config, start_stack: StartStack) -> None:
    """Every state on the watch, in order. A watch may skip a revision for a reader slower than the
    job (the contract), which a no-op model that ends while the test starts its batcher was on a
    loaded machine (CI beside helpers: QUEUED then SUCCEEDED): the batch computes here until the
    watch has read RUNNING. The queue is paused while the batcher starts, so its warm-up call
    passes the gate and the job's call is the one held."""
    gated = DEMO_MODEL.model_copy(update={"name": "gated", "loader": "services.batcher.models.demo:build_gated_model"})
    stack = await start_stack(config.replace(models=[gated]), batcher=False)
    jobs = stack.jobs
    async with grpc.aio.insecure_channel(stack.ops_address) as channel:
        ops = ops_service_pb2_grpc.OpsServiceStub(channel)
        assert (await ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name="gated"))).paused
        request = demo_request([[1, 2, 3, 4], [0, 0, 0, -1]])
        request.model_name = "gated"
        submitted = (await jobs.SubmitJob(request)).job
        assert submitted.state == job_pb2.JOB_STATE_QUEUED

        watch = jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=submitted.job_id))
        first = await watch.read()
        assert first.job.state == job_pb2.JOB_STATE_QUEUED  # no batcher yet: it must wait

        await stack.start_batcher()
        GATE.clear()
        try:
            await ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name="gated"))
            running = await watch.read()
            assert running is not grpc.aio.EOF
            assert running.job.state == job_pb2.JOB_STATE_RUNNING
        finally:
            GATE.set()
    states = [first.job.state, running.job.state]
    while (update := await watch.read()) is not grpc.aio.EOF:
        states.append(update.job.state)
    assert states == [job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_SUCCEEDED]

    done = (await jobs.GetJob(job_service_pb2.GetJobRequest(job_id=submitted.job_id))).job
    assert done.state == job_pb2.JOB_STATE_SUCCEEDED
    assert done.attempt == 1
    (y,) = done.outputs
    assert y.name == "y"
    assert list(y.shape) == [2, 4]
    np.testing.assert_allclose(np.array(y.contents.fp32_contents), [3, 5, 7, 9, 1, 1, 1, -1])
    assert done.batch.batch_size >= 1
    assert done.HasField("queue_duration")
    assert done.HasField("run_duration")


async def test_many_jobs_are_batched_and_all_succeed(idle_stack: Stack) -> None:
    await idle_stack.start_batcher()
    jobs = idle_stack.jobs
    submitted = await asyncio.gather(*(jobs.SubmitJob(demo_request([[float(i)] * 4])) for i in range(40)))

    async def finish(job_id: str) -> job_pb2.Job:
        last = None
        async for update in jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)):
            last = update.job
        assert last is not None
        return last

    done = await asyncio.gather(*(finish(s.job.job_id) for s in submitted))
    for i, job in enumerate(done):
        assert job.state == job_pb2.JOB_STATE_SUCCEEDED
        assert list(job.outputs[0].contents.fp32_contents) == [2.0 * i + 1] * 4
    assert max(job.batch.batch_size for job in done) > 1, "jobs queued together should share batches"


async def test_invalid_request_queues_nothing(config: Config, idle_stack: Stack) -> None:
    bad = demo_request([[1, 2, 3]])  # 3 values for shape [1, 4]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await idle_stack.jobs.SubmitJob(bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    js = idle_stack.nc.jetstream()
    stream = await js.stream_info(config.nats.work_stream)
    assert stream.state.messages == 0
    kv = await js.key_value(config.nats.jobs_bucket)
    status = await kv.status()
    assert status.values == 0, "a refused job leaves no record"


async def test_a_job_whose_deadline_passes_in_its_batchers_queue_is_expired(
    config: Config, start_stack: StartStack
) -> None:
    """Dispatched before its queue deadline, it waits in the batcher behind a batch that computes;
    its deadline passes there and the batcher drops it unrun: EXPIRED, as a job past its deadline in
    the queue is (it was FAILED, DEADLINE_EXCEEDED: the scheduler read a drop with an error as a
    failed attempt, so the failed-jobs metric and alerts counted it)."""
    gated = DEMO_MODEL.model_copy(update={"name": "gated", "loader": "services.batcher.models.demo:build_gated_model"})
    stack = await start_stack(config.replace(models=[gated]))
    GATE.clear()  # the first batch computes until the gate opens
    GATE_ENTERED.clear()
    try:
        async with AsyncClient(stack.address) as client:
            first = await client.submit("gated", {"x": [[1, 2, 3, 4]]})
            # Its batch computing before the late job comes: on a loaded machine both were
            # dispatched in one group and batched together, and the late job ran.
            assert await asyncio.to_thread(GATE_ENTERED.wait, 30), "the first batch never started"  # a hang guard
            late = await client.submit("gated", {"x": [[1, 2, 3, 4]]}, queue_ttl_s=0.5)
            ended = await client.wait(late, timeout_s=10)
            GATE.set()
            assert ended.state is JobState.EXPIRED, ended.error
            assert ended.error is not None
            assert ended.error.reason == "DEADLINE_EXCEEDED"
            assert ended.attempt == 1  # it was dispatched: the batcher dropped it
            assert (await client.wait(first, timeout_s=10)).state is JobState.SUCCEEDED
    finally:
        GATE.set()
