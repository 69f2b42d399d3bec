"""SubmitJobs messages of many jobs, queued as one group (services/gateway/submit_group.py), against
a real nats-server and real gateways (no scheduler): each item answered on its own, in order,
with its own error; a key repeated within a message is one job; the model's queue limit and the
tenant's quota reached mid-message refuse exactly the items past them; every accepted job is in
the work stream and readable from another gateway afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from asyncinfer.config import Config
from asyncinfer.contract import JOB_ID_HEADER
from asyncinfer.nats import Client as NatsClient
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.gateway import bulk_message
from services.gateway.app import GatewayApp
from tests.test_gateway import fp32_input, submit_request
from tests.test_gateway_auth import serve

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@pytest.fixture
async def stub(config: Config) -> AsyncIterator[JobStub]:
    async for stub in serve(config):
        yield stub


def message(*jobs: job_service_pb2.SubmitJobRequest) -> job_service_pb2.SubmitJobsRequest:
    return job_service_pb2.SubmitJobsRequest(
        items=[job_service_pb2.SubmitJobsItem(job=job, correlation_id=f"c{i}") for i, job in enumerate(jobs)]
    )


async def submit_messages(stub: JobStub, *messages: job_service_pb2.SubmitJobsRequest) -> list[Any]:
    """The answers of every item of `messages`, sent on one stream, in order."""

    async def send() -> AsyncIterator[job_service_pb2.SubmitJobsRequest]:
        for request in messages:
            yield request

    responses = [response async for response in stub.SubmitJobs(send())]
    assert [len(r.answers) for r in responses] == [len(m.items) for m in messages]
    return [answer for response in responses for answer in response.answers]


async def queued_job_ids(nc: NatsClient) -> list[str]:
    """The job IDs of the work stream's messages, in stream order."""
    js = nc.jetstream()
    count = (await js.stream_info("WORK")).state.messages
    ids = []
    for seq in range(1, count + 1):
        stored = await js.get_msg("WORK", seq=seq)
        ids.append((stored.headers or {})[JOB_ID_HEADER])
    return ids


def plain(i: int) -> job_service_pb2.SubmitJobRequest:
    return submit_request(inputs=[fp32_input(values=[float(i)] * 4)], labels={"row": str(i)})


async def test_a_message_answers_each_item_in_order_with_its_own_error(
    config: Config, stub: JobStub, nc: NatsClient
) -> None:
    bad_shape = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 3], raw_contents=b"\0" * 12)
    jobs = [plain(i) for i in range(60)]
    expected = ["job"] * 60
    for i, (job, kind) in {
        3: (submit_request(inputs=[]), "inputs"),
        10: (submit_request(inputs=[bad_shape]), "inputs[0].shape"),
        11: (submit_request(model_name="no-such-model"), "model"),
        30: (submit_request(priority=99), "priority"),  # refused in conversion, before validation
        59: (submit_request(inputs=[]), "inputs"),
    }.items():
        jobs[i], expected[i] = job, kind
    got = await submit_messages(stub, message(*jobs))
    accepted: list[str] = []
    for i, (answer, kind) in enumerate(zip(got, expected, strict=True)):
        assert (answer.index, answer.correlation_id) == (i, f"c{i}")
        if kind == "job":
            assert answer.HasField("job"), (i, answer.error)
            assert not answer.HasField("error")
            assert answer.job.state == job_pb2.JOB_STATE_QUEUED
            assert answer.job.labels["row"] == str(i)
            assert not answer.deduplicated
            accepted.append(answer.job.job_id)
        elif kind == "model":
            assert (answer.error.code, answer.error.reason) == (NOT_FOUND, "MODEL_NOT_FOUND")
        else:
            assert answer.error.code == INVALID_ARGUMENT, (i, answer.error)
            assert kind in [v.field for v in answer.error.field_violations]
            assert answer.error.message
            assert not answer.error.retriable
            assert not answer.HasField("job")
    assert len(set(accepted)) == 55
    # Exactly the accepted jobs are queued, in the message's order (one pipelined group).
    assert await queued_job_ids(nc) == accepted
    # ... and readable by another gateway (from NATS, not from the first one's memory).
    async for other in serve(config):
        read = await other.GetJobs(job_service_pb2.GetJobsRequest(job_ids=accepted))
        assert [r.job_id for r in read.results] == accepted
        for result, i in zip(read.results, (i for i, kind in enumerate(expected) if kind == "job"), strict=True):
            assert not result.HasField("error"), result.error
            assert result.job.state == job_pb2.JOB_STATE_QUEUED
            assert result.job.labels["row"] == str(i)


