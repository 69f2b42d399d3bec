"""asyncinfer.nats.requests against a real nats-server: the same answers and errors as nats-py's
`Client.request` / `JetStreamContext.publish`, and no response future left behind. They run on the
fast path, and with ASYNCINFER_NATS_FASTPATH=0 (make pytest-nats-fallback) on the public one."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from nats.aio.transport import TcpTransport

from asyncinfer.config import Config
from asyncinfer.nats import (
    APIError,
    BadHeaderError,
    BadSubjectError,
    InvalidKeyError,
    KeyWrongLastSequenceError,
    NatsTimeoutError,
    NoRespondersError,
    NoStreamResponseError,
    NotFoundError,
    UnexpectedEOF,
    _fastpath,
    api,
    requests,
)
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.connection import connect
from asyncinfer.nats.groups import DurableMessage, publish_durably_many
from asyncinfer.nats.kv import KvBucket, kv_latest, kv_put_expecting, open_kv_bucket
from asyncinfer.nats.requests import js_publish, pending_request_count, request
from asyncinfer.nats.streams import StoreFullError

# Also run with the NATS adapter's fast path off (make pytest-nats-fallback).
pytestmark = pytest.mark.nats_fallback


@pytest.fixture
async def stream(nc: NatsClient) -> str:
    await nc.jetstream().add_stream(api.StreamConfig(name="REQ", subjects=["req.>"], duplicate_window=60))
    return "REQ"


async def test_publish_stores_and_a_repeated_msg_id_is_the_first(nc: NatsClient, stream: str) -> None:
    first = await js_publish(nc.jetstream(), "req.a", b"one", timeout_s=2, headers={"Nats-Msg-Id": "m1"})
    second = await js_publish(nc.jetstream(), "req.a", b"two", timeout_s=2, headers={"Nats-Msg-Id": "m2"})
    again = await js_publish(nc.jetstream(), "req.a", b"one again", timeout_s=2, headers={"Nats-Msg-Id": "m1"})
    assert (first, second, again) == (1, 2, 1)
    stored = await nc.jetstream().get_msg(stream, seq=1)
    assert stored.data == b"one"
    assert (await nc.jetstream().stream_info(stream)).state.messages == 2
    assert pending_request_count(nc) == 0


async def test_a_lost_compare_and_set_is_key_wrong_last_sequence(nc: NatsClient, stream: str) -> None:
    expect = "Nats-Expected-Last-Subject-Sequence"
    created = await js_publish(nc.jetstream(), "req.key", b"v1", timeout_s=2, headers={expect: "0"})
    with pytest.raises(KeyWrongLastSequenceError):
        await js_publish(nc.jetstream(), "req.key", b"v1 again", timeout_s=2, headers={expect: "0"})
    updated = await js_publish(nc.jetstream(), "req.key", b"v2", timeout_s=2, headers={expect: str(created)})
    with pytest.raises(KeyWrongLastSequenceError):
        await js_publish(nc.jetstream(), "req.key", b"stale", timeout_s=2, headers={expect: str(created)})
    assert updated == created + 1


async def test_other_api_errors_raise_as_nats_py_does(nc: NatsClient, stream: str) -> None:
    with pytest.raises(APIError) as info:
        await js_publish(nc.jetstream(), "req.a", b"x", timeout_s=2, headers={"Nats-Expected-Stream": "ANOTHER"})
    assert info.value.code == 400
    assert not isinstance(info.value, KeyWrongLastSequenceError)


async def test_no_stream_is_no_responders(nc: NatsClient) -> None:
    with pytest.raises(NoStreamResponseError):
        await js_publish(nc.jetstream(), "nothing.listens.here", b"x", timeout_s=2)
    with pytest.raises(NoRespondersError):
        await request(nc, "nothing.listens.here", b"x", timeout_s=2)
    assert pending_request_count(nc) == 0


async def test_a_silent_responder_times_out_and_its_future_is_dropped(nc: NatsClient) -> None:
    heard = asyncio.Event()

    async def silent(msg: Any) -> None:
        heard.set()

    await nc.subscribe("silent", cb=silent)
    with pytest.raises(NatsTimeoutError):
        await request(nc, "silent", b"x", timeout_s=0.2)
    assert heard.is_set()
    assert pending_request_count(nc) == 0


async def test_concurrent_requests_each_get_their_own_answer(nc: NatsClient) -> None:
    async def echo(msg: Any) -> None:
        await msg.respond(msg.data + b"!" + (msg.headers or {}).get("n", "").encode())

    await nc.subscribe("echo", cb=echo)
    answers = await asyncio.gather(
        *(request(nc, "echo", str(i).encode(), timeout_s=5, headers={"n": str(i)}) for i in range(500))
    )
    assert [a.data for a in answers] == [f"{i}!{i}".encode() for i in range(500)]
    assert pending_request_count(nc) == 0


async def test_a_cancelled_request_leaves_nothing_behind(nc: NatsClient) -> None:
    heard = asyncio.Event()

    async def silent(msg: Any) -> None:
        heard.set()

    await nc.subscribe("slow", cb=silent)
    call = asyncio.create_task(request(nc, "slow", b"x", timeout_s=30))
    await heard.wait()
    assert pending_request_count(nc) == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert pending_request_count(nc) == 0


def both_paths(name: str, fast: Any, public: Any) -> Any:
    """Parametrizes `name` with the fast and the public implementation, whichever this run binds."""
    return pytest.mark.parametrize(
        name,
        [
            pytest.param(
                fast,
                marks=pytest.mark.skipif(
                    bool(_fastpath._missing_private_names()), reason="this nats-py lacks what the fast path uses"
                ),
            ),
            public,
        ],
        ids=["fast", "public"],
    )


# Both implementations of a pipelined group.
PUBLISH_MANY = both_paths("publish_many", _fastpath.js_publish_many, requests.public_js_publish_many)


@PUBLISH_MANY
async def test_a_group_is_all_sent_before_any_answer_is_awaited(nc: NatsClient, publish_many: Any) -> None:
    """A responder that answers nobody until it has heard the whole group: a group sent one
    publish per answer would never complete (and time out)."""
    count = 50
    heard: list[Any] = []

    async def answer_when_all_heard(msg: Any) -> None:
        heard.append(msg)
        if len(heard) == count:
            for n, held in enumerate(heard):
                await held.respond(b'{"stream": "G", "seq": %d}' % (n + 1))

    await nc.subscribe("group.>", cb=answer_when_all_heard)
    publishes = [(f"group.{i}", b"x", {"n": str(i)}) for i in range(count)]
    results = await publish_many(nc.jetstream(), publishes, timeout_s=30)
    assert results == list(range(1, count + 1))
    assert [h.headers["n"] for h in heard] == [str(i) for i in range(count)]  # sent in order
    assert pending_request_count(nc) == 0


@PUBLISH_MANY
async def test_a_group_answers_each_publish_with_its_own_sequence_or_error(
    nc: NatsClient, stream: str, publish_many: Any
) -> None:
    expect = "Nats-Expected-Last-Subject-Sequence"
    results = await publish_many(
        nc.jetstream(),
        [
            ("req.a", b"one", {"Nats-Msg-Id": "g1"}),
            ("nothing.listens.here", b"x", None),
            ("req.a", b"one again", {"Nats-Msg-Id": "g1"}),  # a duplicate: the first one's sequence
            ("req.b", b"x", {"Nats-Expected-Stream": "ANOTHER"}),
            ("req.c", b"x", {expect: "7"}),
            ("req.d", b"two", None),
        ],
        timeout_s=5,
    )
    assert results[0] == 1
    assert isinstance(results[1], NoStreamResponseError)
    assert results[2] == 1
    assert isinstance(results[3], APIError)
    assert results[3].code == 400
    assert isinstance(results[4], KeyWrongLastSequenceError)
    assert results[5] == 2
    assert (await nc.jetstream().stream_info(stream)).state.messages == 2
    assert pending_request_count(nc) == 0


@PUBLISH_MANY
async def test_a_group_delivers_what_nats_py_publishes_and_refuses_what_it_refuses(
    nc: NatsClient, publish_many: Any
) -> None:
    """The fast path builds each HPUB itself: a subscriber gets the same payload and headers as from
    nats-py's own publish (values trimmed, CR/LF turned to spaces, an empty key skipped), and a
    subject or header nats-py refuses is refused the same way, with what came before it still sent."""
    heard: asyncio.Queue[Any] = asyncio.Queue()

    async def echo(msg: Any) -> None:
        heard.put_nowait(msg)
        if msg.reply:
            await msg.respond(b'{"stream": "G", "seq": 1}')

    await nc.subscribe("same.>", cb=echo)
    headers = {"Plain": "v", "Spaced": "  padded  ", "Broken": "a\r\nb", " ": "skipped", "Nats-Msg-Id": "m-1"}
    payload = bytes(range(256)) * 4
    await nc.publish("same.public", payload, headers=dict(headers))
    public = await asyncio.wait_for(heard.get(), 5)
    assert await publish_many(nc.jetstream(), [("same.group", payload, dict(headers))], timeout_s=5) == [1]
    grouped = await asyncio.wait_for(heard.get(), 5)
    assert grouped.data == public.data == payload
    assert grouped.headers == public.headers
    assert grouped.headers["Broken"] == "a  b"
    for bad in (("same.with space", b"x", None), ("same.x", b"x", {"bad key": "v"})):
        with pytest.raises((BadSubjectError, BadHeaderError)) as public_error:
            await nc.publish(bad[0], bad[1], headers=bad[2])
        results = await publish_many(nc.jetstream(), [("same.before", b"ok", None), bad], timeout_s=5)
        assert results[0] == 1
        assert type(results[1]) is type(public_error.value)
        assert (await asyncio.wait_for(heard.get(), 5)).subject == "same.before"
    assert heard.empty()
    if publish_many is _fastpath.js_publish_many:
        # nats-py's own request leaves the future of a publish it refused in its response map.
        assert pending_request_count(nc) == 0


@both_paths("publish_all", _fastpath.publish_all, requests.public_publish_all)
async def test_publish_all_sends_in_order_up_to_what_nats_py_refuses(nc: NatsClient, publish_all: Any) -> None:
    heard: asyncio.Queue[Any] = asyncio.Queue()

    async def hear(msg: Any) -> None:
        heard.put_nowait(msg)

    await nc.subscribe("all.>", cb=hear)
    await publish_all(nc, [("all.a", b"1"), ("all.b", b""), ("all.c", b"3" * 5000)])
    got = [await asyncio.wait_for(heard.get(), 5) for _ in range(3)]
    assert [(m.subject, m.data, m.reply, m.headers) for m in got] == [
        ("all.a", b"1", "", None),
        ("all.b", b"", "", None),
        ("all.c", b"3" * 5000, "", None),
    ]
    with pytest.raises(BadSubjectError):
        await publish_all(nc, [("all.d", b"4"), ("all bad", b"x"), ("all.e", b"5")])
    await nc.publish("all.z", b"after")
    assert [(await asyncio.wait_for(heard.get(), 5)).subject for _ in range(2)] == ["all.d", "all.z"]  # no all.e


async def test_a_durable_group_retries_what_met_no_stream_and_maps_a_full_store(nc: NatsClient) -> None:
    js = nc.jetstream()
    await js.add_stream(api.StreamConfig(name="TINY", subjects=["tiny.>"], max_msgs=2, discard=api.DiscardPolicy.NEW))
    messages = [DurableMessage(f"tiny.{i}", b"x", msg_id=f"t{i}") for i in range(3)]
    messages.append(DurableMessage("tiny.0", b"x", msg_id="t0"))  # a duplicate of the first: no room needed
    results = await publish_durably_many(js, messages, stream="TINY", retry_for_s=0.5)
    assert results[:2] == [1, 2]
    assert isinstance(results[2], StoreFullError)
    assert results[3] == 1
    # The wrong stream's subject: retried for retry_for_s, then its error, the others unharmed.
    results = await publish_durably_many(
        js, [DurableMessage("nowhere.0", b"x", msg_id="n0"), messages[0]], stream="TINY", retry_for_s=0.3
    )
    assert isinstance(results[0], NoStreamResponseError)
    assert results[1] == 1
    assert pending_request_count(nc) == 0


@pytest.fixture
async def bucket(nc: NatsClient) -> KvBucket:
    js = nc.jetstream()
    await js.create_key_value(bucket="records", history=1, direct=False)
    return await open_kv_bucket(js, "records")


DIRECT_GET = both_paths("direct_get", _fastpath.direct_get, requests.public_direct_get)


@DIRECT_GET
async def test_a_direct_get_reads_a_message_by_sequence_or_the_next_on_a_subject(
    nc: NatsClient, direct_get: Any
) -> None:
    """What BlobStore reads an object's chunks with: by sequence, or the first at or after one on a
    subject; NotFoundError past the end, as nats-py's get_msg(direct=True) raises."""
    js = nc.jetstream()
    await js.add_stream(api.StreamConfig(name="DIRECT", subjects=["direct.>"], allow_direct=True))
    for n, subject in enumerate(["direct.a", "direct.b", "direct.a"]):
        await js.publish(subject, b"payload %d" % n)
    assert await direct_get(js, "DIRECT", seq=2, timeout_s=5) == ("direct.b", 2, b"payload 1")
    assert await direct_get(js, "DIRECT", seq=2, next_by_subject="direct.a", timeout_s=5) == (
        "direct.a",
        3,
        b"payload 2",
    )
    with pytest.raises(NotFoundError):
        await direct_get(js, "DIRECT", seq=4, timeout_s=5)
    with pytest.raises(NotFoundError):
        await direct_get(js, "DIRECT", seq=4, next_by_subject="direct.a", timeout_s=5)
    assert pending_request_count(nc) == 0


