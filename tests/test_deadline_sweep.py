"""The scheduler's deadline sweep (services/scheduler/deadline_sweep.py), on a real stack: a paused
queue's jobs end EXPIRED at their deadline while the queue stays paused and nobody reads them
(no GetJob, no watch: the gateway's expiry on read never runs), their webhooks are sent, and their
messages leave the queue; with two schedulers sweeping, each job is written EXPIRED once."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from structlog.testing import capture_logs
from test_scheduler import FakeBatcher, until

from asyncinfer.codecs.record import decode_record
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.contract import DEADLINE_HEADER, model_work_subjects, work_consumer_name
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.jobs import JobRecord, JobState, Priority
from asyncinfer.nats import KeyValue
from asyncinfer.nats.streams import next_headers
from asyncinfer.v1 import (
    job_pb2,
    job_service_pb2,
    ops_service_pb2,
    ops_service_pb2_grpc,
    tensor_pb2,
    worker_service_pb2,
)
from services.scheduler.app import SchedulerApp
from services.scheduler.deadline_sweep import EXPIRE_CONCURRENCY
from tests.stack import Stack, StartStack
from tests.webhook_receiver import Receiver, receiver, webhook_config

__all__ = ["receiver"]  # the fixture, used by name

WAIT_S = 20.0  # a guard: the deadlines are 1.5 s away, the sweep runs every 0.2 s
QUEUE_TTL_S = 1.5


def sweeping(config: Config) -> Config:
    return webhook_config(config).replace(
        models=[DEMO_MODEL], scheduler={"queue_stats_interval_s": 0.1, "deadline_sweep_interval_s": 0.2}
    )


def demo_request(*, url: str, queue_ttl_s: float | None) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([1, 2, 3, 4])
    request = job_service_pb2.SubmitJobRequest(model_name=DEMO_MODEL.name, inputs=[x])
    if url:
        request.callback.CopyFrom(job_pb2.Callback(url=url))
    if queue_ttl_s is not None:
        request.queue_ttl.FromNanoseconds(int(queue_ttl_s * 1e9))
    return request


async def expired_records(jobs_kv: KeyValue, job_ids: set[str]) -> dict[str, JobRecord]:
    """The records of `job_ids` once the bucket holds each one EXPIRED, from a watch of the bucket
    (the gateway reads nothing)."""
    expired: dict[str, JobRecord] = {}
    watcher = await jobs_kv.watch(">")
    try:
        async with asyncio.timeout(WAIT_S):
            async for entry in watcher:
                if entry is None or not entry.value:
                    continue
                record = decode_record(entry.value, revision=entry.revision or 0)
                if record.job_id in job_ids and record.state is JobState.EXPIRED:
                    expired[record.job_id] = record
                    if len(expired) == len(job_ids):
                        return expired
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]
    raise AssertionError(f"the watch ended with {len(expired)} of {len(job_ids)} expired")


async def depth_until(ops: ops_service_pb2_grpc.OpsServiceStub, depth: int) -> None:
    """GetQueueStats until the model's depth is `depth` (its snapshots come every 0.1 s)."""
    request = ops_service_pb2.GetQueueStatsRequest(model_name=DEMO_MODEL.name)
    give_up_at = time.monotonic() + WAIT_S
    while True:
        (model,) = (await ops.GetQueueStats(request)).models
        if sum(queue.depth for queue in model.priorities) == depth:
            return
        assert time.monotonic() < give_up_at, f"depth not {depth}: {model}"
        await asyncio.sleep(0.05)


async def paused_stack(config: Config, start_stack: StartStack) -> tuple[Stack, grpc.aio.Channel]:
    stack = await start_stack(sweeping(config), batcher=False)
    channel = grpc.aio.insecure_channel(stack.ops_address)
    ops = ops_service_pb2_grpc.OpsServiceStub(channel)
    assert (await ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=DEMO_MODEL.name))).paused
    return stack, channel


