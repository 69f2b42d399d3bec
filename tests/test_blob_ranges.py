"""BlobStore.read_range against a real nats-server: a byte range read by its chunks' sequences
(recorded in the meta when the object is written), across chunk boundaries, with objects written
at the same time interleaving their chunks; and by walking the chunks for an object whose meta has
no sequences (one written before they were recorded)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from asyncinfer import blob_reader
from asyncinfer.blob_meta import CHUNK_BYTES, RESULT_CHUNK_BYTES, new_input_ref, sequence_runs
from asyncinfer.blobs import BlobStore, ensure_objects_bucket
from asyncinfer.config import Config
from asyncinfer.contract import CHUNK_SEQUENCES_HEADER
from asyncinfer.errors import InvalidArgument, NotFound
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import NotFoundError
from asyncinfer.ranged_inputs import RangedInputs, decode, is_ranged

# Also run with the NATS adapter's fast path off (make pytest-nats-fallback).
pytestmark = pytest.mark.nats_fallback

SIZE = 5 * CHUNK_BYTES + 1000


def content(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


async def store_of(nc: NatsClient, config: Config) -> BlobStore:
    return await ensure_objects_bucket(nc, config.nats)


def test_sequences_are_written_as_runs() -> None:
    assert sequence_runs([5, 6, 7, 10, 11, 20]) == "5+3,10+2,20+1"
    assert sequence_runs([]) == ""


async def test_ranges_read_only_what_they_cover_even_when_objects_interleave(nc: NatsClient, config: Config) -> None:
    store = await store_of(nc, config)
    later = time.time() + 3600

    async def slowly(data: bytes) -> AsyncIterator[bytes]:
        for start in range(0, len(data), 50_000):
            yield data[start : start + 50_000]
            await asyncio.sleep(0)  # the two puts take turns, so their chunks interleave in the stream

    a, b = content(1), content(2)
    ref_a, ref_b = new_input_ref(), new_input_ref()
    await asyncio.gather(
        store.put("t", ref_a, slowly(a), expires_at=later, max_bytes=SIZE),
        store.put("t", ref_b, slowly(b), expires_at=later, max_bytes=SIZE),
    )
    info = await store.info("t", ref_a)
    runs = info.meta["headers"][CHUNK_SEQUENCES_HEADER][0]
    assert len(runs.split(",")) > 1  # interleaved: more than one run of sequences
    for offset, length in [(0, 10), (CHUNK_BYTES - 3, 7), (CHUNK_BYTES * 2 + 5, CHUNK_BYTES * 2), (SIZE - 100, 100)]:
        assert await store.read_range("t", ref_a, offset, length) == a[offset : offset + length]
        assert await store.read_range("t", ref_b, offset, length) == b[offset : offset + length]
    assert await store.read_range("t", ref_a, 17, 0) == b""
    with pytest.raises(InvalidArgument):
        await store.read_range("t", ref_a, SIZE - 10, 11)
    with pytest.raises(NotFound) as changed:
        await store.read_range("t", ref_a, 0, 10, sha256="0" * 64)
    assert changed.value.reason == "BLOB_CHANGED"


async def test_an_object_without_sequences_is_read_by_walking_its_chunks(nc: NatsClient, config: Config) -> None:
    store = await store_of(nc, config)
    data = content(3)
    old = new_input_ref()
    await store.put_bytes("t", old, data, expires_at=time.time() + 3600)
    info = await store.info("t", old)
    meta = dict(info.meta)
    meta["headers"] = {k: v for k, v in meta["headers"].items() if k != CHUNK_SEQUENCES_HEADER}
    # The meta as an older writer left it (rolled up over the current one, as every meta write is).
    meta_subject = f"$O.{store.bucket}.M.{base64.urlsafe_b64encode(info.name.encode()).decode()}"
    await nc.jetstream().publish(meta_subject, json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
    assert CHUNK_SEQUENCES_HEADER not in (await store.info("t", old)).meta["headers"]
    offset, length = CHUNK_BYTES * 3 - 1, CHUNK_BYTES + 2
    assert await store.read_range("t", old, offset, length) == data[offset : offset + length]


def test_a_range_descriptor_round_trips_narrows_and_converts() -> None:
    whole = RangedInputs("in/x", "ab" * 32, 128, 0, 10, (4,), "<f8", "x", "FP32")
    half = whole.narrowed(5, 10)
    assert (half.first, half.rows, half.byte_offset, half.byte_length) == (5, 5, 128 + 5 * 32, 5 * 32)
    encoded = half.encode()
    assert is_ranged(encoded)
    assert decode(encoded) == half
    rows = np.arange(20, dtype="<f8").reshape(5, 4)
    (tensor,) = half.tensors(rows.tobytes())
    assert tensor.datatype == "FP32"
    assert np.array_equal(tensor.to_numpy(), rows.astype(np.float32))
    with pytest.raises(InvalidArgument):
        half.tensors(rows.tobytes()[:-1])
    with pytest.raises(ValueError, match="not within"):
        whole.narrowed(3, 11)
    # Rows already of the model's dtype are the tensor's data as they came, not a copy.
    same = RangedInputs("in/x", "ab" * 32, 128, 0, 5, (4,), "<f4", "x", "FP32")
    data = rows.astype("<f4").tobytes()
    (as_read,) = same.tensors(data)
    assert as_read.data is data
    assert as_read.shape == (5, 4)
    assert np.array_equal(as_read.to_numpy(), rows.astype(np.float32))


def test_a_range_of_text_rows_is_one_bytes_value_per_element() -> None:
    """An NPY file of numpy text (<U) or bytes (S) for a BYTES input: its rows are fixed-width
    characters, not BYTES' length-prefixed serialization, so each element becomes its value (text as
    UTF-8), as a JSONL record's strings do."""
    texts = np.array([["hello world"], ["é ✓"], ["a"]])  # shape (3, 1), <U11
    for rows, expected in (
        (texts, [[b"hello world"], ["é ✓".encode()], [b"a"]]),
        (np.array([[b"ab"], [b"c"]]), [[b"ab"], [b"c"]]),
    ):
        ranged = RangedInputs("in/x", "ab" * 32, 128, 0, len(rows), (1,), rows.dtype.str, "text", "BYTES")
        (tensor,) = ranged.tensors(rows.tobytes())
        assert tensor.datatype == "BYTES"
        assert tensor.to_numpy().tolist() == expected


