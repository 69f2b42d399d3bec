"""SubmitJobs, the bulk stream, against a real nats-server and a real gateway (no scheduler): one
answer per request, in order, errors per item without ending the stream, exactly the valid items
queued, idempotency keys honoured, authentication once per stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import structlog

from asyncinfer.client._convert import error_from_proto
from asyncinfer.config import Config
from asyncinfer.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from asyncinfer.errors import FieldViolation as DomainViolation
from asyncinfer.nats import Client as NatsClient
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2
from services.gateway.bulk import error_status
from services.gateway.job_service import JobService
from tests.test_gateway import fp32_input, submit_request
from tests.test_gateway_auth import ACME_KEY, GLOBEX_KEY, bearer, serve, with_keys

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


@pytest.fixture
async def stub(config: Config) -> AsyncIterator[JobStub]:
    async for stub in serve(config):
        yield stub


async def work_messages(nc: NatsClient) -> int:
    return (await nc.jetstream().stream_info("WORK")).state.messages


def bulk(items: Iterable[tuple[str, job_service_pb2.SubmitJobRequest]]) -> list[job_service_pb2.SubmitJobsRequest]:
    return [job_service_pb2.SubmitJobsRequest(correlation_id=cid, job=job) for cid, job in items]


async def answers(stub: JobStub, requests: list[job_service_pb2.SubmitJobsRequest], **kwargs: Any) -> list[Any]:
    async def send() -> AsyncIterator[job_service_pb2.SubmitJobsRequest]:
        for request in requests:
            yield request

    return [answer async for answer in stub.SubmitJobs(send(), **kwargs)]


# Every 7th record is invalid, in one of three ways.
def record(i: int) -> tuple[str, job_service_pb2.SubmitJobRequest, str]:
    """(correlation id, request, what the answer must be: 'job', or the bad field / 'model')."""
    if i % 7 == 3:
        kind = (i // 7) % 3
        if kind == 0:
            return f"rec-{i}", submit_request(inputs=[]), "inputs"
        if kind == 1:
            shape = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 3], raw_contents=b"\0" * 12)
            return f"rec-{i}", submit_request(inputs=[shape]), "inputs[0].shape"
        return f"rec-{i}", submit_request(model_name="no-such-model"), "model"
    return f"rec-{i}", submit_request(inputs=[fp32_input(values=[float(i)] * 4)], labels={"row": str(i)}), "job"


async def test_a_thousand_records_answer_in_order_and_only_valid_ones_are_queued(stub: JobStub, nc: NatsClient) -> None:
    records = [record(i) for i in range(1000)]
    got = await answers(stub, bulk((cid, job) for cid, job, _ in records))
    assert len(got) == len(records)
    job_ids = set()
    for i, (answer, (cid, _, expected)) in enumerate(zip(got, records, strict=True)):
        assert answer.index == i
        assert answer.correlation_id == cid
        if expected == "job":
            assert answer.HasField("job"), (i, answer.error)
            assert not answer.HasField("error")
            assert answer.job.state == job_pb2.JOB_STATE_QUEUED
            assert answer.job.labels["row"] == str(i)
            job_ids.add(answer.job.job_id)
        elif expected == "model":
            assert answer.error.code == NOT_FOUND
            assert answer.error.reason == "MODEL_NOT_FOUND"
            assert not answer.HasField("job")
        else:
            assert answer.error.code == INVALID_ARGUMENT, answer.error
            assert expected in [v.field for v in answer.error.field_violations]
            assert not answer.error.retriable
    valid = sum(expected == "job" for _, _, expected in records)
    assert len(job_ids) == valid
    assert await work_messages(nc) == valid


async def test_idempotency_keys_dedup_within_and_across_streams(stub: JobStub, nc: NatsClient) -> None:
    earlier = await stub.SubmitJob(submit_request(idempotency_key="k-0"))
    items = [(f"a{i}", submit_request(idempotency_key=f"k-{i}")) for i in range(5)]
    items += [(f"b{i}", submit_request(idempotency_key=f"k-{i}")) for i in range(5)]  # each key again
    items.append(("c", submit_request(idempotency_key="k-1", priority=job_pb2.PRIORITY_LOW)))  # reused
    got = await answers(stub, bulk(items))
    assert got[0].deduplicated
    assert got[0].job.job_id == earlier.job.job_id
    by_key = {i: {got[i].job.job_id, got[i + 5].job.job_id} for i in range(5)}
    assert all(len(ids) == 1 for ids in by_key.values())  # the same job for both uses of a key
    assert len({next(iter(ids)) for ids in by_key.values()}) == 5
    assert all(answer.deduplicated for answer in got[5:10])
    assert got[10].error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert got[10].error.reason == "IDEMPOTENCY_KEY_REUSED"
    assert got[1].job.job_id in got[10].error.message
    assert await work_messages(nc) == 5


async def test_answers_flow_while_the_client_is_still_sending(stub: JobStub) -> None:
    call = stub.SubmitJobs()
    for i in range(3):
        await call.write(job_service_pb2.SubmitJobsRequest(correlation_id=str(i), job=submit_request()))
        answer = await call.read()  # before the next request is even written
        assert answer.index == i
        assert answer.correlation_id == str(i)
        assert answer.HasField("job")
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


async def test_an_empty_stream_ends_cleanly(stub: JobStub) -> None:
    assert await answers(stub, []) == []


async def test_the_stream_is_authenticated_once_for_its_tenant(config: Config) -> None:
    async for stub in serve(with_keys(config)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await answers(stub, bulk([("x", submit_request())]))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        got = await answers(stub, bulk([("x", submit_request()), ("y", submit_request())]), metadata=bearer(ACME_KEY))
        for answer in got:
            mine = await stub.GetJob(job_service_pb2.GetJobRequest(job_id=answer.job.job_id), metadata=bearer(ACME_KEY))
            assert mine.job.job_id == answer.job.job_id
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await stub.GetJob(job_service_pb2.GetJobRequest(job_id=answer.job.job_id), metadata=bearer(GLOBEX_KEY))
            assert other.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.unit
def test_error_status_carries_what_a_unary_status_would() -> None:
    invalid = error_status(InvalidArgument("bad", [DomainViolation("inputs", "missing")]))
    assert (invalid.code, invalid.reason, invalid.retriable) == (INVALID_ARGUMENT, "INVALID_ARGUMENT", False)
    assert [(v.field, v.description) for v in invalid.field_violations] == [("inputs", "missing")]
    busy = error_status(ResourceExhausted("full", retry_after_s=3, reason="QUEUE_FULL"))
    assert (busy.code, busy.reason, busy.retriable) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "QUEUE_FULL", True)
    # The RetryInfo a unary refusal carries (a helper's limits pass: items had no delay to wait).
    assert busy.retry_after.ToNanoseconds() == 3_000_000_000
    assert error_from_proto(busy).retry_after_s == 3.0
    assert error_from_proto(invalid).retry_after_s is None
    reused = error_status(AlreadyExists("job j1", reason="IDEMPOTENCY_KEY_REUSED"))
    assert (reused.code, reused.message) == (grpc.StatusCode.ALREADY_EXISTS.value[0], "job j1")


async def test_many_jobs_per_message_are_answered_together_in_order(stub: JobStub, nc: NatsClient) -> None:
    """A request carrying items gets one response with one answer per item; one-job requests on
    the same stream keep their own answers, and indexes count jobs across both."""
    records = [record(i) for i in range(300)]
    requests = [
        job_service_pb2.SubmitJobsRequest(
            items=[job_service_pb2.SubmitJobsItem(correlation_id=cid, job=job) for cid, job, _ in records[i : i + 100]]
        )
        for i in range(0, 300, 100)
    ]
    single_cid, single_job, _ = record(300)
    requests.insert(1, job_service_pb2.SubmitJobsRequest(correlation_id=single_cid, job=single_job))
    got = await answers(stub, requests)
    assert [len(r.answers) for r in got] == [100, 0, 100, 100]
    assert got[1].correlation_id == single_cid
    assert got[1].index == 100
    flat = [*got[0].answers, *got[2].answers, *got[3].answers]
    for answer, (cid, _, expected) in zip(flat, records, strict=True):
        assert answer.correlation_id == cid
        assert answer.HasField("job") == (expected == "job"), (cid, answer.error)
    assert [a.index for a in flat] == [*range(100), *range(101, 301)]
    valid = sum(expected == "job" for _, _, expected in records) + 1
    assert await work_messages(nc) == valid


async def test_items_failing_alike_on_a_bug_log_one_traceback_an_interval(
    stub: JobStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def a_bug(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the submit path")

    monkeypatch.setattr(JobService, "_submit", a_bug)
    with structlog.testing.capture_logs() as logs:
        said = await answers(stub, bulk((f"c{i}", submit_request()) for i in range(20)))
    assert [a.error.reason for a in said] == ["INTERNAL"] * 20  # each item still answered, and the stream goes on
    failed = [e for e in logs if e["event"] == "bulk_item_failed"]
    assert len(failed) == 20  # each one's traceback at debug past the first
    assert [e["index"] for e in failed if e["log_level"] != "debug"] == [0]