async def test_kv_reads_the_latest_write_and_nothing_after_a_delete_or_purge(bucket: KvBucket) -> None:
    assert await kv_latest(bucket, "t.a") is None
    first = await kv_put_expecting(bucket, "t.a", b"v1", last_revision=0)
    assert await kv_latest(bucket, "t.a") == (b"v1", first)
    second = await kv_put_expecting(bucket, "t.a", b"v2", last_revision=first, ttl_s=60)
    assert await kv_latest(bucket, "t.a") == (b"v2", second)
    assert (await bucket.kv.get("t.a")).value == b"v2"  # what KeyValue itself reads
    await bucket.kv.delete("t.a")
    assert await kv_latest(bucket, "t.a") is None
    await bucket.kv.put("t.b", b"x")
    await bucket.kv.purge("t.b")
    assert await kv_latest(bucket, "t.b") is None
    with pytest.raises(InvalidKeyError):
        await kv_latest(bucket, "t.*")


async def test_kv_compare_and_set_loses_to_a_newer_write(bucket: KvBucket) -> None:
    first = await kv_put_expecting(bucket, "t.a", b"v1", last_revision=0)
    with pytest.raises(KeyWrongLastSequenceError):
        await kv_put_expecting(bucket, "t.a", b"again", last_revision=0)
    await kv_put_expecting(bucket, "t.a", b"v2", last_revision=first)
    with pytest.raises(KeyWrongLastSequenceError):
        await kv_put_expecting(bucket, "t.a", b"stale", last_revision=first)
    assert await kv_latest(bucket, "t.a") == (b"v2", first + 1)


