"""The health service every server answers (asyncinfer.health_service), over a real GrpcServer: a
name that goes answers as one never set, and every watcher of a name hears every change."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncinfer.grpc_server import GrpcServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def watch_of(health: health_pb2_grpc.HealthStub, service: str) -> Any:
    return health.Watch(health_pb2.HealthCheckRequest(service=service))


async def next_status(watch: Any) -> int:
    """The watch's next status (a bound on a hang: a watcher that hears nothing more)."""
    reply = await asyncio.wait_for(watch.read(), 5.0)
    assert reply is not grpc.aio.EOF
    return int(reply.status)


async def test_a_name_that_goes_answers_as_unknown_and_every_watcher_hears_it() -> None:
    """grpc_health's aio servicer had no removal, and its Watch deleted the name's condition when it
    ended though another watch of the name still waited on it: here the second watch of `m` heard
    nothing once the first was cancelled (its wait timed out at NOT_SERVING)."""
    server = GrpcServer(host="127.0.0.1", port=0, add_servicers=lambda _: None, service_names=())
    await server.start()
    try:
        await server.set_serving_of("m", True)
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            first, second = watch_of(health, "m"), watch_of(health, "m")
            assert [await next_status(first), await next_status(second)] == [SERVING, SERVING]
            first.cancel()
            async with asyncio.timeout(5.0):
                while server.health._watches.get("m") != 1:  # noqa: ASYNC110 - until the server saw the cancel
                    await asyncio.sleep(0.01)

            await server.set_serving_of("m", False)
            assert await next_status(second) == NOT_SERVING
            await server.forget_serving_of("m")
            assert await next_status(second) == SERVICE_UNKNOWN  # the stream stays open (the protocol)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health.Check(health_pb2.HealthCheckRequest(service="m"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert info.value.details() == "unknown service 'm'"
            await server.set_serving_of("m", True)  # a name that comes back is said again
            assert await next_status(second) == SERVING
            never = watch_of(health, "never")
            assert await next_status(never) == SERVICE_UNKNOWN

            await server.begin_shutdown()  # every name NOT_SERVING for good: a removal too is ignored
            assert await next_status(second) == NOT_SERVING
            await server.forget_serving_of("m")
            reply = await health.Check(health_pb2.HealthCheckRequest(service="m"))
            assert reply.status == NOT_SERVING
            second.cancel()
            never.cancel()
            async with asyncio.timeout(5.0):  # nothing is kept of a name no longer watched
                while server.health._watches or server.health._changes:  # noqa: ASYNC110 - no event for it
                    await asyncio.sleep(0.01)
    finally:
        await server.stop(0)
