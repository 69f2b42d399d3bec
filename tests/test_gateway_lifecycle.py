"""The gateway's side of cancellation, queue deadlines, admission and queue standing, against a real
nats-server and a real gRPC channel. No scheduler runs: the tests write job records and queue
snapshots the way the scheduler does (JobStore.transition, encode_snapshot into the queues bucket).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
from structlog.testing import capture_logs

from asyncinfer import lifecycle
from asyncinfer.client import AsyncClient, ResourceExhaustedError, RetryPolicy
from asyncinfer.config import Config
from asyncinfer.contract import tenant_work_subjects
from asyncinfer.errors import FailedPrecondition
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobError, JobRecord, JobState, Priority, job_key
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext, KeyValue, KeyWrongLastSequenceError, Msg
from asyncinfer.nats.kv import KvBucket, open_kv_bucket
from asyncinfer.nats.streams import count_subjects
from asyncinfer.queues import (
    SNAPSHOT_STALE_S,
    CancelNotice,
    PriorityQueueSnapshot,
    QueueSnapshot,
    cancel_subject,
    encode_snapshot,
    paused_key,
)
from asyncinfer.v1 import (
    job_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    ops_service_pb2,
    ops_service_pb2_grpc,
    tensor_pb2,
)
from services.gateway import queue_view, transitions
from services.gateway.app import GatewayApp
from services.gateway.queue_view import (
    NEWEST_SLACK_S,
    WaitingReason,
    version_waiting_reason,
)
from tests.kv_helpers import kv_keys

# Also run with the NATS adapter's fast path off (make pytest-nats-fallback).
pytestmark = pytest.mark.nats_fallback

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub
    from tests.stack import Stack, StartStack

WORK = "WORK"
TENANT = "default"
DEMO = "demo"


def submit_request(**fields: Any) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
    fields.setdefault("model_name", DEMO)
    fields.setdefault("inputs", [x])
    return job_service_pb2.SubmitJobRequest(**fields)


def error_details(error: grpc.aio.AioRpcError) -> dict[str, Any]:
    status = status_details(error)
    assert status is not None
    return unpack_details(status)


async def next_job(call: Any) -> job_pb2.Job:
    """The job of a watch's next message (failing if the stream ended)."""
    response = await call.read()
    assert isinstance(response, job_service_pb2.WatchJobResponse), response
    return response.job


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class Harness:
    """A gateway with a channel to it, the jobs store and the queues bucket."""

    def __init__(self, app: GatewayApp, stub: JobStub, js: JetStreamContext, jobs: KeyValue, queues: KeyValue):
        self.app = app
        self.stub = stub
        self.js = js
        self.jobs = jobs
        self.store = JobStore(
            KvBucket(name=app.config.nats.jobs_bucket, kv=jobs, js=js), work_stream=app.config.nats.work_stream
        )
        self.queues = queues

    async def submit(self, **fields: Any) -> job_pb2.Job:
        return (await self.stub.SubmitJob(submit_request(**fields))).job

    async def get(self, job_id: str) -> job_pb2.Job:
        return (await self.stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job

    async def cancel(self, job_id: str, reason: str = "") -> job_pb2.Job:
        return (await self.stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id, reason=reason))).job

    async def record(self, job_id: str) -> JobRecord:
        record = await self.store.get(job_key(TENANT, job_id))
        assert record is not None
        return record

    async def advance(self, job_id: str, **changes: Any) -> JobRecord:
        """What the scheduler does: compare-and-set on the record it read."""
        record = await self.record(job_id)
        return await self.store.replace(record.evolve(update_time=time.time(), **changes))

    async def put_snapshot(self, snapshot: QueueSnapshot) -> None:
        """Writes a snapshot as the scheduler does, and waits until the gateway has it."""
        await self.queues.put(snapshot.model_name, encode_snapshot(snapshot))
        view = self.app.queue_view
        await wait_for(lambda: view.snapshot(snapshot.model_name) == snapshot)

    async def work_messages(self) -> int:
        return (await self.js.stream_info(WORK)).state.messages

    async def job_keys(self) -> list[str]:
        return await kv_keys(self.js, self.app.config.nats.jobs_bucket)

    def sample(self, name: str, labels: dict[str, str]) -> float | None:
        return self.app.registry.get_sample_value(name, labels)


async def start_harness(config: Config, nc: NatsClient) -> tuple[GatewayApp, grpc.aio.Channel, Harness]:
    app = GatewayApp(config)
    await app.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    js = nc.jetstream()
    harness = Harness(
        app,
        job_service_pb2_grpc.JobServiceStub(channel),
        js,
        await js.key_value(config.nats.jobs_bucket),
        await js.key_value(config.nats.queues_bucket),
    )
    return app, channel, harness


@pytest.fixture
async def gw(config: Config, nc: NatsClient) -> AsyncIterator[Harness]:
    app, channel, harness = await start_harness(config, nc)
    try:
        yield harness
    finally:
        await channel.close(None)
        await app.stop(grace_s=1)


def snapshot(
    *,
    updated_at: float | None = None,
    depths: dict[Priority, tuple[int, float | None]] | None = None,
    batchers: int = 1,
    rate: float = 0.0,
    paused: bool = False,
) -> QueueSnapshot:
    return QueueSnapshot(
        model_name=DEMO,
        updated_at=time.time() if updated_at is None else updated_at,
        priorities={p.value: PriorityQueueSnapshot(d, oldest) for p, (d, oldest) in (depths or {}).items()},
        connected_batchers=batchers,
        free_credits=0,
        completed_per_s=rate,
        paused=paused,
    )


# --- cancellation ---------------------------------------------------------------------------------


async def test_cancel_of_a_queued_job_is_final_at_once(gw: Harness) -> None:
    job = await gw.submit()
    watch = gw.stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
    assert (await next_job(watch)).state == job_pb2.JOB_STATE_QUEUED

    canceled = await gw.cancel(job.job_id, reason="changed my mind")
    assert canceled.state == job_pb2.JOB_STATE_CANCELED
    assert canceled.error.reason == "CANCELED_BY_USER"
    assert canceled.error.code == grpc.StatusCode.CANCELLED.value[0]
    assert "changed my mind" in canceled.error.message
    assert canceled.HasField("end_time")
    assert not canceled.HasField("queue")  # only a QUEUED job has a standing

    record = await gw.record(job.job_id)
    assert record.state is JobState.CANCELED
    assert record.revision == canceled.revision
    assert (await next_job(watch)).state == job_pb2.JOB_STATE_CANCELED
    assert await watch.read() is grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs
    assert (await gw.get(job.job_id)).state == job_pb2.JOB_STATE_CANCELED
    assert gw.sample("asyncinfer_cancels_total", {"model": DEMO, "outcome": "CANCELED"}) == 1


