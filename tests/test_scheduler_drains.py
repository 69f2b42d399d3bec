"""Draining behind the Kubernetes Service (deploy/k8s/base/scheduler.yaml: 2 scheduler replicas
behind one Service): an operator's call reaches either scheduler. Two real schedulers on one
nats-server, the one batcher connected to the first (A), as tests/test_scheduler_replicas.py runs
them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from google.protobuf import duration_pb2

from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.v1 import job_pb2, job_service_pb2, ops_service_pb2, ops_service_pb2_grpc, tensor_pb2
from services.scheduler.app import SchedulerApp
from tests.stack import StartStack

WAIT_S = 15.0
Ops = ops_service_pb2_grpc.OpsServiceStub


def demo_request(first: float) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([first, 1.0, 1.0, 1.0])
    return job_service_pb2.SubmitJobRequest(model_name=DEMO_MODEL.name, inputs=[x])


async def stats_until(
    ops: Ops, holds: Callable[[ops_service_pb2.ModelQueueStats], bool]
) -> ops_service_pb2.ModelQueueStats:
    """The model's GetQueueStats from `ops` once `holds` (polled: the other scheduler's snapshot
    arrives at its next write)."""
    request = ops_service_pb2.GetQueueStatsRequest(model_name=DEMO_MODEL.name)
    deadline = time.monotonic() + WAIT_S
    while True:
        (model,) = (await ops.GetQueueStats(request)).models
        if holds(model):
            return model
        assert time.monotonic() < deadline, f"not reached in time; last: {model}"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(120)
async def test_get_queue_stats_counts_a_draining_schedulers_completions(
    config: Config, start_stack: StartStack
) -> None:
    """A (the batcher's scheduler) completes jobs, then drains. GetQueueStats' completed_per_second
    summed the schedulers not draining: asked of B (no batcher) while A drained, 0, though A's
    completions were the model's all. Now every reporting scheduler's rate counts."""
    shared = config.replace(models=[DEMO_MODEL], scheduler={"queue_stats_interval_s": 0.1})
    stack = await start_stack(shared)  # the gateway, scheduler A and the batcher, connected to A
    second = SchedulerApp(shared)  # B: no batcher connects to it
    await second.start()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") for app in (stack.scheduler, second)]
    ops_a, ops_b = (Ops(channel) for channel in channels)
    try:
        for i in range(3):
            job_id = (await stack.jobs.SubmitJob(demo_request(float(i)))).job.job_id
            async for update in stack.jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)):
                if update.job.state == job_pb2.JOB_STATE_SUCCEEDED:
                    break
        before = await stats_until(ops_b, lambda m: m.schedulers == 2 and m.completed_per_second > 0)
        assert before.draining_schedulers == 0
        drained = await ops_a.Drain(ops_service_pb2.DrainRequest(timeout=duration_pb2.Duration(seconds=5)))
        assert drained.drained
        during = await stats_until(ops_b, lambda m: m.draining_schedulers == 1)
        # A's three completions within the last minute, read by B (0 before: A drains).
        assert (during.schedulers, during.connected_batchers) == (2, 1)
        assert during.completed_per_second > 0, during
        from_a = await stats_until(ops_a, lambda m: m.draining_schedulers == 1)
        assert from_a.completed_per_second > 0, from_a
    finally:
        for channel in channels:
            await channel.close()
        await second.stop(2.0)
