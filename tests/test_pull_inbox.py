"""One pull inbox for every held or no-wait pull of the scheduler's (the dispatcher's queues, the
webhook sender's and notifier's held pulls), against a real nats-server: a pull answered by
messages, by an expiry, by a refusal (409), ended early by an interrupt, lost with its connection;
one inbox for a consumer's pulls, and a late answer never read as the next pull's."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from asyncinfer.config import Config
from asyncinfer.contract import consumer_next_subject
from asyncinfer.declarations import ensure_work_consumer, ensure_work_stream
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.jobs import Priority, work_subject
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg
from asyncinfer.nats.connection import connect, connection_changes
from asyncinfer.nats.pull_inbox import PullInbox, connection_epoch
from tests.silent_proxy import SilentProxy

MODEL = "demo"


async def consumer(nc: NatsClient, config: Config, priority: Priority = Priority.NORMAL) -> str:
    js = nc.jetstream()
    await ensure_work_stream(js, config.nats)
    return await ensure_work_consumer(js, config.nats, model_name=MODEL, priority=priority, ack_wait_s=30)


def subscriptions(nc: NatsClient) -> int:
    return len(nc._subs)


async def requests_seen(nc: NatsClient, subject: str) -> asyncio.Queue[Msg]:
    """The pull requests sent to a consumer, as the server gets them (a subscriber of its own)."""
    seen: asyncio.Queue[Msg] = asyncio.Queue()
    await nc.subscribe(subject, cb=seen.put)
    await nc.flush()
    return seen


async def test_pulls_share_one_inbox_and_a_late_answer_is_not_taken_for_the_next(
    nc: NatsClient, config: Config
) -> None:
    stream, normal = config.nats.work_stream, await consumer(nc, config)
    inbox = PullInbox(nc)
    before = subscriptions(nc)
    assert await inbox.pull(stream, normal, 4) == []
    assert inbox.ended == "empty"
    js = nc.jetstream()
    for n in range(3):
        await js.publish(work_subject(MODEL, Priority.NORMAL), b"job %d" % n)
    first = await inbox.pull(stream, normal, 2)  # exactly as many as asked: no status follows
    assert inbox.ended == "answered"
    second = await inbox.pull(stream, normal, 2)  # fewer: a status ends it
    assert inbox.ended == "empty"
    assert [m.data for m in first + second] == [b"job 0", b"job 1", b"job 2"]
    assert subscriptions(nc) == before + 1
    # A pull whose timer fires before its answer is read (here at once; a process that stalled,
    # below) makes a round trip to the server, after which its answer has been read: it takes its
    # own late "no messages", so that cannot be read as the answer to the next pull either.
    assert await inbox.pull(stream, normal, 1, timeout_s=1e-6) == []
    assert inbox.ended == "empty"
    assert subscriptions(nc) == before + 1
    await js.publish(work_subject(MODEL, Priority.NORMAL), b"job 3")
    # Held, not no-wait: the stream's ack of job 3 may reach us before its consumer has counted it
    # (nats-server tells its consumers of a new message apart from the ack), and a no-wait pull at
    # that moment is answered 404 though the message is stored; a held one waits for it. A late
    # "no messages" of the pull before, read here, would still end it at once, empty.
    third = await inbox.pull(stream, normal, 1, wait_s=5.0)
    assert [m.data for m in third] == [b"job 3"], inbox.ended
    await inbox.close()
    assert subscriptions(nc) == before


async def test_a_held_pull_is_answered_by_a_message_as_it_is_stored(nc: NatsClient, config: Config) -> None:
    high = await consumer(nc, config, Priority.HIGH)
    requests = await requests_seen(nc, consumer_next_subject(config.nats.work_stream, high))
    inbox = PullInbox(nc)
    pulling = asyncio.create_task(inbox.pull(config.nats.work_stream, high, 1, wait_s=5.0))
    request = await asyncio.wait_for(requests.get(), 5.0)
    assert json.loads(request.data) == {"batch": 1, "expires": 5_000_000_000}
    await nc.jetstream().publish(work_subject(MODEL, Priority.HIGH), b"late")
    msgs = await asyncio.wait_for(pulling, 5.0)
    assert [m.data for m in msgs] == [b"late"]
    assert inbox.ended == "answered"
    await msgs[0].ack()
    await inbox.close()


async def test_a_held_pull_of_several_hands_each_message_over_as_it_comes(nc: NatsClient, config: Config) -> None:
    """The webhook sender's pull of as many deliveries as it has free slots: one request, held, and
    each message handled as it is stored, not once the last came (here the next is stored only once
    the one before was handled: handed over at the end, the pull would wait out its hold with one)."""
    normal = await consumer(nc, config)
    requests = await requests_seen(nc, consumer_next_subject(config.nats.work_stream, normal))
    js = nc.jetstream()
    handled: list[bytes] = []

    async def handle(msg: Msg) -> None:
        handled.append(msg.data)
        await msg.ack()
        if len(handled) < 3:
            await js.publish(work_subject(MODEL, Priority.NORMAL), b"%d" % len(handled))

    inbox = PullInbox(nc)
    pulling = asyncio.create_task(inbox.pull(config.nats.work_stream, normal, 3, wait_s=30.0, handle=handle))
    await asyncio.wait_for(requests.get(), 5.0)
    await js.publish(work_subject(MODEL, Priority.NORMAL), b"0")
    msgs = await asyncio.wait_for(pulling, 10.0)
    assert handled == [m.data for m in msgs] == [b"0", b"1", b"2"]
    assert inbox.ended == "answered"
    assert requests.qsize() == 0  # one request for the three
    await inbox.close()


async def test_a_held_pull_that_expires_ends_empty_and_keeps_its_inbox(nc: NatsClient, config: Config) -> None:
    """The server's 408 at the pull's expiry, not the client's timeout: the queue had nothing, and
    the inbox serves the next pull (no SUB or UNSUB per pull)."""
    normal = await consumer(nc, config)
    inbox = PullInbox(nc)
    assert await inbox.pull(config.nats.work_stream, normal, 1, wait_s=0.2) == []
    assert inbox.ended == "empty"
    before = subscriptions(nc)
    assert await inbox.pull(config.nats.work_stream, normal, 1, wait_s=0.2) == []
    assert (inbox.ended, subscriptions(nc)) == ("empty", before)
    await inbox.close()


async def test_a_refused_pull_ends_refused_and_says_why(nc: NatsClient, config: Config) -> None:
    """A 409 (here its consumer deleted under a held pull; also a leader being elected, a batch
    or a number of waiting pulls past the consumer's limits): refused, not empty, so a webhook
    loop waits before it asks again and a dispatcher's held pull does not count as expired."""
    normal = await consumer(nc, config)
    requests = await requests_seen(nc, consumer_next_subject(config.nats.work_stream, normal))
    inbox = PullInbox(nc)
    with capture_logs() as logs:
        pulling = asyncio.create_task(inbox.pull(config.nats.work_stream, normal, 1, wait_s=30.0))
        await asyncio.wait_for(requests.get(), 5.0)  # held now
        await nc.jetstream().delete_consumer(config.nats.work_stream, normal)
        assert await asyncio.wait_for(pulling, 5.0) == []
    assert inbox.ended == "refused"
    (line,) = [e for e in logs if e["event"] == "pull_refused"]
    assert (line["status"], line["consumer"], line["log_level"]) == ("409", normal, "warning")
    assert "Consumer Deleted" in line["description"]
    await inbox.close()


async def test_an_interrupt_ends_a_held_pull_and_every_later_one(nc: NatsClient, config: Config) -> None:
    """A stop cannot wait out a hold: the inbox wakes itself with a message of its own, and is
    abandoned (the pull's answer may still come)."""
    normal = await consumer(nc, config)
    requests = await requests_seen(nc, consumer_next_subject(config.nats.work_stream, normal))
    inbox = PullInbox(nc)
    before = subscriptions(nc)
    pulling = asyncio.create_task(inbox.pull(config.nats.work_stream, normal, 1, wait_s=30.0))
    await asyncio.wait_for(requests.get(), 5.0)  # held now
    assert subscriptions(nc) == before + 1
    await inbox.interrupt()
    assert await asyncio.wait_for(pulling, 2.0) == []
    assert (inbox.ended, inbox.interrupted, subscriptions(nc)) == ("interrupted", True, before)
    assert await inbox.pull(config.nats.work_stream, normal, 1, wait_s=30.0) == []
    assert inbox.ended == "interrupted"
    assert requests.empty()  # no request sent
    await inbox.close()


class LostConnection:
    """A client whose connection was lost a moment ago, before nats-py noticed: still "connected",
    its write to the closed transport raising as uvloop's does."""

    is_connected = True
    stats = {"reconnects": 0}

    def new_inbox(self) -> str:
        return "_INBOX.lost"

    async def subscribe(self, subject: str) -> LostConnection:
        self.subject = subject
        return self

    async def unsubscribe(self) -> None:
        pass

    async def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")


@pytest.mark.unit
async def test_a_pull_on_a_connection_lost_a_moment_ago_pulls_nothing_and_raises_nothing() -> None:
    """What `up` saw when its nats-server died: a round's pull raised, logged as the scheduler's
    error before `up` said why it stops. It is a warning now, and the round finds nothing."""
    inbox = PullInbox(LostConnection())  # type: ignore[arg-type]
    with capture_logs() as logs:
        assert await inbox.pull("WORK", "work-demo-normal", 4) == []
    assert inbox.ended == "lost"
    assert [(e["event"], e["log_level"]) for e in logs] == [("pull_not_sent", "warning")]


async def test_a_pull_while_the_connection_is_down_returns_at_once(
    config: Config, nats_server: NatsServerProcess
) -> None:
    # Else it waits out its timeout in nats-py's buffer: a scheduler's round lasted a timeout per
    # priority, and so did its stop when NATS had died.
    nc = await connect(config.nats, name="test-down")  # its own: the fixture's drain needs a server
    try:
        normal = await consumer(nc, config)
        lost = connection_changes(nc).next()
        nats_server.kill()
        await asyncio.wait_for(lost.wait(), 5.0)
        assert not nc.is_connected
        inbox = PullInbox(nc)
        pull = inbox.pull(config.nats.work_stream, normal, 4, timeout_s=60.0, wait_s=60.0)
        assert await asyncio.wait_for(pull, 10.0) == []
        assert inbox.ended == "lost"
    finally:
        await nc.close()


@pytest.fixture
async def proxy(nats_server: NatsServerProcess) -> AsyncIterator[SilentProxy]:
    proxy = SilentProxy(nats_server.port)
    await proxy.start()
    yield proxy
    await proxy.stop()


async def a_pull_held_on_a_live_connection(
    client: NatsClient,
    inbox: PullInbox,
    requests: asyncio.Queue[Msg],
    stream: str,
    consumer: str,
    hold_s: float,
    logs: list[MutableMapping[str, Any]],
) -> tuple[asyncio.Task[list[Msg]], int, int]:
    """A held pull the server has, sent on the connection the client is still on: its task, that
    connection's epoch, and where in `logs` its try began. The proxied client's quick pings (lost
    after about 1 s unanswered) can take the connection for lost before the test silences it, on
    a loaded machine: the pull then ends lost at once (or is sent on the next connection), and
    the try is made again, three at most."""
    for _ in range(3):
        while (epoch := connection_epoch(client)) == -1:
            await asyncio.wait_for(connection_changes(client).next().wait(), 5.0)
        mark = len(logs)
        pulling = asyncio.create_task(inbox.pull(stream, consumer, 1, timeout_s=1.0, wait_s=hold_s))
        seen = asyncio.ensure_future(requests.get())
        await asyncio.wait({pulling, seen}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
        if seen.done() and not pulling.done() and connection_epoch(client) == epoch:
            return pulling, epoch, mark
        seen.cancel()
        await asyncio.wait_for(pulling, hold_s + 5.0)
        while not requests.empty():
            requests.get_nowait()
    raise AssertionError(f"no pull held on a live connection in three tries: {inbox.ended=}, {client.stats=}")


@pytest.mark.parametrize("hold_s", [1.0, 3.0], ids=["ended-before-the-reconnect", "ended-after-the-reconnect"])
async def test_a_held_pull_lost_with_its_connection_ends_lost_and_abandons_its_inbox(
    config: Config, nc: NatsClient, proxy: SilentProxy, hold_s: float
) -> None:
    """The connection goes silent with a pull held open; the client sees it by its pings (about
    1 s) and connects again (its inbox subscribed again on the new connection). The server ends
    the pull at its hold (408) on its reply subject: down the silent connection if that comes
    first (1 s, mostly), so no answer comes and the pull ends at its hold and timeout; or, once the
    inbox is subscribed again (3 s), on the new connection, where it is no word that nothing was
    queued (what the server handed the pull before may have gone down the lost one: CI, session
    34, read it as "empty"). Either way the pull is lost, its inbox abandoned (a late answer is
    never read as the next pull's), logged at debug (the loss is logged once, by the
    connection). The next pull works on the new connection."""
    normal = await consumer(nc, config)
    proxied = config.replace(
        nats={"url": f"nats://127.0.0.1:{proxy.port}", "ping_interval_s": 0.25, "max_outstanding_pings": 3}
    ).nats
    client = await connect(proxied, name="test-proxied")
    try:
        requests = await requests_seen(nc, consumer_next_subject(config.nats.work_stream, normal))
        inbox = PullInbox(client)
        before = subscriptions(client)
        with capture_logs() as logs:
            pulling, first, mark = await a_pull_held_on_a_live_connection(
                client, inbox, requests, config.nats.work_stream, normal, hold_s, logs
            )
            proxy.silence()
            while connection_epoch(client) in (first, -1):  # lost, then back through the proxy
                await asyncio.wait_for(connection_changes(client).next().wait(), 5.0)
            assert await asyncio.wait_for(pulling, 5.0) == []
        assert inbox.ended == "lost"
        assert subscriptions(client) == before
        assert [(e["event"], e["log_level"]) for e in logs[mark:] if e["event"].startswith("pull_")] == [
            ("pull_lost_with_its_connection", "debug")
        ]
        await nc.jetstream().publish(work_subject(MODEL, Priority.NORMAL), b"after")
        msgs = await inbox.pull(config.nats.work_stream, normal, 1, wait_s=5.0)
        assert [m.data for m in msgs] == [b"after"]
        assert inbox.ended == "answered"
        await msgs[0].ack()
        await inbox.close()
    finally:
        await proxy.cut()
        await client.close()


async def test_a_held_pull_answered_while_the_process_stalled_keeps_its_message(nc: NatsClient, config: Config) -> None:
    """A scheduler whose event loop stalls past a held pull's timer (a frozen process or VM, a long
    pause) wakes to the timer expired and the server's answer unread in its socket; the timer
    fires first. The message is still taken: abandoned with its inbox, it waited out AckWait (30 s)
    in the scheduler's hands (jobs submitted while a scheduler was frozen 14 s ran 23 s after it
    woke; the webhook consumers' held pulls, on this inbox too, did the same)."""
    stream, low = config.nats.work_stream, await consumer(nc, config, Priority.LOW)
    inbox = PullInbox(nc)
    pulling = asyncio.create_task(inbox.pull(stream, low, 1, timeout_s=0.2, wait_s=0.5))
    js = nc.jetstream()

    async def held() -> bool:
        return (await js.consumer_info(stream, low)).num_waiting == 1

    async with asyncio.timeout(10):
        while not await held():  # noqa: ASYNC110 - the server's count of waiting pulls announces nothing
            await asyncio.sleep(0.01)

    def publish_elsewhere() -> None:
        async def publish() -> None:
            other = await connect(config.nats, name="stall-publisher")
            try:
                await other.jetstream().publish(work_subject(MODEL, Priority.LOW), b"payload")
            finally:
                await other.close()

        asyncio.run(publish())

    # The stall: this loop runs nothing while another connection queues a job, which the server
    # delivers to the held pull, and past the pull's timer (0.7 s).
    publisher = threading.Thread(target=publish_elsewhere)
    publisher.start()
    publisher.join()
    time.sleep(1.0)  # noqa: ASYNC251 - the stall is the scenario
    msgs = await asyncio.wait_for(pulling, 5)
    assert [msg.data for msg in msgs] == [b"payload"]
    assert msgs[0].metadata.num_delivered == 1
    await msgs[0].ack()
    await inbox.close()
