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

from asyncinfer.client.errors import from_rpc_error
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.v1 import job_pb2, job_service_pb2, ops_service_pb2, ops_service_pb2_grpc, tensor_pb2
from services.scheduler.app import SchedulerApp
from tests.hanging_models import HANG_VALUE, RELEASE
from tests.stack import Stack, StartStack
from tests.test_scheduler_replicas import HANGING_MODEL, MODEL, request, wait_for
from tests.waits import WAIT_S

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


async def two_schedulers(config: Config, start_stack: StartStack) -> tuple[Stack, SchedulerApp]:
    """A (the stack's, with the batcher of the hanging model, one job at a time) running a job that
    hangs until RELEASE, and B, no batcher."""
    RELEASE.clear()
    shared = config.replace(models=[HANGING_MODEL], scheduler={"queue_stats_interval_s": 0.1})
    stack = await start_stack(shared)
    second = SchedulerApp(shared)
    await second.start()
    hung = (await stack.jobs.SubmitJob(request(HANG_VALUE))).job.job_id
    async for update in stack.jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=hung)):
        if update.job.state == job_pb2.JOB_STATE_RUNNING:
            break
    # Both report the model: a drain order to every one expects both.
    both = sorted([stack.scheduler.instance_name, second.instance_name])
    await wait_for(lambda: stack.gateway.queue_view.reporting(MODEL) == both)
    return stack, second


@pytest.mark.timeout(120)
async def test_drain_all_from_either_scheduler_drains_every_one_and_lists_each(
    config: Config, start_stack: StartStack
) -> None:
    """Behind the Service a Drain reaches one scheduler and drained it alone. With `all` the one
    reached (B) sends the order to every scheduler: A, whose batcher runs the hung job, drains too,
    and the answer lists each with its jobs still in flight; an Undrain with `all`, sent through A,
    undoes both. A single-target Drain names the scheduler it reached."""
    stack, second = await two_schedulers(config, start_stack)
    a, b = stack.scheduler.instance_name, second.instance_name
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") for app in (stack.scheduler, second)]
    ops_a, ops_b = (Ops(channel) for channel in channels)
    try:
        alone = await ops_b.Drain(ops_service_pb2.DrainRequest(timeout=duration_pb2.Duration(seconds=5)))
        assert (alone.scheduler, alone.drained, list(alone.schedulers)) == (b, True, [])
        assert (stack.scheduler.draining, second.draining) == (False, True)

        timeout = duration_pb2.Duration(nanos=200_000_000)  # A's hung job stays in flight
        every = await ops_b.Drain(ops_service_pb2.DrainRequest(all=True, timeout=timeout))
        assert (stack.scheduler.draining, second.draining) == (True, True)
        listed = [(r.scheduler, r.answered, r.in_flight, r.drained) for r in every.schedulers]
        assert listed == sorted([(a, True, 1, False), (b, True, 0, True)]), every
        assert (every.scheduler, every.in_flight, every.drained) == (b, 1, False)
        # The jobs queued behind the hung one say why they wait: every scheduler drains.
        queued = (await stack.jobs.SubmitJob(request(1.0))).job.job_id
        await wait_for(lambda: (merged := stack.gateway.queue_view.snapshot(MODEL)) is not None and merged.draining)
        got = await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=queued))
        assert got.job.queue.waiting_reason == job_pb2.WAITING_REASON_DRAINING

        undone = await ops_a.Undrain(ops_service_pb2.UndrainRequest(all=True))
        assert (stack.scheduler.draining, second.draining) == (False, False)
        assert [(r.scheduler, r.answered, r.was_draining) for r in undone.schedulers] == sorted(
            [(a, True, True), (b, True, True)]
        )
        assert (undone.scheduler, undone.was_draining) == (a, True)
    finally:
        RELEASE.set()
        for channel in channels:
            await channel.close()
        await second.stop(2.0)