async def test_cancel_of_a_running_job_goes_through_cancelling_and_notifies(gw: Harness, nc: NatsClient) -> None:
    notices: asyncio.Queue[CancelNotice] = asyncio.Queue()

    async def on_notice(msg: Msg) -> None:
        notices.put_nowait(CancelNotice.decode(msg.data))

    subscription = await nc.subscribe(cancel_subject(DEMO), cb=on_notice)
    await nc.flush()
    job = await gw.submit()
    await gw.advance(job.job_id, state=JobState.RUNNING, attempt=1, start_time=time.time())
    watch = gw.stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
    assert (await next_job(watch)).state == job_pb2.JOB_STATE_RUNNING

    cancelling = await gw.cancel(job.job_id, reason="too slow")
    assert cancelling.state == job_pb2.JOB_STATE_CANCELLING
    assert not cancelling.HasField("end_time")
    notice = await asyncio.wait_for(notices.get(), 5)
    assert notice == CancelNotice(job_id=job.job_id, tenant=TENANT, model_name=DEMO)
    assert (await next_job(watch)).state == job_pb2.JOB_STATE_CANCELLING

    # Idempotent: the same answer, nothing written, and the notice sent again (it is at most once).
    again = await gw.cancel(job.job_id)
    assert again.state == job_pb2.JOB_STATE_CANCELLING
    assert again.revision == cancelling.revision
    assert (await asyncio.wait_for(notices.get(), 5)).job_id == job.job_id

    # The scheduler ends it, keeping the reason written by the cancel.
    record = await gw.record(job.job_id)
    assert record.error is not None
    await gw.advance(job.job_id, state=JobState.CANCELED, end_time=time.time())
    last = await next_job(watch)
    assert last.state == job_pb2.JOB_STATE_CANCELED
    assert "too slow" in last.error.message
    assert await watch.read() is grpc.aio.EOF  # type: ignore[attr-defined]
    assert gw.sample("asyncinfer_cancels_total", {"model": DEMO, "outcome": "CANCELLING"}) == 2
    await subscription.unsubscribe()


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED, JobState.TIMED_OUT])
async def test_cancel_of_a_finished_job_is_failed_precondition(gw: Harness, state: JobState) -> None:
    job = await gw.submit()
    await gw.advance(job.job_id, state=JobState.RUNNING, attempt=1)
    done = await gw.advance(job.job_id, state=state, end_time=time.time())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await gw.cancel(job.job_id)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    error_info = error_details(info.value)["ErrorInfo"]
    assert error_info.reason == "JOB_ALREADY_FINISHED"
    assert error_info.metadata["state"] == state.value
    assert (await gw.record(job.job_id)).revision == done.revision  # nothing written
    assert gw.sample("asyncinfer_cancels_total", {"model": DEMO, "outcome": "JOB_ALREADY_FINISHED"}) == 1


async def test_cancel_racing_a_completion_reports_the_winner(gw: Harness, nc: NatsClient) -> None:
    job = await gw.submit()
    running = await gw.advance(job.job_id, state=JobState.RUNNING, attempt=1)

    # The completion lands between the cancel's read and its compare-and-set: the cancel loses,
    # re-reads, and says the job already finished.
    await gw.advance(job.job_id, state=JobState.SUCCEEDED, end_time=time.time())
    with pytest.raises(FailedPrecondition) as info:
        await transitions.cancel(gw.store, nc, running, reason="", now=time.time(), lines=RepeatedLines())
    assert info.value.reason == "JOB_ALREADY_FINISHED"
    assert info.value.metadata["state"] == "SUCCEEDED"
    assert (await gw.record(job.job_id)).state is JobState.SUCCEEDED

    # The other way round: the cancel lands first, and the scheduler's completion (on the
    # revision it read) is refused, so it must re-read and find CANCELLING.
    other = await gw.submit()
    stale = await gw.advance(other.job_id, state=JobState.RUNNING, attempt=1)
    assert (await gw.cancel(other.job_id)).state == job_pb2.JOB_STATE_CANCELLING
    with pytest.raises(KeyWrongLastSequenceError):
        await gw.store.replace(stale.evolve(state=JobState.SUCCEEDED, end_time=time.time()))
    assert (await gw.record(other.job_id)).state is JobState.CANCELLING


async def test_cancel_of_an_unknown_or_foreign_job_is_not_found(gw: Harness, config: Config, nc: NatsClient) -> None:
    for job_id in ("0190b6b4-3a1e-7cc0-8000-000000000000", "not-an-id", ""):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await gw.cancel(job_id)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    theirs = await gw.submit()
    app, channel, other = await start_harness(config.replace(gateway={"default_tenant": "other"}), nc)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await other.cancel(theirs.job_id)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert error_details(info.value)["ErrorInfo"].reason == "JOB_NOT_FOUND"
    finally:
        await channel.close(None)
        await app.stop(grace_s=1)
    assert (await gw.record(theirs.job_id)).state is JobState.QUEUED


# --- deadlines on read ----------------------------------------------------------------------------


async def sleep_until(moment: float) -> None:
    await asyncio.sleep(max(moment - time.time(), 0) + 0.01)


async def test_get_job_past_its_deadline_reports_expired_and_makes_it_so(gw: Harness) -> None:
    deadline = time.time() + 0.3
    job = await gw.submit(deadline={"seconds": int(deadline), "nanos": int((deadline % 1) * 1e9)})
    assert job.state == job_pb2.JOB_STATE_QUEUED
    await sleep_until(deadline)

    got = await gw.get(job.job_id)
    assert got.state == job_pb2.JOB_STATE_EXPIRED
    assert got.error.reason == "DEADLINE_EXCEEDED"  # as a dispatch's expiry says (QUEUE_DEADLINE_EXCEEDED before)
    assert got.error.message == "the job's deadline passed before it started"
    assert got.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    record = await gw.record(job.job_id)
    assert record.state is JobState.EXPIRED  # written, not just reported
    assert record.revision == got.revision
    assert (await gw.get(job.job_id)).revision == got.revision  # a second read writes nothing
    assert gw.sample("asyncinfer_jobs_expired_on_read_total", {"model": DEMO}) == 1

    # Cancelling it now is cancelling a finished job.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await gw.cancel(job.job_id)
    assert error_details(info.value)["ErrorInfo"].metadata["state"] == "EXPIRED"


