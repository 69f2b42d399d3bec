"""nats-py's TCP transport across reconnect attempts (asyncinfer/nats/_fastpath.py,
close_replaced_connections): an attempt that connected and then failed (the server, or a proxy in
front of it, closed before its INFO) leaves no connection open when the next attempt connects.
Left open, it was finalised by the garbage collector after the test's event loop had ended: "loop
is closed", an unclosed transport and an unclosed socket, failing whichever test ran then on that
xdist worker (CI; here tests/test_batcher_claim_checks.py's put that dies midway, whose batcher
reconnects through a proxy being cut and stopped)."""

from __future__ import annotations

import asyncio
from urllib.parse import urlparse

from nats.aio.transport import TcpTransport

from asyncinfer.nats import _fastpath


async def test_a_transport_that_connects_again_closes_the_connection_it_held() -> None:
    _fastpath.close_replaced_connections()
    accepted: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()
    writers: list[asyncio.StreamWriter] = []

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        accepted.put_nowait(reader)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    uri = urlparse(f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    transport = TcpTransport()
    try:
        await transport.connect(uri, buffer_size=4096, connect_timeout=5)
        first = await asyncio.wait_for(accepted.get(), 10.0)
        await transport.connect(uri, buffer_size=4096, connect_timeout=5)  # the next attempt
        await asyncio.wait_for(accepted.get(), 10.0)
        assert await asyncio.wait_for(first.read(), 10.0) == b"", "the first connection is closed"
    finally:
        transport.close()
        await transport.wait_closed()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
