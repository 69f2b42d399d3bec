"""The gateway against a real nats-server and a real gRPC channel. No scheduler runs: the tests move
jobs along by compare-and-set on the KV record, as the scheduler would."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from asyncinfer.codecs.envelope import decode_envelope
from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.config import Config
from asyncinfer.contract import JOB_ID_HEADER, MODEL_HEADER, PRIORITY_HEADER, TENANT_HEADER
from asyncinfer.declarations import ensure_jobs_bucket
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.ids import is_job_id, new_job_id
from asyncinfer.jobs import BatchInfo, JobRecord, JobState, job_key
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext, KeyValue
from asyncinfer.queued_notice import announce_queued, decode_queued_notice
from asyncinfer.tensor_codec import decode_tensors
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.gateway import watch_hub, watch_many
from services.gateway.app import GatewayApp
from services.gateway.recent_records import FeedState
from tests.kv_helpers import job_record, kv_keys
from tests.nats_probes import StreamUnavailable

# Also run with the NATS adapter's fast path off (make pytest-nats-fallback).
pytestmark = pytest.mark.nats_fallback

if TYPE_CHECKING:
    # The generated .pyi types the stub's aio flavour separately; at run time it is the one stub class.
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub

WORK = "WORK"
TENANT = "default"


def fp32_input(rows: int = 1, *, name: str = "x", values: list[float] | None = None) -> tensor_pb2.InferInputTensor:
    tensor = tensor_pb2.InferInputTensor(name=name, datatype="FP32", shape=[rows, 4])
    tensor.contents.fp32_contents.extend(values if values is not None else [float(i) for i in range(rows * 4)])
    return tensor


def submit_request(**fields: Any) -> job_service_pb2.SubmitJobRequest:
    fields.setdefault("model_name", "demo")
    fields.setdefault("inputs", [fp32_input()])
    return job_service_pb2.SubmitJobRequest(**fields)


def job_stub(channel: grpc.aio.Channel) -> JobStub:
    return job_service_pb2_grpc.JobServiceStub(channel)


async def next_job(call: Any) -> job_pb2.Job:
    """The job of a watch's next message (failing if the stream ended)."""
    response = await call.read()
    assert isinstance(response, job_service_pb2.WatchJobResponse), response
    return response.job


async def start_gateway(config: Config) -> GatewayApp:
    app = GatewayApp(config)
    await app.start()
    return app


WEBHOOK_SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # base64 of 24 bytes


@pytest.fixture
def config(config: Config) -> Config:
    """The shared config, plus a webhook secret for the default tenant and loopback callbacks allowed."""
    return config.replace(
        webhooks={"secrets": [{"tenant": TENANT, "secret": WEBHOOK_SECRET}], "allowed_networks": ["127.0.0.0/8"]}
    )


@pytest.fixture
async def gateway(config: Config) -> AsyncIterator[GatewayApp]:
    app = await start_gateway(config)
    try:
        yield app
    finally:
        await app.stop(grace_s=1)


@pytest.fixture
async def channel(gateway: GatewayApp) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield channel


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> JobStub:
    return job_stub(channel)


@pytest.fixture
def js(nc: NatsClient) -> JetStreamContext:
    return nc.jetstream()


@pytest.fixture
async def kv(js: JetStreamContext, gateway: GatewayApp, config: Config) -> KeyValue:
    return await js.key_value(config.nats.jobs_bucket)


async def read_record(js: JetStreamContext, job_id: str) -> JobRecord:
    record = await job_record(js, job_key(TENANT, job_id))
    assert record is not None
    return record


async def advance(js: JetStreamContext, kv: KeyValue, job_id: str, **changes: Any) -> JobRecord:
    """What the scheduler does: read, change, compare-and-set on the revision read."""
    current = await read_record(js, job_id)
    changed = current.evolve(update_time=time.time(), **changes)
    revision = await kv.update(changed.key, encode_record(changed), last=current.revision)
    return changed.evolve(revision=revision)


async def work_messages(js: JetStreamContext) -> int:
    return (await js.stream_info(WORK)).state.messages


async def test_submit_queues_the_job_at_once(stub: JobStub, js: JetStreamContext, kv: KeyValue) -> None:
    sent = fp32_input(2)
    response = await stub.SubmitJob(submit_request(inputs=[sent], labels={"team": "ml"}))
    job = response.job
    assert is_job_id(job.job_id)
    assert job.state == job_pb2.JOB_STATE_QUEUED
    assert job.priority == job_pb2.PRIORITY_NORMAL
    # No version asked: the model's default is chosen at dispatch (docs/MODEL_VERSIONS.md), not here.
    assert (job.model_name, job.model_version, job.attempt, job.max_attempts) == ("demo", "", 0, 3)
    assert job.revision == 0  # its record is its work message: nothing is in the jobs bucket yet
    assert job.labels["team"] == "ml"
    assert job.execution_timeout.seconds == 60
    assert not job.HasField("end_time")
    assert not job.HasField("expire_time")

    record = await read_record(js, job.job_id)
    assert record.state is JobState.QUEUED
    assert record.revision == job.revision
    assert record.attempt == 0
    assert record.tenant == TENANT

    assert await work_messages(js) == 1
    assert await kv_keys(js, "jobs") == []  # one durable write per submit
    message = await js.get_last_msg(WORK, f"asyncinfer.work.demo.normal.{TENANT}.{job.job_id}")
    assert message.headers is not None
    assert message.headers["Nats-Msg-Id"] == job.job_id
    # The routing facts travel in headers, so that nothing parses the payload to route the job.
    assert message.headers[TENANT_HEADER] == TENANT
    assert message.headers[JOB_ID_HEADER] == job.job_id
    assert message.headers[PRIORITY_HEADER] == "NORMAL"
    assert message.headers[MODEL_HEADER] == "demo"
    assert message.data is not None
    envelope = decode_envelope(message.data)
    assert envelope.job_id == job.job_id
    assert list(envelope.inputs) == decode_tensors([sent])

    high = await stub.SubmitJob(submit_request(priority=job_pb2.PRIORITY_HIGH))
    assert high.job.priority == job_pb2.PRIORITY_HIGH
    message = await js.get_last_msg(WORK, "asyncinfer.work.demo.high.>")
    assert message.headers is not None
    assert message.headers["Nats-Msg-Id"] == high.job.job_id
    assert message.headers[PRIORITY_HEADER] == "HIGH"
    assert await work_messages(js) == 2


