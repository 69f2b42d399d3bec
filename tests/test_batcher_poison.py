"""Interactive jobs that share a batch with a poison input, through the whole stack (tests/stack.py:
real NATS, gateway, scheduler, batcher): the model raises for the whole batch, the batcher bisects
it until the poison row fails alone, so the good jobs succeed on their first attempt and only the
poison job fails, MODEL_ERROR on each of its attempts, then FAILED (README "Failures end",
docs/ARCHITECTURE.md "A model that misbehaves")."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2
from tests.hanging_models import HANG_VALUE, POISON_VALUE, POISONED_CALLS, RELEASE
from tests.stack import StartStack

pytestmark = pytest.mark.timeout(90)

MODEL = "poisoned"
POISONED_MODEL = DEMO_MODEL.model_copy(
    update={
        "name": MODEL,
        "loader": "tests.hanging_models:build_poisoned_model",
        "max_inflight_batches": 1,  # what comes behind the held call waits, and forms one batch
        "max_queue_delay_ms": 0.0,
        "max_attempts": 2,
        "retry_backoff_base_s": 0.05,
        "retry_backoff_max_s": 0.1,
        "warm_up": False,
    }
)
TERMINAL = {job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED}
GOOD = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def request(first: float) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([first, 1.0, 1.0, 1.0])
    return job_service_pb2.SubmitJobRequest(model_name=MODEL, inputs=[x])


async def until(condition: object, what: str, timeout_s: float = 20.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_poison_input_fails_its_own_job_alone_and_its_batchmates_succeed_at_once(
    config: Config, start_stack: StartStack
) -> None:
    RELEASE.clear()
    POISONED_CALLS.clear()
    stack = await start_stack(config.replace(models=[POISONED_MODEL]))
    assert stack.batcher is not None
    engine = stack.batcher.engine
    jobs = stack.jobs
    try:
        held = (await jobs.SubmitJob(request(HANG_VALUE))).job.job_id
        await until(lambda: POISONED_CALLS == [[HANG_VALUE]], "the held call computing")
        values = [*GOOD[:3], POISON_VALUE, *GOOD[3:]]
        submitted = {value: (await jobs.SubmitJob(request(value))).job.job_id for value in values}
        await until(lambda: engine.queue_depth(MODEL) == len(values), "all waiting behind the held call")
        RELEASE.set()

        async def ended(job_id: str) -> job_pb2.Job:
            deadline = time.monotonic() + 30.0
            while (job := (await jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job).state not in TERMINAL:
                assert time.monotonic() < deadline, job
                await asyncio.sleep(0.05)
            return job

        assert (await ended(held)).state == job_pb2.JOB_STATE_SUCCEEDED
        outcomes = {value: await ended(job_id) for value, job_id in submitted.items()}
    finally:
        RELEASE.set()
    # They shared one batch with the poison: the model raised for the whole of it.
    assert sorted(POISONED_CALLS[1]) == sorted(values), POISONED_CALLS
    poison = outcomes.pop(POISON_VALUE)
    assert poison.state == job_pb2.JOB_STATE_FAILED, poison
    assert (poison.error.reason, poison.attempt, poison.max_attempts) == ("MODEL_ERROR", 2, 2), poison
    assert "a poison row in this batch" in poison.error.message
    for value, job in outcomes.items():
        assert job.state == job_pb2.JOB_STATE_SUCCEEDED, (value, job)
        assert job.attempt == 1, (value, job)  # not failed, nor retried, for its batchmate
        assert list(job.outputs[0].contents.fp32_contents) == [2 * value + 1, 3.0, 3.0, 3.0]
    # The poison's second attempt ran alone and raised again.
    assert POISONED_CALLS[-1] == [POISON_VALUE], POISONED_CALLS
