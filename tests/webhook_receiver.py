"""A real HTTP receiver of webhooks on loopback that verifies every signature with the independent
`standardwebhooks` library, its fixture, and the webhook settings the stack's tests run with
(tests/test_webhooks.py, test_batch_webhooks.py and test_nats_users.py share them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook

from asyncinfer.config import Config
from asyncinfer.webhook_secrets import new_secret
from tests.waits import WAIT_S

SECRET = new_secret()


# --- a webhook receiver -------------------------------------------------------------------------


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    verified: Any  # the payload standardwebhooks verified, or the exception it raised


@dataclass
class Receiver:
    """An HTTP/1.1 server on 127.0.0.1 answering each path from a script (then 200)."""

    secret: str
    scripts: dict[str, list[tuple[int, dict[str, str]]]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    # path -> (n, event): that path's requests after its first n are answered only once the event is
    # set, so a test can read what the sender recorded between two attempts however fast it retries.
    holds: dict[str, tuple[int, asyncio.Event]] = field(default_factory=dict)
    port: int = 0
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _server: asyncio.Server | None = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def at(self, path: str) -> list[Received]:
        return [r for r in self.received if r.path == path]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def wait_for(self, path: str, count: int) -> list[Received]:
        async with asyncio.timeout(WAIT_S), self._changed:
            await self._changed.wait_for(lambda: len(self.at(path)) >= count)
        return self.at(path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            _method, path, _version = (await reader.readline()).decode().split(" ", 2)
            headers: dict[str, str] = {}
            while (line := (await reader.readline()).decode().rstrip("\r\n")) != "":
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            try:
                verified: Any = Webhook(self.secret).verify(body, headers)
            except Exception as exc:
                verified = exc
            hold = self.holds.get(path)
            if hold is not None and len(self.at(path)) >= hold[0]:
                await hold[1].wait()
            script = self.scripts.get(path, [])
            status, extra = script.pop(0) if script else (200, {})
            lines = [f"HTTP/1.1 {status} X", "Content-Length: 0", "Connection: close"]
            lines += [f"{k}: {v}" for k, v in extra.items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            await writer.drain()
            async with self._changed:
                self.received.append(Received(path, headers, body, time.monotonic(), verified))
                self._changed.notify_all()
        finally:
            writer.close()


def webhook_config(config: Config, **webhooks: Any) -> Config:
    settings: dict[str, Any] = {
        "secrets": [{"tenant": "default", "secret": SECRET}],
        "allowed_networks": ["127.0.0.0/8"],
        "backoff_base_s": 0.2,
        "backoff_max_s": 1.0,
        "request_timeout_s": 2.0,
        "retry_horizon_s": 60.0,
    }
    return config.replace(webhooks={**settings, **webhooks})


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    """A receiver verifying with SECRET, the tenant "default"'s (webhook_config)."""
    server = Receiver(SECRET)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
