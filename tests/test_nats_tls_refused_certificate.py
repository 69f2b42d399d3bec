"""A NATS client certificate that the server refuses (signed by another CA than the one its
`tls { verify: true }` checks clients with, or expired) ends a service's start with a configuration
error (exit 2) well within `nats.first_connect_wait_s` (60 s by default), fast path on or off.

The server sends a TLS alert at the handshake's end and closes the connection. The client, writing its
CONNECT meanwhile, reads the alert on most attempts (an SSL error: a configuration error at once) and
now and then only a broken pipe or a reset connection, which was an outage to wait out: the service
waited 60 s, then exited 69, where it had ended after 3 tries (~1.5 s) before the wait. Here a relay
in front of the real nats-server loses the alert every time (what the unlucky attempts see), and the
start ends at the second such attempt: a server that greets each attempt and closes it after the
handshake is refusing, not down. A server that is away (no greeting) is still waited for."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import sys
from pathlib import Path

import pytest
import structlog.testing

from asyncinfer.config import NatsConfig
from asyncinfer.embedded_nats import NatsServerProcess, free_port
from asyncinfer.nats.connection import FIRST_CONNECT_ATTEMPTS, connect
from tests.certs import TestCA
from tests.tls_helpers import tls_nats_server

ROOT = Path(__file__).resolve().parent.parent
FASTPATH_SWITCH = "ASYNCINFER_NATS_FASTPATH"
WAIT_S = 60.0  # nats.first_connect_wait_s, the default
GUARD_S = 30.0  # a start that waited the wait out fails this guard
TLS_APPLICATION_DATA = 23  # a TLS record's content type: TLS 1.3 sends its encrypted handshake as such

REFUSED_AFTER_THE_HANDSHAKE = (
    "the server closed the connection right after the TLS handshake, twice, having said that it verifies client "
    "certificates (nats-server tls { verify: true }): it refuses this one, nats.tls_cert_file (with "
    "nats.tls_key_file)"
)


class AlertLosingRelay:
    """A TCP relay to a nats-server that passes everything until the client has sent its encrypted
    handshake flight (its certificate and Finished), and nothing the server sends after it: the server's
    close then reaches the client as a reset, its alert unread. With `resets`, the relay itself resets
    that many connections at that point (a server gone right after the handshake), then passes all."""

    def __init__(self, upstream_port: int, *, resets: int | None = None) -> None:
        self._upstream_port = upstream_port
        self._resets = resets
        self.connections = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> AlertLosingRelay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        await self._server.wait_closed()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        resets_itself = bool(self._resets)
        if self._resets:
            self._resets -= 1
        passing = self._resets is not None and not resets_itself  # past the connections it resets
        self._writers.append(client_writer)
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        self._writers.append(server_writer)
        handshake_sent = asyncio.Event()

        def reset_client() -> None:
            sock = client_writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client_writer.transport.abort()

        async def upstream() -> None:
            pending = b""
            with _quietly():
                while data := await client_reader.read(65536):
                    if not handshake_sent.is_set() and not passing:
                        pending += data
                        # Whole records before it (the ClientHello, ChangeCipherSpec): 5-byte headers.
                        while len(pending) >= 5 and pending[0] != TLS_APPLICATION_DATA:
                            end = 5 + int.from_bytes(pending[3:5], "big")
                            if len(pending) < end:
                                break
                            pending = pending[end:]
                        if pending[:1] == bytes([TLS_APPLICATION_DATA]):
                            handshake_sent.set()
                            if resets_itself:
                                reset_client()
                                break
                    server_writer.write(data)
            server_writer.close()

        async def downstream() -> None:
            with _quietly():
                while data := await server_reader.read(65536):
                    if not handshake_sent.is_set():
                        client_writer.write(data)
            if handshake_sent.is_set():
                reset_client()
            else:
                client_writer.close()

        await asyncio.gather(upstream(), downstream())


class _quietly:
    """Ends a pump at its side's reset, as a relay does."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, OSError)