async def test_a_key_repeated_within_a_message_is_one_job(stub: JobStub, nc: NatsClient) -> None:
    earlier = (await submit_messages(stub, message(submit_request(idempotency_key="seen"))))[0]
    got = await submit_messages(
        stub,
        message(
            submit_request(idempotency_key="k1"),
            plain(1),
            submit_request(idempotency_key="k1"),  # the same request again: the same job
            submit_request(idempotency_key="seen"),  # a key from an earlier message
            submit_request(idempotency_key="k1", priority=job_pb2.PRIORITY_LOW),  # reused for another request
            submit_request(idempotency_key="k1"),
            plain(2),
        ),
    )
    first = got[0].job.job_id
    assert got[0].HasField("job")
    assert not got[0].deduplicated
    assert (got[2].job.job_id, got[2].deduplicated) == (first, True)
    assert (got[5].job.job_id, got[5].deduplicated) == (first, True)
    assert (got[3].job.job_id, got[3].deduplicated) == (earlier.job.job_id, True)
    assert (got[4].error.code, got[4].error.reason) == (ALREADY_EXISTS, "IDEMPOTENCY_KEY_REUSED")
    assert first in got[4].error.message
    assert not got[4].HasField("job")
    assert [(got[i].HasField("job"), got[i].deduplicated) for i in (1, 6)] == [(True, False)] * 2
    assert sorted(await queued_job_ids(nc)) == sorted([earlier.job.job_id, first, got[1].job.job_id, got[6].job.job_id])


def with_queue_limit(config: Config, depth: int) -> Config:
    (demo,) = config.models
    return config.replace(models=[demo.model_copy(update={"max_queue_depth": depth}).model_dump()])


async def test_the_queue_limit_reached_mid_message_refuses_only_the_items_past_it(
    config: Config, nc: NatsClient
) -> None:
    async for stub in serve(with_queue_limit(config, 5)):
        got = await submit_messages(
            stub, message(plain(0), plain(1), submit_request(inputs=[]), *(plain(i) for i in range(3, 10)))
        )
        assert got[2].error.code == INVALID_ARGUMENT  # refused before admission: takes no place
        accepted = [a.job.job_id for a in got if a.HasField("job")]
        assert [i for i, a in enumerate(got) if a.HasField("job")] == [0, 1, 3, 4, 5]
        for answer in got[6:]:
            assert (answer.error.code, answer.error.reason) == (RESOURCE_EXHAUSTED, "QUEUE_FULL")
            assert answer.error.retriable
            assert "max_queue_depth" in answer.error.message
        assert await queued_job_ids(nc) == accepted
        # The next message finds the queue still full.
        (again,) = await submit_messages(stub, message(plain(10)))
        assert again.error.reason == "QUEUE_FULL"
        read = await stub.GetJobs(job_service_pb2.GetJobsRequest(job_ids=accepted))
        assert all(r.job.state == job_pb2.JOB_STATE_QUEUED for r in read.results)


async def test_the_tenant_quota_reached_mid_message_refuses_only_the_items_past_it(
    config: Config, nc: NatsClient
) -> None:
    async for stub in serve(config.replace(gateway={"max_queued_per_tenant": 4})):
        # The first message answered first, so its job is counted once (in the stream) by the reads
        # the second one's items make, not also as a publish in flight.
        got = await submit_messages(stub, message(plain(0)))
        got += await submit_messages(stub, message(*(plain(i) for i in range(1, 7))))
        assert [a.HasField("job") for a in got] == [True, True, True, True, False, False, False]
        for answer in got[4:]:
            assert (answer.error.code, answer.error.reason) == (RESOURCE_EXHAUSTED, "TENANT_QUOTA_EXCEEDED")
        assert await queued_job_ids(nc) == [a.job.job_id for a in got[:4]]


