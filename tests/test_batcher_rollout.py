"""A batcher stopped gracefully (a rollout) with orders it had taken but not started: they go back
to the queue with their attempts given back, so a job of max_attempts 1 runs on the next batcher
instead of failing WORKER_LOST (an operator's pass, session 22: 27 of 40 such jobs failed). Real
gateway, scheduler, batchers and NATS."""

from __future__ import annotations

import numpy as np

from asyncinfer.client import AsyncClient, JobState
from asyncinfer.config import DEMO_MODEL, Config
from tests.stack import StartStack

SLOW = DEMO_MODEL.model_copy(
    update={
        "name": "slow",
        "loader": "services.batcher.models.demo:build_slow_model",  # 0.3 s a batch
        "max_batch_size": 1,
        "max_inflight_batches": 1,
    }
)


async def test_a_graceful_batcher_stop_gives_back_the_attempts_of_what_it_had_not_started(
    config: Config, start_stack: StartStack
) -> None:
    stack = await start_stack(config.replace(models=[SLOW], batcher={"shutdown_grace_s": 5.0}))
    async with AsyncClient(stack.address) as client:
        jobs = [await client.submit("slow", {"x": np.ones((1, 4), np.float32)}, max_attempts=1) for _ in range(6)]
        async for snapshot in client.watch(jobs[0]):
            if snapshot.state is JobState.RUNNING:
                break
        assert stack.batcher is not None
        await stack.batcher.stop(5.0)  # what it started finishes; what it holds unstarted goes back
        stack.batcher = None
        await stack.start_batcher()
        done = await client.wait_jobs(jobs, timeout_s=60)
    states = {job_id: job.state for job_id, job in done.items() if not isinstance(job, Exception)}
    assert list(states.values()) == [JobState.SUCCEEDED] * 6, [
        (j.state.value, j.attempt, j.max_attempts, j.error and j.error.message)
        for j in done.values()
        if not isinstance(j, Exception)
    ]
