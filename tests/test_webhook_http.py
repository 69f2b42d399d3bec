"""The webhook sender's HTTP client (services/scheduler/webhooks/http_post.py) against loopback
servers: the request goes to the vetted address whatever the URL's host resolves to (here, to
nothing), names that host (Host, SNI, certificate), follows no redirect, takes no proxy from the
environment, and every failure is an HttpFailure."""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncinfer.webhook_urls import parse_callback_url
from services.scheduler.webhooks.http_post import HttpFailure, PinnedResolver, WebhookHttp

LOOPBACK = ipaddress.ip_address("127.0.0.1")
HOST = "hooks.example"  # resolves nowhere: only the pinned address can be reached


@dataclass
class Server:
    """An HTTP/1.1 server on 127.0.0.1 that records each request's head and answers `answer`."""

    answer: bytes = b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"
    silent: bool = False
    heads: list[dict[str, str]] = field(default_factory=list)
    server_names: list[str | None] = field(default_factory=list)
    port: int = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = {"request": (await reader.readline()).decode().strip()}
            while (line := (await reader.readline()).decode().rstrip("\r\n")) != "":
                name, _, value = line.partition(":")
                head[name.strip().lower()] = value.strip()
            await reader.readexactly(int(head.get("content-length", "0")))
            self.heads.append(head)
            if self.silent:
                await asyncio.sleep(30)
            writer.write(self.answer)
            await writer.drain()
        finally:
            writer.close()


@pytest.fixture
async def http() -> AsyncIterator[WebhookHttp]:
    client = WebhookHttp()
    try:
        yield client
    finally:
        await client.close()


async def started(server: Server, tls: ssl.SSLContext | None = None) -> asyncio.Server:
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0, ssl=tls)
    server.port = listening.sockets[0].getsockname()[1]
    return listening


async def test_the_request_goes_to_the_vetted_address_and_names_the_urls_host(
    http: WebhookHttp, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # taken from the environment, it would fail
    server = Server()
    async with await started(server):
        url = parse_callback_url(f"http://{HOST}:{server.port}/hooks/a?b=c%20d")
        response = await http.post(url, LOOPBACK, headers={"webhook-id": "msg_1"}, body=b"{}", timeout_s=5)
    assert response.status == 204
    (head,) = server.heads
    assert head["request"] == "POST /hooks/a?b=c%20d HTTP/1.1"
    assert head["host"] == f"{HOST}:{server.port}"
    assert head["webhook-id"] == "msg_1"
    assert head["user-agent"] == "asyncinfer-webhooks/1"
    assert head["content-type"] == "application/json"
    assert "cookie" not in head
    assert "accept-encoding" not in head


async def test_a_redirect_is_an_answer_not_followed(http: WebhookHttp) -> None:
    server = Server(answer=b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:9/x\r\nSet-Cookie: a=b\r\n\r\n")
    async with await started(server):
        url = parse_callback_url(f"http://{HOST}:{server.port}/hook")
        response = await http.post(url, LOOPBACK, headers={}, body=b"{}", timeout_s=5)
        again = await http.post(url, LOOPBACK, headers={}, body=b"{}", timeout_s=5)
    assert (response.status, response.headers["location"]) == (302, "http://127.0.0.1:9/x")
    assert again.status == 302
    assert len(server.heads) == 2
    assert "cookie" not in server.heads[1]  # the first answer's cookie is not kept


async def test_failures_are_http_failures(http: WebhookHttp) -> None:
    silent = Server(silent=True)
    async with await started(silent):
        url = parse_callback_url(f"http://{HOST}:{silent.port}/hook")
        with pytest.raises(HttpFailure, match=r"no answer within 0\.3 s"):
            await http.post(url, LOOPBACK, headers={}, body=b"{}", timeout_s=0.3)
    garbage = Server(answer=b"SMTP ready\r\n\r\n")
    async with await started(garbage):
        url = parse_callback_url(f"http://{HOST}:{garbage.port}/hook")
        with pytest.raises(HttpFailure):
            await http.post(url, LOOPBACK, headers={}, body=b"{}", timeout_s=5)
    closed = parse_callback_url(f"http://{HOST}:{silent.port}/hook")  # nothing listens there now
    with pytest.raises(HttpFailure, match="cannot connect"):
        await http.post(closed, LOOPBACK, headers={}, body=b"{}", timeout_s=5)


async def test_the_resolver_answers_nothing_outside_a_request() -> None:
    with pytest.raises(OSError, match="no vetted address"):
        await PinnedResolver().resolve(HOST, 443)


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for HOST alone, and its key."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    command = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    command += ["-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={HOST}"]
    command += ["-addext", f"subjectAltName=DNS:{HOST}"]
    subprocess.run(command, check=True, capture_output=True, timeout=30)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
async def test_tls_names_the_urls_host_for_sni_and_the_certificate(http: WebhookHttp, tmp_path: Path) -> None:
    cert, key = await asyncio.to_thread(self_signed, tmp_path)
    server = Server()
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    tls.sni_callback = lambda _socket, name, _context: server.server_names.append(name)  # type: ignore[func-returns-value]
    trusted = ssl.create_default_context(cafile=str(cert))
    async with await started(server, tls):
        url = parse_callback_url(f"https://{HOST}:{server.port}/hook")
        response = await http.post(url, LOOPBACK, headers={}, body=b"{}", timeout_s=5, ssl_context=trusted)
        assert response.status == 204
        assert server.server_names == [HOST]
        other = parse_callback_url(f"https://other.example:{server.port}/hook")  # the certificate is not its
        with pytest.raises(HttpFailure, match="TLS failed"):
            await http.post(other, LOOPBACK, headers={}, body=b"{}", timeout_s=5, ssl_context=trusted)