async def test_jobs_expired_on_read_alike_are_said_once_not_a_line_a_job(gw: Harness) -> None:
    """A client reading its jobs past their deadline expires each on the read: a
    `job_expired_on_read` line each at info. Now the first names its job; the rest within the
    interval are at debug, each still there."""
    deadline = time.time() + 0.3
    due = {"seconds": int(deadline), "nanos": int((deadline % 1) * 1e9)}
    jobs = [(await gw.submit(deadline=due)).job_id for _ in range(6)]
    await sleep_until(deadline)
    with capture_logs() as logs:
        for job_id in jobs:
            assert (await gw.get(job_id)).state == job_pb2.JOB_STATE_EXPIRED
    said = [e for e in logs if e["event"] == "job_expired_on_read" and e["log_level"] != "debug"]
    assert [(e["log_level"], e["job_id"], e["model"]) for e in said] == [("info", jobs[0], DEMO)]
    held = [e["job_id"] for e in logs if e["event"] == "job_expired_on_read" and e["log_level"] == "debug"]
    assert held == jobs[1:]


async def test_expiry_on_read_loses_to_a_dispatch_and_reports_it(gw: Harness) -> None:
    job = await gw.submit(queue_ttl={"seconds": 60})
    queued = await gw.record(job.job_id)
    await gw.advance(job.job_id, state=JobState.RUNNING, attempt=1)  # dispatched just in time
    overdue = queued.evolve(deadline=time.time() - 1)
    latest, wrote = await transitions.expire_if_overdue(gw.store, overdue, time.time())
    assert not wrote
    assert latest is not None
    assert latest.state is JobState.RUNNING


async def test_watch_shows_expired_when_the_deadline_passes(gw: Harness) -> None:
    deadline = time.time() + 0.5
    job = await gw.submit(deadline={"seconds": int(deadline), "nanos": int((deadline % 1) * 1e9)})
    watch = gw.stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
    states = [r.job.state async for r in watch]  # nothing else writes: the watch itself expires it
    assert states == [job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_EXPIRED]
    assert time.time() >= deadline
    assert (await gw.record(job.job_id)).state is JobState.EXPIRED


async def test_cancel_of_a_queued_job_past_its_deadline_finds_it_expired(gw: Harness) -> None:
    deadline = time.time() + 0.2
    job = await gw.submit(deadline={"seconds": int(deadline), "nanos": int((deadline % 1) * 1e9)})
    await sleep_until(deadline)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await gw.cancel(job.job_id)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_details(info.value)["ErrorInfo"].metadata["state"] == "EXPIRED"
    assert (await gw.record(job.job_id)).state is JobState.EXPIRED


# --- admission ------------------------------------------------------------------------------------


def with_queue_limit(config: Config, depth: int) -> Config:
    (demo,) = config.models
    return config.replace(models=[demo.model_copy(update={"max_queue_depth": depth}).model_dump()])


async def assert_refused(gw: Harness, reason: str, *, retry_s: float) -> None:
    messages, keys = await gw.work_messages(), await gw.job_keys()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await gw.submit()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = error_details(info.value)
    assert details["ErrorInfo"].reason == reason
    assert details["RetryInfo"].retry_delay.ToNanoseconds() / 1e9 == pytest.approx(retry_s)
    # Nothing is queued: no work message, no record.
    assert await gw.work_messages() == messages
    assert await gw.job_keys() == keys


async def test_model_queue_limit_counts_the_snapshot_and_recent_submits(config: Config, nc: NatsClient) -> None:
    app, channel, gw = await start_harness(with_queue_limit(config, 3), nc)
    try:
        await gw.put_snapshot(snapshot(depths={Priority.NORMAL: (1, time.time()), Priority.LOW: (1, None)}, rate=0.5))
        await gw.submit()  # 2 reported + 0 since: admitted, now 3
        # 2 reported + 1 submitted since the snapshot = 3: full. 1 job over, at 0.5/s: 2 s.
        await assert_refused(gw, "QUEUE_FULL", retry_s=2.0)
        assert gw.sample(
            "asyncinfer_submit_rejected_total", {"model": DEMO, "code": "RESOURCE_EXHAUSTED", "reason": "QUEUE_FULL"}
        )
        # A newer snapshot that has seen the queue drain admits again.
        await gw.put_snapshot(snapshot(depths={Priority.NORMAL: (0, None)}, rate=0.5))
        for _ in range(3):
            await gw.submit()
        await assert_refused(gw, "QUEUE_FULL", retry_s=2.0)
        assert await gw.work_messages() == 4
    finally:
        await channel.close(None)
        await app.stop(grace_s=1)


async def test_a_model_queue_limit_is_a_depth_not_a_rate(config: Config, start_stack: StartStack) -> None:
    """A helper's limits pass, session 24: every job queued since the last snapshot counted, run or
    not, so a model limited to 3 was admitted 3 jobs per snapshot interval however empty its queue
    (14,505 of 14,805 refused in one run, the queue 0 deep). Before a refusal the gateway reads the
    count again; a queue that is really full still refuses."""
    limited = with_queue_limit(config, 3).replace(scheduler={"queue_stats_interval_s": 60.0})
    stack = await start_stack(limited, batcher=False)
    await stack.start_batcher()
    async with AsyncClient(stack.address) as client:
        for _ in range(10):  # one at a time, each run before the next: never more than 1 queued
            done = await client.wait(await client.submit(DEMO, {"x": np.ones((1, 4), np.float32)}), timeout_s=30)
            assert done.state.value == "SUCCEEDED"
        await stack.batcher.stop(grace_s=1)  # nothing runs now: the queue fills for real
        stack.batcher = None
        queued = [await client.submit(DEMO, {"x": np.ones((1, 4), np.float32)}) for _ in range(3)]
    async with AsyncClient(stack.address, retry=RetryPolicy(retry_resource_exhausted=False)) as once:
        with pytest.raises(ResourceExhaustedError) as full:
            await once.submit(DEMO, {"x": np.ones((1, 4), np.float32)})
    assert full.value.reason == "QUEUE_FULL"
    assert len(queued) == 3


