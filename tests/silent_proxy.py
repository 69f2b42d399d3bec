"""A TCP proxy on loopback whose connections can go silent: what a peer looks like when its host is
lost or a network drops the flow. A silenced connection stays open at both ends (no FIN, no reset:
the kernel still acknowledges what arrives, until its buffers fill) but nothing more crosses it,
either way, until `resume()` (a path that came back: what was sent meanwhile arrives then, late, as
TCP would retransmit it) or `cut()` (both ends closed, as when the proxy or NAT entry is finally
torn down). Connections made after `silence()` cross normally, as to a replacement at the same
address."""

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
        # Each connection's event and its two ends, once both are open.
        self._ends: list[tuple[asyncio.Event, asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._stopped = asyncio.Event()
        self.port = 0

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        return len(self._live)

    @property
    def open(self) -> int:
        """Connections accepted whose client's end is still open (the proxy closes its end of both
        once either side closes)."""
        return sum(1 for _, client_writer, _ in self._ends if not client_writer.is_closing())

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def silence(self) -> None:
        """Every connection open now stops forwarding (until `resume`)."""
        for live in self._live:
            live.clear()

    def resume(self) -> None:
        """The silenced connections forward again, what waited first."""
        for live in self._live:
            live.set()

    async def cut(self) -> None:
        """Closes both ends of every silenced connection (a FIN each way)."""
        for live, *ends in self._ends:
            if live.is_set():
                continue
            for writer in ends:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        live = asyncio.Event()
        live.set()
        self._live.append(live)
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        self._writers += [client_writer, server_writer]
        self._ends.append((live, client_writer, server_writer))
        await asyncio.gather(
            self._pump(client_reader, server_writer, live),
            self._pump(server_reader, client_writer, live),
            return_exceptions=True,
        )
        # One side closed (or was cut): so is the other, as a proxy does. Waited for: a stop that
        # came while this connection was being made closed nothing of it, and a transport left to
        # close after the test's loop ended was a ResourceWarning in the next test (CI5).
        for writer in (client_writer, server_writer):
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, live: asyncio.Event) -> None:
        while await self._forwarding(live) and (data := await source.read(65536)):
            # Silent: a chunk read as the connection was silenced waits too (nothing is dropped;
            # what is not read waits in the kernel's buffers).
            if not await self._forwarding(live):
                return
            sink.write(data)
            await sink.drain()
        if not self._stopped.is_set() and sink.can_write_eof():
            with contextlib.suppress(Exception):
                sink.write_eof()  # a FIN passed on

    async def _forwarding(self, live: asyncio.Event) -> bool:
        """Waits while the connection is silent; False once the proxy stops."""
        if not live.is_set():
            waiters = [asyncio.ensure_future(live.wait()), asyncio.ensure_future(self._stopped.wait())]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
                await asyncio.gather(*waiters, return_exceptions=True)
        return not self._stopped.is_set()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._stopped.set()  # a silenced pump waits for this
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        await asyncio.gather(*self._tasks, return_exceptions=True)
