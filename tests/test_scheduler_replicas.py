"""Two schedulers on one NATS, as the Kubernetes deployment runs them (deploy/k8s/base/scheduler.yaml:
2 replicas), with the one batcher connected to the first: each writes the model's one queue snapshot
key with its own view, and the gateway answers a queued job's standing from their merge
(asyncinfer.snapshot_merge). Before session 29 the key's last write was the answer: every
write of the scheduler without a batcher made the queued jobs say NO_WORKER, and its drain made
them say DRAINING while the other dispatched."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from google.protobuf import duration_pb2

from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.nats import KeyValue
from asyncinfer.queues import SNAPSHOT_HEARTBEAT_S, SNAPSHOT_STALE_S, QueueSnapshot, decode_snapshot
from asyncinfer.v1 import job_pb2, job_service_pb2, ops_service_pb2, ops_service_pb2_grpc, tensor_pb2
from services.gateway.queue_view import QueueView
from services.scheduler.app import SchedulerApp
from tests.hanging_models import HANG_VALUE, RELEASE
from tests.stack import StartStack
from tests.waits import WAIT_S

# One job at a time, and the first one hangs (until RELEASE) for longer than the test runs: the
# jobs behind it wait for capacity on the one batcher.
HANGING_MODEL = DEMO_MODEL.model_copy(
    update={
        "name": "hang",
        "loader": "tests.hanging_models:build_hanging_model",
        "default_execution_timeout_s": 600.0,
        "max_batch_size": 1,
        "max_inflight_batches": 1,
        "max_queue_size": 1,  # the batcher holds the hung job alone
        "max_queue_delay_ms": 0.0,
        "warm_up": False,
    }
)
MODEL = HANGING_MODEL.name


def request(first: float) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([first, 1.0, 1.0, 1.0])
    return job_service_pb2.SubmitJobRequest(model_name=MODEL, inputs=[x])


async def wait_for(condition: Callable[[], bool], *, deadline: float | None = None) -> None:
    """Until `condition` holds, by `deadline` (monotonic; default WAIT_S from now)."""
    deadline = time.monotonic() + WAIT_S if deadline is None else deadline
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def next_written(
    writes: KeyValue.KeyWatcher, matches: Callable[[QueueSnapshot], bool], *, after: float = 0.0
) -> QueueSnapshot:
    """The next snapshot written to the model's key (by either scheduler) that `matches`, taken
    after `after` (Unix seconds: the schedulers run on this host's clock)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        entry = await writes.updates(timeout=max(deadline - time.monotonic(), 0.01))
        if entry is not None and entry.value:
            snapshot = decode_snapshot(entry.value)
            if snapshot.updated_at > after and matches(snapshot):
                return snapshot


@pytest.mark.timeout(120)
async def test_a_scheduler_without_batchers_or_draining_does_not_hide_the_others_batcher(
    config: Config, start_stack: StartStack
) -> None:
    RELEASE.clear()
    shared = config.replace(models=[HANGING_MODEL], scheduler={"queue_stats_interval_s": 0.1})
    stack = await start_stack(shared)  # the gateway, scheduler A and the batcher, connected to A
    second = SchedulerApp(shared)  # scheduler B: no batcher connects to it
    await second.start()
    queues = await stack.nc.jetstream().key_value(shared.nats.queues_bucket)
    writes = await queues.watch(MODEL)
    view = stack.gateway.queue_view
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") for app in (stack.scheduler, second)]
    ops_a, ops_b = (ops_service_pb2_grpc.OpsServiceStub(channel) for channel in channels)
    try:
        hung = (await stack.jobs.SubmitJob(request(HANG_VALUE))).job.job_id

        async def state_of(job_id: str) -> int:
            return (await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job.state

        deadline = time.monotonic() + WAIT_S
        while await state_of(hung) != job_pb2.JOB_STATE_RUNNING:
            assert time.monotonic() < deadline, "the first job did not start"
            await asyncio.sleep(0.05)
        queued = [(await stack.jobs.SubmitJob(request(float(i)))).job.job_id for i in range(3)]

        async def reasons() -> list[int]:
            got = await stack.jobs.GetJobs(job_service_pb2.GetJobsRequest(job_ids=queued))
            assert [r.job.state for r in got.results] == [job_pb2.JOB_STATE_QUEUED] * len(queued)
            return [r.job.queue.waiting_reason for r in got.results]

        async def read_by_gateway(snapshot: QueueSnapshot) -> None:
            await wait_for(
                lambda: (held := view.snapshot(MODEL)) is not None and held.updated_at >= snapshot.updated_at
            )

        capacity = [job_pb2.WAITING_REASON_WAITING_FOR_CAPACITY] * len(queued)
        await read_by_gateway(await next_written(writes, lambda s: s.connected_batchers == 1 and s.total_depth == 3))
        # B writes at every change of its own (its drain, then its undrain), with no batcher: each
        # time, the jobs still wait for A's batcher, whichever scheduler wrote last.
        for _ in range(3):
            drained_at = time.time()
            assert (await ops_b.Drain(ops_service_pb2.DrainRequest())).drained
            await read_by_gateway(await next_written(writes, lambda s: s.draining, after=drained_at))
            assert await reasons() == capacity
            undrained_at = time.time()
            assert (await ops_b.Undrain(ops_service_pb2.UndrainRequest())).was_draining
            b_alone = await next_written(
                writes, lambda s: s.connected_batchers == 0 and not s.draining, after=undrained_at
            )
            await read_by_gateway(b_alone)
            assert await reasons() == capacity
            merged = view.snapshot(MODEL)
            assert merged is not None
            assert (merged.connected_batchers, merged.in_flight) == (1, 1)

        # A drains, whose batcher is the only one: nothing dispatches, and the jobs say why.
        drained_at = time.time()
        await ops_a.Drain(ops_service_pb2.DrainRequest(timeout=duration_pb2.Duration(nanos=1000)))
        await read_by_gateway(
            await next_written(writes, lambda s: s.draining and s.connected_batchers == 1, after=drained_at)
        )
        assert await reasons() == [job_pb2.WAITING_REASON_DRAINING] * len(queued)
    finally:
        RELEASE.set()
        await writes.stop()
        for channel in channels:
            await channel.close()
        await second.stop(2.0)


@pytest.mark.timeout(120)
async def test_a_scheduler_stopping_in_order_leaves_the_gateways_merge_at_once(
    config: Config, start_stack: StartStack
) -> None:
    """B stops in order: its last snapshot (`stopped`) drops it from the gateway's merge as it
    arrives. Before, B stayed until its snapshot went stale (SNAPSHOT_STALE_S after its last write,
    which an idle scheduler makes every SNAPSHOT_HEARTBEAT_S): meanwhile its batchers, reconnected
    to A, counted twice. The last write says what A reports (a gateway of the release before reads
    it as the whole queue): A's batcher, not "no batcher"."""
    shared = config.replace(models=[HANGING_MODEL], scheduler={"queue_stats_interval_s": 0.1})
    stack = await start_stack(shared)  # the gateway, scheduler A and the batcher, connected to A
    second = SchedulerApp(shared)
    await second.start()
    a, b = stack.scheduler.instance_name, second.instance_name
    view = stack.gateway.queue_view
    writes = await (await stack.nc.jetstream().key_value(shared.nats.queues_bucket)).watch(MODEL)
    try:
        await wait_for(lambda: view.reporting(MODEL) == sorted([a, b]))
        merged = view.snapshot(MODEL)
        assert merged is not None
        assert merged.connected_batchers == 1
        stopping_at = time.monotonic()
        await second.stop(2.0)
        # B's last periodic snapshot was at most a heartbeat old as it stopped, so it went stale no
        # earlier than this: the bound the old code waited out.
        stale_no_earlier = stopping_at + SNAPSHOT_STALE_S - SNAPSHOT_HEARTBEAT_S - 1.0
        await wait_for(lambda: view.reporting(MODEL) == [a], deadline=stale_no_earlier)
        merged = view.snapshot(MODEL)
        assert merged is not None
        assert (merged.connected_batchers, merged.draining) == (1, False)
        last = await next_written(writes, lambda s: s.stopped)
        assert (last.scheduler, last.connected_batchers, last.draining) == (b, 1, False)
    finally:
        await writes.stop()
        await second.stop(2.0)


@pytest.mark.timeout(120)
async def test_get_queue_stats_of_either_scheduler_reports_the_whole_cluster(
    config: Config, start_stack: StartStack
) -> None:
    """Behind the Kubernetes Service an operator reaches either scheduler: B, with no batcher,
    reports A's (it said 0), and how many schedulers report the model and drain; `draining` stays
    the answering scheduler's own."""
    shared = config.replace(models=[HANGING_MODEL], scheduler={"queue_stats_interval_s": 0.1})
    stack = await start_stack(shared)  # the gateway, scheduler A and the batcher, connected to A
    second = SchedulerApp(shared)
    await second.start()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") for app in (stack.scheduler, second)]
    ops_a, ops_b = (ops_service_pb2_grpc.OpsServiceStub(channel) for channel in channels)
    request = ops_service_pb2.GetQueueStatsRequest(model_name=MODEL)

    async def stats(ops: ops_service_pb2_grpc.OpsServiceStub) -> ops_service_pb2.ModelQueueStats:
        (model,) = (await ops.GetQueueStats(request)).models
        return model

    async def until(
        ops: ops_service_pb2_grpc.OpsServiceStub, holds: Callable[[ops_service_pb2.ModelQueueStats], bool]
    ) -> ops_service_pb2.ModelQueueStats:
        deadline = time.monotonic() + WAIT_S
        while not holds(model := await stats(ops)):
            assert time.monotonic() < deadline, f"not reached in time; last: {model}"
            await asyncio.sleep(0.05)
        return model

    try:
        from_b = await until(ops_b, lambda m: m.connected_batchers == 1 and m.schedulers == 2)
        assert (from_b.draining, from_b.draining_schedulers) == (False, 0)
        from_a = await until(ops_a, lambda m: m.schedulers == 2)
        assert from_a.connected_batchers == 1
        await ops_a.Drain(ops_service_pb2.DrainRequest(timeout=duration_pb2.Duration(nanos=1000)))
        from_b = await until(ops_b, lambda m: m.draining_schedulers == 1)
        assert (from_b.draining, from_b.state, from_b.connected_batchers) == (
            False,
            ops_service_pb2.QUEUE_STATE_DISPATCHING,
            1,
        )
        from_a = await stats(ops_a)
        assert (from_a.draining, from_a.draining_schedulers) == (True, 1)
    finally:
        for channel in channels:
            await channel.close()
        await second.stop(2.0)


# How far a scheduler's host clock is off the gateway's (Kubernetes nodes whose NTP is off).
SKEW_S = 60.0


def skewed_clock(by_s: float) -> Callable[[], float]:
    """A scheduler's wall clock `by_s` off this host's: the `updated_at` of its snapshots."""
    return lambda: time.time() + by_s


async def no_last_words() -> None:
    """In place of SchedulerApp._write_last_snapshots: stopped as if killed, its last snapshot not
    written (readers learn of its end only as its snapshots go stale)."""


@pytest.mark.timeout(120)
async def test_snapshots_are_fresh_by_the_readers_clock_whatever_the_schedulers_wall_clocks_say(
    config: Config, start_stack: StartStack
) -> None:
    """Scheduler A (with the batcher) runs 60 s behind the gateway's and B's wall clocks. The
    gateway and B judged A's snapshots by `updated_at` against their own wall clocks: stale as they
    arrived, so the jobs queued behind A's busy batcher said NO_WORKER, and B's GetQueueStats
    reported no batcher and itself alone. Freshness is now the readers' monotonic clock: received
    within SNAPSHOT_STALE_S."""
    RELEASE.clear()
    shared = config.replace(models=[HANGING_MODEL], scheduler={"queue_stats_interval_s": 0.1})
    stack = await start_stack(shared, scheduler_wall_clock=skewed_clock(-SKEW_S))
    second = SchedulerApp(shared)  # B: no batcher connects to it
    await second.start()
    view = stack.gateway.queue_view
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{second.port}")
    ops_b = ops_service_pb2_grpc.OpsServiceStub(channel)
    try:
        hung = (await stack.jobs.SubmitJob(request(HANG_VALUE))).job.job_id
        deadline = time.monotonic() + WAIT_S
        while (await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=hung))).job.state != (
            job_pb2.JOB_STATE_RUNNING
        ):
            assert time.monotonic() < deadline, "the first job did not start"
            await asyncio.sleep(0.05)
        queued = [(await stack.jobs.SubmitJob(request(float(i)))).job.job_id for i in range(3)]
        # Both schedulers count the three (the same consumers); B's view counts them while A's is
        # taken for stale, so this holds on either rule.
        # And A's snapshot since the hung job's dispatch (its credit taken): the two schedulers
        # write in rounds of their own, so the merge may hold B's count of the three beside A's
        # snapshot from before, whose free credit places the first job DISPATCHING.
        await wait_for(
            lambda: (
                (merged := view.snapshot(MODEL)) is not None
                and merged.total_depth == 3
                and (merged.in_flight, merged.free_credits) == (1, 0)
            )
        )
        got = await stack.jobs.GetJobs(job_service_pb2.GetJobsRequest(job_ids=queued))
        assert [r.job.state for r in got.results] == [job_pb2.JOB_STATE_QUEUED] * 3
        # Waiting for A's one batcher (NO_WORKER before: A's snapshots were a minute old on arrival).
        assert [r.job.queue.waiting_reason for r in got.results] == [job_pb2.WAITING_REASON_WAITING_FOR_CAPACITY] * 3
        # Both report the model (A was never fresh before).
        both = sorted([stack.scheduler.instance_name, second.instance_name])
        await wait_for(lambda: view.reporting(MODEL) == both)
        # B, asked for the cluster's queue, counts A's batcher and A.
        request_stats = ops_service_pb2.GetQueueStatsRequest(model_name=MODEL)
        (from_b,) = (await ops_b.GetQueueStats(request_stats)).models
        assert (from_b.connected_batchers, from_b.in_flight, from_b.schedulers) == (1, 1, 2), from_b
    finally:
        RELEASE.set()
        await channel.close()
        await second.stop(2.0)