async def test_model_queue_limit_without_a_snapshot_counts_what_this_gateway_queued(
    config: Config, nc: NatsClient
) -> None:
    app, channel, gw = await start_harness(with_queue_limit(config, 2), nc)
    try:
        jobs = await asyncio.gather(*(gw.submit() for _ in range(2)))
        assert all(j.state == job_pb2.JOB_STATE_QUEUED for j in jobs)
        await assert_refused(gw, "QUEUE_FULL", retry_s=5.0)  # no measured rate: the default delay
    finally:
        await channel.close(None)
        await app.stop(grace_s=1)


async def test_a_full_paused_queue_says_it_is_paused(config: Config, nc: NatsClient) -> None:
    """Its refusal said "try again in 5 s", which a paused queue cannot keep (a helper's pass)."""
    app, channel, gw = await start_harness(with_queue_limit(config, 1), nc)
    try:
        await gw.queues.put(paused_key(DEMO), b"1")
        await wait_for(lambda: gw.app.queue_view.is_paused(DEMO))
        await gw.submit()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await gw.submit()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "its queue is paused (nothing leaves it until ResumeQueue)" in (info.value.details() or "")
    finally:
        await channel.close(None)
        await app.stop(grace_s=1)


async def test_concurrent_submits_cannot_overshoot_the_model_limit(config: Config, nc: NatsClient) -> None:
    app, channel, gw = await start_harness(with_queue_limit(config, 5), nc)
    try:
        results = await asyncio.gather(*(gw.submit() for _ in range(20)), return_exceptions=True)
        accepted = [r for r in results if isinstance(r, job_pb2.Job)]
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(accepted) == 5
        assert len(refused) == 15
        assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
        assert await gw.work_messages() == 5
    finally:
        await channel.close(None)
        await app.stop(grace_s=1)


async def test_tenant_quota_counts_the_tenants_work_messages(config: Config, nc: NatsClient) -> None:
    app, channel, gw = await start_harness(config.replace(gateway={"max_queued_per_tenant": 2}), nc)
    try:
        await gw.put_snapshot(snapshot(rate=4.0))
        first = await gw.submit()
        await gw.submit()
        assert await count_subjects(nc, WORK, tenant_work_subjects(TENANT), timeout_s=2.0) == 2
        # 2 queued, limit 2: 1 over, at 4 jobs/s: 0.25 s, raised to the 1 s minimum.
        await assert_refused(gw, "TENANT_QUOTA_EXCEEDED", retry_s=1.0)

        # The first job ended (its message left the stream): the tenant may queue one more. The
        # count is the stream's, so nothing had to be told.
        await gw.js.purge_stream(WORK, subject=f"asyncinfer.work.*.*.{TENANT}.{first.job_id}")
        await gw.submit()
        await assert_refused(gw, "TENANT_QUOTA_EXCEEDED", retry_s=1.0)
    finally:
        await channel.close(None)
        await app.stop(grace_s=1)


async def test_concurrent_submits_cannot_overshoot_the_tenant_limit(config: Config, nc: NatsClient) -> None:
    app, channel, gw = await start_harness(config.replace(gateway={"max_queued_per_tenant": 7}), nc)
    try:
        for _ in range(3):  # a read, then submits admitted on it
            await gw.submit()
        results = await asyncio.gather(*(gw.submit() for _ in range(40)), return_exceptions=True)
        accepted = [r for r in results if isinstance(r, job_pb2.Job)]
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(accepted) == 4
        assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert await count_subjects(nc, WORK, tenant_work_subjects(TENANT), timeout_s=2.0) == 7
    finally:
        await channel.close(None)
        await app.stop(grace_s=1)


async def test_a_submit_that_is_not_queued_leaves_no_count_behind(config: Config, nc: NatsClient) -> None:
    limited = config.replace(gateway={"max_queued_per_tenant": 3, "enqueue_retry_s": 0.2})
    app, channel, gw = await start_harness(limited, nc)
    try:
        await gw.submit()
        stream = await gw.js.stream_info(WORK)
        await gw.js.delete_stream(WORK)
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await gw.submit()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await gw.js.add_stream(stream.config)
        for _ in range(3):
            await gw.submit()
        await assert_refused(gw, "TENANT_QUOTA_EXCEEDED", retry_s=5.0)
    finally:
        await channel.close(None)
        await app.stop(grace_s=1)


# --- queue standing -------------------------------------------------------------------------------


