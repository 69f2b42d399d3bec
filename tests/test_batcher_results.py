"""A result too large for the work stream fails its own job and nothing else (a helper's limits
pass, session 24): sent, it ended the batcher's stream (RESOURCE_EXHAUSTED on the scheduler's side),
every other job on it ended FAILED WORKER_LOST, and the job was computed again on each attempt."""

from __future__ import annotations

import numpy as np

from asyncinfer.client import AsyncClient, JobState
from asyncinfer.config import DEMO_MODEL, Config
from tests.stack import StartStack

HUGE = {
    **DEMO_MODEL.model_dump(),
    "name": "huge",
    "loader": "tests.huge_output_model:build_huge_output_model",
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, -1]}],
    "max_batch_size": 1,
    "warm_up": False,
}


async def test_an_output_over_the_stream_limit_fails_its_job_alone(config: Config, start_stack: StartStack) -> None:
    # The stream's limit is then its floor, 64 MiB (asyncinfer.worker_stream): 68 MB is past it.
    stack = await start_stack(
        config.replace(gateway={"max_upload_bytes": 8 * 1024 * 1024}, models=[DEMO_MODEL.model_dump(), HUGE])
    )
    assert stack.batcher is not None
    x = {"x": np.ones((1, 4), np.float32)}
    async with AsyncClient(stack.address) as client:
        huge = await client.submit("huge", x, max_attempts=3)
        beside = [await client.submit("demo", x) for _ in range(5)]
        failed = await client.wait(huge, timeout_s=60)
        done = [await client.wait(job, timeout_s=60) for job in beside]
    assert failed.state is JobState.FAILED
    assert failed.error is not None
    assert failed.error.reason == "OUTPUT_TOO_LARGE"
    assert failed.attempt == 1, "final: the same input gives the same output"
    assert all(job.state is JobState.SUCCEEDED for job in done)
    assert len(stack.scheduler.batchers.sessions) == 1  # the stream stayed up
