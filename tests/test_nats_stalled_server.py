"""A nats-server that stalls past a flush's timeout and comes back (SIGSTOP then SIGCONT: a VM or
GC pause, a partition healed): the client goes on reading. nats-py's flush(timeout) cancels its
PONG's future when the timeout passes but leaves it queued, and the late PONG's `set_result` on it
raised InvalidStateError inside nats-py's read loop, which logged "nats: encountered error" with a
traceback and ended: the connection stayed up but deaf (nothing read: no message, no answer) until
its unanswered pings took it for stale and reconnected, ~10 s later. The scheduler's pulls flush
with a 1 s timeout once one times out (asyncinfer.nats.pull_inbox.caught_up): found by bench/soak.py
(--nats-chaos), a scheduler's traceback after the nats-server's SIGSTOP."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from asyncinfer.config import Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.nats import _fastpath
from asyncinfer.nats.connection import close, connect
from asyncinfer.nats.pull_inbox import caught_up

pytestmark = [pytest.mark.timeout(60)]


async def stopped(pid: int) -> None:
    """Until the process is stopped (its state in /proc is T), bounded."""
    for _ in range(500):
        stat = await asyncio.to_thread(Path(f"/proc/{pid}/stat").read_text)
        if stat.rpartition(")")[2].split()[0] in ("T", "t"):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the nats-server did not stop")


@pytest.mark.skipif(not _fastpath.FASTPATH_ENABLED, reason="the fix is a patch of nats-py's private plumbing")
async def test_a_client_reads_on_after_the_server_stalled_past_a_flush(tmp_path: Path) -> None:
    server = NatsServerProcess(store_dir=tmp_path / "nats")
    server.start()
    try:
        nc = await connect(Config().replace(nats={"url": server.url}).nats, name="stall-test")
        try:
            heard: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_message(msg: object) -> None:
                heard.put_nowait(msg.data)  # type: ignore[attr-defined]

            await nc.subscribe("stall.test", cb=on_message)
            await nc.flush()
            assert server.process is not None
            server.process.send_signal(signal.SIGSTOP)
            await stopped(server.process.pid)
            try:
                assert not await caught_up(nc)  # its flush timed out: the server is stalled
            finally:
                server.process.send_signal(signal.SIGCONT)
            await nc.flush(timeout=5)  # the stalled flush's PONG comes first, then this one's
            await nc.publish("stall.test", b"after the stall")
            # Read within a second, as before the stall: not after the stale-connection reconnect.
            assert await asyncio.wait_for(heard.get(), 3) == b"after the stall"
            assert nc.is_connected
        finally:
            await close(nc)
    finally:
        server.stop()
