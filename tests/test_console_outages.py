"""The console when its gateway or scheduler is away, silent or slow (a fresh-eyes pass, session 30):
each page still comes back, within its calls' deadline, saying which service and why, and the
console recovers when the service does. Plain HTTP against a real console and stack; a SilentProxy
(tests/silent_proxy.py) between them, or a listener that never answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest

from asyncinfer.client import AsyncClient
from asyncinfer.config import Config
from asyncinfer.v1 import batch_service_pb2, batch_service_pb2_grpc
from services.console import backend
from services.console.app import ConsoleApp
from tests.processes import until
from tests.silent_proxy import SilentProxy
from tests.stack import StartStack
from tests.test_console import X
from tests.test_console import start_console as start_console  # the fixture

pytestmark = pytest.mark.timeout(120)

KEEPALIVE_S = 1.0
NOTICED_WITHIN_S = 15.0  # pings every 1 s, each answered within 1 s: gone within ~2 s, on a busy machine more


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def get(http: aiohttp.ClientSession, console: ConsoleApp, path: str) -> tuple[int, str]:
    async with http.get(console.url.rstrip("/") + path, allow_redirects=False) as response:
        return response.status, await response.text()


@pytest.fixture
async def proxies() -> AsyncIterator[list[SilentProxy]]:
    started: list[SilentProxy] = []
    yield started
    for proxy in started:
        await proxy.stop()


async def test_pages_come_back_after_the_connections_to_the_gateway_and_scheduler_went_silent(
    config: Config, start_stack: StartStack, start_console: Any, http: aiohttp.ClientSession, proxies: list[SilentProxy]
) -> None:
    """A connection that goes silent (the service's host lost, a network dropping the flow: no FIN,
    no reset) is noticed by the console's pings, an idle one too, and the next page connects again
    (to the service's replacement at the same address). Before, the console kept the connection:
    every page waited out its 10-s deadline on it and said DEADLINE_EXCEEDED, for good."""
    stack = await start_stack(
        config.replace(gateway={"keepalive_s": KEEPALIVE_S}, scheduler={"keepalive_s": KEEPALIVE_S}), batcher=False
    )
    gateway, scheduler = SilentProxy(stack.gateway.port), SilentProxy(stack.scheduler.port)
    for proxy in (gateway, scheduler):
        await proxy.start()
        proxies.append(proxy)
    console = await start_console(
        stack,
        gateway_address=f"127.0.0.1:{gateway.port}",
        scheduler_address=f"127.0.0.1:{scheduler.port}",
        keepalive_s=KEEPALIVE_S,
    )
    async with AsyncClient(stack.address) as client:
        job = await client.submit("demo", X)
    status, page = await get(http, console, "/jobs")
    assert status == 200, page[-2000:]
    assert job.job_id in page
    assert (gateway.connections, scheduler.connections) == (1, 1)

    gateway.silence()
    scheduler.silence()
    # The console's sampler keeps the scheduler's connection busy; nothing uses the gateway's until
    # the next page: its pings alone find it gone (the channel leaves READY, to connect anew on use).
    gateway_channel = console._backend._channels.gateway
    await until(
        lambda: scheduler.connections == 2 and gateway_channel.get_state() is not grpc.ChannelConnectivity.READY,
        timeout_s=NOTICED_WITHIN_S,
    )
    status, page = await get(http, console, "/jobs")
    assert status == 200, page[-2000:]
    assert job.job_id in page
    assert gateway.connections == 2
    status, page = await get(http, console, "/queues")
    assert status == 200, page[-2000:]
    assert "<td>demo</td>" in page


async def test_a_page_whose_service_does_not_answer_in_time_says_which_and_how_long_it_waited(
    config: Config,
    start_stack: StartStack,
    start_console: Any,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gateway or scheduler that takes the connection and never answers (hung, or a connection
    gone silent before the pings notice): the page comes back when its call's deadline passes, a
    504 that names the service, its address and the time waited. Before: a 502 saying only
    "DEADLINE_EXCEEDED: Deadline Exceeded", which named neither."""
    monkeypatch.setattr(backend, "CALL_TIMEOUT_S", 1.0)  # the page's wait, 10 s otherwise

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(65536):
                pass
        finally:
            writer.close()  # else its socket outlives the test, a ResourceWarning failing the next one

    hung = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    address = f"127.0.0.1:{hung.sockets[0].getsockname()[1]}"
    try:
        stack = await start_stack(batcher=False)
        console = await start_console(stack, gateway_address=address, scheduler_address=address)
        for path, service in (("/jobs", "the gateway"), ("/queues", "the scheduler")):
            status, page = await get(http, console, path)
            assert status == 504, page[-2000:]
            assert f"{service} ({address}) did not answer within 1 s" in page, page[-2000:]
    finally:
        hung.close()


class SendsNothing(batch_service_pb2_grpc.BatchServiceServicer):
    """A gateway's BatchService that takes ReadBatchFile and never sends a piece (hung on its
    store, say), on a real gRPC server: pings are answered, the stream stays open."""

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.ended = asyncio.Event()  # the caller went: the call was cancelled

    async def ReadBatchFile(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.called.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.ended.set()
        yield batch_service_pb2.ReadBatchFileResponse()  # never reached: makes this a stream


async def test_a_download_whose_gateway_sends_nothing_is_a_504_naming_the_gateway(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch file's first piece comes within the call's deadline, as a page's answer does: the
    download waited for it with no deadline, so a gateway that took the call and sent nothing held
    it open for good (the browser's download spinning). Now a 504 naming the gateway, its address
    and the wait, and the call is cancelled (the gateway stops too). The pieces after the first
    have no deadline (a large file takes its time)."""
    monkeypatch.setattr(backend, "CALL_TIMEOUT_S", 1.0)  # the first piece's wait, 10 s otherwise
    servicer = SendsNothing()
    server = grpc.aio.server()
    batch_service_pb2_grpc.add_BatchServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    console = ConsoleApp(
        Config().replace(console={"port": 0, "gateway_address": address, "scheduler_address": address})
    )
    await console.start()
    try:
        status, page = await get(http, console, "/batches/0123abcd/files/output")
        assert servicer.called.is_set()
        assert status == 504, page[-2000:]
        assert f"the gateway ({address}) did not answer within 1 s" in page, page[-2000:]
        await asyncio.wait_for(servicer.ended.wait(), timeout=30)
    finally:
        await console.stop()
        await server.stop(None)