async def test_waiting_reasons_follow_the_snapshot(gw: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    job = await gw.submit()
    assert job.queue.waiting_reason == job_pb2.WAITING_REASON_NO_WORKER  # no scheduler has reported

    async def reason() -> int:
        return (await gw.get(job.job_id)).queue.waiting_reason

    await gw.put_snapshot(snapshot(batchers=0, depths={Priority.NORMAL: (1, job.create_time.ToNanoseconds() / 1e9)}))
    assert await reason() == job_pb2.WAITING_REASON_NO_WORKER  # scaled to zero
    # Written by a scheduler whose clock is a minute behind: fresh as it arrives (the gateway's
    # monotonic clock judges it, asyncinfer.snapshot_freshness; NO_WORKER before session 29).
    await gw.put_snapshot(snapshot(batchers=2, updated_at=time.time() - 60))
    assert await reason() == job_pb2.WAITING_REASON_WAITING_FOR_CAPACITY
    # Nothing written for longer than SNAPSHOT_STALE_S (the gateway's monotonic clock moved on):
    # stale, no scheduler looks after it.
    view = gw.app.queue_view
    monkeypatch.setattr(view, "_monotonic", lambda: time.monotonic() + SNAPSHOT_STALE_S + 1.0)
    assert await reason() == job_pb2.WAITING_REASON_NO_WORKER
    monkeypatch.undo()
    await gw.put_snapshot(snapshot(batchers=2))
    assert await reason() == job_pb2.WAITING_REASON_WAITING_FOR_CAPACITY
    await gw.put_snapshot(snapshot(batchers=2, paused=True))
    assert await reason() == job_pb2.WAITING_REASON_PAUSED

    # The pause key takes effect before the next snapshot says so.
    await gw.put_snapshot(snapshot(batchers=2))
    await gw.queues.put(paused_key(DEMO), b"1")
    await wait_for(lambda: gw.app.queue_view.is_paused(DEMO))
    assert await reason() == job_pb2.WAITING_REASON_PAUSED
    await gw.queues.delete(paused_key(DEMO))
    await wait_for(lambda: not gw.app.queue_view.is_paused(DEMO))

    # Back in the queue after a failed attempt: waiting out the retry backoff.
    await gw.advance(job.job_id, state=JobState.RUNNING, attempt=1)
    error = JobError(code=13, reason="WORKER_LOST", message="the batcher went away", retriable=True)
    await gw.advance(job.job_id, state=JobState.QUEUED, last_error=error)
    assert await reason() == job_pb2.WAITING_REASON_RETRY_BACKOFF

    watch = gw.stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
    assert (await next_job(watch)).queue.waiting_reason == job_pb2.WAITING_REASON_RETRY_BACKOFF
    watch.cancel()


async def test_a_fresh_job_on_an_idle_batcher_does_not_wait_for_capacity(start_stack: StartStack) -> None:
    """Issue 18: a job submitted to an idle stack said WAITING_FOR_CAPACITY; the scheduler's
    snapshot has the batcher's free slots, so the job is only being dispatched: no reason."""
    stack = await start_stack()
    view = stack.gateway.queue_view
    await wait_for(lambda: (s := view.snapshot(DEMO)) is not None and s.connected_batchers > 0, timeout_s=10.0)
    assert view.snapshot(DEMO).free_credits > 0  # type: ignore[union-attr]
    job = (await stack.jobs.SubmitJob(submit_request())).job
    assert job.state == job_pb2.JOB_STATE_QUEUED
    assert job.queue.waiting_reason == job_pb2.WAITING_REASON_UNSPECIFIED


async def test_position_and_estimated_start_come_from_the_snapshot(gw: Harness) -> None:
    job = await gw.submit()
    created = job.create_time.ToNanoseconds() / 1e9
    # 5 HIGH jobs ahead; 10 NORMAL jobs spread from created - 100 s to when the snapshot was written
    # (no newest time: a scheduler of the release before), just after this one: the other 9 ahead of
    # it. The scheduler's clock is 100 s ahead, which positions do not read (the span ran to its
    # updated_at: 5 NORMAL ahead). At 4 jobs/s, 14 jobs ahead start in 3.5 s.
    await gw.put_snapshot(
        snapshot(
            updated_at=created + 100,
            depths={Priority.HIGH: (5, created - 1), Priority.NORMAL: (10, created - 100), Priority.LOW: (7, created)},
            rate=4.0,
        )
    )
    before = time.time()
    got = await gw.get(job.job_id)
    assert got.queue.position == 14
    assert got.queue.waiting_reason == job_pb2.WAITING_REASON_WAITING_FOR_CAPACITY
    estimate = got.queue.estimated_start_time.ToNanoseconds() / 1e9
    assert before + 3.5 <= estimate <= time.time() + 3.5

    # Not stored: the record has no such thing, and a running job has no standing.
    await gw.advance(job.job_id, state=JobState.RUNNING, attempt=1)
    assert not (await gw.get(job.job_id)).HasField("queue")


async def test_unknown_rate_leaves_the_estimate_unset(gw: Harness) -> None:
    job = await gw.submit(priority=job_pb2.PRIORITY_HIGH)
    await gw.put_snapshot(snapshot(depths={Priority.HIGH: (3, time.time() - 5)}, rate=0.0))
    got = await gw.get(job.job_id)
    assert got.queue.waiting_reason == job_pb2.WAITING_REASON_WAITING_FOR_CAPACITY
    assert not got.queue.HasField("estimated_start_time")


def record_at(create_time: float, priority: Priority = Priority.NORMAL, **changes: Any) -> JobRecord:
    return JobRecord(
        job_id="j",
        tenant=TENANT,
        model_name=DEMO,
        model_version="1",
        state=JobState.QUEUED,
        priority=priority,
        create_time=create_time,
        update_time=create_time,
        max_attempts=3,
        result_retention_s=60,
        **changes,
    )


@pytest.mark.unit
def test_jobs_ahead_interpolates_within_the_priority() -> None:
    snap = snapshot(
        updated_at=100.0,
        depths={Priority.HIGH: (4, 10.0), Priority.NORMAL: (10, 0.0), Priority.LOW: (50, 0.0)},
    )
    jobs_ahead = functools.partial(queue_view.jobs_ahead, written_wall_time=100.0)
    assert jobs_ahead(record_at(55.0, Priority.HIGH), snap) == 2  # HIGH: nothing above; half of 4
    assert jobs_ahead(record_at(0.0), snap) == 4  # the oldest NORMAL: only HIGH ahead
    assert jobs_ahead(record_at(-5.0), snap) == 4  # older than the oldest (a retry): first
    assert jobs_ahead(record_at(50.0), snap) == 4 + 5
    assert jobs_ahead(record_at(100.0), snap) == 4 + 9  # the newest counted: the other 9 ahead
    assert jobs_ahead(record_at(101.0), snap) == 4 + 10  # after the snapshot: all of them ahead
    assert jobs_ahead(record_at(50.0, Priority.LOW), snap) == 14 + 25
    assert jobs_ahead(record_at(50.0), None) == 0


@pytest.mark.unit
def test_jobs_ahead_interpolates_between_the_oldest_and_the_newest() -> None:
    """A paused queue read long after its burst: the jobs lie between the oldest and the newest,
    not between the oldest and the snapshot's time (where every one of them read 0)."""
    burst = PriorityQueueSnapshot(11, 1000.0, 1001.0)  # 11 jobs queued in one second
    snap = replace(snapshot(updated_at=1060.0), priorities={Priority.NORMAL.value: burst})
    jobs_ahead = functools.partial(queue_view.jobs_ahead, written_wall_time=1060.0)
    assert [jobs_ahead(record_at(1000.0 + i / 10), snap) for i in range(11)] == list(range(11))
    assert jobs_ahead(record_at(999.0), snap) == 0  # a retried job, older than the oldest
    assert jobs_ahead(record_at(1001.0 + NEWEST_SLACK_S), snap) == 10  # the newest, on another clock
    assert jobs_ahead(record_at(1030.0), snap) == 11  # queued since the newest: behind all of them
    assert jobs_ahead(record_at(1061.0), snap) == 11  # after the snapshot


async def paused_burst(stack: Stack, count: int, spacing_s: float = 0.0) -> list[job_pb2.Job]:
    """The demo model's queue paused, then `count` jobs submitted one after another (`spacing_s`
    between one's answer and the next submit): their QUEUED records."""
    async with grpc.aio.insecure_channel(stack.ops_address) as channel:
        await ops_service_pb2_grpc.OpsServiceStub(channel).PauseQueue(
            ops_service_pb2.PauseQueueRequest(model_name=DEMO)
        )
    jobs: list[job_pb2.Job] = []
    for index in range(count):
        if index and spacing_s:
            await asyncio.sleep(spacing_s)
        jobs.append((await stack.jobs.SubmitJob(submit_request())).job)
    return jobs


@pytest.mark.parametrize("scheduler_ahead_s", [0.0, -60.0, 60.0])
async def test_a_paused_queue_places_each_job_of_a_burst(
    config: Config, start_stack: StartStack, scheduler_ahead_s: float
) -> None:
    """Positions in a queue paused while a burst came in, read seconds later, count 0, 1, 2, ... in
    the order the jobs were queued (each read 0 when the span ran to the snapshot's time), whatever
    the scheduler's wall clock says: 60 s behind the gateway's, every one read 8 ("behind all of
    them": created after the snapshot's `updated_at`) before session 29's skew pass."""
    stack = await start_stack(
        config.replace(scheduler={"queue_stats_interval_s": 0.2}),
        batcher=False,
        scheduler_wall_clock=lambda: time.time() + scheduler_ahead_s,
    )
    jobs = await paused_burst(stack, 8)
    last_queued = jobs[-1].create_time.ToNanoseconds() / 1e9
    view = stack.gateway.queue_view

    def read_late() -> bool:
        late = view.snapshot(DEMO)
        taken = late.updated_at - scheduler_ahead_s if late is not None else 0.0  # on this host's clock
        return late is not None and late.total_depth == len(jobs) and taken > last_queued + 1.0

    await wait_for(read_late, timeout_s=10.0)
    got = await stack.jobs.GetJobs(job_service_pb2.GetJobsRequest(job_ids=[j.job_id for j in jobs]))
    assert {r.job.queue.waiting_reason for r in got.results} == {job_pb2.WAITING_REASON_PAUSED}
    positions = [r.job.queue.position for r in got.results]
    # Interpolated between the oldest and the newest by the time each was queued: exact at both
    # ends, in order, and within two of where its time falls. Not of its index: a busy machine
    # spaces a burst's jobs unevenly (within one of the index failed now and then in session 26,
    # within two in session 32's CI2, [0, 2, 5, 5, 6, 6, ...]). The time is nats-server's stamp on
    # each work message (what GetJobs reads), not the gateway's create time: a publish that stalled
    # 250 ms put a job's stamp beside the next one's while its create time stayed with the ones
    # before (session 39's CI: [0, 0, 0, 0, 6, 7, ...] against create times' [0, 0, 0, 0, 0, 7, ...]).
    assert (positions[0], positions[-1]) == (0, len(jobs) - 1), positions
    assert positions == sorted(positions), positions
    store = JobStore(
        await open_kv_bucket(stack.nc.jetstream(), config.nats.jobs_bucket), work_stream=config.nats.work_stream
    )
    stamps = [record.work_message_time for j in jobs if (record := await store.get(job_key(TENANT, j.job_id)))]
    times = [stamp for stamp in stamps if stamp is not None]
    assert len(times) == len(jobs), stamps
    span = times[-1] - times[0]
    where = [round((t - times[0]) / span * (len(jobs) - 1)) if span > 0 else 0 for t in times]
    assert all(abs(p - w) <= 2 for p, w in zip(positions, where, strict=True)), (positions, where)


@pytest.mark.parametrize("gateway_ahead_s", [60.0, -60.0])
async def test_a_paused_queue_places_each_job_of_a_burst_whatever_the_gateways_clock(
    config: Config, start_stack: StartStack, gateway_ahead_s: float
) -> None:
    """The gateway's wall clock 60 s off nats-server's (and the scheduler's): a paused burst of 8 is
    placed 0 first, 7 last, in order, from GetJobs, which reads each job's work message and so the
    server's stamp on it; and within one of that from the QUEUED records as this gateway's submits
    keep them (create_time only, moved to the server's clock by the offset measured from its
    snapshots' stamps). Each read 8 (ahead) or 0 (behind) when create_time was compared with the
    server's stamps as it was."""
    stack = await start_stack(
        config.replace(scheduler={"queue_stats_interval_s": 0.2}),
        batcher=False,
        gateway_wall_clock=lambda: time.time() + gateway_ahead_s,
    )
    # 50 ms apart: a place is then 50 ms of the span, and what one create_time's publish round trip
    # took more than another's (a few ms, tens on a loaded machine: CI24 placed one 2 off, 8 back
    # to back spanning ~20 ms) stays under half of one.
    jobs = await paused_burst(stack, 8, spacing_s=0.05)
    view = stack.gateway.queue_view

    def counted() -> bool:
        late = view.snapshot(DEMO)
        return late is not None and late.total_depth == len(jobs)

    await wait_for(counted, timeout_s=10.0)
    got = await stack.jobs.GetJobs(job_service_pb2.GetJobsRequest(job_ids=[j.job_id for j in jobs]))
    assert {r.job.queue.waiting_reason for r in got.results} == {job_pb2.WAITING_REASON_PAUSED}
    by_stamp = [r.job.queue.position for r in got.results]
    # Interpolated between the oldest and the newest: exact at both ends, in order (the places
    # between follow how the submits were spaced: the first is often slower).
    assert (by_stamp[0], by_stamp[-1]) == (0, len(jobs) - 1), by_stamp
    assert by_stamp == sorted(by_stamp), by_stamp

    store = JobStore(
        await open_kv_bucket(stack.nc.jetstream(), config.nats.jobs_bucket), work_stream=config.nats.work_stream
    )
    read = [await store.get(job_key(TENANT, j.job_id)) for j in jobs]
    kept = [replace(r, work_message_time=None) for r in read if r is not None and r.work_message_time is not None]
    assert [r.create_time for r in kept] == [j.create_time.ToNanoseconds() / 1e9 for j in jobs]  # the gateway's
    standings = [view.standing(r) for r in kept]
    by_create_time = [s.position for s in standings if s is not None]
    assert len(by_create_time) == len(jobs), standings
    assert by_create_time == sorted(by_create_time), by_create_time
    # Each create_time is a publish's round trip (a millisecond or two, more on a loaded machine)
    # before its stamp, so the last may be placed one early: within one of the stamps' places.
    assert all(abs(a - b) <= 1 for a, b in zip(by_stamp, by_create_time, strict=True)), (by_stamp, by_create_time)


@pytest.mark.parametrize("queuer_ahead_s", [30.0, -30.0])
async def test_a_burst_another_gateway_queued_is_placed_in_order_from_its_records_in_the_bucket(
    config: Config, start_stack: StartStack, queuer_ahead_s: float
) -> None:
    """Two gateways whose wall clocks are 60 s apart (one 30 s ahead of nats-server, one 30 s
    behind, or the other way): a paused burst of 8 queued through one, then read through the other
    from QUEUED records in the jobs bucket (as a retry leaves them: no work message is read) is
    placed 0 first, 7 last, in order, by the server's stamp the scheduler kept from its dispatch.
    The reader moved the queuing gateway's create_time by its own offset to the server: every job
    read 8 (the queuer ahead) or 0 (behind)."""
    stack = await start_stack(
        config.replace(scheduler={"queue_stats_interval_s": 0.2}),
        batcher=False,
        gateway_wall_clock=lambda: time.time() + queuer_ahead_s,
    )
    reader = GatewayApp(config, wall_clock=lambda: time.time() - queuer_ahead_s)
    await reader.start()
    try:
        jobs = await paused_burst(stack, 8)
        assert all(  # the queuer's clock, not the server's
            abs(j.create_time.ToNanoseconds() / 1e9 - time.time() - queuer_ahead_s) < 30 for j in jobs
        )

        def counted() -> bool:
            late = reader.queue_view.snapshot(DEMO)
            return late is not None and late.total_depth == len(jobs)

        await wait_for(counted, timeout_s=30.0)
        store = JobStore(
            await open_kv_bucket(stack.nc.jetstream(), config.nats.jobs_bucket), work_stream=config.nats.work_stream
        )
        lost = JobError(code=14, reason="WORKER_LOST", message="its batcher went away", retriable=True)
        for job in jobs:  # as the scheduler writes a job it dispatched, then put back for a retry
            queued = await store.get(job_key(TENANT, job.job_id))
            assert queued is not None
            assert queued.work_message_time is not None  # read from its work message
            now = time.time()
            pulled = lifecycle.Dispatch(batcher_id="b-1", queued_server_time=queued.work_message_time)
            running = lifecycle.dispatch(queued, pulled, now)
            assert isinstance(running, JobRecord)
            retried = lifecycle.requeue(running, lifecycle.Requeue(attempt=1, error=lost), now)
            assert isinstance(retried, JobRecord)
            await store.create(retried)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{reader.port}") as channel:
            got = await job_service_pb2_grpc.JobServiceStub(channel).GetJobs(
                job_service_pb2.GetJobsRequest(job_ids=[j.job_id for j in jobs])
            )
        assert [r.job.attempt for r in got.results] == [1] * len(jobs)  # read from the bucket
        assert {r.job.queue.waiting_reason for r in got.results} == {job_pb2.WAITING_REASON_PAUSED}
        positions = [r.job.queue.position for r in got.results]
        assert (positions[0], positions[-1]) == (0, len(jobs) - 1), positions
        assert positions == sorted(positions), positions
    finally:
        await reader.stop(1.0)


async def test_a_dispatched_jobs_record_keeps_the_servers_stamp_on_its_work_message(
    config: Config, start_stack: StartStack
) -> None:
    """The scheduler's RUNNING write keeps nats-server's stamp on the work message it pulled
    (queued_server_time), which a retry's QUEUED record carries on: the one time of a job that any
    gateway can place among the queue's stamps without trusting another gateway's clock."""
    stack = await start_stack(config)
    job = (await paused_burst(stack, 1))[0]
    store = JobStore(
        await open_kv_bucket(stack.nc.jetstream(), config.nats.jobs_bucket), work_stream=config.nats.work_stream
    )
    queued = await store.get(job_key(TENANT, job.job_id))
    assert queued is not None
    assert queued.work_message_time is not None
    assert queued.queued_server_time is None  # not dispatched yet
    async with grpc.aio.insecure_channel(stack.ops_address) as channel:
        await ops_service_pb2_grpc.OpsServiceStub(channel).ResumeQueue(
            ops_service_pb2.ResumeQueueRequest(model_name=DEMO)
        )
    async with AsyncClient(stack.address) as client:
        ended = await client.wait(job.job_id, timeout_s=60)  # a hang guard
    assert ended.state.value == "SUCCEEDED"
    record = await store.recorded(job_key(TENANT, job.job_id))
    assert record is not None
    assert record.attempt == 1
    # The same stamp, read from the delivery's reply subject (nanoseconds) and from the message
    # get's RFC 3339 time: each rounds to a microsecond its own way.
    assert record.queued_server_time == pytest.approx(queued.work_message_time, abs=2e-6)


@pytest.mark.parametrize("gateway_ahead_s", [60.0, -60.0])
async def test_a_queue_ttl_and_its_expiry_read_the_gateways_own_clock(
    config: Config, start_stack: StartStack, gateway_ahead_s: float
) -> None:
    """The deadline a queue_ttl gives, its check, and the expiry of a queued job past it read the
    same wall clock as the job's create_time (the gateway's, 60 s off nats-server's and the test's).
    The deadline and the expiry read time.time: 60 s ahead, a queue_ttl of 30 s was refused
    ("the deadline has already passed"); 60 s behind, it gave the job 90 s, and a job past its
    deadline by the gateway's clock stayed QUEUED."""
    skew = [gateway_ahead_s]
    stack = await start_stack(batcher=False, gateway_wall_clock=lambda: time.time() + skew[0])
    ttl_s = 30
    one = (await stack.jobs.SubmitJob(submit_request(queue_ttl={"seconds": ttl_s}))).job
    bulk = stack.jobs.SubmitJobs()
    item = job_service_pb2.SubmitJobsItem(job=submit_request(queue_ttl={"seconds": ttl_s}))
    await bulk.write(job_service_pb2.SubmitJobsRequest(items=[item, item]))  # one group (bulk_message.py)
    await bulk.done_writing()
    many = [answer.job async for response in bulk for answer in response.answers]
    assert len(many) == 2
    for job in (one, *many):
        assert job.state == job_pb2.JOB_STATE_QUEUED
        given_s = (job.deadline.ToNanoseconds() - job.create_time.ToNanoseconds()) / 1e9
        # Both read by the gateway within its handling of the call (the 30-s bound is no timing:
        # the clocks' 60 s is what it tells apart).
        assert ttl_s - 30 < given_s <= ttl_s, given_s
    skew[0] += ttl_s + 1  # past the deadline by the gateway's clock, not by the test's
    got = (await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=one.job_id))).job
    assert got.state == job_pb2.JOB_STATE_EXPIRED