async def test_submit_announces_the_queued_record_once_it_is_written(
    js: JetStreamContext, stub: JobStub, nc: NatsClient, kv: KeyValue
) -> None:
    notices: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

    async def heard(msg: Any) -> None:
        notices.put_nowait((msg.subject, msg.data))

    await nc.subscribe("asyncinfer.queued.>", cb=heard)
    await nc.flush()
    job = (await stub.SubmitJob(submit_request(priority=job_pb2.PRIORITY_HIGH))).job
    subject, payload = await asyncio.wait_for(notices.get(), 5.0)
    assert subject == "asyncinfer.queued.demo.high"
    key, revision, data = decode_queued_notice(payload)
    assert key == job_key(TENANT, job.job_id)
    assert revision == job.revision == 0  # the record is the work message
    assert decode_record(data, revision) == await read_record(js, job.job_id)
    assert decode_record(data, revision).state is JobState.QUEUED


async def test_submit_options_reach_the_record(js: JetStreamContext, stub: JobStub, kv: KeyValue) -> None:
    before = time.time()
    request = submit_request(max_attempts=5)
    request.queue_ttl.FromSeconds(30)
    request.execution_timeout.FromSeconds(7)
    request.result_retention.FromSeconds(3600)
    request.callback.url = "http://127.0.0.1:9/hook"
    request.callback.events.append(job_pb2.CALLBACK_EVENT_COMPLETED)
    job = (await stub.SubmitJob(request)).job
    record = await read_record(js, job.job_id)
    assert record.deadline is not None
    assert before + 30 <= record.deadline <= time.time() + 30
    assert (record.execution_timeout_s, record.result_retention_s, record.max_attempts) == (7, 3600, 5)
    assert record.callback is not None
    assert record.callback.events == ("COMPLETED",)
    assert job.callback.events == [job_pb2.CALLBACK_EVENT_COMPLETED]
    assert job.deadline.ToNanoseconds() / 1e9 == pytest.approx(record.deadline, abs=1e-6)


async def test_get_job_returns_the_record_then_the_outputs(js: JetStreamContext, stub: JobStub, kv: KeyValue) -> None:
    job = (await stub.SubmitJob(submit_request())).job
    got = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id))).job
    assert got == job

    now = time.time()
    outputs = (Tensor.from_numpy("y", np.array([[0.5, 1.5, 2.5, 3.5]], np.float32)),)
    await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1, start_time=now, queue_duration_s=0.25)
    done = await advance(
        js,
        kv,
        job.job_id,
        state=JobState.SUCCEEDED,
        end_time=now + 1,
        run_duration_s=1.0,
        outputs=outputs,
        batch=BatchInfo(batcher_id="b1", batch_size=3, compute_s=0.125),
    )
    got = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id))).job
    assert got.state == job_pb2.JOB_STATE_SUCCEEDED
    assert got.revision == done.revision
    assert got.attempt == 1
    (output,) = got.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("y", "FP32", [1, 4])
    assert list(output.contents.fp32_contents) == [0.5, 1.5, 2.5, 3.5]
    assert not output.raw_contents
    assert got.batch.batch_size == 3
    assert got.batch.compute_duration.ToMilliseconds() == 125
    assert got.queue_duration.ToMilliseconds() == 250
    assert got.expire_time.ToSeconds() == int(now + 1 + done.result_retention_s)


async def test_watch_streams_every_change_until_terminal(
    js: JetStreamContext, stub: JobStub, kv: KeyValue, gateway: GatewayApp
) -> None:
    job = (await stub.SubmitJob(submit_request())).job
    call = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
    first = await next_job(call)
    assert first.state == job_pb2.JOB_STATE_QUEUED
    assert first.revision == job.revision

    running = await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1, start_time=time.time())
    second = await next_job(call)
    assert second.state == job_pb2.JOB_STATE_RUNNING
    assert second.revision == running.revision

    succeeded = await advance(js, kv, job.job_id, state=JobState.SUCCEEDED, end_time=time.time())
    third = await next_job(call)
    assert third.state == job_pb2.JOB_STATE_SUCCEEDED
    assert third.revision == succeeded.revision
    assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs
    assert await call.code() == grpc.StatusCode.OK

    # Resuming after what was seen sends only what came later, then ends on the terminal state.
    resumed = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id, after_revision=running.revision))
    states = [response.job.state async for response in resumed]
    assert states == [job_pb2.JOB_STATE_SUCCEEDED]
    caught_up = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id, after_revision=succeeded.revision))
    assert [response async for response in caught_up] == []
    assert gateway.watch_hub.watcher_count == 0


async def test_watch_resumes_mid_flight_and_skips_what_was_seen(
    js: JetStreamContext, stub: JobStub, kv: KeyValue
) -> None:
    job = (await stub.SubmitJob(submit_request())).job
    running = await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
    call = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id, after_revision=running.revision))
    # Nothing is newer than after_revision yet: the next message must be the next change.
    await advance(js, kv, job.job_id, state=JobState.FAILED, end_time=time.time())
    responses = [response async for response in call]
    assert [r.job.state for r in responses] == [job_pb2.JOB_STATE_FAILED]

    ahead = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id, after_revision=10**9))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ahead.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [field for field, _ in violations_of(info.value)[1]] == ["after_revision"]


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_cancelled_watch_frees_its_queue(stub: JobStub, gateway: GatewayApp) -> None:
    job = (await stub.SubmitJob(submit_request())).job
    calls = [stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id)) for _ in range(3)]
    for call in calls:
        assert (await next_job(call)).state == job_pb2.JOB_STATE_QUEUED
    assert gateway.watch_hub.watcher_count == 3
    assert gateway.registry.get_sample_value("asyncinfer_watchers") == 3
    for call in calls:
        call.cancel()
    await wait_for(lambda: gateway.watch_hub.watcher_count == 0)


