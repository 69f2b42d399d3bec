"""A job whose batcher left while its RUNNING write was in flight (the order not yet sent) is put
back with its attempt given back: it never reached a batcher. Seen after a frozen scheduler
resumed (session 28's freeze scenarios): the batchers had dropped their streams (keepalive), and
the redeliveries the scheduler pulled first went to sessions that closed as it woke, each spending
an attempt, on top of the attempt of the jobs the lost batcher held; a job could lose two of its
three attempts to one freeze, and a job of max_attempts 1 failed without ever running."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from asyncinfer.client import AsyncClient
from asyncinfer.config import Config
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState
from tests.processes import until
from tests.stack import StartStack

pytestmark = pytest.mark.timeout(60)


async def test_a_dispatch_whose_batcher_left_during_its_write_spends_no_attempt(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = await start_stack(config)
    left = asyncio.Event()
    original = JobStore.transition

    async def transition(self: JobStore, record: JobRecord, decide: Any) -> tuple[JobRecord | None, bool]:
        latest, written = await original(self, record, decide)
        if written and latest is not None and latest.state is JobState.RUNNING and not left.is_set():
            # The batcher goes away while the scheduler awaits its RUNNING write.
            left.set()
            batcher, stack.batcher = stack.batcher, None
            assert batcher is not None
            await batcher.stop(1.0)
            await until(lambda: all(session.closed for session in stack.scheduler.batchers.sessions), 10)
        return latest, written

    monkeypatch.setattr(JobStore, "transition", transition)
    async with AsyncClient(stack.address) as client:
        # A claim-checked input: the scheduler reads it after the write, so the order is sent only
        # then (a job with its inputs inline has its order sent before the write is answered).
        ref = await client.upload_inputs({"x": np.ones((1, 4), np.float32)})
        job = await client.submit("demo", input_ref=ref, max_attempts=1)
        await asyncio.wait_for(left.wait(), 10)
        async for queued in client.watch(job, timeout_s=10):
            if queued.state.value != "RUNNING":
                break
        assert queued.state.value == "QUEUED", queued
        assert queued.last_error is not None
        assert queued.last_error.reason == "WORKER_LOST"
        assert (queued.attempt, queued.max_attempts) == (1, 2)  # given back: it never reached a batcher
        await stack.start_batcher()
        done = await client.wait(job, timeout_s=20)
    assert done.state.value == "SUCCEEDED", done
    assert done.attempt == 2