@pytest.mark.unit
def test_waiting_reason_precedence() -> None:
    now = 1000.0
    retried = record_at(1.0, attempt=1, last_error=JobError(code=13, reason="WORKER_LOST", message=""))
    served = snapshot(updated_at=now, batchers=1)
    # Written when the scheduler says it was taken (no skew: tests/unit/test_queue_position_skew.py).
    waiting_reason = functools.partial(queue_view.waiting_reason, written_wall_time=now)
    assert waiting_reason(retried, served, paused=True, fresh=True) == WaitingReason.PAUSED
    assert waiting_reason(retried, None, paused=False, fresh=True) == WaitingReason.NO_WORKER
    assert waiting_reason(retried, served, paused=False, fresh=True) == WaitingReason.RETRY_BACKOFF
    assert waiting_reason(record_at(1.0), served, paused=False, fresh=True) == WaitingReason.WAITING_FOR_CAPACITY
    draining = replace(served, draining=True)
    assert waiting_reason(record_at(1.0), draining, paused=False, fresh=True) == WaitingReason.DRAINING
    assert waiting_reason(retried, draining, paused=False, fresh=True) == WaitingReason.DRAINING
    assert waiting_reason(record_at(1.0), draining, paused=True, fresh=True) == WaitingReason.PAUSED
    # No scheduler reports the model any more (its snapshot is stale by the gateway's monotonic
    # clock: asyncinfer.snapshot_freshness), draining or not.
    assert waiting_reason(record_at(1.0), draining, paused=False, fresh=False) == WaitingReason.NO_WORKER
    # A batcher with free slots for it: about to be dispatched, no reason to wait (issue 18).
    idle = replace(served, free_credits=2, priorities={Priority.NORMAL.value: PriorityQueueSnapshot(2, 0.0)})
    assert waiting_reason(record_at(now), idle, paused=False, fresh=True) == WaitingReason.DISPATCHING
    assert waiting_reason(record_at(now + 1), idle, paused=False, fresh=True) == WaitingReason.WAITING_FOR_CAPACITY
    assert waiting_reason(record_at(now), replace(idle, paused=True), paused=False, fresh=True) == WaitingReason.PAUSED
    assert waiting_reason(retried, idle, paused=False, fresh=True) == WaitingReason.RETRY_BACKOFF


