"""KeyWatch (an ordered consumer of nats-py's, which the fast path keeps from waking every 0.25 s
for flow control while idle): an idle watch sets no such timer, and a watch whose deliveries stop
still recovers and gets every change, whether its consumer was deleted on the server or the
nats-server restarted on the same store (the consumer, in memory, is gone). What makes it recover
is nats-py's own: its heartbeat check remakes a consumer that missed two idle heartbeats (5 s
each by default; these tests' watches are told 0.5 s, KeyWatch's idle_heartbeat_s, so that they
recover in about 2 s rather than 20), resuming after the last stream sequence it delivered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from asyncinfer.config import Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import KeyValue
from asyncinfer.nats._fastpath import FASTPATH_ENABLED, FLOW_CONTROL_RECHECK_S
from asyncinfer.nats.connection import connect
from asyncinfer.nats.kv_watch import KeyUpdate, KeyWatch
from asyncinfer.nats.protocol import kv_stream

pytestmark = pytest.mark.timeout(120)
BUCKET = "watched"
QUICK_HEARTBEAT_S = 0.5  # the recovery tests' watches: a lost consumer is remade within 2 s


class Seen:
    """The updates a watch delivered, in order, and a way to wait for the one wanted."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, bytes]] = []
        self._changed = asyncio.Event()

    def __call__(self, update: KeyUpdate) -> None:
        self.updates.append((update.key, update.value))
        self._changed.set()

    async def until(self, count: int, timeout_s: float = 60.0) -> list[tuple[str, bytes]]:
        async with asyncio.timeout(timeout_s):
            while len(self.updates) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.updates


@pytest.fixture
async def bucket(nc: NatsClient) -> KeyValue:
    return await nc.jetstream().create_key_value(bucket=BUCKET, history=1)


@pytest.fixture
async def watch(nc: NatsClient, bucket: KeyValue) -> AsyncIterator[tuple[KeyWatch, Seen]]:
    seen = Seen()
    key_watch = KeyWatch(nc.jetstream(), BUCKET, seen, name="test")
    await key_watch.start()
    try:
        yield key_watch, seen
    finally:
        await key_watch.stop()


@pytest.fixture
async def quick_watch(nc: NatsClient, bucket: KeyValue) -> AsyncIterator[tuple[KeyWatch, Seen]]:
    seen = Seen()
    key_watch = KeyWatch(nc.jetstream(), BUCKET, seen, name="test", idle_heartbeat_s=QUICK_HEARTBEAT_S)
    await key_watch.start()
    try:
        yield key_watch, seen
    finally:
        await key_watch.stop()


