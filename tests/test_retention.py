"""Record retention: a terminal record carries its retention as a per-message TTL, NATS deletes it
when the retention passes, and reads then say so (JOB_RETENTION_PASSED) rather than "unknown job"."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf import duration_pb2

from asyncinfer.config import Config
from asyncinfer.nats import Client as NatsClient
from asyncinfer.v1 import job_pb2, job_service_pb2
from tests.test_gateway import submit_request, violations_of
from tests.test_gateway_auth import serve

# Also run with the NATS adapter's fast path off (make pytest-nats-fallback).
pytestmark = pytest.mark.nats_fallback

if TYPE_CHECKING:
    from asyncinfer.v1.job_service_pb2_grpc import JobServiceAsyncStub as JobStub


@pytest.fixture
async def stub(config: Config) -> AsyncIterator[JobStub]:
    async for stub in serve(config):
        yield stub


def reason_of(error: grpc.aio.AioRpcError) -> str:
    return violations_of(error)[0]


async def get_error(stub: JobStub, job_id: str) -> grpc.aio.AioRpcError | None:
    try:
        await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
    except grpc.aio.AioRpcError as error:
        return error
    return None


async def test_a_finished_record_expires_with_its_retention_and_says_so(
    stub: JobStub, nc: NatsClient, config: Config
) -> None:
    kept = await stub.SubmitJob(submit_request(result_retention=duration_pb2.Duration(seconds=3600)))
    short = await stub.SubmitJob(submit_request(result_retention=duration_pb2.Duration(seconds=1)))
    for job in (kept.job, short.job):
        canceled = await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job.job_id))
        assert canceled.job.state == job_pb2.JOB_STATE_CANCELED

    # The terminal write carries the retention as its TTL.
    js = nc.jetstream()
    stream = f"KV_{config.nats.jobs_bucket}"
    message = await js.get_last_msg(stream, f"$KV.{config.nats.jobs_bucket}.default.{short.job.job_id}")
    assert message.headers is not None
    assert message.headers.get("Nats-TTL") == "1"

    error = None
    for _ in range(100):  # NATS expires it after about a second; bounded wait on the condition
        error = await get_error(stub, short.job.job_id)
        if error is not None:
            break
        await asyncio.sleep(0.1)
    assert error is not None, "the record outlived its retention"
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert reason_of(error) == "JOB_RETENTION_PASSED"
    assert "retention passed" in (error.details() or "")

    # A watch of it says the same; the job with a long retention is still there; an unknown ID is not found.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=short.job.job_id)).read()
    assert reason_of(info.value) == "JOB_RETENTION_PASSED"
    assert (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=kept.job.job_id))).job.state == (
        job_pb2.JOB_STATE_CANCELED
    )
    unknown = await get_error(stub, "0190b6b4-3a1e-7cc0-8000-000000000000")
    assert unknown is not None
    assert reason_of(unknown) == "JOB_NOT_FOUND"
