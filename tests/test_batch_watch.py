"""WatchBatch on the batches bucket's watch (services/gateway/batch_watch.py): every distinct state
of a batch arrives, in order (a short-lived one too, which a read on a timer could step over),
the watch ends at the terminal state, and it resumes after a revision."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from rich.filesize import decimal

from asyncinfer.blob_meta import CHUNK_BYTES
from asyncinfer.blobs import BlobStore
from asyncinfer.client.batches import batch_from_proto
from asyncinfer.commands.batches import batch_summary
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.v1 import batch_service_pb2
from services.batcher.models import demo
from services.gateway import batch_prepare
from tests.batch_helpers import batches_stub, create_request, demo_records, jsonl, upload
from tests.stack import StartStack
from tests.test_batch_lifecycle import GATED, gate

__all__ = ["gate"]  # the fixture, used by name
S = batch_service_pb2
ORDER = [S.BATCH_STATE_VALIDATING, S.BATCH_STATE_IN_PROGRESS, S.BATCH_STATE_COMPLETED]


def watch_config(config: Config) -> Config:
    return config.replace(batches={"chunk_records": 50, "chunks_in_flight": 2}, models=[DEMO_MODEL.model_dump(), GATED])


async def watched(stub: object, batch_id: str, after_revision: int = 0) -> list[S.Batch]:
    async with asyncio.timeout(60):
        request = S.WatchBatchRequest(batch_id=batch_id, after_revision=after_revision)
        return [update.batch async for update in stub.WatchBatch(request)]  # type: ignore[attr-defined]


def distinct_states(updates: list[S.Batch]) -> list[int]:
    states: list[int] = []
    for batch in updates:
        if not states or states[-1] != batch.state:
            states.append(batch.state)
    return states


async def test_the_watch_yields_every_distinct_state_in_order_and_ends(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(watch_config(config))
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(5)))
    for _ in range(3):  # a small batch is IN_PROGRESS for about one drive interval (0.2 s)
        created = await stub.CreateBatch(create_request(ref))
        updates = await watched(stub, created.batch.batch_id)
        states = distinct_states(updates)
        assert states in (ORDER, ORDER[1:]), states
        assert len(states) == len({*states})  # no state comes back
        revisions = [u.revision for u in updates]
        assert revisions == sorted(revisions)
        assert len(set(revisions)) == len(revisions)
        assert updates[-1].request_counts.completed == 5


async def test_the_watch_resumes_after_a_revision(config: Config, start_stack: StartStack, gate: None) -> None:
    stack = await start_stack(watch_config(config))
    stub = batches_stub(stack.channel)
    created = await stub.CreateBatch(
        create_request(await upload(stack.jobs, jsonl(demo_records(100))), model_name="gated")
    )
    batch_id = created.batch.batch_id
    async with asyncio.timeout(60):
        async for update in stub.WatchBatch(S.WatchBatchRequest(batch_id=batch_id)):
            if update.batch.state == S.BATCH_STATE_IN_PROGRESS:
                running = update.batch
                break
    demo.GATE.set()
    rest = await watched(stub, batch_id, after_revision=running.revision)
    assert rest
    assert all(u.revision > running.revision for u in rest)
    assert rest[-1].state == S.BATCH_STATE_COMPLETED
    ended = await watched(stub, batch_id)  # a terminal batch: the batch now, and the watch ends
    assert [u.state for u in ended] == [S.BATCH_STATE_COMPLETED]
    with pytest.raises(grpc.aio.AioRpcError) as ahead:
        await watched(stub, batch_id, after_revision=ended[0].revision + 100)
    assert ahead.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as wildcard:
        await watched(stub, ">")
    assert wildcard.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.timeout(300)
async def test_a_long_reading_reports_how_far_it_has_come_until_it_moves_on(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch walk-through (session 33): an 800,000-record file sat in VALIDATING for minutes
    and every view said `VALIDATING  reading its input`, nothing of how far. The preparation now
    writes how much it has read to the record (every READ_PROGRESS_INTERVAL_S; 0 here, so each
    piece of the upload reports): held part-way, WatchBatch, GetBatch, the SDK's Batch and the
    CLI's line show bytes and records read of the total; once read, the report is gone."""
    monkeypatch.setattr(batch_prepare, "READ_PROGRESS_INTERVAL_S", 0.0)
    stack = await start_stack(watch_config(config))
    stub = batches_stub(stack.channel)
    data = jsonl(demo_records(10_000))  # some 700 kB: several pieces of the object store's
    ref = await upload(stack.jobs, data)
    held, release = asyncio.Event(), asyncio.Event()
    chunks = BlobStore.chunks

    async def held_part_way(self: BlobStore, tenant: str, name: str) -> AsyncIterator[bytes]:
        count = 0
        async for piece in chunks(self, tenant, name):
            if name == ref and count == 3:  # the preparation's reading stops here until released
                held.set()
                await release.wait()
            count += 1
            yield piece

    monkeypatch.setattr(BlobStore, "chunks", held_part_way)
    created = await stub.CreateBatch(create_request(ref))
    batch_id = created.batch.batch_id
    async with asyncio.timeout(60):
        await held.wait()
        async for update in stub.WatchBatch(S.WatchBatchRequest(batch_id=batch_id)):
            if update.batch.HasField("read_progress") and update.batch.read_progress.records_read:
                break
    reading = update.batch.read_progress
    assert update.batch.state == S.BATCH_STATE_VALIDATING
    assert 0 < reading.bytes_read < reading.bytes_total == len(data)
    assert 0 < reading.records_read < 10_000
    assert reading.HasField("update_time")
    got = batch_from_proto((await stub.GetBatch(S.GetBatchRequest(batch_id=batch_id))).batch)
    assert got.read_progress is not None
    assert got.read_progress.bytes_read == reading.bytes_read
    line = batch_summary(got)
    assert f"reading its input  {decimal(reading.bytes_read)}/{decimal(len(data))}" in line, line
    assert f"{reading.records_read} records" in line, line
    release.set()
    updates = await watched(stub, batch_id, after_revision=update.batch.revision)
    assert updates[-1].state == S.BATCH_STATE_COMPLETED
    assert updates[-1].request_counts.completed == 10_000
    moved_on = [u for u in updates if u.state != S.BATCH_STATE_VALIDATING]
    assert moved_on
    assert not any(u.HasField("read_progress") for u in moved_on)