async def test_an_idle_watch_sets_no_flow_control_timer(
    nc: NatsClient, watch: tuple[KeyWatch, Seen], bucket: KeyValue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-py's flow-control check slept 0.25 s in a loop for as long as the watch lived: 4
    wake-ups a second per watch, 20 of an idle `up`'s 24. Now a watch with nothing to answer
    waits for the server's flow-control request without a timer."""
    _, seen = watch
    await bucket.put("a", b"1")
    await seen.until(1)
    loop = asyncio.get_running_loop()
    delays: list[float] = []
    call_later = loop.call_later

    def counting_call_later(delay: float, callback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        delays.append(delay)
        return call_later(delay, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_later", counting_call_later)
    # Over 1 s nats-py's check slept 4 times; the heartbeat check sleeps 10 s, and the server's
    # heartbeat (every 5 s) is a read, not a timer.
    await asyncio.sleep(1.0)
    await bucket.put("b", b"2")
    assert await seen.until(2) == [("a", b"1"), ("b", b"2")]
    if FASTPATH_ENABLED:
        assert FLOW_CONTROL_RECHECK_S not in delays, delays
    else:  # nats-py's own (ASYNCINFER_NATS_FASTPATH=0, or a nats-py the fast path does not know)
        assert FLOW_CONTROL_RECHECK_S in delays, delays


async def test_an_ordered_consumer_read_as_an_iterator_answers_flow_control_through_a_backlog(
    nc: NatsClient,
) -> None:
    """Read through `messages` (not a callback, not next_msg), an ordered consumer's flow-control
    requests are answered by the task the fast path now wakes only when one is scheduled. The
    server stops delivering until an answer comes; with heartbeats 60 s apart (a stalled consumer's
    heartbeat carries the request again) nothing else would answer within the test's 30 s."""
    js = nc.jetstream()
    await js.add_stream(name="BACKLOG", subjects=["backlog.>"])
    count, size = 500, 64 * 1024  # 32 MiB: the server asks for flow control a few times
    for number in range(count):
        await js.publish(f"backlog.{number}", bytes(size))
    subscription = await js.subscribe("backlog.>", stream="BACKLOG", ordered_consumer=True, idle_heartbeat=60)
    received: list[str] = []
    try:
        async with asyncio.timeout(30):
            async for msg in subscription.messages:
                received.append(msg.subject)
                await asyncio.sleep(0)  # a reader that handles each message on its own turn
                if len(received) == count:
                    break
    finally:
        await subscription.unsubscribe()
    assert received == [f"backlog.{number}" for number in range(count)]


async def test_a_watch_whose_consumer_is_deleted_resumes_with_every_change(
    nc: NatsClient, quick_watch: tuple[KeyWatch, Seen], bucket: KeyValue
) -> None:
    _, seen = quick_watch
    await bucket.put("a", b"1")
    await seen.until(1)
    js = nc.jetstream()
    [consumer] = await js.consumers_info(kv_stream(BUCKET))
    assert await js.delete_consumer(kv_stream(BUCKET), consumer.name)
    await bucket.put("b", b"2")  # nobody delivers it now
    await bucket.put("a", b"3")
    # nats-py's heartbeat check remakes the consumer after the last sequence delivered.
    assert await seen.until(3) == [("a", b"1"), ("b", b"2"), ("a", b"3")]
    await bucket.put("c", b"4")
    assert await seen.until(4) == [("a", b"1"), ("b", b"2"), ("a", b"3"), ("c", b"4")]
    [remade] = await js.consumers_info(kv_stream(BUCKET))
    assert remade.name != consumer.name


async def test_a_watch_resumes_with_every_change_after_the_nats_server_restarts_on_its_store(
    nats_server: NatsServerProcess, config: Config
) -> None:
    nc = await connect(config.nats, name="test")
    try:
        bucket = await nc.jetstream().create_key_value(bucket=BUCKET, history=1)
        seen = Seen()
        key_watch = KeyWatch(nc.jetstream(), BUCKET, seen, name="test", idle_heartbeat_s=QUICK_HEARTBEAT_S)
        await key_watch.start()
        try:
            await bucket.put("a", b"1")
            await seen.until(1)
            await nats_server.astop()  # the ordered consumer, in memory, goes with it
            nats_server.start()  # same port, same store
            async with asyncio.timeout(30):
                while not nc.is_connected:  # noqa: ASYNC110 - nats-py's reconnect loop, no event to wait on
                    await asyncio.sleep(0.05)
                # Connected is not JetStream ready: a restarted server recovers its streams from the
                # store after it takes connections, and a put before then went unanswered for its
                # 5 s under load (session 32's CI2). A read tells, and writes nothing twice.
                while True:
                    try:
                        async with asyncio.timeout(2):
                            await nc.jetstream().stream_info(kv_stream(BUCKET))
                        break
                    except (
                        TimeoutError,
                        nats.errors.TimeoutError,
                        nats.errors.NoRespondersError,
                        nats.js.errors.ServiceUnavailableError,
                    ):
                        await asyncio.sleep(0.1)
            await bucket.put("b", b"2")
            await bucket.put("a", b"3")
            assert await seen.until(3) == [("a", b"1"), ("b", b"2"), ("a", b"3")]
        finally:
            await key_watch.stop()
    finally:
        await nc.close()


async def test_a_watch_needs_a_heartbeat_above_zero(nc: NatsClient) -> None:
    for heartbeat_s in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="idle_heartbeat_s"):
            KeyWatch(nc.jetstream(), BUCKET, Seen(), name="test", idle_heartbeat_s=heartbeat_s)