async def test_stream_indexes_count_jobs_across_messages_of_both_kinds(stub: JobStub, nc: NatsClient) -> None:
    async def send() -> AsyncIterator[job_service_pb2.SubmitJobsRequest]:
        yield message(*(plain(i) for i in range(3)))
        yield job_service_pb2.SubmitJobsRequest(job=plain(3), correlation_id="single")
        yield message(*(plain(i) for i in range(4, 6)))

    responses = [r async for r in stub.SubmitJobs(send())]
    assert [a.index for a in responses[0].answers] == [0, 1, 2]
    assert (responses[1].index, responses[1].correlation_id) == (3, "single")
    assert [a.index for a in responses[2].answers] == [4, 5]
    assert len(await queued_job_ids(nc)) == 6


async def test_grouped_jobs_are_counted_as_single_submits_are(config: Config) -> None:
    app = GatewayApp(config)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            got = await submit_messages(
                stub,
                message(
                    plain(0),
                    submit_request(priority=job_pb2.PRIORITY_LOW),
                    submit_request(model_name="no-such-model"),
                    plain(1),
                    submit_request(inputs=[]),
                    submit_request(idempotency_key="counted-by-its-own-submit"),
                    plain(2),
                ),
            )
        assert [a.HasField("job") for a in got] == [True, True, False, True, False, True, True]
        sample = app.registry.get_sample_value
        assert sample("asyncinfer_jobs_submitted_total", {"model": "demo", "priority": "NORMAL"}) == 4
        assert sample("asyncinfer_jobs_submitted_total", {"model": "demo", "priority": "LOW"}) == 1
        unknown = {"model": "unknown", "code": "NOT_FOUND", "reason": "MODEL_NOT_FOUND"}
        assert sample("asyncinfer_submit_rejected_total", unknown) == 1
        invalid = {"model": "demo", "code": "INVALID_ARGUMENT", "reason": "INVALID_ARGUMENT"}
        assert sample("asyncinfer_submit_rejected_total", invalid) == 1
        assert sample("asyncinfer_submit_seconds_count") == 7
    finally:
        await app.stop(grace_s=1)


async def test_a_message_larger_than_a_group_is_taken_a_group_at_a_time(
    stub: JobStub, nc: NatsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk_message, "MAX_GROUP", 7)
    jobs = [plain(i) for i in range(20)]
    jobs[2] = jobs[12] = submit_request(idempotency_key="across-groups")
    jobs[9] = submit_request(inputs=[])
    got = await submit_messages(stub, message(*jobs))
    assert [a.index for a in got] == list(range(20))
    assert got[9].error.code == INVALID_ARGUMENT
    assert (got[12].job.job_id, got[12].deduplicated) == (got[2].job.job_id, True)
    accepted = [a.job.job_id for i, a in enumerate(got) if i not in (9, 12)]
    assert all(accepted)
    # (The keyed job's claim comes first, so its work message may land after its group's.)
    assert sorted(await queued_job_ids(nc)) == sorted(accepted)


async def test_a_message_of_too_many_items_ends_the_stream_and_queues_none_of_it(stub: JobStub, nc: NatsClient) -> None:
    """Its answer is one message, which must fit the send limit: a hostile-input pass (session 25)
    sent 9,000 small items, all were queued, and the answer (over 5 MiB) never left: the client
    learnt no job ID. Now a message over 1,000 items is refused whole, after the answers to the
    messages before it."""
    first = message(plain(0), plain(1))
    too_many = message(*(plain(i) for i in range(bulk_message.MAX_GROUP + 1)))

    async def send() -> AsyncIterator[job_service_pb2.SubmitJobsRequest]:
        yield first
        yield too_many

    responses: list[job_service_pb2.SubmitJobsResponse] = []

    async def read_all() -> None:
        async for response in stub.SubmitJobs(send()):
            responses.append(response)

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await read_all()
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 1000 items per SubmitJobs message" in (refused.value.details() or "")
    assert "1001" in (refused.value.details() or "")
    assert [len(r.answers) for r in responses] == [2]
    assert sorted(await queued_job_ids(nc)) == sorted(a.job.job_id for a in responses[0].answers)


async def test_a_message_with_a_job_and_items_ends_the_stream_and_queues_neither(stub: JobStub, nc: NatsClient) -> None:
    """`job` beside `items` was dropped without an answer (the items were answered)."""
    both = message(plain(0), plain(1))
    both.job.CopyFrom(plain(2))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await submit_messages(stub, both)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "one job or items, not both" in (refused.value.details() or "")
    assert await queued_job_ids(nc) == []
