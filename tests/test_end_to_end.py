"""One job through all three services, in one process: gateway -> NATS -> scheduler -> batcher."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from asyncinfer.config import Config
from asyncinfer.nats.connection import connect
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.batcher.app import BatcherApp
from services.gateway.app import GatewayApp
from services.scheduler.app import SchedulerApp


@pytest.fixture
async def gateway_and_scheduler(config: Config) -> AsyncIterator[tuple[GatewayApp, SchedulerApp]]:
    gateway = GatewayApp(config)
    scheduler = SchedulerApp(config)
    await gateway.start()
    await scheduler.start()
    try:
        yield gateway, scheduler
    finally:
        await scheduler.stop(2.0)
        await gateway.stop(2.0)


def demo_request(rows: list[list[float]]) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[len(rows), 4])
    x.contents.fp32_contents.extend(v for row in rows for v in row)
    return job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])


async def test_job_travels_queued_running_succeeded(
    config: Config, gateway_and_scheduler: tuple[GatewayApp, SchedulerApp]
) -> None:
    gateway, scheduler = gateway_and_scheduler
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        jobs = job_service_pb2_grpc.JobServiceStub(channel)
        submitted = (await jobs.SubmitJob(demo_request([[1, 2, 3, 4], [0, 0, 0, -1]]))).job
        assert submitted.state == job_pb2.JOB_STATE_QUEUED

        watch = jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=submitted.job_id))
        first = await watch.read()
        assert first.job.state == job_pb2.JOB_STATE_QUEUED  # no batcher yet: it must wait

        batcher = BatcherApp(config.replace(batcher={"scheduler_address": f"127.0.0.1:{scheduler.port}"}))
        await batcher.start()
        try:
            states = [first.job.state]
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
        finally:
            await batcher.stop(2.0)


async def test_many_jobs_are_batched_and_all_succeed(
    config: Config, gateway_and_scheduler: tuple[GatewayApp, SchedulerApp]
) -> None:
    gateway, scheduler = gateway_and_scheduler
    batcher = BatcherApp(config.replace(batcher={"scheduler_address": f"127.0.0.1:{scheduler.port}"}))
    await batcher.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            jobs = job_service_pb2_grpc.JobServiceStub(channel)
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
    finally:
        await batcher.stop(2.0)


async def test_invalid_request_queues_nothing(
    config: Config, gateway_and_scheduler: tuple[GatewayApp, SchedulerApp]
) -> None:
    gateway, _ = gateway_and_scheduler
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        jobs = job_service_pb2_grpc.JobServiceStub(channel)
        bad = demo_request([[1, 2, 3]])  # 3 values for shape [1, 4]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await jobs.SubmitJob(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    nc = await connect(config.nats, name="test")
    try:
        stream = await nc.jetstream().stream_info(config.nats.work_stream)
        assert stream.state.messages == 0
        kv = await nc.jetstream().key_value(config.nats.jobs_bucket)
        status = await kv.status()
        assert status.values == 0, "a refused job leaves no record"
    finally:
        await nc.close()
