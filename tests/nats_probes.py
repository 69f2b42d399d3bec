"""Seeing a service's NATS requests from a test, so a test waits for the request it expects
instead of sleeping and hoping the service got that far.

`RequestsSeen` listens beside the server: a client subscription on a JetStream API subject gets a
copy of every request on it while the server still answers the requester, so it changes nothing
for the service. `StreamUnavailable` stands in for a stream that cannot take a publish (as during
a leader election): it answers each publish on the stream's subjects with JetStream's 503, which
is what makes the service retry, and counts them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tests.waits import WAIT_S


class _Counted:
    def __init__(self) -> None:
        self.count = 0
        self._changed = asyncio.Condition()
        self._subscriptions: list[Subscription] = []

    async def _seen(self) -> None:
        async with self._changed:
            self.count += 1
            self._changed.notify_all()

    async def wait_for(self, count: int, timeout_s: float = WAIT_S) -> None:
        """Until `count` requests were seen (failing after timeout_s)."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: self.count >= count)

    async def close(self) -> None:
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()


class RequestsSeen(_Counted):
    """Counts the requests on `subject` (wildcards allowed) that `matches` (subject, payload)."""

    @classmethod
    async def on(cls, nc: NatsClient, subject: str, matches: Callable[[str, bytes], bool]) -> RequestsSeen:
        seen = cls()

        async def observe(msg: Msg) -> None:
            if matches(msg.subject, msg.data):
                await seen._seen()

        seen._subscriptions.append(await nc.subscribe(subject, cb=observe))
        await nc.flush()  # the server knows the subscription before the test goes on
        return seen


class StreamUnavailable(_Counted):
    """Answers every publish on `subjects` with a 503 until closed; `count` publishes so far."""

    @classmethod
    async def on(cls, nc: NatsClient, subjects: list[str]) -> StreamUnavailable:
        down = cls()
        answer = json.dumps(
            {"type": "io.nats.jetstream.api.v1.pub_ack_response", "error": {"code": 503, "description": "test: down"}}
        ).encode()

        async def refuse(msg: Msg) -> None:
            await msg.respond(answer)
            await down._seen()

        for subject in subjects:
            down._subscriptions.append(await nc.subscribe(subject, cb=refuse))
        await nc.flush()
        return down
