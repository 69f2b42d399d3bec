"""SubmitJob's wait (services/gateway/submit_wait.py): the answer held until the job ends, against a
real nats-server and a real gateway. No scheduler runs: the tests move jobs along by
compare-and-set on the KV record, as the scheduler would, so each step of the wait is seen."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from google.protobuf import duration_pb2

from asyncinfer.config import Config
from asyncinfer.contract import QUEUED_SUBJECT_PREFIX
from asyncinfer.jobs import JobState, job_key
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext, KeyValue
from asyncinfer.queued_notice import decode_queued_notice
from asyncinfer.v1 import job_pb2, job_service_pb2
from services.gateway.app import GatewayApp
from services.gateway.submit_wait import ANSWER_MARGIN_S, wait_budget_s
from tests.test_gateway import (
    advance,
    counting_reads,
    job_stub,
    next_job,
    start_gateway,
    submit_request,
    violations_of,
    wait_for,
    work_messages,
)
from tests.test_gateway import channel as channel_fixture
from tests.test_gateway import gateway as gateway_fixture
from tests.test_gateway import js as js_fixture
from tests.test_gateway import kv as kv_fixture
from tests.test_gateway import stub as stub_fixture

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub

TENANT = "default"
# The gateway tests' fixtures (a gateway alone on the test's NATS, a stub on it, the jobs bucket), under
# the names the tests ask for; `config` stays this module's (conftest's), without their webhook secret.
gateway, channel, stub, js, kv = gateway_fixture, channel_fixture, stub_fixture, js_fixture, kv_fixture


def waiting(seconds: float, **fields: Any) -> job_service_pb2.SubmitJobRequest:
    request = submit_request(**fields)
    request.wait.CopyFrom(duration_pb2.Duration(seconds=int(seconds), nanos=int(seconds % 1 * 1e9)))
    return request


async def queued_ids(nc: NatsClient) -> asyncio.Queue[str]:
    """The ID of each job queued from now on (from the gateway's queued notices)."""
    found: asyncio.Queue[str] = asyncio.Queue()

    async def on_notice(msg: Any) -> None:
        key, _, _ = decode_queued_notice(msg.data)
        found.put_nowait(key.partition(".")[2])

    await nc.subscribe(f"{QUEUED_SUBJECT_PREFIX}.>", cb=on_notice)
    await nc.flush()
    return found


def waits(gateway: GatewayApp, outcome: str) -> float:
    return gateway.registry.get_sample_value("asyncinfer_submit_waits_total", {"outcome": outcome}) or 0.0


@pytest.mark.unit
def test_the_wait_is_cut_to_the_limit_and_ends_before_the_calls_deadline() -> None:
    assert wait_budget_s(5.0, 60.0, None) == 5.0
    assert wait_budget_s(120.0, 60.0, None) == 60.0
    assert wait_budget_s(30.0, 60.0, 10.0) == pytest.approx(10.0 - ANSWER_MARGIN_S)
    assert wait_budget_s(30.0, 60.0, 0.4) == pytest.approx(0.3)  # a quarter of a short remainder left
    assert wait_budget_s(30.0, 0.0, 10.0) == 0.0  # gateway.max_submit_wait_s = 0: never waits
    assert wait_budget_s(0.0, 60.0, 10.0) == 0.0


async def test_a_waiting_submit_answers_with_the_finished_job_without_a_read(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, nc: NatsClient, gateway: GatewayApp
) -> None:
    """The answer comes once the job ends, with its final record, and not before; the job's changes
    come from the gateway's feed, which the wait starts before the job is queued: no read."""
    reads = counting_reads(gateway.watch_hub)
    queued = await queued_ids(nc)
    call = asyncio.ensure_future(stub.SubmitJob(waiting(30)))
    job_id = await asyncio.wait_for(queued.get(), 5)
    key = job_key(TENANT, job_id)
    running = await advance(js, kv, job_id, state=JobState.RUNNING, attempt=1)
    await wait_for(lambda: (kept := gateway.watch_hub.recent.latest(key)) is not None and kept.revision > 0)
    assert not call.done()  # RUNNING is no answer
    succeeded = await advance(js, kv, job_id, state=JobState.SUCCEEDED, end_time=time.time())
    answer = await asyncio.wait_for(call, 5)
    assert (answer.job.job_id, answer.job.state) == (job_id, job_pb2.JOB_STATE_SUCCEEDED)
    assert answer.job.revision == succeeded.revision > running.revision
    assert not answer.deduplicated
    assert reads == []
    assert waits(gateway, "ended") == 1
    assert gateway.watch_hub.watcher_count == 0


async def test_a_wait_that_passes_answers_the_job_as_it_stands_and_the_job_goes_on(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, gateway: GatewayApp
) -> None:
    answer = await stub.SubmitJob(waiting(0.2))
    job = answer.job
    assert (job.state, job.revision) == (job_pb2.JOB_STATE_QUEUED, 0)
    assert await work_messages(js) == 1  # accepted, still queued
    assert waits(gateway, "wait_passed") == 1
    # It runs on as any job: a watch from the answer's revision sees the rest.
    watch = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id))
    assert (await next_job(watch)).state == job_pb2.JOB_STATE_QUEUED
    running = await advance(js, kv, job.job_id, state=JobState.RUNNING, attempt=1)
    assert (await next_job(watch)).revision == running.revision
    watch.cancel()