async def test_the_watch_feed_runs_only_while_someone_watches_or_polls(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, gateway: GatewayApp, config: Config
) -> None:
    hub = gateway.watch_hub
    assert hub._idle_stop_s == config.gateway.watch_feed_idle_s == 10.0
    hub._idle_stop_s = 0.05  # instead of gateway.watch_feed_idle_s's 10 s
    stream = f"KV_{config.nats.jobs_bucket}"

    async def consumer_deleted() -> None:  # deleted, not left to time out
        deadline = time.monotonic() + 5
        while (await js.stream_info(stream)).state.consumer_count:
            assert time.monotonic() < deadline, "the feed's consumer was not deleted"
            await asyncio.sleep(0.01)

    job = (await stub.SubmitJob(submit_request())).job
    assert not hub.feeding  # nobody watches or polls: record writes are not read at all
    assert (await js.stream_info(stream)).state.consumer_count == 0
    await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id))
    await wait_for(lambda: hub.feeding)  # a poll starts it: the next jobs' polls need no read
    await wait_for(lambda: not hub.feeding)  # and it stops once nobody polls or watches
    await consumer_deleted()

    call = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
    assert (await next_job(call)).state == job_pb2.JOB_STATE_QUEUED
    assert hub.feeding
    call.cancel()
    await wait_for(lambda: not hub.feeding)
    await consumer_deleted()

    # A change made while the feed is off is read by the next watch; later ones come by the feed.
    running = await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
    resumed = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id, after_revision=job.revision))
    assert (await next_job(resumed)).revision == running.revision
    succeeded = await advance(js, kv, job.job_id, state=JobState.SUCCEEDED, end_time=time.time())
    last = await next_job(resumed)
    assert (last.state, last.revision) == (job_pb2.JOB_STATE_SUCCEEDED, succeeded.revision)


def counting_reads(hub: Any) -> list[str]:
    """The keys the hub reads from the bucket from now on."""
    store: Any = hub._records
    real_get = store.get
    reads: list[str] = []

    async def counting_get(key: str) -> JobRecord | None:
        reads.append(key)
        return await real_get(key)

    store.get = counting_get
    return reads


async def feeding_and_counting_reads(stub: JobStub, hub: Any) -> tuple[Any, list[str]]:
    """A watch that keeps the hub's feed running, and the keys the hub reads from the bucket from now on."""
    other = (await stub.SubmitJob(submit_request())).job
    keep_feeding = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=other.job_id))
    assert (await next_job(keep_feeding)).state == job_pb2.JOB_STATE_QUEUED
    return keep_feeding, counting_reads(hub)


async def test_a_watch_right_after_its_submit_starts_without_a_read(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, gateway: GatewayApp
) -> None:
    """While the feed runs, a job this gateway just queued is watched from the record it kept
    (services.gateway.recent_records): the client's round trip, SubmitJob then WatchJob, makes no
    read, also when the job started RUNNING before its watch came (the feed's change is kept for
    it), or ended SUCCEEDED. A job that ended FAILED, unwatched, is read as before: an operator's
    Replay may queue it again."""
    hub = gateway.watch_hub
    keep_feeding, reads = await feeding_and_counting_reads(stub, hub)
    job = (await stub.SubmitJob(submit_request())).job
    watch = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id, after_revision=job.revision))
    first = await next_job(watch)
    assert (first.state, first.revision) == (job_pb2.JOB_STATE_QUEUED, 0)
    assert first == job
    assert reads == []
    running = await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
    assert (await next_job(watch)).revision == running.revision
    watch.cancel()
    # Unwatched, it fails: the next watch reads it.
    failed = await advance(js, kv, job.job_id, state=JobState.FAILED, end_time=time.time())
    await wait_for(lambda: hub.recent.latest(job_key(TENANT, job.job_id)) is None)
    again = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
    assert (await next_job(again)).revision == failed.revision
    assert reads == [job_key(TENANT, job.job_id)]
    again.cancel()
    # Started before its watch came: the watch starts from the RUNNING change, without a read.
    started = (await stub.SubmitJob(submit_request())).job
    running = await advance(js, kv, started.job_id, state=JobState.RUNNING, attempt=1)
    key = job_key(TENANT, started.job_id)
    await wait_for(lambda: (kept := hub.recent.latest(key)) is not None and kept.revision == running.revision)
    late = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=started.job_id, after_revision=started.revision))
    first = await next_job(late)
    assert (first.state, first.revision) == (job_pb2.JOB_STATE_RUNNING, running.revision)
    late.cancel()
    # Ended SUCCEEDED before its watch came: the watch has the final record, without a read.
    succeeded = await advance(js, kv, started.job_id, state=JobState.SUCCEEDED, end_time=time.time())
    await wait_for(lambda: (kept := hub.recent.latest(key)) is not None and kept.revision == succeeded.revision)
    ended = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=started.job_id))
    last = await next_job(ended)
    assert (last.state, last.revision) == (job_pb2.JOB_STATE_SUCCEEDED, succeeded.revision)
    assert reads == [job_key(TENANT, job.job_id)]
    keep_feeding.cancel()


async def test_a_clients_polls_keep_the_feed_running_for_the_jobs_it_queues_next(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, gateway: GatewayApp
) -> None:
    """A client that submits and then polls with GetJob, never watching: its first poll starts the
    feed, so its polls for the jobs it queues after that are answered without reads. The job
    queued before the feed ran is read."""
    hub = gateway.watch_hub
    reads = counting_reads(hub)
    first = (await stub.SubmitJob(submit_request())).job
    assert (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=first.job_id))).job.job_id == first.job_id
    await wait_for(lambda: hub.feeding)
    jobs = [first, *[(await stub.SubmitJob(submit_request())).job for _ in range(3)]]
    for job in jobs:
        await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
        await advance(js, kv, job.job_id, state=JobState.SUCCEEDED, end_time=time.time())
    for job in jobs[1:]:
        await wait_for(lambda job=job: hub.recent.finished(job_key(TENANT, job.job_id)) is not None)
    for job in jobs:
        got = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id))).job
        assert got.state == job_pb2.JOB_STATE_SUCCEEDED
    assert reads == [job_key(TENANT, first.job_id)] * 2  # its first poll, and its last


