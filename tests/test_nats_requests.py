"""asyncinfer.nats.requests against a real nats-server: the same answers and errors as nats-py's
`Client.request` / `JetStreamContext.publish`, and no response future left behind. They run on the
fast path, and with ASYNCINFER_NATS_FASTPATH=0 (make pytest-nats-fallback) on the public one."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.nats import (
    APIError,
    InvalidKeyError,
    KeyWrongLastSequenceError,
    NatsTimeoutError,
    NoRespondersError,
    NoStreamResponseError,
    api,
    requests,
)
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.kv import KvBucket, kv_latest, kv_put_expecting, open_kv_bucket
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


@pytest.fixture
async def bucket(nc: NatsClient) -> KvBucket:
    js = nc.jetstream()
    await js.create_key_value(bucket="records", history=1, direct=False)
    return await open_kv_bucket(js, "records")


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
