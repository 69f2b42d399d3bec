"""Idempotent submit against a real nats-server and a real gateway (no scheduler: jobs stay QUEUED):
a repeated key returns the first job and queues nothing, races included; a reused key with another
request is ALREADY_EXISTS; keys are per tenant; a crashed owner's claim is taken over."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.config import Config
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.idempotency_claims import KEY_TTL_SLACK_S, Claim
from asyncinfer.ids import new_job_id
from asyncinfer.jobs import JobRecord, JobState, Priority, job_key
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import KeyNotFoundError, KeyValue
from asyncinfer.v1 import job_pb2, job_service_pb2
from services.gateway import idempotency
from services.gateway.app import GatewayApp
from services.gateway.claims import request_fingerprint
from services.gateway.convert import submit_request_from_proto
from services.gateway.idempotency import claim_key
from tests.nats_probes import RequestsSeen
from tests.test_gateway import channel as channel_fixture
from tests.test_gateway import fp32_input, job_stub, submit_request, violations_of
from tests.test_gateway import gateway as gateway_fixture
from tests.test_gateway import stub as stub_fixture
from tests.test_gateway_auth import ACME_KEY, GLOBEX_KEY, bearer, with_keys

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub

TENANT = "default"
# The gateway tests' fixtures (a gateway alone on the test's NATS, a stub on it), under the names the
# tests ask for; `config` stays this module's (conftest's).
gateway, channel, stub = gateway_fixture, channel_fixture, stub_fixture


@pytest.fixture
async def claims(nc: NatsClient, gateway: GatewayApp, config: Config) -> KeyValue:
    return await nc.jetstream().key_value(config.nats.idempotency_bucket)


async def work_messages(nc: NatsClient) -> int:
    return (await nc.jetstream().stream_info("WORK")).state.messages


async def test_a_repeated_key_returns_the_first_job_and_queues_nothing(
    stub: JobStub, nc: NatsClient, claims: KeyValue, config: Config
) -> None:
    request = submit_request(idempotency_key="order-42", labels={"batch": "7"})
    first = await stub.SubmitJob(request)
    again = await stub.SubmitJob(request)
    assert not first.deduplicated
    assert again.deduplicated
    assert again.job.job_id == first.job.job_id
    assert again.job.idempotency_key == "order-42"
    assert await work_messages(nc) == 1
    got = await stub.GetJob(job_service_pb2.GetJobRequest(job_id=first.job.job_id))
    assert got.job.idempotency_key == "order-42"

    # The claim: keyed by tenant and the key's hash, naming the job, with a TTL past the job's life.
    entry = await claims.get(claim_key(TENANT, "order-42"))
    assert entry.value is not None
    assert json.loads(entry.value)["job_id"] == first.job.job_id
    message = await nc.jetstream().get_last_msg(
        f"KV_{config.nats.idempotency_bucket}", f"$KV.{config.nats.idempotency_bucket}.{claim_key(TENANT, 'order-42')}"
    )
    assert message.headers is not None
    assert int(message.headers["Nats-TTL"]) > config.gateway.default_result_retention_s


async def test_concurrent_identical_submits_make_one_job(stub: JobStub, nc: NatsClient) -> None:
    request = submit_request(idempotency_key="race")
    answers = await asyncio.gather(*(stub.SubmitJob(request) for _ in range(20)))
    assert len({answer.job.job_id for answer in answers}) == 1
    assert sum(not answer.deduplicated for answer in answers) == 1
    assert await work_messages(nc) == 1


async def test_a_reused_key_with_another_request_is_already_exists(stub: JobStub, nc: NatsClient) -> None:
    first = await stub.SubmitJob(submit_request(idempotency_key="k"))
    changes = {
        "inputs": submit_request(idempotency_key="k", inputs=[fp32_input(values=[9.0, 9.0, 9.0, 9.0])]),
        "priority": submit_request(idempotency_key="k", priority=job_pb2.PRIORITY_HIGH),
        "labels": submit_request(idempotency_key="k", labels={"a": "b"}),
    }
    for what, request in changes.items():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SubmitJob(request)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS, what
        # What happened, whose the key is, and both ways on (Stripe's idempotency_error says the
        # first and the last; the message before this said neither that a retry of the first
        # request is fine nor how to reach the job).
        assert info.value.details() == (
            f"idempotency key 'k' was first used for job {first.job.job_id}, with a different request: a key "
            "can be sent again only with its first request (a retry, answered with that job). Get that job "
            "with GetJob, or use a new key for a different request"
        ), what
        status = status_details(info.value)
        assert status is not None
        error_info = unpack_details(status)["ErrorInfo"]
        assert error_info.reason == "IDEMPOTENCY_KEY_REUSED"
        assert error_info.metadata["job_id"] == first.job.job_id
    assert await work_messages(nc) == 1


async def test_a_reused_long_key_is_quoted_in_part_and_the_way_on_is_never_cut(stub: JobStub) -> None:
    # An error's message is clipped to MAX_MESSAGE_BYTES (asyncinfer/error_bounds.py): a key of the
    # most bytes allowed, quoted whole, would have cut what to do, the message's end.
    key = "order-" + "é" * 125  # 256 bytes of UTF-8
    first = await stub.SubmitJob(submit_request(idempotency_key=key))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitJob(submit_request(idempotency_key=key, priority=job_pb2.PRIORITY_HIGH))
    details = info.value.details() or ""
    assert details.startswith(f"idempotency key 'order-{'é' * 15}...' was first used for job {first.job.job_id},")
    assert details.endswith("Get that job with GetJob, or use a new key for a different request")


async def test_a_queue_ttl_retried_later_is_the_same_request(stub: JobStub, nc: NatsClient) -> None:
    # The deadline derived from a queue TTL moves with each try; the TTL itself is what is compared.
    request = submit_request(idempotency_key="ttl", queue_ttl=duration_pb2.Duration(seconds=600))
    first = await stub.SubmitJob(request)
    again = await stub.SubmitJob(request)
    assert again.deduplicated
    assert again.job.job_id == first.job.job_id
    assert await work_messages(nc) == 1


async def test_keys_of_any_characters_are_kept_apart(stub: JobStub, nc: NatsClient) -> None:
    keys = ["a.b", "a>b", "a b", "ключ/*", "a.b "]
    jobs = [(await stub.SubmitJob(submit_request(idempotency_key=key))).job.job_id for key in keys]
    assert len(set(jobs)) == len(keys)
    assert await work_messages(nc) == len(keys)


async def test_an_overlong_key_is_invalid_and_writes_nothing(stub: JobStub, nc: NatsClient, claims: KeyValue) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitJob(submit_request(idempotency_key="k" * 257))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "idempotency_key" in [field for field, _ in violations_of(info.value)[1]]
    assert await work_messages(nc) == 0
    assert (await claims.status()).values == 0
    # 256 bytes is fine.
    assert (await stub.SubmitJob(submit_request(idempotency_key="k" * 256))).job.job_id


async def test_tenants_using_the_same_key_get_their_own_jobs(config: Config, nc: NatsClient) -> None:
    app = GatewayApp(with_keys(config))
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = job_stub(channel)
            request = submit_request(idempotency_key="shared")
            acme = await stub.SubmitJob(request, metadata=bearer(ACME_KEY))
            globex = await stub.SubmitJob(request, metadata=bearer(GLOBEX_KEY))
            acme_again = await stub.SubmitJob(request, metadata=bearer(ACME_KEY))
    finally:
        await app.stop(grace_s=1)
    assert acme.job.job_id != globex.job.job_id
    assert not globex.deduplicated
    assert acme_again.deduplicated
    assert acme_again.job.job_id == acme.job.job_id
    assert await work_messages(nc) == 2


async def test_a_refused_submit_releases_its_key(
    config: Config, nc: NatsClient, gateway: GatewayApp, stub: JobStub, claims: KeyValue
) -> None:
    # Admission refuses after the key was claimed: one job fills a queue limited to one.
    limited = config.replace(models=[config.models[0].model_copy(update={"max_queue_depth": 1})])
    app = GatewayApp(limited)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            limited_stub = job_stub(channel)
            await limited_stub.SubmitJob(submit_request())
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await limited_stub.SubmitJob(submit_request(idempotency_key="full"))
    finally:
        await app.stop(grace_s=1)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(KeyNotFoundError):
        await claims.get(claim_key(TENANT, "full"))
    bucket = config.nats.idempotency_bucket
    marker = await nc.jetstream().get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{claim_key(TENANT, 'full')}")
    assert marker.headers is not None
    assert marker.headers["KV-Operation"] == "DEL"
    assert "Nats-TTL" in marker.headers  # released keys leave no trace for long
    # The key is free again: the next submit with it makes a job.
    answer = await stub.SubmitJob(submit_request(idempotency_key="full"))
    assert not answer.deduplicated
    assert await work_messages(nc) == 2


def queued_record(job_id: str, *, key: str, now: float) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        tenant=TENANT,
        model_name="demo",
        model_version="1",
        state=JobState.QUEUED,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        max_attempts=3,
        result_retention_s=3600.0,
        idempotency_key=key,
    )


async def test_a_live_claim_is_waited_for(
    stub: JobStub, nc: NatsClient, claims: KeyValue, config: Config, gateway: GatewayApp
) -> None:
    request = submit_request(idempotency_key="owner-crashed")
    fingerprint = request_fingerprint(submit_request_from_proto(request, now=time.time()))
    key = claim_key(TENANT, "owner-crashed")
    jobs = await nc.jetstream().key_value(config.nats.jobs_bucket)

    # A live claim whose owner is still writing: the repeat waits for the owner's record.
    writing = new_job_id()
    await claims.create(key, Claim(writing, fingerprint, time.time()).encode())
    wanted = job_key(TENANT, writing)
    reads = await RequestsSeen.on(nc, "$JS.API.>", lambda subject, data: wanted in subject or wanted.encode() in data)
    repeat = asyncio.ensure_future(stub.SubmitJob(request))
    await reads.wait_for(2)  # it found the claim, looked for the owner's record, and looked again
    await reads.close()
    assert not repeat.done(), "a live claim without its record yet is waited for"
    record = queued_record(writing, key="owner-crashed", now=time.time())
    await jobs.create(job_key(TENANT, writing), encode_record(record))
    answer = await asyncio.wait_for(repeat, 5)
    assert answer.deduplicated
    assert answer.job.job_id == writing
    assert await work_messages(nc) == 0  # the "owner" here published nothing; the repeat neither


@pytest.fixture
async def short_bound_gateway(
    config: Config, nc: NatsClient, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[JobStub, KeyValue]]:
    """A gateway whose submits write their records within 0.5 s (enqueue_retry_s) with no takeover
    margin, so a claim goes stale 0.5 s after it was made; a stub on it and the claims bucket."""
    monkeypatch.setattr(idempotency, "TAKEOVER_MARGIN_S", 0.0)
    app = GatewayApp(config.replace(gateway={"enqueue_retry_s": 0.5}))
    await app.start()
    try:
        claims = await nc.jetstream().key_value(config.nats.idempotency_bucket)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            yield job_stub(channel), claims
    finally:
        await app.stop(grace_s=1)


def claimed_key(request: job_service_pb2.SubmitJobRequest, job_id: str, claim_time: float) -> tuple[str, bytes]:
    """The claim a submit of `request` would have made for `job_id` at `claim_time`: key and value."""
    fingerprint = request_fingerprint(submit_request_from_proto(request, now=time.time()))
    return claim_key(TENANT, request.idempotency_key), Claim(job_id, fingerprint, claim_time).encode()


async def test_a_claim_whose_owner_crashed_is_taken_over_once_stored_that_long_ago(
    short_bound_gateway: tuple[JobStub, KeyValue], nc: NatsClient
) -> None:
    # A claim older than the owner's bound (0.5 s here) whose record never came: the owner crashed.
    # By the wall clocks it is an hour old; the repeat takes it over, with a new job ID, once the
    # server stored it that long ago too.
    stub, claims = short_bound_gateway
    request = submit_request(idempotency_key="stale")
    crashed = new_job_id()
    await claims.create(*claimed_key(request, crashed, time.time() - 3600))
    taken = await stub.SubmitJob(request, timeout=10)
    again = await stub.SubmitJob(request, timeout=10)
    assert not taken.deduplicated
    assert taken.job.job_id != crashed
    entry = await claims.get(claim_key(TENANT, "stale"))
    assert entry.value is not None
    assert json.loads(entry.value)["job_id"] == taken.job.job_id
    assert again.deduplicated
    assert again.job.job_id == taken.job.job_id
    assert await work_messages(nc) == 1


@pytest.mark.parametrize("removal", ["delete", "purge"])
async def test_a_submit_over_a_removed_claim_makes_its_job(
    stub: JobStub, nc: NatsClient, claims: KeyValue, removal: str
) -> None:
    # An operator's `nats kv del` or `nats kv purge` of a claim leaves a marker with no TTL: a
    # create expecting revision 0 is refused over it (a batch's claim looped on that without
    # end). The submit claims the key over the marker's revision.
    request = submit_request(idempotency_key="removed")
    key, value = claimed_key(request, new_job_id(), time.time())
    await claims.create(key, value)
    if removal == "delete":
        await claims.delete(key)
    else:
        await claims.purge(key)
    answer = await stub.SubmitJob(request, timeout=10)
    assert not answer.deduplicated
    entry = await claims.get(key)
    assert entry.value is not None
    assert json.loads(entry.value)["job_id"] == answer.job.job_id
    again = await stub.SubmitJob(request, timeout=10)
    assert (again.job.job_id, again.deduplicated) == (answer.job.job_id, True)
    assert await work_messages(nc) == 1


async def test_a_live_claim_is_not_taken_over_when_the_wall_clock_steps_forward(
    stub: JobStub, nc: NatsClient, claims: KeyValue, config: Config
) -> None:
    # Session 29: a gateway whose wall clock stepped an hour forward (an NTP sync after a resume)
    # while another submit with the key was still writing its job saw that claim as an hour old,
    # took it over and made a second job for the key. The server stored the claim a moment ago:
    # the repeat waits for the owner's record, as for any live claim.
    request = submit_request(idempotency_key="clock-stepped")
    fingerprint = request_fingerprint(submit_request_from_proto(request, now=time.time()))
    key = claim_key(TENANT, "clock-stepped")
    writing = new_job_id()
    await claims.create(key, Claim(writing, fingerprint, time.time() - 3600).encode())
    stream = f"KV_{config.nats.idempotency_bucket}"
    age_reads = await RequestsSeen.on(nc, f"$JS.API.STREAM.INFO.{stream}", lambda _subject, _data: True)
    repeat = asyncio.ensure_future(stub.SubmitJob(request))
    looked_twice = asyncio.ensure_future(age_reads.wait_for(2))  # it asked the server the claim's age, twice
    await asyncio.wait([repeat, looked_twice], return_when=asyncio.FIRST_COMPLETED)
    await age_reads.close()
    assert not repeat.done(), "a claim the server stored a moment ago is live, whatever the wall clocks say"
    await looked_twice
    jobs = await nc.jetstream().key_value(config.nats.jobs_bucket)
    await jobs.create(
        job_key(TENANT, writing), encode_record(queued_record(writing, key="clock-stepped", now=time.time()))
    )
    answer = await asyncio.wait_for(repeat, 5)
    assert answer.deduplicated
    assert answer.job.job_id == writing
    assert await work_messages(nc) == 0  # one job for the key: the owner's (which published nothing here)


async def test_a_claim_that_never_goes_stale_is_waited_for_only_so_long(
    short_bound_gateway: tuple[JobStub, KeyValue], nc: NatsClient
) -> None:
    # The claim's holder has a clock an hour ahead: by ours its claim is never stale. The repeat
    # waits (backing off) as long as a claim can be live, then answers UNAVAILABLE.
    stub, claims = short_bound_gateway
    request = submit_request(idempotency_key="clock-ahead")
    holder = new_job_id()
    await claims.create(*claimed_key(request, holder, time.time() + 3600))
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stub.SubmitJob(request, timeout=10)
    waited_s = time.monotonic() - started
    # The gateway's own answer once it waited out the claim's bound (0.5 s): the call's deadline
    # (10 s) would have ended it DEADLINE_EXCEEDED (how long it took past the bound is not asserted).
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert holder in (failed.value.details() or "")
    status = status_details(failed.value)
    assert status is not None
    assert unpack_details(status)["ErrorInfo"].reason == "IDEMPOTENCY_CONTENDED"
    assert waited_s >= 0.5
    assert await work_messages(nc) == 0


async def test_a_retry_after_its_deadline_passed_still_names_the_first_job(stub: JobStub, nc: NatsClient) -> None:
    deadline = timestamp_pb2.Timestamp()
    deadline.FromNanoseconds(int((time.time() + 0.3) * 1e9))
    request = submit_request(idempotency_key="late", deadline=deadline)
    first = await stub.SubmitJob(request)
    await asyncio.sleep(max(deadline.ToNanoseconds() / 1e9 - time.time(), 0) + 0.01)  # what we wait for is time
    again = await stub.SubmitJob(request)
    assert again.deduplicated
    assert again.job.job_id == first.job.job_id
    assert again.job.state == job_pb2.JOB_STATE_EXPIRED  # settled on read, as GetJob does
    assert await work_messages(nc) == 1


async def test_a_keyed_job_cancelled_while_queued_keeps_its_claim_as_long_as_its_record(
    stub: JobStub, nc: NatsClient, claims: KeyValue, config: Config
) -> None:
    # Claimed for a week (no queue deadline); the gateway that cancels the job cuts the claim to the
    # record's retention plus the slack, and a repeat still gets the job.
    bucket = config.nats.idempotency_bucket
    key = claim_key(TENANT, "cancel-me")

    async def claim_ttl_s() -> int:
        message = await nc.jetstream().get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{key}")
        assert message.headers is not None
        return int(message.headers["Nats-TTL"])

    request = submit_request(idempotency_key="cancel-me")
    first = await stub.SubmitJob(request)
    assert await claim_ttl_s() > 7 * 86400
    claimed = await claims.get(key)
    await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=first.job.job_id))
    # The record keeps the claim its submit wrote, so the cut needs no read.
    jobs = await nc.jetstream().key_value(config.nats.jobs_bucket)
    cancelled = decode_record((await jobs.get(job_key(TENANT, first.job.job_id))).value or b"")
    assert cancelled.claim_revision == claimed.revision
    assert cancelled.claim_fingerprint == json.loads(claimed.value or b"{}")["fingerprint"]
    retention_s = int(config.gateway.default_result_retention_s + KEY_TTL_SLACK_S)
    deadline = time.monotonic() + 5
    while await claim_ttl_s() != retention_s:  # rewritten by a worker of the gateway's, off the call
        assert time.monotonic() < deadline, "the claim's TTL was not cut"
        await asyncio.sleep(0.02)
    again = await stub.SubmitJob(request)
    assert again.deduplicated
    assert (again.job.job_id, again.job.state) == (first.job.job_id, job_pb2.JOB_STATE_CANCELED)