async def test_a_stopped_feed_resumes_with_the_changes_it_missed(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, gateway: GatewayApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client polls, goes quiet for longer than the feed outlives a poll, queues more jobs that
    end while nobody watches, and polls for them: the feed resumes where it stopped, replaying what
    it missed, so once it caught up those polls are answered without reads. With more changes
    missed than REPLAY_MAX_CHANGES it starts afresh instead, and they are read."""
    hub = gateway.watch_hub
    hub._idle_stop_s = 0.05  # instead of gateway.watch_feed_idle_s's 10 s
    reads = counting_reads(hub)

    async def quiet_then_jobs_ended_unwatched(count: int) -> list[job_pb2.Job]:
        await wait_for(lambda: not hub.feeding)
        jobs = [(await stub.SubmitJob(submit_request())).job for _ in range(count)]
        for job in jobs:
            await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
            await advance(js, kv, job.job_id, state=JobState.SUCCEEDED, end_time=time.time())
        return jobs

    async def poll(job: job_pb2.Job) -> None:
        got = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id))).job
        assert got.state == job_pb2.JOB_STATE_SUCCEEDED

    first = (await stub.SubmitJob(submit_request())).job
    await stub.GetJob(job_service_pb2.GetJobRequest(job_id=first.job_id))  # starts the feed
    await wait_for(lambda: hub.feeding)
    jobs = await quiet_then_jobs_ended_unwatched(3)
    with structlog.testing.capture_logs() as logs:
        await poll(jobs[0])  # the feed is off: read; and it resumes
        await wait_for(lambda: hub.recent.state is FeedState.LIVE)
    # At debug: a client polling again after gateway.watch_feed_idle_s wrote an info line each time
    # (5 in a first-hour pass's two minutes), a detail of the feed's, not an event of the service.
    resumed = [entry for entry in logs if entry["event"] == "watch_feed_resumed"]
    assert [entry["log_level"] for entry in resumed] == ["debug"], resumed
    for job in jobs[1:]:
        await poll(job)
    assert reads == [job_key(TENANT, job.job_id) for job in (first, jobs[0])]

    monkeypatch.setattr(watch_hub, "REPLAY_MAX_CHANGES", 3)
    more = await quiet_then_jobs_ended_unwatched(2)  # 4 changes missed
    await poll(more[0])
    await wait_for(lambda: hub.feeding)
    await poll(more[1])
    assert reads[2:] == [job_key(TENANT, job.job_id) for job in more]


async def test_a_label_watch_that_comes_while_the_idle_feed_stops_hears_every_change(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, gateway: GatewayApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The idle stopper checked under the feed's lock that nobody watched, then unsubscribed from
    the queued notices (an await) before it let go of the records' subscription; ensure_feed's
    first look, without the lock, still saw that subscription and returned. A label watch that came
    in between listened with the feed stopped: it heard its jobs' QUEUED (the notices, subscribed
    anew) and never a change after it. Here the notices' unsubscribe is held until the second watch
    has made that first look."""
    hub = gateway.watch_hub
    hub._idle_stop_s = 0.05  # instead of gateway.watch_feed_idle_s's 10 s
    request = job_service_pb2.WatchJobsRequest(labels={"run": "idle-stop"})
    first = stub.WatchJobs(request)
    await asyncio.wait_for(first.initial_metadata(), 30)  # a hang guard; listening: feed and notices run
    assert hub.feeding
    assert hub.hears_notices
    notices: Any = hub._notices
    unsubscribe = notices.unsubscribe
    stopping, release = asyncio.Event(), asyncio.Event()

    async def held_unsubscribe(limit: int = 0) -> None:
        stopping.set()
        await release.wait()
        await unsubscribe(limit)

    monkeypatch.setattr(notices, "unsubscribe", held_unsubscribe)
    first.cancel()
    await asyncio.wait_for(stopping.wait(), 30)  # the stopper found nobody watching and stops the feed
    ensure_feed = hub.ensure_feed
    looked = asyncio.Event()

    async def noted_ensure_feed() -> None:
        looked.set()  # its first look follows at once, before this task runs again
        await ensure_feed()

    monkeypatch.setattr(hub, "ensure_feed", noted_ensure_feed)
    second = stub.WatchJobs(request)
    await asyncio.wait_for(looked.wait(), 30)
    release.set()
    await asyncio.wait_for(second.initial_metadata(), 30)
    assert hub.feeding, "a label watch listens: the feed runs"
    job = (await stub.SubmitJob(submit_request(labels={"run": "idle-stop"}))).job
    queued = await asyncio.wait_for(second.read(), 30)
    assert isinstance(queued, job_service_pb2.WatchJobsResponse)
    assert [(c.job_id, c.job.state) for c in queued.changes] == [(job.job_id, job_pb2.JOB_STATE_QUEUED)]
    running = await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
    changed = await asyncio.wait_for(second.read(), 30)
    assert isinstance(changed, job_service_pb2.WatchJobsResponse)
    assert [(c.job.state, c.job.revision) for c in changed.changes] == [(job_pb2.JOB_STATE_RUNNING, running.revision)]
    second.cancel()


async def test_a_label_watch_keeps_a_change_its_jobs_late_queued_notice_comes_after(
    stub: JobStub,
    kv: KeyValue,
    js: JetStreamContext,
    nc: NatsClient,
    gateway: GatewayApp,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job's QUEUED comes to a label watch as the gateway's queued notice, sent once the work
    message's publish is acknowledged; its later changes come on the records' feed. A scheduler
    holding a pull open has the job as the stream stores it, so on a loaded gateway the notice can
    come after the batcher's RUNNING and SUCCEEDED. The watch's queue keeps one update per job, and
    the late notice took the place of the SUCCEEDED waiting there: the watch, which had sent the
    job's QUEUED, dropped it as no newer, and never sent the job's end. Here the watch's generator
    waits at its first change while the job ends, then the notice comes (sent again, late), then
    another job's, which says the first has been heard."""
    hub = gateway.watch_hub
    labels = {"run": "late-notice"}
    listens = asyncio.Event()

    async def listening() -> None:
        listens.set()

    watch = watch_many.watch_labels(hub, TENANT, labels, listening)
    try:
        first = asyncio.ensure_future(anext(watch))
        await asyncio.wait_for(listens.wait(), 30)  # a hang guard
        job = (await stub.SubmitJob(submit_request(labels=labels))).job
        (queued,) = await asyncio.wait_for(first, 30)
        assert queued.record is not None
        assert (queued.job_id, queued.record.state) == (job.job_id, JobState.QUEUED)
        await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
        succeeded = await advance(js, kv, job.job_id, state=JobState.SUCCEEDED, end_time=time.time())
        key = job_key(TENANT, job.job_id)
        # The feed brought it (to the watch's queue too: the same callback, before this one).
        await wait_for(lambda: (kept := hub.recent.finished(key)) is not None and kept.revision == succeeded.revision)
        other = queued.record.evolve(job_id=new_job_id())
        heard = asyncio.Event()
        to_selectors = hub._to_selectors

        def noted(update: Any, key: str) -> None:
            to_selectors(update, key)
            if key == other.key:
                heard.set()

        monkeypatch.setattr(hub, "_to_selectors", noted)
        await announce_queued(nc, [queued.record, other])
        await asyncio.wait_for(heard.wait(), 30)  # both notices heard, the watch still waiting at its yield
        changes = await asyncio.wait_for(anext(watch), 30)
        assert [(c.job_id, c.record and c.record.state) for c in changes] == [
            (job.job_id, JobState.SUCCEEDED),
            (other.job_id, JobState.QUEUED),
        ]
    finally:
        await watch.aclose()


async def test_a_label_watch_never_sends_a_jobs_queued_after_its_end(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, nc: NatsClient
) -> None:
    """A raw WatchJobs client with a label selector: the job's queued notice comes again after
    the watch sent the job's SUCCEEDED (a notice late behind the feed, as a loaded gateway sends
    it). watch_labels forgot a job's revision once it sent its end, so it sent the late QUEUED
    after the SUCCEEDED. Another job's notice, sent behind it on the same connection, says the
    late one was heard: the next message is that job's QUEUED alone."""
    labels = {"run": "late-queued-after-end"}
    notices: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

    async def heard(msg: Any) -> None:
        notices.put_nowait((msg.subject, msg.data))

    await nc.subscribe("asyncinfer.queued.>", cb=heard)
    await nc.flush()
    call = stub.WatchJobs(job_service_pb2.WatchJobsRequest(labels=labels))
    await asyncio.wait_for(call.initial_metadata(), 30)  # a hang guard; listening: feed and notices run

    async def next_changes() -> list[tuple[str, int]]:
        response = await asyncio.wait_for(call.read(), 30)
        assert isinstance(response, job_service_pb2.WatchJobsResponse), response
        return [(c.job_id, c.job.state) for c in response.changes]

    job = (await stub.SubmitJob(submit_request(labels=labels))).job
    subject, notice = await asyncio.wait_for(notices.get(), 30)
    assert await next_changes() == [(job.job_id, job_pb2.JOB_STATE_QUEUED)]
    await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
    assert await next_changes() == [(job.job_id, job_pb2.JOB_STATE_RUNNING)]
    await advance(js, kv, job.job_id, state=JobState.SUCCEEDED, end_time=time.time())
    assert await next_changes() == [(job.job_id, job_pb2.JOB_STATE_SUCCEEDED)]
    _, revision, data = decode_queued_notice(notice)
    other = decode_record(data, revision).evolve(job_id=new_job_id())
    await nc.publish(subject, notice)  # the job's notice, late
    await announce_queued(nc, [other])
    assert await next_changes() == [(other.job_id, job_pb2.JOB_STATE_QUEUED)]
    call.cancel()


async def test_a_feed_does_not_resume_into_a_bucket_made_anew(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, gateway: GatewayApp, config: Config
) -> None:
    """An operator deleted and made the jobs bucket again while the feed was off: its sequences
    start over, so a resume from where the feed stopped would skip the new bucket's first changes
    (here a job's whole run, queued while the feed was off) and keep it at QUEUED. The feed starts
    afresh instead, and the job is read."""
    hub = gateway.watch_hub
    hub._idle_stop_s = 0.05
    job = (await stub.SubmitJob(submit_request())).job
    # A watch keeps the feed on while the two changes come (a GetJob alone left it idle, and on a
    # loaded machine its 0.05-s idle stop could come before they did).
    held = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
    await asyncio.wait_for(next_job(held), 30)  # a hang guard
    await wait_for(lambda: hub.feeding, timeout_s=30.0)
    await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
    await advance(js, kv, job.job_id, state=JobState.SUCCEEDED, end_time=time.time())
    await wait_for(lambda: hub.recent.resume_from() == 3, timeout_s=30.0)  # the feed brought both changes
    held.cancel()
    await wait_for(lambda: not hub.feeding, timeout_s=30.0)
    await js.delete_stream(f"KV_{config.nats.jobs_bucket}")
    await ensure_jobs_bucket(js, config.nats)
    early = (await stub.SubmitJob(submit_request())).job  # expected by the recent records, feed off
    await advance(js, kv, early.job_id, state=JobState.RUNNING, attempt=1)
    succeeded = await advance(js, kv, early.job_id, state=JobState.SUCCEEDED, end_time=time.time())
    assert succeeded.revision == 2  # the new bucket's sequences, up to where the old feed stopped
    watch = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=early.job_id))
    first = await asyncio.wait_for(next_job(watch), 5)
    assert (first.state, first.revision) == (job_pb2.JOB_STATE_SUCCEEDED, succeeded.revision)
    assert hub.feeding