@pytest.mark.timeout(120)
async def test_a_killed_schedulers_snapshot_goes_stale_in_snapshot_stale_s_whatever_its_clock_says(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler whose wall clock runs 60 s ahead of the gateway's is killed (its last snapshot
    not written). Judged by `updated_at`, its last snapshot stayed fresh for 75 s; now a gateway
    drops it SNAPSHOT_STALE_S after it received it, and a gateway started after the scheduler died
    SNAPSHOT_STALE_S after the server stored it (the key's last value has no arrival to count from:
    its age is the server's stamp against the server's time as the watch began)."""
    shared = config.replace(scheduler={"queue_stats_interval_s": 0.1})
    stack = await start_stack(shared, scheduler_wall_clock=skewed_clock(SKEW_S), batcher=False)
    view = stack.gateway.queue_view
    name = stack.scheduler.instance_name
    await wait_for(lambda: view.reporting(DEMO_MODEL.name) == [name])
    monkeypatch.setattr(stack.scheduler, "_write_last_snapshots", no_last_words)
    killed_at = time.monotonic()
    await stack.scheduler.stop(2.0)
    # Its last write came at most a heartbeat before: still fresh, and no `stopped` word dropped it.
    assert view.reporting(DEMO_MODEL.name) == [name]
    # A gateway that starts a while after: the key's last value is as old as the server says. (The
    # time passing is what is tested: no event marks it.)
    await asyncio.sleep(SNAPSHOT_HEARTBEAT_S)
    late = QueueView(stack.nc.jetstream(), stack.nc, bucket=shared.nats.queues_bucket)
    await late.start()
    try:
        await wait_for(lambda: late.reporting(DEMO_MODEL.name) == [name])
        # Both within SNAPSHOT_STALE_S of its last write, which came before the kill (2 s for a
        # loaded machine; 75 s before, and the late gateway's SNAPSHOT_STALE_S after its start).
        stale_by = killed_at + SNAPSHOT_STALE_S + 2.0
        await wait_for(lambda: late.reporting(DEMO_MODEL.name) == [], deadline=stale_by)
        await wait_for(lambda: view.reporting(DEMO_MODEL.name) == [], deadline=stale_by)
        assert not view.is_fresh(DEMO_MODEL.name)
        assert not late.is_fresh(DEMO_MODEL.name)
    finally:
        await late.stop()