async def test_a_wait_longer_than_the_calls_deadline_answers_before_the_deadline(
    stub: JobStub, js: JetStreamContext
) -> None:
    """A caller whose deadline passed would not learn the ID of a job that was accepted: the
    gateway answers first."""
    answer = await stub.SubmitJob(waiting(30), timeout=1.0)
    assert answer.job.state == job_pb2.JOB_STATE_QUEUED
    assert await work_messages(js) == 1


@pytest.mark.parametrize("limit_s", [0.0, 0.2])
async def test_a_wait_is_cut_to_the_gateways_limit(config: Config, limit_s: float) -> None:
    app = await start_gateway(config.replace(gateway={"max_submit_wait_s": limit_s}))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = job_stub(channel)
            # No deadline on the call: only the limit can end this 10-minute wait within 10 s.
            answer = await asyncio.wait_for(stub.SubmitJob(waiting(600)), 10)
            assert answer.job.state == job_pb2.JOB_STATE_QUEUED
            assert waits(app, "wait_passed") == (1 if limit_s else 0)  # a limit of 0: no wait at all
    finally:
        await app.stop(grace_s=1)


async def test_a_repeated_idempotency_key_waits_for_the_first_job(
    stub: JobStub, kv: KeyValue, js: JetStreamContext, nc: NatsClient
) -> None:
    first = (await stub.SubmitJob(submit_request(idempotency_key="k1"))).job
    call = asyncio.ensure_future(stub.SubmitJob(waiting(30, idempotency_key="k1")))
    await advance(js, kv, first.job_id, state=JobState.RUNNING, attempt=1)
    succeeded = await advance(js, kv, first.job_id, state=JobState.SUCCEEDED, end_time=time.time())
    answer = await asyncio.wait_for(call, 5)
    assert answer.deduplicated
    assert (answer.job.job_id, answer.job.revision) == (first.job_id, succeeded.revision)
    assert await work_messages(js) == 1


async def test_a_waiting_submit_counts_among_the_watches(config: Config, nc: NatsClient) -> None:
    """Refused past the tenant's watches before anything is queued; without a wait, accepted."""
    app = await start_gateway(config.replace(gateway={"max_watches_per_tenant": 1}))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = job_stub(channel)
            held = (await stub.SubmitJob(submit_request())).job
            watch = stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=held.job_id))
            assert (await next_job(watch)).state == job_pb2.JOB_STATE_QUEUED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SubmitJob(waiting(5))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert violations_of(info.value)[0] == "TOO_MANY_WATCHES"
            assert await work_messages(nc.jetstream()) == 1  # only the first job
            assert (await stub.SubmitJob(submit_request())).job.state == job_pb2.JOB_STATE_QUEUED
            watch.cancel()
    finally:
        await app.stop(grace_s=1)


async def test_only_submit_job_waits(stub: JobStub, js: JetStreamContext) -> None:
    """A wait on a SubmitJobs item is refused, that item alone; a negative wait too."""

    async def send() -> AsyncIterator[job_service_pb2.SubmitJobsRequest]:
        items = [job_service_pb2.SubmitJobsItem(job=job) for job in (submit_request(), waiting(5))]
        yield job_service_pb2.SubmitJobsRequest(items=items)

    answers = [answer async for response in stub.SubmitJobs(send()) for answer in response.answers]
    assert answers[0].job.state == job_pb2.JOB_STATE_QUEUED
    assert answers[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "WatchJobs" in answers[1].error.message
    negative = submit_request()
    negative.wait.CopyFrom(duration_pb2.Duration(seconds=-1))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitJob(negative)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [field for field, _ in violations_of(info.value)[1]] == ["wait"]
    assert await work_messages(js) == 1


async def test_a_gateway_stopping_during_a_wait_answers_with_the_job(config: Config, nc: NatsClient) -> None:
    app = await start_gateway(config)
    stopped = False
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            queued = await queued_ids(nc)
            call = asyncio.ensure_future(job_stub(channel).SubmitJob(waiting(30)))
            job_id = await asyncio.wait_for(queued.get(), 5)
            await wait_for(lambda: app.watch_hub.watcher_count == 1)
            await app.stop(grace_s=5)
            stopped = True
            answer = await asyncio.wait_for(call, 5)
            assert (answer.job.job_id, answer.job.state) == (job_id, job_pb2.JOB_STATE_QUEUED)
    finally:
        if not stopped:
            await app.stop(grace_s=1)
