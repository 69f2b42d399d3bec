"""A NATS client whose TLS settings cannot work with its server, told so from the server's greeting
(its INFO line), before any TLS handshake or CONNECT: a configuration error at once, even under
`nats.first_connect_wait_s` (the Kubernetes configuration waits 120 s for a server that is away).

- A server that requires client certificates (`tls { verify: true }`: INFO says tls_verify), and a
  client without one: the server's alert at the handshake's end was often read as "Connection lost"
  or a broken pipe, an outage to wait for (`nats_waiting_for_server`).
- A server without TLS, and a client configured for it: nats-py took the server's word and
  connected in plaintext, its password in the CONNECT.
- A server that offers TLS without requiring it (allow_non_tls): the client configured for TLS
  connected in plaintext too; it is answered over TLS now."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import pytest
import structlog.testing

from asyncinfer.config import NatsConfig
from asyncinfer.embedded_nats import NatsServerProcess, free_port
from asyncinfer.errors import ConfigError
from asyncinfer.nats.connection import connect
from tests.certs import TestCA

# Each case below ends at its first attempt (~0.05 s); the wait it must not wait is 120 s.
ENDS_WITHIN_S = 15.0
WAIT_S = 120.0


async def test_a_client_without_a_certificate_is_told_to_set_one_at_once_not_after_the_wait(
    ca: TestCA, verifying_nats: NatsServerProcess
) -> None:
    """Run five times: the old client read the server's alert on most attempts, and a lost
    connection (logged as nats_waiting_for_server, an outage to wait out) before it on most runs."""
    url = verifying_nats.url.replace("nats://", "tls://")
    settings = NatsConfig(url=url, tls_ca_file=ca.ca_file, connect_timeout_s=2.0, first_connect_wait_s=WAIT_S)
    for run in range(5):
        started = time.monotonic()
        with structlog.testing.capture_logs() as logs, pytest.raises(ConfigError) as refused:
            async with asyncio.timeout(ENDS_WITHIN_S):
                await connect(settings, name="test")
        assert time.monotonic() - started < ENDS_WITHIN_S, run
        assert str(refused.value) == (
            f"cannot connect to NATS at {url}: the server requires a client certificate (nats-server tls "
            "{ verify: true }): set nats.tls_cert_file and nats.tls_key_file to one signed by the CA it "
            "verifies clients with"
        ), run
        # Said once, by the error: no line of waiting, nor a warning that repeats it.
        assert [entry for entry in logs if entry["log_level"] != "debug"] == [], (run, logs)


async def test_a_client_configured_for_tls_sends_nothing_to_a_server_without_it(tmp_path: Path, ca: TestCA) -> None:
    """A server greeting without TLS (here a stand-in that records what it is sent): the client's
    CONNECT, its password in it, is never written."""
    received: list[bytes] = []

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "plain", "version": "2.15.1", "proto": 1, "max_payload": 1048576, "auth_required": True}
        writer.write(f"INFO {json.dumps(info)}\r\n".encode())
        await writer.drain()
        while chunk := await reader.read(4096):
            received.append(chunk)
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"tls://127.0.0.1:{port}"
    settings = NatsConfig(
        url=url, tls_ca_file=ca.ca_file, user="u", password="secret", connect_timeout_s=2.0, first_connect_wait_s=WAIT_S
    )
    try:
        with pytest.raises(ConfigError) as refused:
            async with asyncio.timeout(ENDS_WITHIN_S):
                await connect(settings, name="test")
    finally:
        server.close()
        await server.wait_closed()
    assert str(refused.value).startswith(
        f"cannot connect to NATS at {url}: the server does not offer TLS, which this configuration requires"
    )
    assert b"".join(received) == b""


async def test_a_client_configured_for_tls_uses_it_where_the_server_only_offers_it(tmp_path: Path, ca: TestCA) -> None:
    """nats-server's allow_non_tls: INFO says tls_available, not tls_required, and nats-py upgraded
    only for the latter. The server's monitor tells whether the connection is on TLS."""
    cert = ca.issue("nats")
    config_file = tmp_path / "nats.conf"
    config_file.write_text(
        f'tls {{\n  cert_file: "{cert.cert_file}"\n  key_file: "{cert.key_file}"\n}}\nallow_non_tls: true\n'
    )
    server = NatsServerProcess(
        store_dir=tmp_path / "nats", monitor_port=free_port(), extra_args=("-c", str(config_file))
    )
    server.start()
    try:
        nc = await connect(NatsConfig(url=server.url, tls_ca_file=ca.ca_file), name="greeted")
        try:
            await nc.flush(timeout=5)
            connz = await asyncio.to_thread(_connections, server.monitor_port)
        finally:
            await nc.close()
    finally:
        server.stop()
    [connection] = [c for c in connz if c.get("name") == "greeted"]
    assert connection.get("tls_version"), connection


def _connections(monitor_port: int) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz", timeout=5) as answer:
        connections: list[dict[str, object]] = json.load(answer)["connections"]
    return connections
