"""A TCP proxy on loopback whose connections can go silent: what a peer looks like when its host is
lost or a network drops the flow. A silenced connection stays open at both ends (no FIN, no reset:
the kernel still acknowledges what arrives) but nothing more crosses it, either way. Connections
made after `silence()` cross normally, as to a replacement at the same address."""

from __future__ import annotations

import asyncio
import contextlib


class SilentProxy:
    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._server: asyncio.Server | None = None
        self._live: list[asyncio.Event] = []  # one per connection: set while it forwards
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._stopped = asyncio.Event()
        self.port = 0

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        return len(self._live)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def silence(self) -> None:
        """Every connection open now stops forwarding, for good."""
        for live in self._live:
            live.clear()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        live = asyncio.Event()
        live.set()
        self._live.append(live)
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        self._writers += [client_writer, server_writer]
        await asyncio.gather(
            self._pump(client_reader, server_writer, live),
            self._pump(server_reader, client_writer, live),
            return_exceptions=True,
        )

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, live: asyncio.Event) -> None:
        while data := await source.read(65536):
            if not live.is_set():
                await self._stopped.wait()  # silent: what came is dropped, and nothing more is read
                return
            sink.write(data)
            await sink.drain()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._stopped.set()  # a silenced pump waits for this
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        await asyncio.gather(*self._tasks, return_exceptions=True)