@pytest.mark.timeout(120)
async def test_a_paused_queues_jobs_expire_at_their_deadline_with_nobody_reading_them(
    config: Config, start_stack: StartStack, receiver: Receiver
) -> None:
    """Three jobs with a 1.5-s queue_ttl and one without, in a paused queue. Before the sweep the
    three stayed QUEUED (no record in the bucket at all) until the queue's resume or a read: their
    callbacks heard nothing, and their messages counted in the depth and the tenant's quota."""
    stack, channel = await paused_stack(config, start_stack)
    ops = ops_service_pb2_grpc.OpsServiceStub(channel)
    try:
        url = receiver.url("/expired")
        overdue = {
            (await stack.jobs.SubmitJob(demo_request(url=url, queue_ttl_s=QUEUE_TTL_S))).job.job_id for _ in range(3)
        }
        kept = (await stack.jobs.SubmitJob(demo_request(url=url, queue_ttl_s=None))).job.job_id
        submitted_at = time.time()
        await depth_until(ops, 4)

        jobs_kv = await stack.nc.jetstream().key_value(stack.config.nats.jobs_bucket)
        records = await expired_records(jobs_kv, overdue)
        for record in records.values():
            assert record.error is not None
            assert (record.error.reason, record.attempt) == ("DEADLINE_EXCEEDED", 0)
            assert record.deadline is not None
            assert record.end_time is not None
            assert record.end_time >= record.deadline
        # Their messages are gone (each deleted after its record's write: the count is final).
        await depth_until(ops, 1)
        # Still paused, and the job without a deadline still waits (it has no record yet either).
        assert stack.scheduler.deadline_sweep is not None
        assert stack.scheduler.deadline_sweep.swept(DEMO_MODEL.name)
        assert stack.scheduler.deadline_sweep.jobs_expired == 3
        assert time.time() - submitted_at < WAIT_S

        deliveries = await receiver.wait_for("/expired", 3)
        bodies = [json.loads(delivery.body) for delivery in deliveries]
        assert sorted(body["data"]["job_id"] for body in bodies) == sorted(overdue)
        assert {(body["type"], body["data"]["state"], body["data"]["error"]["reason"]) for body in bodies} == {
            ("job.failed", "EXPIRED", "DEADLINE_EXCEEDED")
        }
        got = await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=kept))
        assert got.job.state == job_pb2.JOB_STATE_QUEUED
    finally:
        await channel.close()


@pytest.mark.timeout(120)
async def test_two_schedulers_sweeping_one_paused_queue_expire_each_job_once(
    config: Config, start_stack: StartStack, receiver: Receiver
) -> None:
    """Both schedulers read every message and try every expiry; the record's compare-and-set lets
    one write each (its key has one revision), and one webhook is sent per job."""
    stack, channel = await paused_stack(config, start_stack)
    second = SchedulerApp(sweeping(config))
    await second.start()
    try:
        url = receiver.url("/once")
        overdue = {
            (await stack.jobs.SubmitJob(demo_request(url=url, queue_ttl_s=QUEUE_TTL_S))).job.job_id for _ in range(6)
        }
        sweeps = [stack.scheduler.deadline_sweep, second.deadline_sweep]
        assert sweeps[0] is not None
        assert sweeps[1] is not None

        jobs_kv = await stack.nc.jetstream().key_value(stack.config.nats.jobs_bucket)
        records = await expired_records(jobs_kv, overdue)
        for record in records.values():
            history = await jobs_kv.history(record.key)
            assert [entry.revision for entry in history] == [record.revision], "written more than once"
        deliveries = await receiver.wait_for("/once", 6)
        assert sorted(json.loads(delivery.body)["data"]["job_id"] for delivery in deliveries) == sorted(overdue)
        await depth_until(ops_service_pb2_grpc.OpsServiceStub(channel), 0)
        assert sum(sweep.jobs_expired for sweep in sweeps) == 6
        assert all(sweep.messages_read >= 1 for sweep in sweeps)  # both swept
    finally:
        await channel.close()
        await second.stop(2.0)


@pytest.mark.timeout(120)
async def test_a_paused_queues_job_put_back_on_another_scheduler_is_swept_and_leaves_no_delivery(
    config: Config, start_stack: StartStack
) -> None:
    """With two schedulers a put-back is its putter's alone (the consumer counts it delivered, not
    pending), and each sweep decides its backlog on its own view. Checked here: a paused queue's job
    put back on A (its batcher shed it), A not sweeping at all, is expired at its deadline by B's
    sweep, which reads every message of the model from the stream whoever pulled it; its message is
    deleted, the consumer keeps no delivery of it, and A forgets it (its depth, GetQueueStats)."""
    a_config = sweeping(config).replace(scheduler={"deadline_sweep_interval_s": 0.0})  # A never sweeps
    stack = await start_stack(sweeping(config), batcher=False, scheduler_config=a_config)
    b = SchedulerApp(sweeping(config))
    await b.start()
    channel = grpc.aio.insecure_channel(stack.ops_address)
    ops = ops_service_pb2_grpc.OpsServiceStub(channel)
    on_a = FakeBatcher(stack.scheduler.port, "on-a")
    await on_a.connect()
    try:
        await on_a.grant(1)
        submitted = await stack.jobs.SubmitJob(demo_request(url="", queue_ttl_s=3.0))
        job_id = submitted.job.job_id
        order = await on_a.next_order()
        assert order.job_id == job_id
        shed = worker_service_pb2.WorkResult(job_id=job_id, attempt=order.attempt, dropped=True)
        await on_a._call.write(worker_service_pb2.ConnectRequest(result=shed))  # no credit back
        assert (await ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=DEMO_MODEL.name))).paused
        assert stack.scheduler.deadline_sweep is None
        assert b.deadline_sweep is not None
        jobs_kv = await stack.nc.jetstream().key_value(stack.config.nats.jobs_bucket)
        (record,) = (await expired_records(jobs_kv, {job_id})).values()
        assert (record.attempt, record.given_back_attempts) == (1, 1)  # put back on A, then swept by B
        sweep = b.deadline_sweep

        async def counted_by_b() -> bool:  # its count follows its write, which the record shows first
            return sweep.jobs_expired == 1

        await until(counted_by_b)
        await depth_until(ops, 0)
        consumer = work_consumer_name(DEMO_MODEL.name, Priority.NORMAL)
        info = await stack.nc.jetstream().consumer_info(stack.config.nats.work_stream, consumer)
        assert (info.num_pending, info.num_ack_pending) == (0, 0)
    finally:
        await on_a.close()
        await channel.close()
        await b.stop(2.0)


