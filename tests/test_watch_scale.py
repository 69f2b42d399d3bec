"""WatchJob at scale: one subscription per gateway fans out to thousands of watchers, each sees the
current record, then every change in order, then the stream ends at the terminal state; resuming
sends only later changes; a cancelled watch leaves the hub at once.

The streams are spread over a few channels (HTTP/2 multiplexes them), as many clients behind a
few connections would; one channel per watcher would measure the test's own sockets instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from asyncinfer.config import Config
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.batcher.app import BatcherApp
from services.gateway.app import GatewayApp
from services.scheduler.app import SchedulerApp

CHANNELS = 8
WAVE = 500
TERMINAL = {
    job_pb2.JOB_STATE_SUCCEEDED,
    job_pb2.JOB_STATE_FAILED,
    job_pb2.JOB_STATE_CANCELED,
    job_pb2.JOB_STATE_EXPIRED,
    job_pb2.JOB_STATE_TIMED_OUT,
}


def demo_request(value: float) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([value] * 4)
    return job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])


@dataclass
class Watcher:
    """One WatchJob stream and what it has seen."""

    job_id: str
    stub: Any
    call: Any = None
    seen: list[job_pb2.Job] = field(default_factory=list)
    first: asyncio.Event = field(default_factory=asyncio.Event)

    async def follow(self) -> None:
        self.call = self.stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=self.job_id))
        try:
            async for response in self.call:
                self.seen.append(response.job)
                self.first.set()
        finally:
            self.first.set()  # also when the call fails: the test then sees what it got


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Seconds until `condition` held (failing past timeout_s)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.005)
    return time.monotonic() - started


@pytest.fixture
async def gateway(config: Config) -> AsyncIterator[GatewayApp]:
    app = GatewayApp(config)
    await app.start()
    try:
        yield app
    finally:
        await app.stop(grace_s=1)


@pytest.fixture
async def stubs(gateway: GatewayApp) -> AsyncIterator[list[Any]]:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") for _ in range(CHANNELS)]
    try:
        yield [job_service_pb2_grpc.JobServiceStub(channel) for channel in channels]
    finally:
        for channel in channels:
            await channel.close()


def open_watches(stubs: list[Any], job_ids: list[str], per_job: int) -> list[Watcher]:
    watchers = []
    for i in range(len(job_ids) * per_job):
        watchers.append(Watcher(job_ids[i % len(job_ids)], stubs[i % len(stubs)]))
    return watchers


async def follow_in_waves(watchers: list[Watcher], tasks: list[asyncio.Task[None]]) -> None:
    """Follows the watchers WAVE at a time, each wave once its first messages came. grpc's server
    core cancels calls beyond 1000 waiting to be taken up by the application (its default
    grpc.server.max_pending_requests), and the Python server takes them up one at a time: a
    burst of thousands of new calls at once would be partly CANCELLED before reaching the hub."""
    for start in range(0, len(watchers), WAVE):
        wave = watchers[start : start + WAVE]
        tasks.extend(asyncio.create_task(w.follow()) for w in wave)
        await asyncio.gather(*(w.first.wait() for w in wave))


async def test_a_hundred_cancelled_watches_leave_the_hub_at_once(gateway: GatewayApp, stubs: list[Any]) -> None:
    job = (await stubs[0].SubmitJob(demo_request(1.0))).job
    watchers = open_watches(stubs, [job.job_id], per_job=100)
    tasks = [asyncio.create_task(w.follow()) for w in watchers]
    await asyncio.gather(*(w.first.wait() for w in watchers))
    assert all(w.seen[0].state == job_pb2.JOB_STATE_QUEUED for w in watchers)
    assert gateway.watch_hub.watcher_count == 100

    for watcher in watchers:
        watcher.call.cancel()
    # A hang guard: a cancelled watch that stayed registered would stay until a change of its job,
    # and none comes.
    await wait_for(lambda: gateway.watch_hub.watcher_count == 0, timeout_s=30.0)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    # The hub still serves: a new watch gets the record.
    again = open_watches(stubs, [job.job_id], per_job=1)[0]
    follower = asyncio.create_task(again.follow())
    await again.first.wait()
    assert again.seen[0].job_id == job.job_id
    again.call.cancel()
    await asyncio.gather(follower, return_exceptions=True)
    await wait_for(lambda: gateway.watch_hub.watcher_count == 0)


async def test_two_thousand_watchers_each_see_their_job_to_the_end(
    config: Config, gateway: GatewayApp, stubs: list[Any]
) -> None:
    jobs, per_job = 200, 10
    submitted = await asyncio.gather(*(stubs[i % CHANNELS].SubmitJob(demo_request(float(i))) for i in range(jobs)))
    job_ids = [s.job.job_id for s in submitted]
    watchers = open_watches(stubs, job_ids, per_job)
    started = time.monotonic()
    tasks: list[asyncio.Task[None]] = []
    await follow_in_waves(watchers, tasks)
    opened_s = time.monotonic() - started
    assert all(w.seen for w in watchers), [t.exception() for t in tasks if t.done()][:3]
    # No batcher yet: every watch is open, on the current (QUEUED) record, before any job runs.
    assert gateway.watch_hub.watcher_count == jobs * per_job
    assert all(w.seen[0].state == job_pb2.JOB_STATE_QUEUED for w in watchers)

    scheduler = SchedulerApp(config)
    await scheduler.start()
    batcher = BatcherApp(config.replace(batcher={"scheduler_address": f"127.0.0.1:{scheduler.port}"}))
    try:
        await batcher.start()
        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        completed_s = time.monotonic() - started
    finally:
        await batcher.stop(2.0)
        await scheduler.stop(2.0)

    for watcher in watchers:
        states = [job.state for job in watcher.seen]
        revisions = [job.revision for job in watcher.seen]
        assert states[-1] == job_pb2.JOB_STATE_SUCCEEDED, (watcher.job_id, states)
        assert not TERMINAL & set(states[:-1]), states  # the stream ended at the first terminal state
        assert revisions == sorted(set(revisions)), revisions  # each change once, in order
        assert job_pb2.JOB_STATE_RUNNING in states, states  # no change was skipped
    # Every watcher of a job saw the same changes.
    by_job: dict[str, list[int]] = {}
    for watcher in watchers:
        revisions = [job.revision for job in watcher.seen]
        assert by_job.setdefault(watcher.job_id, revisions) == revisions
    assert gateway.watch_hub.watcher_count == 0
    print(f"\n{jobs * per_job} watches opened in {opened_s:.2f} s; all jobs seen to the end in {completed_s:.2f} s")

    # Resuming from a revision sends only the record as it is now (the bucket keeps no history),
    # and nothing at all once the caller has seen the terminal revision.
    for watcher in watchers[:20]:
        resume_from = [watcher.seen[0].revision, watcher.seen[-1].revision]
        for after, expected in zip(resume_from, [[watcher.seen[-1].revision], []], strict=True):
            request = job_service_pb2.WatchJobRequest(job_id=watcher.job_id, after_revision=after)
            assert [r.job.revision async for r in stubs[0].WatchJob(request)] == expected
    assert gateway.watch_hub.watcher_count == 0