async def test_a_job_queued_while_the_feed_starts_is_read_not_taken_from_the_feed(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, gateway: GatewayApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The feed's consumer delivers only the changes stored after it was made: a job queued while
    it is being made, that changes before it exists, is not kept (its watch reads it and starts
    from the change), rather than kept at QUEUED with the change never coming."""
    making, made = asyncio.Event(), asyncio.Event()
    subscribe = JetStreamContext.subscribe

    async def slow_subscribe(self: JetStreamContext, *args: Any, **kwargs: Any) -> Any:
        making.set()  # the feed's consumer is being made (the only subscribe of this test)
        await made.wait()
        return await subscribe(self, *args, **kwargs)

    monkeypatch.setattr(JetStreamContext, "subscribe", slow_subscribe)
    other = (await stub.SubmitJob(submit_request())).job
    keep_feeding = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=other.job_id))
    first_of_other = asyncio.create_task(next_job(keep_feeding))  # it starts the feed
    await asyncio.wait_for(making.wait(), 5.0)
    job = (await stub.SubmitJob(submit_request())).job
    running = await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
    made.set()
    assert (await first_of_other).job_id == other.job_id
    watch = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id, after_revision=job.revision))
    first = await next_job(watch)
    assert (first.state, first.revision) == (job_pb2.JOB_STATE_RUNNING, running.revision)
    watch.cancel()
    keep_feeding.cancel()


async def test_a_poll_for_a_finished_job_is_answered_without_a_read(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, gateway: GatewayApp
) -> None:
    """GetJob and GetJobs answer a job this gateway queued that ended SUCCEEDED (or CANCELED,
    EXPIRED) from the feed's record: the unary client's poll for its result makes no read. Its
    outputs come whole; a job still running, or one that FAILED, is read; so is a finished job
    once its record is deleted."""
    hub = gateway.watch_hub
    keep_feeding, reads = await feeding_and_counting_reads(stub, hub)
    done, running_job, failed_job = [(await stub.SubmitJob(submit_request())).job for _ in range(3)]
    outputs = (Tensor.from_numpy("out", np.arange(4, dtype=np.float32)),)
    await advance(js, kv, done.job_id, state=JobState.RUNNING, attempt=1)
    succeeded = await advance(js, kv, done.job_id, state=JobState.SUCCEEDED, end_time=time.time(), outputs=outputs)
    await advance(js, kv, running_job.job_id, state=JobState.RUNNING, attempt=1)
    failed = await advance(js, kv, failed_job.job_id, state=JobState.FAILED, end_time=time.time())
    done_key = job_key(TENANT, done.job_id)
    await wait_for(lambda: (kept := hub.recent.finished(done_key)) is not None and kept.revision == succeeded.revision)
    await wait_for(lambda: hub.recent.latest(job_key(TENANT, failed_job.job_id)) is None)
    got = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=done.job_id))).job
    assert (got.state, got.revision) == (job_pb2.JOB_STATE_SUCCEEDED, succeeded.revision)
    assert decode_tensors(got.outputs, "outputs") == list(outputs)
    assert reads == []
    many = await stub.GetJobs(
        job_service_pb2.GetJobsRequest(job_ids=[done.job_id, running_job.job_id, failed_job.job_id])
    )
    states = [(result.job.job_id, result.job.state) for result in many.results]
    assert states == [
        (done.job_id, job_pb2.JOB_STATE_SUCCEEDED),
        (running_job.job_id, job_pb2.JOB_STATE_RUNNING),
        (failed_job.job_id, job_pb2.JOB_STATE_FAILED),
    ]
    assert many.results[2].job.revision == failed.revision
    assert sorted(reads) == sorted([job_key(TENANT, running_job.job_id), job_key(TENANT, failed_job.job_id)])
    # Deleted: the kept record goes with it, and GetJob reads (and finds nothing).
    await kv.delete(done_key)
    await wait_for(lambda: hub.recent.finished(done_key) is None)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetJob(job_service_pb2.GetJobRequest(job_id=done.job_id))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert reads.count(done_key) == 1
    keep_feeding.cancel()


async def test_a_watch_of_many_jobs_just_queued_starts_without_reads(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, gateway: GatewayApp
) -> None:
    """WatchJobs by IDs starts from the records kept for the jobs this gateway just queued, as
    WatchJob does (a RUNNING change that came first included); the others are read."""
    hub = gateway.watch_hub
    keep_feeding, reads = await feeding_and_counting_reads(stub, hub)
    jobs = [(await stub.SubmitJob(submit_request())).job for _ in range(3)]
    running = await advance(js, kv, jobs[0].job_id, state=JobState.RUNNING, attempt=1)
    key = job_key(TENANT, jobs[0].job_id)
    await wait_for(lambda: (kept := hub.recent.latest(key)) is not None and kept.revision == running.revision)
    ended = await advance(js, kv, jobs[1].job_id, state=JobState.FAILED, end_time=time.time())
    await wait_for(lambda: hub.recent.latest(job_key(TENANT, jobs[1].job_id)) is None)
    call = stub.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=[job.job_id for job in jobs]))
    first = await asyncio.wait_for(call.read(), 5.0)
    assert isinstance(first, job_service_pb2.WatchJobsResponse)
    states = {change.job_id: (change.job.state, change.job.revision) for change in first.changes}
    assert states == {
        jobs[0].job_id: (job_pb2.JOB_STATE_RUNNING, running.revision),
        jobs[1].job_id: (job_pb2.JOB_STATE_FAILED, ended.revision),
        jobs[2].job_id: (job_pb2.JOB_STATE_QUEUED, 0),
    }
    assert reads == [job_key(TENANT, jobs[1].job_id)]  # the failed job's record is not kept
    call.cancel()
    keep_feeding.cancel()


async def test_deleted_record_ends_the_watch_with_not_found(stub: JobStub, kv: KeyValue, gateway: GatewayApp) -> None:
    job = (await stub.SubmitJob(submit_request())).job
    call = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
    assert (await next_job(call)).state == job_pb2.JOB_STATE_QUEUED
    await kv.delete(job_key(TENANT, job.job_id))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert gateway.watch_hub.watcher_count == 0


async def test_stopping_the_gateway_ends_watches_resumably(config: Config) -> None:
    app = await start_gateway(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = job_stub(channel)
            job = (await stub.SubmitJob(submit_request())).job
            call = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
            assert (await next_job(call)).state == job_pb2.JOB_STATE_QUEUED
            # The watch does not hold the grace period: holding it would take 600 s (the hang
            # guard's 60 s say which), and the watch's end below says the hub ended it.
            await asyncio.wait_for(app.stop(grace_s=600), 60)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"after_revision={job.revision}" in (info.value.details() or "")
    finally:
        await app.stop()


def violations_of(error: grpc.aio.AioRpcError) -> tuple[str, list[tuple[str, str]]]:
    status = status_details(error)
    assert status is not None
    details = unpack_details(status)
    bad = details.get("BadRequest")
    pairs = [(v.field, v.description) for v in bad.field_violations] if bad else []
    return details["ErrorInfo"].reason, pairs


BAD_REQUESTS: dict[str, tuple[Callable[[], job_service_pb2.SubmitJobRequest], str]] = {
    "missing input": (lambda: submit_request(inputs=[]), "inputs"),
    "extra input": (lambda: submit_request(inputs=[fp32_input(), fp32_input(name="z")]), "inputs[1].name"),
    "wrong datatype": (
        lambda: submit_request(
            inputs=[tensor_pb2.InferInputTensor(name="x", datatype="INT64", shape=[1, 4], raw_contents=b"\0" * 32)]
        ),
        "inputs[0].datatype",
    ),
    "wrong shape": (
        lambda: submit_request(
            inputs=[tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 3], raw_contents=b"\0" * 12)]
        ),
        "inputs[0].shape",
    ),
    "contents do not match the shape": (
        lambda: submit_request(inputs=[fp32_input(2, values=[1.0] * 4)]),
        "inputs[0].contents",
    ),
    "unknown datatype": (
        lambda: submit_request(inputs=[tensor_pb2.InferInputTensor(name="x", datatype="FLOAT", shape=[1, 4])]),
        "inputs[0].datatype",
    ),
    "deadline and queue_ttl": (
        lambda: submit_request(deadline={"seconds": int(time.time()) + 60}, queue_ttl={"seconds": 60}),
        "queue_ttl",
    ),
    "retention over the limit": (lambda: submit_request(result_retention={"seconds": 365 * 86400}), "result_retention"),
    "too many labels": (lambda: submit_request(labels={f"k{i}": "v" for i in range(17)}), "labels"),
    "label key too long": (lambda: submit_request(labels={"k" * 64: "v"}), "labels["),
    "max_attempts over the model's limit": (lambda: submit_request(max_attempts=11), "max_attempts"),
    "negative max_attempts": (lambda: submit_request(max_attempts=-1), "max_attempts"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_invalid_requests_are_refused_and_nothing_is_queued(
    case: str, stub: JobStub, js: JetStreamContext, config: Config
) -> None:
    build, field = BAD_REQUESTS[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitJob(build())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    reason, violations = violations_of(info.value)
    assert reason == "INVALID_ARGUMENT"
    assert any(f.startswith(field) for f, _ in violations), violations
    assert len(set(violations)) == len(violations), "a violation named twice (a negative max_attempts was)"
    assert await work_messages(js) == 0
    assert await kv_keys(js, config.nats.jobs_bucket) == []  # no record was written either


async def test_contents_violation_says_what_was_expected(stub: JobStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitJob(submit_request(inputs=[fp32_input(values=[1.0] * 8)]))
    # Shape [1, 4] with 8 values: shape matches the signature, contents do not.
    _, violations = violations_of(info.value)
    assert violations == [("inputs[0].contents", violations[0][1])]
    assert "needs 4 FP32 elements" in violations[0][1]


async def test_unknown_model_is_not_found_and_names_the_models(
    stub: JobStub, js: JetStreamContext, gateway: GatewayApp
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitJob(submit_request(model_name="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "demo" in (info.value.details() or "")
    reason, _ = violations_of(info.value)
    assert reason == "MODEL_NOT_FOUND"
    assert await work_messages(js) == 0
    rejected = gateway.registry.get_sample_value(
        "asyncinfer_submit_rejected_total", {"model": "unknown", "code": "NOT_FOUND", "reason": "MODEL_NOT_FOUND"}
    )
    assert rejected == 1


async def test_unknown_input_refs_and_results_are_not_found(stub: JobStub, js: JetStreamContext) -> None:
    # The claim check itself is tested in test_claim_check.py.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitJob(submit_request(inputs=[], input_ref="in/x"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ReadResult(job_service_pb2.ReadResultRequest(job_id="x")).read()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert await work_messages(js) == 0


async def test_request_over_the_size_limit_names_the_limit(config: Config, nc: NatsClient) -> None:
    app = await start_gateway(config.replace(gateway={"max_request_bytes": 1024}))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = job_stub(channel)
            big = submit_request(inputs=[fp32_input(32)], labels={f"note{i}": "x" * 250 for i in range(4)})
            assert big.ByteSize() > 1024
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SubmitJob(big)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "1024 bytes" in (info.value.details() or "")
            reason, violations = violations_of(info.value)
            assert reason == "REQUEST_TOO_LARGE"
            assert violations[0][0] == "inputs"
            assert await work_messages(nc.jetstream()) == 0
            # Within the limit it is accepted.
            assert (await stub.SubmitJob(submit_request())).job.state == job_pb2.JOB_STATE_QUEUED
    finally:
        await app.stop()


async def test_a_request_whose_work_message_nats_would_refuse_is_too_large_not_unavailable(
    config: Config, nc: NatsClient
) -> None:
    """A helper's limits pass, session 24: under gateway.max_request_bytes (4 MiB) but over the NATS
    server's max_payload (1 MB here, NATS's default), the publish was refused and the caller told
    UNAVAILABLE ENQUEUE_FAILED "submit it again", which could never work."""
    (demo,) = config.models
    wide = {
        **demo.model_dump(),
        "name": "wide",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}],
        "max_batch_size": 1,
    }
    app = await start_gateway(config.replace(models=[demo.model_dump(), wide]))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = job_stub(channel)
            x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 300_000])
            x.contents.fp32_contents.extend([0.5] * 300_000)
            big = submit_request(model_name="wide", inputs=[x])
            assert big.ByteSize() < 4 * 1024 * 1024  # under gateway.max_request_bytes
            assert big.ByteSize() * 4 / 3 > 1_048_576  # its tensor as base64: over max_payload
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SubmitJob(big)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_payload of 1048576" in (info.value.details() or "")
            reason, violations = violations_of(info.value)
            assert (reason, violations[0][0]) == ("REQUEST_TOO_LARGE", "inputs")
            # In a SubmitJobs message, that job alone is refused.
            items = [job_service_pb2.SubmitJobsItem(job=j) for j in (submit_request(), big, submit_request())]
            call = stub.SubmitJobs()
            await call.write(job_service_pb2.SubmitJobsRequest(items=items))
            await call.done_writing()
            answers = [a async for response in call for a in response.answers]
            assert [a.HasField("job") for a in answers] == [True, False, True]
            assert answers[1].error.reason == "REQUEST_TOO_LARGE"
            assert await work_messages(nc.jetstream()) == 2
    finally:
        await app.stop()


async def test_get_job_of_an_unknown_id_is_not_found(stub: JobStub) -> None:
    for job_id in ("0190b6b4-3a1e-7cc0-8000-000000000000", "not-an-id", "a.>", ""):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, job_id
        reason, _ = violations_of(info.value)
        assert reason == "JOB_NOT_FOUND"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.WatchJob(job_service_pb2.WatchJobRequest(job_id="0190b6b4-3a1e-7cc0-8000-000000000000")).read()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_jobs_are_tenant_scoped(config: Config, nats_server: Any) -> None:
    app = await start_gateway(config)
    other = await start_gateway(config.replace(gateway={"default_tenant": "other"}))
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as mine,
            grpc.aio.insecure_channel(f"127.0.0.1:{other.port}") as theirs,
        ):
            job = (await job_stub(mine).SubmitJob(submit_request())).job
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await job_stub(theirs).GetJob(job_service_pb2.GetJobRequest(job_id=job.job_id))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await other.stop()
        await app.stop()


async def test_publish_failure_is_unavailable_and_records_nothing(config: Config, js: JetStreamContext) -> None:
    """The work message is published before the record is written: a job that could not be
    queued leaves no record behind (nothing QUEUED that would never run)."""
    app = await start_gateway(config.replace(gateway={"enqueue_retry_s": 0.5}))
    try:
        kv = await js.key_value(config.nats.jobs_bucket)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            await js.delete_stream(WORK)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await job_stub(channel).SubmitJob(submit_request())
            assert time.monotonic() - started >= 0.2  # it was retried within enqueue_retry_s first
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        reason, _ = violations_of(info.value)
        assert reason == "ENQUEUE_FAILED"
        assert (await kv.status()).values == 0
    finally:
        await app.stop()


async def test_publish_is_retried_until_the_stream_answers(
    stub: JobStub, nc: NatsClient, js: JetStreamContext, kv: KeyValue, gateway: GatewayApp, config: Config
) -> None:
    """What a leader election looks like from the gateway: the stream cannot take a publish for a
    moment (503, as JetStream answers without a leader)."""
    stream = await js.stream_info(WORK)
    await js.delete_stream(WORK)
    down = await StreamUnavailable.on(nc, list(stream.config.subjects or []))
    submit = asyncio.ensure_future(stub.SubmitJob(submit_request()))
    await down.wait_for(3)  # the publish was refused, and tried again, twice
    assert not submit.done(), "a refused publish is retried, not answered"
    await down.close()
    await js.add_stream(stream.config)
    job = (await submit).job
    assert job.state == job_pb2.JOB_STATE_QUEUED
    assert (await read_record(js, job.job_id)).state is JobState.QUEUED
    assert await work_messages(js) == 1


async def test_a_submit_whose_caller_left_is_seen_through(
    stub: JobStub, nc: NatsClient, js: JetStreamContext, kv: KeyValue, gateway: GatewayApp, config: Config
) -> None:
    """A caller that gives up mid-publish: the submit is seen through, and its job is queued (its
    work message, which is its record) once the stream answers."""
    stream = await js.stream_info(WORK)
    await js.delete_stream(WORK)
    down = await StreamUnavailable.on(nc, list(stream.config.subjects or []))
    call = stub.SubmitJob(submit_request())
    await down.wait_for(2)  # the publish is being retried
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await down.close()
    await js.add_stream(stream.config)
    await gateway.stop(grace_s=1)  # waits for the orphaned submit to finish
    assert await kv_keys(js, config.nats.jobs_bucket) == []
    message = await js.get_last_msg(WORK, "asyncinfer.work.>")
    assert message.data is not None
    envelope = decode_envelope(message.data)
    assert (await read_record(js, envelope.job_id)).state is JobState.QUEUED
    assert await work_messages(js) == 1


async def test_health_reflection_and_metrics(channel: grpc.aio.Channel, gateway: GatewayApp, stub: Any) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    answer = await health.Check(health_pb2.HealthCheckRequest(service="asyncinfer.v1.JobService"))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING

    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = reflection.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    listed = await call.read()
    await call.done_writing()
    names = {s.name for s in listed.list_services_response.service}
    assert {"asyncinfer.v1.JobService", "grpc.health.v1.Health"} <= names

    await stub.SubmitJob(submit_request(priority=job_pb2.PRIORITY_LOW))
    registry = gateway.registry
    assert registry.get_sample_value("asyncinfer_jobs_submitted_total", {"model": "demo", "priority": "LOW"}) == 1
    assert registry.get_sample_value("asyncinfer_submit_seconds_count") == 1
    assert registry.get_sample_value("asyncinfer_watchers") == 0


async def test_start_failure_cleans_up_and_stop_is_safe(config: Config) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        app = GatewayApp(config.replace(gateway={"port": taken.getsockname()[1]}))
        with pytest.raises((OSError, RuntimeError)):
            await app.start()
    await app.stop()  # already stopped by the failed start: a no-op
    assert app.port == 0
