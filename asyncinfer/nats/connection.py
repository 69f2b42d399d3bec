"""Connecting to NATS: reconnects without limit once connected, and a first connect that gives up.

nats-py has one setting for both: with unlimited reconnect attempts it retries the *first*
connect forever too, so a wrong URL would hang start-up. Here the client is connected with
unlimited attempts, and the first connect is abandoned once it has failed FIRST_CONNECT_ATTEMPTS
times per server (nats-py reports each failed attempt to the error callback; each is bounded by
`connect_timeout_s`), which raises Unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog
from nats.aio.client import Client

from asyncinfer.config import NatsConfig
from asyncinfer.errors import Unavailable

log = structlog.get_logger("asyncinfer.nats")

FIRST_CONNECT_ATTEMPTS = 3
RECONNECT_WAIT_S = 0.5


async def connect(config: NatsConfig, *, name: str) -> Client:
    """Connects with reconnects on; Unavailable if the server cannot be reached at all."""
    servers = [u.strip() for u in config.url.split(",") if u.strip()]
    client = Client()
    first_connect_failures: list[Exception] = []
    connected = False
    gave_up = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", error=str(exc))
        if not connected:
            first_connect_failures.append(exc)
            if len(first_connect_failures) >= FIRST_CONNECT_ATTEMPTS * max(1, len(servers)):
                gave_up.set()

    async def on_disconnected() -> None:
        if client.is_closed:  # our own close() (nats-py marks it closed before calling back): no news
            log.debug("nats_closed")
            return
        log.warning("nats_disconnected")

    async def on_reconnected() -> None:
        log.info("nats_reconnected")

    options: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "connect_timeout": config.connect_timeout_s,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": RECONNECT_WAIT_S,
        "allow_reconnect": True,
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
    }
    if config.credentials_file:
        options["user_credentials"] = config.credentials_file
    connecting = asyncio.ensure_future(client.connect(**options))
    giving_up = asyncio.ensure_future(gave_up.wait())
    try:
        await asyncio.wait((connecting, giving_up), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _abandon(client, connecting)
        raise
    finally:
        giving_up.cancel()
    if not connecting.done():
        await _abandon(client, connecting)
        raise Unavailable(f"cannot connect to NATS at {config.url}: {first_connect_failures[-1]}")
    failure = connecting.exception()
    if failure is not None:  # nats raises several unrelated types here
        await _abandon(client, connecting)
        raise Unavailable(f"cannot connect to NATS at {config.url}: {failure}") from failure
    connected = True
    return client


async def _abandon(client: Client, connecting: asyncio.Future[None]) -> None:
    """Stops a first connect and releases what it holds."""
    connecting.cancel()
    await asyncio.wait((connecting,))  # its own cancellation is not ours to raise
    with contextlib.suppress(Exception):
        await client.close()
