"""Issue 17: a full store. With the WORK stream at a small max_bytes (DiscardNew), SubmitJob answers
RESOURCE_EXHAUSTED STORE_FULL at once (it took ~10 s to answer UNAVAILABLE, retried as if a leader
election were under way), nothing is queued by a refused submit, health says NOT_SERVING while
writes fail, and once there is room again health is SERVING and submits are accepted (a keyed
submit's idempotency claim was released, so its retry goes through)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncinfer.config import Config
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.grpc_server import LIVENESS_SERVICE
from asyncinfer.nats import Client as NatsClient
from asyncinfer.v1 import job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.gateway.app import GatewayApp

pytestmark = pytest.mark.timeout(60)


def submit_request(**fields: object) -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[32, 4])
    x.contents.fp32_contents.extend([1.0] * 128)
    return job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x], **fields)  # type: ignore[arg-type]


ENQUEUE_RETRY_S = 120.0


async def health_of(channel: grpc.aio.Channel, service: str = "") -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return reply.status


async def wait_health(channel: grpc.aio.Channel, status: int, timeout_s: float) -> float:
    began = time.monotonic()
    while await health_of(channel) != status:
        assert time.monotonic() - began < timeout_s, f"health never became {status}"
        await asyncio.sleep(0.05)
    return time.monotonic() - began


async def test_a_full_store_refuses_at_once_and_health_follows(config: Config, nc: NatsClient) -> None:
    # A refusal retried like a leader election would take ENQUEUE_RETRY_S; the 30-s guards below
    # tell the two apart, not a bound on how fast it was.
    app = GatewayApp(
        config.replace(
            gateway={"enqueue_retry_s": ENQUEUE_RETRY_S},
            scheduler={"orphan_message_grace_s": 2 * ENQUEUE_RETRY_S},  # must exceed it
        )
    )
    await app.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    stub = job_service_pb2_grpc.JobServiceStub(channel)
    js = nc.jetstream()
    stream = config.nats.work_stream
    try:
        info = await js.stream_info(stream)
        info.config.max_bytes = 16 * 1024
        await js.update_stream(info.config)
        accepted, refused = 0, None
        while refused is None and accepted < 100:
            try:
                await stub.SubmitJob(submit_request())
                accepted += 1
            except grpc.aio.AioRpcError as error:
                refused = error
        assert accepted > 0
        assert refused is not None
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = status_details(refused)
        assert status is not None
        assert unpack_details(status)["ErrorInfo"].reason == "STORE_FULL"
        assert "maximum bytes exceeded" in (refused.details() or "")

        messages = (await js.stream_info(stream)).state.messages
        assert messages == accepted
        timings = []
        for key in ("", "k-1"):
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as again:
                await asyncio.wait_for(stub.SubmitJob(submit_request(idempotency_key=key)), 30)  # a hang guard
            timings.append(time.monotonic() - began)
            assert again.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await js.stream_info(stream)).state.messages == messages  # nothing half-written
        await wait_health(channel, health_pb2.HealthCheckResponse.NOT_SERVING, 30.0)  # a hang guard
        # Not a reason to restart the gateway: its liveness probe's service stays SERVING.
        assert await health_of(channel, LIVENESS_SERVICE) == health_pb2.HealthCheckResponse.SERVING

        # Room again (the jobs ran, say): health SERVING from the probe, submits accepted.
        await js.purge_stream(stream)
        back_s = await wait_health(channel, health_pb2.HealthCheckResponse.SERVING, 30.0)  # a hang guard
        job = (await stub.SubmitJob(submit_request(idempotency_key="k-1"))).job
        assert job.job_id
        print(
            f"store full: {accepted} accepted, refusals in {max(timings) * 1000:.0f} ms, SERVING {back_s:.2f} s after room"
        )
    finally:
        await channel.close(None)
        await app.stop(grace_s=1)
