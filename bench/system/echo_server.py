"""The ceiling references: a trivial unary grpc.aio call (1 KB in, 2 bytes out) on uvloop, as the
services run, in its own process:

    python -m bench.system.echo_server PORT [NATS_URL]

It also serves a bidirectional stream (`STREAM_METHOD`) that answers every message with 2 bytes.

With NATS_URL, each call first publishes its 1 KB to JetStream (stream BENCH_ECHO, one
`js.publish` awaited for its ack) before it answers: the least any gRPC front end that makes a
request durable in JetStream can do per call, with no code of its own (a SubmitJob does two such
writes, and more). Stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import nats
import uvloop
from nats.js import api

from asyncinfer.gc_tuning import tune_for_serving
from asyncinfer.v1 import job_pb2, job_service_pb2

SERVICE = "bench.Echo"
METHOD = f"/{SERVICE}/Call"
# A unary call that parses a SubmitJobRequest and answers a canned SubmitJobResponse: the trivial
# server that does what SubmitJob must do at the edge (parse the same request, answer a job), and
# nothing else (issue 14's unary reference).
PARSE_METHOD = f"/{SERVICE}/ParseSubmit"
# A bidirectional stream answering each message with b"ok": the ceiling for any per-message stream
# API (SubmitJobs) here, as Call is for unary ones.
STREAM_METHOD = f"/{SERVICE}/Stream"
PUBLISH_STREAM = "BENCH_ECHO"
PUBLISH_SUBJECT = "bench_echo.call"

Handler = Callable[[bytes, grpc.aio.ServicerContext[bytes, bytes]], Awaitable[bytes]]


async def _call(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return b"ok"


_CANNED = job_service_pb2.SubmitJobResponse(
    job=job_pb2.Job(job_id="01000000-0000-7000-8000-000000000000", state=job_pb2.JOB_STATE_QUEUED)
)


async def _parse_submit(
    request: job_service_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext[bytes, bytes]
) -> job_service_pb2.SubmitJobResponse:
    return _CANNED


async def _stream(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
) -> AsyncIterator[bytes]:
    async for _ in requests:
        yield b"ok"


async def _publishing_handler(nats_url: str) -> tuple[Handler, nats.aio.client.Client]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(
        api.StreamConfig(
            name=PUBLISH_STREAM,
            subjects=[PUBLISH_SUBJECT],
            retention=api.RetentionPolicy.LIMITS,
            max_msgs=100_000,
            storage=api.StorageType.FILE,
        )
    )

    async def call(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await js.publish(PUBLISH_SUBJECT, request)
        return b"ok"

    return call, nc


async def serve(port: int, nats_url: str = "") -> None:
    nc = None
    call: Handler = _call
    if nats_url:
        call, nc = await _publishing_handler(nats_url)
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Call": grpc.unary_unary_rpc_method_handler(call),
            "ParseSubmit": grpc.unary_unary_rpc_method_handler(
                _parse_submit,
                request_deserializer=job_service_pb2.SubmitJobRequest.FromString,
                response_serializer=job_service_pb2.SubmitJobResponse.SerializeToString,
            ),
            "Stream": grpc.stream_stream_rpc_method_handler(_stream),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    tune_for_serving()  # as the services do once started (services.cli)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)
    if nc is not None:
        await nc.close()


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else ""))