async def test_an_object_of_larger_chunks_reads_back_whole_and_by_range(nc: NatsClient, config: Config) -> None:
    # Results are stored in RESULT_CHUNK_BYTES chunks; readers take the size from the meta.
    store = await store_of(nc, config)
    data = np.random.default_rng(3).integers(0, 256, 3 * RESULT_CHUNK_BYTES + 77, dtype=np.uint8).tobytes()
    ref = new_input_ref()
    stored = await store.put_bytes("t", ref, data, expires_at=time.time() + 3600, chunk_bytes=RESULT_CHUNK_BYTES)
    assert stored.size_bytes == len(data)
    info = await store.info("t", ref)
    assert info.meta["options"]["max_chunk_size"] == RESULT_CHUNK_BYTES
    assert info.meta["chunks"] == 4  # three whole chunks and the rest, not 13 of CHUNK_BYTES
    _, whole = await store.read("t", ref, max_bytes=len(data))
    assert bytes(whole) == data
    offset = RESULT_CHUNK_BYTES - 5
    assert await store.read_range("t", ref, offset, RESULT_CHUNK_BYTES) == data[offset : offset + RESULT_CHUNK_BYTES]


async def test_a_put_stores_what_it_was_given_whatever_the_pieces(nc: NatsClient, config: Config) -> None:
    """Whole chunks of bytes go as views (copied once, into their publishes, which run later); a
    bytearray is copied when given, so its owner changing it afterwards changes nothing stored; an
    array's view counts its bytes, not its items."""
    store = await store_of(nc, config)
    whole = content(3)[: 2 * CHUNK_BYTES]
    given = content(4)[: 2 * CHUNK_BYTES + 1000]
    changing = bytearray(given)
    floats = np.arange(CHUNK_BYTES // 4 + 10, dtype=np.float32)  # more than a chunk, not a whole number of them

    async def pieces() -> AsyncIterator[bytes | memoryview]:
        yield memoryview(whole)  # two whole chunks, as views
        yield changing  # whole chunks too, but of a buffer its owner may change
        changing[:] = bytes(len(changing))  # the owner reuses it before the publishes have run
        yield memoryview(floats)  # items of 4 bytes

    expected = whole + given + floats.tobytes()
    ref = new_input_ref()
    stored = await store.put("t", ref, pieces(), expires_at=time.time() + 3600, max_bytes=len(expected))
    assert stored.size_bytes == len(expected)
    assert await store.read_range("t", ref, 0, len(expected)) == expected


@pytest.mark.parametrize("replica", ["behind", "hung"])
async def test_a_chunk_a_replica_cannot_give_is_read_from_the_leader(
    nc: NatsClient, config: Config, monkeypatch: pytest.MonkeyPatch, replica: str
) -> None:
    """Any replica may answer a direct get: one behind the leader (just resumed after a hang) said
    404 for chunks the leader had acknowledged, and the read failed BLOB_CORRUPT (a gateway refused
    a valid upload DATA_LOSS); one that hangs let it time out (UNAVAILABLE). In a 3-node run of
    the cluster pass, 31-34 inputs a run were unusable for a while. Such a miss is read again from
    the stream's leader. Here every other direct get is that replica's answer."""
    store = await store_of(nc, config)
    data = content(3)
    ref = new_input_ref()
    await store.put_bytes("t", ref, data, expires_at=time.time() + 3600)
    real_direct_get = blob_reader.direct_get
    calls = 0

    async def flaky_replicas(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls % 2:
            raise NotFoundError if replica == "behind" else TimeoutError
        return await real_direct_get(*args, **kwargs)

    monkeypatch.setattr(blob_reader, "direct_get", flaky_replicas)
    assert (await store.read("t", ref, max_bytes=SIZE))[1] == data  # walked from its first chunk
    assert (
        await store.read_range("t", ref, CHUNK_BYTES - 3, CHUNK_BYTES * 2)
        == data[CHUNK_BYTES - 3 : CHUNK_BYTES * 3 - 3]
    )
    assert calls > 4