async def test_a_publish_on_a_connection_lost_a_moment_ago_raises_a_nats_error(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-py's flusher ends when its socket write raises (uvloop's RuntimeError on a transport
    that has just closed); every publish then writes inline and raised that RuntimeError, past the
    callers that handle NATS errors, until nats-py noticed the loss. On the fast path it is a NATS
    error (UnexpectedEOF). The closed transport is played by a write that raises."""
    nc = await connect(config.nats, name="test")
    real_writelines = TcpTransport.writelines

    def closed(self: TcpTransport, payload: Any) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    monkeypatch.setattr(TcpTransport, "writelines", closed)
    raised: BaseException | None = None
    try:
        for _ in range(100):  # the first publishes only queue their bytes; the flusher's write then fails
            try:
                await nc.publish("anything", b"x")
            except BaseException as exc:
                raised = exc
                break
            await asyncio.sleep(0)
    finally:
        monkeypatch.setattr(TcpTransport, "writelines", real_writelines)
        with contextlib.suppress(Exception):
            await nc.close()
    if requests.FASTPATH_ENABLED:
        assert isinstance(raised, UnexpectedEOF), raised
    else:  # nats-py's own behaviour, which the scheduler's pull handles (tests/test_pull_inbox.py)
        assert isinstance(raised, RuntimeError), raised


SWITCH = "ASYNCINFER_NATS_FASTPATH"
ROOT = Path(__file__).resolve().parent.parent


def choice_of_a_fresh_process(**environ: str | None) -> tuple[bool, str]:
    """(FASTPATH_ENABLED, FASTPATH_REASON) as the adapter decides them at import in a new
    interpreter, with `environ` changed (None: unset)."""
    env = {**os.environ, **{k: v for k, v in environ.items() if v is not None}}
    for name in (k for k, v in environ.items() if v is None):
        env.pop(name, None)
    code = "from asyncinfer.nats import requests as r; print(r.FASTPATH_ENABLED); print(r.FASTPATH_REASON)"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    enabled, reason = done.stdout.splitlines()
    return enabled == "True", reason


def test_the_switch_forces_the_public_path() -> None:
    assert choice_of_a_fresh_process(**{SWITCH: "0"}) == (False, f"{SWITCH}=0")
    enabled, reason = choice_of_a_fresh_process(**{SWITCH: None})
    if importlib.metadata.version("nats-py").startswith("2.16."):  # what the fast path was written against
        assert enabled, reason


def test_this_run_uses_the_path_its_environment_asks_for() -> None:
    if os.environ.get(SWITCH) == "0":
        assert not requests.FASTPATH_ENABLED
        assert requests.request is requests.public_request
        assert requests.js_publish is requests.public_js_publish
    elif requests.FASTPATH_ENABLED:
        assert requests.request is not requests.public_request
        assert requests.js_publish is not requests.public_js_publish
