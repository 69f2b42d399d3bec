"""The ceiling reference: a trivial unary grpc.aio call (1 KB in, 2 bytes out) on uvloop, as the
services run, in its own process:

    python -m bench.system.echo_server PORT

Stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc
import uvloop

SERVICE = "bench.Echo"
METHOD = f"/{SERVICE}/Call"


async def _call(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return b"ok"


async def serve(port: int) -> None:
    handler = grpc.method_handlers_generic_handler(SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(_call)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(int(sys.argv[1])))
