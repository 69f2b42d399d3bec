"""GetJobs: many of the caller's jobs in one call, one answer per ID in the order asked — through
the real stack (gateway, scheduler, batcher on a real nats-server), by raw stub and by the SDK."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from asyncinfer.api_keys import hash_key
from asyncinfer.client import AsyncClient, JobState, NotFoundError
from asyncinfer.config import Config
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.ids import new_job_id
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc
from services.gateway.job_service import MAX_IDS_PER_READ
from tests.stack import Stack

X = np.array([[1, 2, 3, 4]], dtype=np.float32)


async def test_answers_every_id_in_order_with_not_found_in_its_own_answer(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        jobs = [await client.submit("demo", {"x": X * i}) for i in range(5)]
        done = [await client.wait(job, timeout_s=30) for job in jobs]
        unknown = new_job_id()
        asked = [jobs[3].job_id, unknown, jobs[0].job_id, "not-an-id", jobs[3].job_id]
        async with grpc.aio.insecure_channel(stack.address) as channel:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            response = await stub.GetJobs(job_service_pb2.GetJobsRequest(job_ids=asked))
    assert [r.job_id for r in response.results] == asked
    assert [r.HasField("job") for r in response.results] == [True, False, True, False, True]
    assert response.results[0].job.job_id == jobs[3].job_id
    assert response.results[0].job.state == response.results[4].job.state
    assert response.results[2].job.outputs[0].name == "y"
    for missing in (response.results[1], response.results[3]):
        assert missing.error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert missing.error.reason == "JOB_NOT_FOUND"
    assert all(d.state is JobState.SUCCEEDED for d in done)


async def test_the_sdk_maps_each_id_to_its_job_or_its_error(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        jobs = [await client.submit("demo", {"x": X + i}) for i in range(3)]
        for job in jobs:
            await client.wait(job, timeout_s=30)
        unknown = new_job_id()
        found = await client.get_jobs([*jobs, unknown])
    assert list(found) == [*(j.job_id for j in jobs), unknown]
    for i, job in enumerate(jobs):
        got = found[job.job_id]
        assert not isinstance(got, Exception)
        assert got.state is JobState.SUCCEEDED
        np.testing.assert_array_equal(got.outputs["y"], 2 * (X + i) + 1)
    assert isinstance(found[unknown], NotFoundError)


async def test_another_tenants_job_is_not_found(config: Config) -> None:
    keyed = config.replace(
        gateway={
            "api_keys": [
                {"tenant": "tenant-a", "sha256": hash_key("key-a")},
                {"tenant": "tenant-b", "sha256": hash_key("key-b")},
            ]
        }
    )
    stack = Stack(keyed)
    await stack.start(batcher=False)
    try:
        async with AsyncClient(stack.address, api_key="key-a") as a, AsyncClient(stack.address, api_key="key-b") as b:
            job = await a.submit("demo", {"x": X})
            mine = await a.get_jobs([job])
            theirs = await b.get_jobs([job])
    finally:
        await stack.stop()
    assert not isinstance(mine[job.job_id], Exception)
    assert isinstance(theirs[job.job_id], NotFoundError)


async def test_too_many_ids_is_invalid_argument_with_the_field(idle_stack: Stack) -> None:
    ids = [new_job_id() for _ in range(MAX_IDS_PER_READ + 1)]
    async with grpc.aio.insecure_channel(idle_stack.address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.GetJobs(job_service_pb2.GetJobsRequest(job_ids=ids))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = status_details(raised.value)
    assert status is not None
    bad = unpack_details(status)["BadRequest"]
    assert [v.field for v in bad.field_violations] == ["job_ids"]


async def test_a_full_answer_is_asked_again_until_every_job_is_there(config: Config) -> None:
    """With a small answer limit, the gateway answers ANSWER_FULL for the jobs past it; the SDK
    asks for those again, so it still returns every job."""
    small = config.replace(gateway={"max_request_bytes": 2_000})
    stack = Stack(small)
    await stack.start(batcher=True)
    try:
        async with AsyncClient(stack.address) as client:
            jobs = [await client.submit("demo", {"x": np.full((1, 4), i, dtype=np.float32)}) for i in range(12)]
            for job in jobs:
                await client.wait(job, timeout_s=30)
            async with grpc.aio.insecure_channel(stack.address) as channel:
                stub = job_service_pb2_grpc.JobServiceStub(channel)
                raw = await stub.GetJobs(job_service_pb2.GetJobsRequest(job_ids=[j.job_id for j in jobs]))
            found = await client.get_jobs(jobs)
    finally:
        await stack.stop()
    full = [r for r in raw.results if not r.HasField("job")]
    assert raw.results[0].HasField("job"), "the first job always fits"
    assert full, "2,000 bytes cannot hold twelve records"
    assert all(r.error.reason == "ANSWER_FULL" and r.error.retriable for r in full)
    assert raw.ByteSize() < 4_000
    assert [found[j.job_id].state for j in jobs] == [JobState.SUCCEEDED] * 12  # type: ignore[union-attr]
