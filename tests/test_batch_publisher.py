"""Coalesced publishes (asyncinfer.nats.batch_publisher) against a real nats-server: writes ready
together are stored as one atomic batch with one answer; a batch the server refuses fails each of
its writes (for the caller to write alone) and stores none; a stream without atomic batches turns
batching off; a lone write is stored at once."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.batch_publisher import BatchNotStored, BatchPublisher


async def stream(nc: NatsClient, name: str, *, atomic: bool) -> None:
    config = {"name": name, "subjects": [f"{name.lower()}.>"], "storage": "memory", "allow_atomic": atomic}
    answer = json.loads((await nc.request(f"$JS.API.STREAM.CREATE.{name}", json.dumps(config).encode())).data)
    assert "error" not in answer, answer


async def stored(nc: NatsClient, name: str) -> int:
    return (await nc.jetstream().stream_info(name)).state.messages


async def test_writes_ready_together_are_one_batch_with_one_answer(nc: NatsClient) -> None:
    await stream(nc, "ATOMIC", atomic=True)
    publisher = BatchPublisher(nc, what="test")
    sequences = await asyncio.gather(
        *(publisher.publish(f"atomic.{i}", b"x", {"Nats-Msg-Id": f"m{i}"}) for i in range(250))
    )
    assert sorted(sequences) == list(range(1, 251))
    assert await stored(nc, "ATOMIC") == 250
    assert publisher.messages_sent == 250
    assert publisher.batches_sent == 3, "250 writes at most 100 to a batch"
    alone = await publisher.publish("atomic.alone", b"x", {})
    assert alone == 251
    assert publisher.batches_sent == 4


async def test_a_refused_batch_stores_none_and_fails_each_write(nc: NatsClient) -> None:
    await stream(nc, "ATOMIC", atomic=True)
    publisher = BatchPublisher(nc, what="test")
    # The same message ID twice in one batch: the server refuses the whole batch.
    results = await asyncio.gather(
        *(publisher.publish(f"atomic.{i}", b"x", {"Nats-Msg-Id": "same" if i < 2 else f"m{i}"}) for i in range(5)),
        return_exceptions=True,
    )
    assert all(isinstance(r, BatchNotStored) for r in results), results
    assert await stored(nc, "ATOMIC") == 0
    assert publisher.enabled, "a refused batch does not turn batching off"


async def test_a_stream_without_atomic_batches_turns_batching_off(nc: NatsClient) -> None:
    await stream(nc, "PLAIN", atomic=False)
    publisher = BatchPublisher(nc, what="test")
    results = await asyncio.gather(
        *(publisher.publish(f"plain.{i}", b"x", {}) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, BatchNotStored) for r in results)
    assert not publisher.enabled
    assert await stored(nc, "PLAIN") == 0
    with pytest.raises(BatchNotStored):
        await asyncio.gather(*(publisher.publish(f"plain.{i}", b"x", {}) for i in range(2)))
    assert await publisher.publish("plain.alone", b"x", {}) == 1, "a lone write is a plain publish"
