"""A keyed CreateBatch whose batch could still be written after its key went to another batch,
against a real stack (gateway, scheduler, batcher, nats-server): a create that stalls between its
claim and its record past its bound (a frozen process, a suspended host) while a duplicate takes the
key over; a create whose record write lands after it failed and freed its key; and a suspend seen by
the wall clock alone. Each time one batch of the key runs, and the stalled create answers with it
(services/gateway/batch_service.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import nats.errors
import pytest

from asyncinfer import batches
from asyncinfer.blob_meta import BlobInfo
from asyncinfer.blobs import BlobStore
from asyncinfer.config import Config
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.nats.kv import KvBucket
from asyncinfer.v1 import batch_service_pb2
from services.gateway import batch_store
from services.gateway.batch_store import BatchStore, ensure_batches_bucket
from tests.batch_helpers import HeldCreate, batches_stub, create_request, demo_records, jsonl, upload, wait_ended
from tests.stack import Stack, StartStack

TENANT = "default"
HANG_GUARD_S = 60.0


def stalls_config(config: Config) -> Config:
    return config.replace(batches={"chunk_records": 50, "drive_interval_s": 0.05})


async def claim_holder(stack: Stack, key: str) -> str | None:
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), stack.config.nats), stack.nc)
    held = await store.holder(TENANT, key)
    return held[0] if held is not None else None


async def assert_withdrawn(stub: Any, batch_id: str, *, naming: str = "") -> None:
    """The batch never ran: its record ended FAILED, never validated, saying it was withdrawn."""
    batch = (await stub.GetBatch(batch_service_pb2.GetBatchRequest(batch_id=batch_id))).batch
    assert batch.state == batch_service_pb2.BATCH_STATE_FAILED, batch
    assert batch.failure_message.startswith(batches.WITHDRAWN_PREFIX), batch.failure_message
    assert naming in batch.failure_message
    assert batch.request_counts.total == 0
    assert not batch.HasField("in_progress_time")


async def test_a_create_that_stalls_past_its_bound_answers_with_the_batch_that_took_its_key_over(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A claims the key and stalls before its record's write; B, a duplicate, finds the claim stale
    # (by both clocks) and makes its own batch; A wakes and writes its record: two batches ran for
    # one key, and A answered its own. Now B's takeover first withdraws A's batch (a FAILED record
    # created under its ID), and A's record create loses to it: A answers B's batch.
    monkeypatch.setattr(batches, "CREATE_RECORD_WITHIN_S", 1.0)  # a claim goes stale after 1 s
    monkeypatch.setattr(batches, "CREATE_WRITE_MARGIN_S", 0.0)
    stack = await start_stack(stalls_config(config))
    stub = batches_stub(stack.channel)
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="stalled")
    held = HeldCreate(monkeypatch)
    first = asyncio.ensure_future(stub.CreateBatch(request, timeout=HANG_GUARD_S))
    stalled_id = await asyncio.wait_for(held.batch_id, HANG_GUARD_S)  # claimed, its record not written
    second = await stub.CreateBatch(request, timeout=HANG_GUARD_S)  # takes the stale claim over
    assert not second.deduplicated
    assert second.batch.batch_id != stalled_id
    held.release.set()
    answer = await first
    assert (answer.batch.batch_id, answer.deduplicated) == (second.batch.batch_id, True)
    assert (await wait_ended(stub, second.batch.batch_id)).request_counts.completed == 5
    await assert_withdrawn(stub, stalled_id, naming=second.batch.batch_id)
    assert await claim_holder(stack, "stalled") == second.batch.batch_id
    # Both creates were answered with B's batch: the withdrawal is no batch of the caller's.
    listed = await stub.ListBatches(batch_service_pb2.ListBatchesRequest())
    assert [batch.batch_id for batch in listed.batches] == [second.batch.batch_id]


async def test_a_failed_create_whose_record_lands_after_it_freed_its_key_never_runs(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The record write's answer never came (NATS silent): the create answered UNAVAILABLE and freed
    # its key, and the write landed later. Before, the release read no record and freed the key:
    # the late batch ran, and so did the retry's. Now the release withdraws the batch first.
    stack = await start_stack(stalls_config(config))
    stub = batches_stub(stack.channel)
    put = batch_store.kv_put_expecting
    land = asyncio.Event()
    late: list[asyncio.Task[int]] = []
    lost: list[str] = []

    async def unanswered(bucket: KvBucket, key: str, value: bytes, *, last_revision: int, **options: Any) -> int:
        if ".key." in key or late:  # claims, and every write after the first record's
            return await put(bucket, key, value, last_revision=last_revision, **options)

        async def after_release() -> int:
            await land.wait()
            return await put(bucket, key, value, last_revision=last_revision, **options)

        lost.append(key.rpartition(".")[2])
        late.append(asyncio.create_task(after_release()))
        raise nats.errors.TimeoutError

    monkeypatch.setattr(batch_store, "kv_put_expecting", unanswered)
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="late-record")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stub.CreateBatch(request, timeout=HANG_GUARD_S)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await claim_holder(stack, "late-record") is None, "the failed create kept its key"
    land.set()
    await asyncio.wait_for(asyncio.gather(late[0], return_exceptions=True), HANG_GUARD_S)
    retry = await stub.CreateBatch(request, timeout=HANG_GUARD_S)
    assert not retry.deduplicated
    assert retry.batch.batch_id != lost[0]
    assert (await wait_ended(stub, retry.batch.batch_id)).request_counts.completed == 5
    await assert_withdrawn(stub, lost[0])


async def test_a_create_suspended_past_its_bound_by_the_wall_clock_writes_no_batch(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A suspended host's monotonic clock stops while the wall clock (and every reader's) runs on:
    # the create's bound, checked on the monotonic clock alone, passed, and it wrote its record
    # past the time a duplicate or a DeleteInput reads as "can no longer be written".
    ahead_s = [0.0]
    stack = await start_stack(stalls_config(config), batcher=False, gateway_wall_clock=lambda: time.time() + ahead_s[0])
    stub = batches_stub(stack.channel)
    hold = BlobStore.hold_for_batch

    async def suspended(store: BlobStore, *args: Any, **kwargs: Any) -> BlobInfo:
        ahead_s[0] = batches.CREATE_RECORD_WITHIN_S  # the suspend, as the wall clock saw it
        return await hold(store, *args, **kwargs)

    monkeypatch.setattr(BlobStore, "hold_for_batch", suspended)
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="suspended")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stub.CreateBatch(request, timeout=HANG_GUARD_S)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    status = status_details(failed.value)
    assert status is not None
    assert unpack_details(status)["ErrorInfo"].reason == "BATCH_CREATE_TOO_SLOW"
    listed = await stub.ListBatches(batch_service_pb2.ListBatchesRequest())
    assert list(listed.batches) == []
    assert await claim_holder(stack, "suspended") is None  # nothing was sent: the key is free at once