@pytest.mark.parametrize("fastpath", ["on", "off"])
@pytest.mark.parametrize("alert", ["read", "lost"])
async def test_a_certificate_of_another_ca_ends_the_start_with_a_configuration_error_not_the_wait(
    tmp_path: Path, ca: TestCA, verifying_nats: NatsServerProcess, alert: str, fastpath: str
) -> None:
    """A gateway whose NATS client certificate another CA signed: exit 2 naming its TLS settings,
    within the guard (30 s) of a 60-s wait. Directly ("read": the alert read on most attempts), and
    through the relay ("lost": the old code waited the 60 s out, then exited 69)."""
    stranger = TestCA(tmp_path / "other-pki", name="another CA").issue("services")
    async with AlertLosingRelay(verifying_nats.port) as relay:
        port = relay.port if alert == "lost" else verifying_nats.port
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[nats]\nurl = "tls://127.0.0.1:{port}"\ntls_ca_file = "{ca.ca_file}"\n'
            f'tls_cert_file = "{stranger.cert_file}"\ntls_key_file = "{stranger.key_file}"\n'
            f"connect_timeout_s = 2.0\nfirst_connect_wait_s = {WAIT_S}\n"
            "[gateway]\nport = 0\nmetrics_port = 0\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop(FASTPATH_SWITCH, None)
        if fastpath == "off":
            env[FASTPATH_SWITCH] = "0"
        gateway = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "services.cli", "gateway", "--config", str(config)),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=tmp_path,
        )
        try:
            _, said = await asyncio.wait_for(gateway.communicate(), GUARD_S)  # a wait that ran out fails here
        finally:
            if gateway.returncode is None:
                gateway.kill()
                await gateway.wait()
    stderr = said.decode()
    assert gateway.returncode == 2, stderr
    assert "nats.tls_cert_file" in stderr, stderr
    if alert == "lost":
        assert relay.connections >= 2, relay.connections
        assert REFUSED_AFTER_THE_HANDSHAKE in stderr, stderr
        assert "nats.tls_ca_file" in stderr, stderr
        assert "expired" in stderr, stderr
        # Said once, by the error: no line of waiting (an outage), nor a warning that repeats it.
        assert "nats_waiting_for_server" not in stderr, stderr
        assert '"level": "warning"' not in stderr, stderr
    else:  # the alert read (most runs), or lost on two attempts in a row
        assert "does not trust this client's certificate" in stderr or REFUSED_AFTER_THE_HANDSHAKE in stderr, stderr


async def test_one_connection_closed_after_the_handshake_is_tried_again(
    tmp_path: Path, ca: TestCA, verifying_nats: NatsServerProcess
) -> None:
    """A certificate the server takes, and a first attempt reset after the handshake (a server gone at
    that moment): not a refusal, the next attempt connects."""
    client = ca.issue("services")
    async with AlertLosingRelay(verifying_nats.port, resets=1) as relay:
        settings = NatsConfig(
            url=f"tls://127.0.0.1:{relay.port}",
            tls_ca_file=ca.ca_file,
            tls_cert_file=client.cert_file,
            tls_key_file=client.key_file,
            connect_timeout_s=2.0,
            first_connect_wait_s=WAIT_S,
        )
        async with asyncio.timeout(GUARD_S):
            nc = await connect(settings, name="test")
        try:
            await nc.flush(timeout=5)
        finally:
            await nc.close()
    assert relay.connections == 2, relay.connections


async def test_a_verifying_server_that_is_away_is_still_waited_for(tmp_path: Path, ca: TestCA) -> None:
    """With a certificate, and a server that says tls_verify once up: attempts that get no greeting
    are an outage, even those whose connection is closed (here a port that accepts and closes at once,
    as a load balancer before its NATS), waited for past the tries that once gave up; then it connects."""
    client = ca.issue("services")
    port = free_port()
    settings = NatsConfig(
        url=f"tls://127.0.0.1:{port}",
        tls_ca_file=ca.ca_file,
        tls_cert_file=client.cert_file,
        tls_key_file=client.key_file,
        connect_timeout_s=2.0,
        first_connect_wait_s=WAIT_S,
    )
    accepted = 0
    past_the_tries = asyncio.Event()

    async def close_at_once(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        if accepted > FIRST_CONNECT_ATTEMPTS + 1:  # past the tries that gave up without the wait
            past_the_tries.set()
        writer.close()

    with structlog.testing.capture_logs() as logs:
        connecting = asyncio.ensure_future(connect(settings, name="test"))
        try:
            # (Its first attempt may find the port closed: an outage too.)
            listener = await asyncio.start_server(close_at_once, "127.0.0.1", port)
            waited = asyncio.ensure_future(past_the_tries.wait())
            try:
                async with asyncio.timeout(GUARD_S):
                    await asyncio.wait((connecting, waited), return_when="FIRST_COMPLETED")
            finally:
                waited.cancel()
                listener.close()
                await listener.wait_closed()
            assert not connecting.done(), connecting.exception()
            with tls_nats_server(tmp_path, ca, port=port):
                async with asyncio.timeout(GUARD_S):
                    nc = await connecting
                try:
                    await nc.flush(timeout=5)
                finally:
                    await nc.close()
        finally:
            connecting.cancel()
    assert "nats_waiting_for_server" in [entry["event"] for entry in logs], logs
