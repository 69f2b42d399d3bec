"""asyncinfer.nats.requests against a real nats-server: the same answers and errors as nats-py's
`Client.request` / `JetStreamContext.publish`, and no response future left behind. They run on the
fast path, and with ASYNCINFER_NATS_FASTPATH=0 (make pytest-nats-fallback) on the public one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncinfer.nats import (
    APIError,
    KeyWrongLastSequenceError,
    NatsTimeoutError,
    NoRespondersError,
    NoStreamResponseError,
    api,
)
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.requests import js_publish, pending_request_count, request


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