async def test_a_cancel_while_the_input_is_read_ends_the_reading(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel while a large file is read: the preparation's next report is a write over the
    record the cancel changed, which loses, and the reading ends there; it read the whole file first,
    only for its final write to lose."""
    monkeypatch.setattr(batch_prepare, "READ_PROGRESS_INTERVAL_S", 0.0)
    stack = await start_stack(watch_config(config))
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(10_000)))
    held, release, ended = asyncio.Event(), asyncio.Event(), asyncio.Event()
    pulled: list[int] = []
    chunks = BlobStore.chunks

    async def held_part_way(self: BlobStore, tenant: str, name: str) -> AsyncIterator[bytes]:
        try:
            async for piece in chunks(self, tenant, name):
                if name == ref and len(pulled) == 2:
                    held.set()
                    await release.wait()
                pulled.append(len(piece))
                yield piece
        finally:
            if name == ref:
                ended.set()

    monkeypatch.setattr(BlobStore, "chunks", held_part_way)
    created = await stub.CreateBatch(create_request(ref))
    batch_id = created.batch.batch_id
    async with asyncio.timeout(60):
        await held.wait()
        await stub.CancelBatch(S.CancelBatchRequest(batch_id=batch_id))
        release.set()
        await ended.wait()
    pieces = -(-len(jsonl(demo_records(10_000))) // CHUNK_BYTES)  # the upload's, all read before
    assert len(pulled) < pieces, (len(pulled), pieces)
    updates = await watched(stub, batch_id)
    assert updates[-1].state == S.BATCH_STATE_CANCELLED