@pytest.mark.timeout(120)
async def test_a_named_scheduler_drains_whichever_one_the_call_reached(config: Config, start_stack: StartStack) -> None:
    """Through B, a Drain naming A drains A alone (the one with the batcher, before its pod's
    maintenance); a name no scheduler reports is NOT_FOUND with the known ones; `all` with a name
    is INVALID_ARGUMENT. A scheduler that does not answer (here B, deaf to orders as a scheduler of
    the release before) is listed as not answering, not left out."""
    stack, second = await two_schedulers(config, start_stack)
    a, b = stack.scheduler.instance_name, second.instance_name
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{second.port}")
    ops_b = Ops(channel)
    try:
        timeout = duration_pb2.Duration(nanos=200_000_000)
        named = await ops_b.Drain(ops_service_pb2.DrainRequest(scheduler=a, timeout=timeout))
        assert [(r.scheduler, r.answered, r.in_flight) for r in named.schedulers] == [(a, True, 1)]
        assert (stack.scheduler.draining, second.draining) == (True, False)
        undone = await ops_b.Undrain(ops_service_pb2.UndrainRequest(scheduler=a))
        assert [(r.scheduler, r.was_draining) for r in undone.schedulers] == [(a, True)]
        assert not stack.scheduler.draining

        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await ops_b.Drain(ops_service_pb2.DrainRequest(scheduler="no-such-scheduler"))
        refused = from_rpc_error(unknown.value)
        assert (refused.code, refused.reason) == (grpc.StatusCode.NOT_FOUND, "SCHEDULER_NOT_FOUND")
        assert refused.metadata == {"scheduler": "no-such-scheduler", "schedulers": ", ".join(sorted([a, b]))}
        with pytest.raises(grpc.aio.AioRpcError) as both:
            await ops_b.Drain(ops_service_pb2.DrainRequest(all=True, scheduler=a))
        assert both.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        deaf = second._drains  # its subscription gone: it reports, and hears no order
        assert deaf is not None
        await deaf.stop()
        every = await ops_b.Drain(ops_service_pb2.DrainRequest(all=True, timeout=timeout))
        assert [(r.scheduler, r.answered) for r in every.schedulers] == sorted([(a, True), (b, False)])
        assert not every.drained
        assert (stack.scheduler.draining, second.draining) == (True, False)
    finally:
        RELEASE.set()
        await channel.close()
        await second.stop(2.0)


async def state_of(stack: Stack, job_id: str, wanted: int) -> job_pb2.Job:
    """The job once its WatchJob reports state `wanted` (within WAIT_S)."""
    async with asyncio.timeout(WAIT_S):
        async for update in stack.jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id)):
            if update.job.state == wanted:
                return update.job
    raise AssertionError(f"job {job_id}'s watch ended before state {wanted}")


@pytest.mark.timeout(120)
async def test_a_cancel_during_a_stops_grace_reaches_the_batcher(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopping scheduler waits up to its grace for its jobs in flight: here one that hangs, and
    one dispatched behind it that waits in the batcher's queue. Cancelled during that wait, the
    waiting one is dropped by its batcher (a CancelOrder) and ends CANCELED while the stop still
    waits for the hung one. The scheduler unsubscribed from cancel notices before its grace: the
    job stayed CANCELLING in the batcher's queue for the whole grace (60 s here), to be computed
    or put back at its end."""
    RELEASE.clear()
    model = HANGING_MODEL.model_copy(update={"max_queue_size": 2})  # the hung job, one waiting behind
    stack = await start_stack(config.replace(models=[model]))
    flow = stack.scheduler.flow
    in_grace = asyncio.Event()
    wait_idle = flow.wait_idle

    async def waits_idle(timeout_s: float) -> bool:
        in_grace.set()
        return await wait_idle(timeout_s)

    monkeypatch.setattr(flow, "wait_idle", waits_idle)
    stopping: asyncio.Task[None] | None = None
    try:
        hung = (await stack.jobs.SubmitJob(request(HANG_VALUE))).job.job_id
        await state_of(stack, hung, job_pb2.JOB_STATE_RUNNING)
        waiting = (await stack.jobs.SubmitJob(request(1.0))).job.job_id
        await state_of(stack, waiting, job_pb2.JOB_STATE_RUNNING)  # on the batcher, behind the hung one
        stopping = asyncio.create_task(stack.scheduler.stop(grace_s=60.0))
        async with asyncio.timeout(WAIT_S):
            await in_grace.wait()
        cancelled = await stack.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=waiting, reason="not needed"))
        assert cancelled.job.state == job_pb2.JOB_STATE_CANCELLING
        ended = await state_of(stack, waiting, job_pb2.JOB_STATE_CANCELED)
        assert not stopping.done(), "the stop's grace ended: the job was put back, not dropped"
        assert ended.attempt == 1
        got = await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=hung))
        assert got.job.state == job_pb2.JOB_STATE_RUNNING  # the grace still waits for it
    finally:
        RELEASE.set()
        if stopping is not None:
            await stopping
