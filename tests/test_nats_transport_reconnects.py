"""nats-py's TCP transport across reconnect attempts (asyncinfer/nats/_fastpath.py,
close_replaced_connections): an attempt that connected and then failed (the server, or a proxy in
front of it, closed before its INFO) leaves no connection open when the next attempt connects.
Left open, it was finalised by the garbage collector after the test's event loop had ended: "loop
is closed", an unclosed transport and an unclosed socket, failing whichever test ran then on that
xdist worker (CI; here tests/test_batcher_claim_checks.py's put that dies midway, whose batcher
reconnects through a proxy being cut and stopped)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import pytest
from nats.aio.transport import TcpTransport

from asyncinfer.config import Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.nats import _fastpath
from asyncinfer.nats.connection import close, connect
from tests.silent_proxy import SilentProxy


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


@pytest.fixture
async def proxy(nats_server: NatsServerProcess) -> AsyncIterator[SilentProxy]:
    proxy = SilentProxy(int(nats_server.url.rsplit(":", 1)[1]))
    await proxy.start()
    yield proxy
    await proxy.stop()


async def test_a_client_closed_while_it_reconnects_leaves_nothing_running_or_open(
    config: Config, proxy: SilentProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-py's close cancels a reconnect under way, but the cancellation can be lost while an
    attempt connects (Python 3.11's asyncio.wait_for returns a connect that completed as it was
    cancelled: stood for here by a connect that swallows one), and the reconnect then went on and
    connected, the client closed: the connection it made stayed open, for the garbage collector to
    finalise after the test's loop had ended (CI, session 34). asyncinfer.nats.connection.close
    ends it and closes what it made."""
    client = await connect(
        config.replace(nats={"url": f"nats://127.0.0.1:{proxy.port}"}).nats, name="test-reconnecting"
    )
    connecting, cancel_lost = asyncio.Event(), asyncio.Event()
    original = TcpTransport.connect

    async def connect_losing_a_cancel(transport: TcpTransport, *args: Any, **kwargs: Any) -> Any:
        connecting.set()
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            cancel_lost.set()
        return await original(transport, *args, **kwargs)

    monkeypatch.setattr(TcpTransport, "connect", connect_losing_a_cancel)
    try:
        assert proxy.open == 1
        proxy.silence()
        await proxy.cut()  # the connection ends: the client reconnects (through the proxy, to the same server)
        await asyncio.wait_for(connecting.wait(), 10.0)
        await close(client)
        assert cancel_lost.is_set(), "the close cancelled the reconnect while it connected"
        async with asyncio.timeout(10):
            while proxy.open:  # noqa: ASYNC110 - the proxy's count of open connections announces nothing
                await asyncio.sleep(0.05)
        assert client.is_closed
        assert not client.is_connected
    finally:
        monkeypatch.undo()
        await close(client)
