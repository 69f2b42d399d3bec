"""A submit refused while the gateway's NATS connection is down stays refused: nothing of it is
queued when NATS comes back. nats-py keeps what is published while it reconnects in a buffer and
sends it once reconnected; a work message left there after its submit was answered UNAVAILABLE
was stored then, and its job ran (a client that retried got two jobs)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.nats import APIError, NatsTimeoutError, NoStreamResponseError, api
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.connection import connect, connection_changes
from asyncinfer.nats.requests import js_publish, js_publish_many
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2
from tests.stack import StartStack

WAIT_S = 60.0


def demo_request(key: str = "") -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([1, 2, 3, 4])
    return job_service_pb2.SubmitJobRequest(model_name=DEMO_MODEL.name, inputs=[x], idempotency_key=key)


async def connection_is(nc: NatsClient, *, connected: bool) -> None:
    """Waits for the client's connection to be lost or back (its ConnectionChanges), not polled."""
    while nc.is_connected != connected:
        await connection_changes(nc).next().wait()


@pytest.mark.timeout(120)
async def test_a_submit_refused_while_nats_is_away_is_not_queued_when_it_comes_back(
    nats_server: NatsServerProcess, config: Config, start_stack: StartStack
) -> None:
    """nats-server killed -9 (the gateway's connection lost), a SubmitJob and a two-job SubmitJobs
    message from a raw stub without idempotency keys, each answered UNAVAILABLE; nats-server
    started again on its port and store. A job submitted once it is back runs; the refused ones
    never appear: the tenant's only job is that one."""
    stack = await start_stack(config.replace(gateway={"enqueue_retry_s": 1.0}))
    gateway_nc = stack.gateway.nats_connection
    nats_server.kill()
    async with asyncio.timeout(WAIT_S):
        await connection_is(gateway_nc, connected=False)

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stack.jobs.SubmitJob(demo_request())
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value

    group = job_service_pb2.SubmitJobsRequest(
        items=[job_service_pb2.SubmitJobsItem(job=demo_request(), correlation_id=str(i)) for i in range(2)]
    )
    call = stack.jobs.SubmitJobs()
    await call.write(group)
    answer = await call.read()
    await call.done_writing()
    assert [item.error.code for item in answer.answers] == [grpc.StatusCode.UNAVAILABLE.value[0]] * 2, answer

    nats_server.start()  # same port, same store
    async with asyncio.timeout(WAIT_S):
        await connection_is(gateway_nc, connected=True)
        while True:  # JetStream answers 503 for a moment after its start: the same key, one job
            try:
                probe = (await stack.jobs.SubmitJob(demo_request("after-the-outage"))).job
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
        while probe.state != job_pb2.JOB_STATE_SUCCEEDED:  # queued after what the buffer held
            watch = stack.jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=probe.job_id))
            async for change in watch:
                probe = change.job
    listed = await stack.jobs.ListJobs(job_service_pb2.ListJobsRequest(page_size=100))
    assert [job.job_id for job in listed.jobs] == [probe.job_id]


@pytest.mark.timeout(60)
async def test_a_publish_that_timed_out_while_disconnected_is_not_sent_on_reconnect(
    nats_server: NatsServerProcess, config: Config
) -> None:
    """The adapter's publish and pipelined group (the submit's two writes, and every KV write, a
    batch record's create among them) made while the connection is down: each times out, and what
    they queued is not sent once the connection is back. A publish made after it is the stream's
    only message."""
    nc = await connect(config.nats, name="test")
    try:
        js = nc.jetstream()
        await js.add_stream(api.StreamConfig(name="OUT", subjects=["out.>"]))
        nats_server.kill()
        async with asyncio.timeout(WAIT_S):
            await connection_is(nc, connected=False)
        with pytest.raises(NatsTimeoutError):
            await js_publish(js, "out.single", b"refused", timeout_s=0.3)
        group = await js_publish_many(js, [("out.group", b"refused", None)] * 2, timeout_s=0.3)
        assert [type(result) for result in group] == [NatsTimeoutError] * 2
        nats_server.start()
        async with asyncio.timeout(WAIT_S):
            await connection_is(nc, connected=True)
            while True:  # JetStream answers 503 for a moment after its start
                try:
                    after = await js_publish(js, "out.after", b"accepted", timeout_s=1.0)
                    break
                except (NatsTimeoutError, NoStreamResponseError, APIError):
                    await asyncio.sleep(0.1)
        state = (await js.stream_info("OUT", subjects_filter="out.>")).state
        assert (state.messages, state.subjects) == (1, {"out.after": 1}), state
        assert after == 1
    finally:
        await nc.close()
