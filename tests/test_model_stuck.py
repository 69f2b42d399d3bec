"""A model call that hangs, through the whole stack (tests/stack.py: real NATS, gateway, scheduler,
batcher): the hung job times out; from then on the model is stuck on that batcher, which takes no
work for it: jobs sent on its earlier credits are given back (their attempts refunded) and wait in
the queue, rather than time out one after another unstarted; once the call returns, they run.
An execution timeout counts from the start of the batch a job computes in: jobs that waited behind a
slow call run with all of theirs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2
from tests.hanging_models import HANG_VALUE, RELEASE, SLOW_S, SLOW_VALUE
from tests.stack import StartStack

HANGING_MODEL = DEMO_MODEL.model_copy(
    update={
        "name": "hang",
        "loader": "tests.hanging_models:build_hanging_model",
        "default_execution_timeout_s": 1.0,
        "max_inflight_batches": 1,
        "max_queue_delay_ms": 0.0,
        "warm_up": False,
    }
)
TERMINAL = {job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_TIMED_OUT}


def request(first: float) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([first, 1.0, 1.0, 1.0])
    return job_service_pb2.SubmitJobRequest(model_name="hang", inputs=[x])


@pytest.mark.timeout(90)
async def test_jobs_behind_a_hung_call_wait_for_it_instead_of_timing_out(
    config: Config, start_stack: StartStack
) -> None:
    RELEASE.clear()
    stack = await start_stack(config.replace(models=[HANGING_MODEL]))
    jobs = stack.jobs

    async def state_of(job_id: str) -> job_pb2.Job:
        return (await jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job

    async def until_state(job_id: str, states: set[int], timeout_s: float) -> job_pb2.Job:
        deadline = time.monotonic() + timeout_s
        while (job := await state_of(job_id)).state not in states:
            assert time.monotonic() < deadline, job
            await asyncio.sleep(0.05)
        return job

    try:
        hung = (await jobs.SubmitJob(request(HANG_VALUE))).job.job_id
        timed_out = await until_state(hung, TERMINAL, 10.0)
        assert timed_out.state == job_pb2.JOB_STATE_TIMED_OUT
        assert timed_out.error.reason == "EXECUTION_TIMEOUT"
        assert timed_out.error.message == "attempt 1 ran longer than its execution timeout of 1 s"
        assert stack.batcher is not None
        stuck = stack.batcher.engine.free_slots
        deadline = time.monotonic() + 5.0
        while stuck("hang") > 0:  # the batcher finds the call overran (past its timeout, from its start)
            assert time.monotonic() < deadline, "the model was not found stuck"
            await asyncio.sleep(0.05)
        behind = [(await jobs.SubmitJob(request(float(i)))).job.job_id for i in range(3)]
        # Twice their execution timeout: they have not timed out; they wait in the queue (sent on
        # the batcher's earlier credits, given back with their attempts refunded).
        await asyncio.sleep(2.0)
        for job_id in behind:
            job = await state_of(job_id)
            assert job.state not in TERMINAL, job
        RELEASE.set()
        for job_id in behind:
            done = await until_state(job_id, TERMINAL, 30.0)
            assert done.state == job_pb2.JOB_STATE_SUCCEEDED, done
    finally:
        RELEASE.set()


@pytest.mark.timeout(90)
async def test_jobs_queued_behind_slow_calls_get_their_whole_execution_timeout(
    config: Config, start_stack: StartStack
) -> None:
    """Three jobs at once on a model with one slot, each computing SLOW_S (under their 2 s timeout):
    the third starts 2 x SLOW_S after its dispatch and ends past 3 x SLOW_S. All succeed: a timeout
    counted from dispatch timed the second and third out, though neither computed 2 s."""
    slow_model = HANGING_MODEL.model_copy(update={"default_execution_timeout_s": 2.0, "max_batch_size": 1})
    stack = await start_stack(config.replace(models=[slow_model]))
    jobs = stack.jobs
    submitted = [(await jobs.SubmitJob(request(SLOW_VALUE))).job.job_id for _ in range(3)]
    ended = []
    for job_id in submitted:
        deadline = time.monotonic() + 30.0
        while (job := (await jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job).state not in TERMINAL:
            assert time.monotonic() < deadline, job
            await asyncio.sleep(0.05)
        ended.append(job)
    assert [job.state for job in ended] == [job_pb2.JOB_STATE_SUCCEEDED] * 3, ended
    assert [job.attempt for job in ended] == [1, 1, 1]
    span_s = (
        max(job.end_time.ToNanoseconds() for job in ended) - min(job.start_time.ToNanoseconds() for job in ended)
    ) / 1e9
    assert span_s >= 3 * SLOW_S - 0.1  # one after another: the last ended far past 2 s from its dispatch


@pytest.mark.timeout(60)
async def test_a_model_that_failed_to_load_says_why_in_list_models(config: Config, start_stack: StartStack) -> None:
    """Its batcher logged NOT LOADED with the reason, but ListModels said "no batcher serves it" and
    its jobs waited NO_WORKER with nothing that said why. The batcher tells its scheduler what it
    could not load, the registry keeps it (state FAILED), and a gateway shows it."""
    broken = DEMO_MODEL.model_copy(update={"name": "broken", "loader": "services.batcher.models.demo:build_nothing"})
    stack = await start_stack(config.replace(models=[DEMO_MODEL, broken]))
    deadline = time.monotonic() + 20.0
    while True:
        listed = await stack.jobs.ListModels(job_service_pb2.ListModelsRequest())
        (model,) = [m for m in listed.models if m.name == "broken"]
        (version,) = model.versions
        if "could not load it" in version.reason:
            break
        assert time.monotonic() < deadline, version
        await asyncio.sleep(0.05)
    assert version.state == job_service_pb2.MODEL_VERSION_STATE_UNAVAILABLE
    assert "build_nothing" in version.reason
    (demo,) = [m for m in listed.models if m.name == "demo"]
    assert [v.state for v in demo.versions] == [job_service_pb2.MODEL_VERSION_STATE_READY]


@pytest.mark.timeout(60)
async def test_a_job_for_a_model_no_batcher_could_load_waits_model_load_failed_until_one_does(
    config: Config, start_stack: StartStack, batchers: Callable[..., Any]
) -> None:
    """Its jobs waited NO_WORKER, which reads as scaling from zero, while a batcher ran that had
    failed to load it. They wait MODEL_LOAD_FAILED (ListModels says why) until a batcher that loads
    the model connects, and then run."""
    broken = DEMO_MODEL.model_copy(update={"name": "broken", "loader": "services.batcher.models.demo:build_nothing"})
    stack = await start_stack(config.replace(models=[DEMO_MODEL, broken]))
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
    job_id = (await stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(model_name="broken", inputs=[x]))).job.job_id

    async def job() -> job_pb2.Job:
        return (await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job

    # The batcher's report reaches the gateway through its scheduler's registry: until it has, the
    # job waits NO_WORKER; nothing else is said of it meanwhile.
    deadline = time.monotonic() + 20.0
    while (waiting := await job()).queue.waiting_reason != job_pb2.WAITING_REASON_MODEL_LOAD_FAILED:
        assert waiting.queue.waiting_reason == job_pb2.WAITING_REASON_NO_WORKER, waiting
        assert time.monotonic() < deadline, waiting
        await asyncio.sleep(0.05)
    assert waiting.state == job_pb2.JOB_STATE_QUEUED
    assert not waiting.queue.HasField("estimated_start_time")
    listed = await stack.jobs.ListModels(job_service_pb2.ListModelsRequest())
    (model,) = [m for m in listed.models if m.name == "broken"]
    assert "build_nothing" in model.versions[0].reason

    await batchers(stack, "loads-it", broken.model_copy(update={"loader": DEMO_MODEL.loader}))
    deadline = time.monotonic() + 20.0
    while (ran := await job()).state not in TERMINAL:
        assert time.monotonic() < deadline, ran
        await asyncio.sleep(0.05)
    assert ran.state == job_pb2.JOB_STATE_SUCCEEDED, ran
    assert ran.batcher_id == "loads-it"