@pytest.mark.unit
def test_a_version_no_batcher_could_load_is_its_own_waiting_reason() -> None:
    """A model whose batcher could not load it left its jobs waiting NO_WORKER, which reads as
    scaling from zero: they wait for a fix and a batcher that loads it (MODEL_LOAD_FAILED)."""
    r = WaitingReason
    unpinned = functools.partial(version_waiting_reason, pinned=False)
    pinned = functools.partial(version_waiting_reason, pinned=True)
    assert unpinned(r.NO_WORKER, served=False, load_failed=True) == r.MODEL_LOAD_FAILED
    assert pinned(r.NO_WORKER, served=False, load_failed=True) == r.MODEL_LOAD_FAILED
    assert pinned(r.WAITING_FOR_CAPACITY, served=False, load_failed=True) == r.MODEL_LOAD_FAILED
    # No failure known: as before (a pinned version nobody serves is NO_VERSION).
    assert unpinned(r.NO_WORKER, served=False, load_failed=False) == r.NO_WORKER
    assert pinned(r.NO_WORKER, served=False, load_failed=False) == r.NO_VERSION
    # An unpinned job other batchers take (another version serves) keeps the snapshot's reason.
    assert unpinned(r.WAITING_FOR_CAPACITY, served=False, load_failed=True) == r.WAITING_FOR_CAPACITY
    # An operator's hold comes first; a version served has nothing to add.
    assert pinned(r.PAUSED, served=False, load_failed=True) == r.PAUSED
    assert unpinned(r.DRAINING, served=False, load_failed=True) == r.DRAINING
    assert pinned(r.NO_WORKER, served=True, load_failed=False) == r.NO_WORKER