async def test_a_work_message_carries_its_jobs_deadline_in_a_header(config: Config, start_stack: StartStack) -> None:
    """The header the sweep reads: the deadline as the record has it; none without one."""
    stack, channel = await paused_stack(config, start_stack)
    try:
        with_ttl = (await stack.jobs.SubmitJob(demo_request(url="", queue_ttl_s=30.0))).job
        without = (await stack.jobs.SubmitJob(demo_request(url="", queue_ttl_s=None))).job
        stream = stack.config.nats.work_stream
        first = await next_headers(stack.nc, stream, model_work_subjects(DEMO_MODEL.name), from_seq=1, timeout_s=5.0)
        assert first is not None
        seq, headers = first
        # The proto's Timestamp has the deadline to the nanosecond: the header's float within one.
        assert abs(float(headers[DEADLINE_HEADER]) - with_ttl.deadline.ToNanoseconds() / 1e9) < 1e-6
        second = await next_headers(
            stack.nc, stream, model_work_subjects(DEMO_MODEL.name), from_seq=seq + 1, timeout_s=5.0
        )
        assert second is not None
        assert DEADLINE_HEADER not in second[1]
        assert without.job_id in second[1].values()  # the routing headers are read too
    finally:
        await channel.close()


@pytest.mark.timeout(120)
async def test_a_sweep_cut_off_from_nats_stops_at_its_first_failure_and_expires_the_rest_once_back(
    nats_server: NatsServerProcess, config: Config, start_stack: StartStack
) -> None:
    """nats-server killed (kill -9) as the sweep expires 40 overdue jobs, then started again on its
    port and store. The sweep went on with every job left, each waiting out its 5-s request
    timeout (16 at a time: 15 s for 40, 5 minutes for EXPIRE_MOST) and logging a line of its own.
    Now the expiries in flight fail, the rest are not tried, all wait for the next sweep, and the
    sweep raises the failure once (its loop says it once per interval); back, every job expires."""
    stack = await start_stack(
        sweeping(config).replace(scheduler={"deadline_sweep_interval_s": 3600.0}), batcher=False
    )  # the sweep is the test's to run
    channel = grpc.aio.insecure_channel(stack.ops_address)
    try:
        ops = ops_service_pb2_grpc.OpsServiceStub(channel)
        assert (await ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name=DEMO_MODEL.name))).paused
        overdue = {(await stack.jobs.SubmitJob(demo_request(url="", queue_ttl_s=0.5))).job.job_id for _ in range(40)}
        await depth_until(ops, 40)
        sweep = stack.scheduler.deadline_sweep
        assert sweep is not None
        started_after_kill: list[int] = []
        expire, dropped = sweep._expire, sweep._on_message_dropped

        async def counted_expire(model_name: str, seq: int) -> None:
            if nats_server.process is not None and nats_server.process.poll() is not None:
                started_after_kill.append(seq)
            await expire(model_name, seq)

        def kill_at_first_drop(model_name: str, job_id: str) -> None:
            nats_server.kill()
            dropped(model_name, job_id)

        sweep._expire = counted_expire  # type: ignore[method-assign]
        sweep._on_message_dropped = kill_at_first_drop
        await asyncio.sleep(0.6)  # every job's 0.5-s queue_ttl passed
        raised: BaseException | None = None
        with capture_logs() as logs:
            try:
                await sweep.sweep()
            except (*NATS_FAILURES, Unavailable) as exc:  # whichever came first
                raised = exc
        assert len(started_after_kill) <= EXPIRE_CONCURRENCY, f"{len(started_after_kill)} tried after the kill"
        said = [line for line in logs if line["event"].startswith("deadline_sweep")]
        assert said == [], said  # the sweep's loop says it, once an interval
        assert raised is not None

        sweep._on_message_dropped = dropped
        nats_server.start()  # same port, same store
        async with asyncio.timeout(WAIT_S):
            while True:
                try:
                    await sweep.sweep()
                except (*NATS_FAILURES, Unavailable):  # JetStream answers 503 for a moment after its start
                    await asyncio.sleep(0.1)
                    continue
                if not sweep._scans[DEMO_MODEL.name].deadlines:
                    break
        jobs_kv = await stack.nc.jetstream().key_value(stack.config.nats.jobs_bucket)
        assert set(await expired_records(jobs_kv, overdue)) == overdue
        await depth_until(ops, 0)
    finally:
        await channel.close()