async def test_a_client_hammering_cancels_and_bad_submits_does_not_flood_the_log(
    config: Config, nc: NatsClient
) -> None:
    """A client cancelling its ten jobs one by one wrote a `job_cancel_requested` line each; now the
    first names its job, the rest within the interval are at debug. Its refused submits (a full
    queue, a wrong shape, an unknown model: at the client's rate) write no line above debug."""
    with capture_logs() as logs:  # from the start: the gateway's loggers are bound as it starts
        app, channel, gw = await start_harness(with_queue_limit(config, 10), nc)
        try:
            jobs = [(await gw.submit()).job_id for _ in range(10)]
            for job_id in jobs:
                assert (await gw.cancel(job_id)).state == job_pb2.JOB_STATE_CANCELED
            wrong_shape = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 3])
            wrong_shape.contents.fp32_contents.extend([1.0, 2.0, 3.0])
            refused = [submit_request(inputs=[wrong_shape]), submit_request(model_name="nope")] * 5
            await gw.put_snapshot(snapshot(depths={Priority.NORMAL: (10, time.time())}, rate=0.5))
            refused += [submit_request()] * 5  # the queue is full
            for request in refused:
                with pytest.raises(grpc.aio.AioRpcError):
                    await gw.stub.SubmitJob(request)
        finally:
            await channel.close(None)
            await app.stop(grace_s=1)
    said = [e for e in logs if e["event"] == "job_cancel_requested" and e["log_level"] != "debug"]
    assert len(said) == 1, said
    assert (said[0]["log_level"], said[0]["job_id"], said[0]["state"]) == ("info", jobs[0], "CANCELED")
    held = [e["job_id"] for e in logs if e["event"] == "job_cancel_requested" and e["log_level"] == "debug"]
    assert held == jobs[1:]
    started = next(n for n, e in enumerate(logs) if e["event"] == "gateway_started")
    after_start = [e["event"] for e in logs[started + 1 :] if e["log_level"] != "debug"]
    # Besides the one cancel line: the accepted jobs' summary and the stop, once each.
    assert sorted(after_start) == ["gateway_stopped", "job_cancel_requested", "jobs_summary"], after_start
