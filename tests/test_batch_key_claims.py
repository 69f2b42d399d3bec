"""A CreateBatch idempotency claim after its create failed, against a real stack: the create frees
the key when its batch was certainly not written, so a retry with the key creates the batch at once
(it waited for the claim to go stale, 26 s); a release never frees a claim taken over since; and a
NATS failure while taking a stale claim over answers UNAVAILABLE saying so."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import nats.errors
import pytest

from asyncinfer import batches
from asyncinfer.config import Config
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.ids import new_job_id
from asyncinfer.nats.kv import KvBucket
from asyncinfer.nats.streams import stream_subjects
from asyncinfer.v1 import batch_service_pb2
from services.gateway import batch_store
from services.gateway.batch_store import BatchStore, batch_claim_key, ensure_batches_bucket, holder_or_revision
from tests.batch_helpers import batches_stub, create_request, demo_records, jsonl, upload
from tests.stack import StartStack

TENANT = "default"


def keyed_config(config: Config) -> Config:
    return config.replace(batches={"chunk_records": 50, "drive_interval_s": 0.05})


def fail_claim_writes(monkeypatch: pytest.MonkeyPatch, *, records: bool = False, takeovers: bool = False) -> list[str]:
    """Makes the batch store's compare-and-set writes of the kinds named fail as NATS failing does
    (no answer): `records`, the first record write (a create's; the withdrawal of its batch that
    follows goes through); `takeovers`, every takeover of a claim. The keys refused, in order."""
    put = batch_store.kv_put_expecting
    refused: list[str] = []

    async def failing_put(bucket: KvBucket, key: str, value: bytes, *, last_revision: int, **options: Any) -> int:
        is_claim = ".key." in key
        if (records and not is_claim and not refused) or (takeovers and is_claim and last_revision > 0):
            refused.append(key)
            raise nats.errors.TimeoutError
        return await put(bucket, key, value, last_revision=last_revision, **options)

    monkeypatch.setattr(batch_store, "kv_put_expecting", failing_put)
    return refused


async def claim_subjects(stack: Any, config: Config) -> list[str]:
    """The batches bucket's subjects of idempotency claims that hold a message (a marker too)."""
    prefix = f"$KV.{config.nats.batches_bucket}.{TENANT}.key."
    return await stream_subjects(stack.nc.jetstream(), f"KV_{config.nats.batches_bucket}", prefix + "*")


def error_info(error: grpc.aio.AioRpcError) -> Any:
    status = status_details(error)
    assert status is not None
    return unpack_details(status)["ErrorInfo"]


async def test_a_create_whose_record_write_failed_frees_its_key_and_a_retry_creates_the_batch_at_once(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create that claimed its key and then failed to write its batch left the claim: a retry with
    the key waited for it to go stale (26 s; 5 s before) and took it over. Now the create withdraws
    its batch (a FAILED record under its ID, which its unanswered write, landing late, would lose)
    and frees the key, leaving no claim in the bucket (as a key never claimed, which a gateway of
    the release before claims too), and the retry claims it at once."""
    stack = await start_stack(keyed_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="nightly-r1")
    with monkeypatch.context() as failing:
        refused = fail_claim_writes(failing, records=True)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.CreateBatch(request)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(refused) == 1  # the record's write, after the claim
    failed_batch_id = refused[0].rpartition(".")[2]
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), config.nats), stack.nc)
    assert await store.holder(TENANT, "nightly-r1") is None, "the failed create still holds the key"
    assert await claim_subjects(stack, config) == []
    retried = await stub.CreateBatch(request)
    assert not retried.deduplicated
    assert retried.batch.batch_id != failed_batch_id
    claim = await store.holder(TENANT, "nightly-r1")
    assert claim is not None
    assert claim[0] == retried.batch.batch_id
    # The failed create was answered UNAVAILABLE: its withdrawal is no batch of the caller's, left
    # out of the listing, page after page, and answered by its ID.
    for page_size in (0, 1):
        listed: list[tuple[str, int]] = []
        token = ""
        while True:
            page = await stub.ListBatches(batch_service_pb2.ListBatchesRequest(page_size=page_size, page_token=token))
            listed += [(b.batch_id, b.state) for b in page.batches]
            if not (token := page.next_page_token):
                break
        assert listed == [(retried.batch.batch_id, batch_service_pb2.BATCH_STATE_VALIDATING)]
    withdrawn = await stub.GetBatch(batch_service_pb2.GetBatchRequest(batch_id=failed_batch_id))
    assert withdrawn.batch.state == batch_service_pb2.BATCH_STATE_FAILED  # withdrawn: it never ran


async def test_a_create_whose_record_landed_unanswered_keeps_its_key(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record write that landed with its answer lost: the create answers UNAVAILABLE but its batch
    exists, so the key stays with it and a retry gets that batch."""
    stack = await start_stack(keyed_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="nightly-r2")
    write = BatchStore.write
    landed: list[str] = []

    async def landed_unanswered(store: BatchStore, record: batches.BatchRecord) -> batches.BatchRecord:
        written = await write(store, record)
        if not landed:
            landed.append(written.batch_id)
            raise nats.errors.TimeoutError
        return written

    with monkeypatch.context() as failing:
        failing.setattr(BatchStore, "write", landed_unanswered)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.CreateBatch(request)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    retried = await stub.CreateBatch(request)
    assert (retried.batch.batch_id, retried.deduplicated) == (landed[0], True)


async def test_a_release_frees_only_a_claim_still_its_own(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(keyed_config(config), scheduler=False, batcher=False)
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), config.nats), stack.nc)
    until = time.time() + 3600
    first, taker, later = new_job_id(), new_job_id(), new_job_id()
    assert await store.claim(TENANT, "k", first, until=until) == first
    assert await store.take_over(TENANT, "k", first, taker, until=until) == taker
    assert not await store.release(TENANT, "k", first)  # taken over since: the taker keeps it
    held = await store.holder(TENANT, "k")
    assert held is not None
    assert held[0] == taker
    assert await store.release(TENANT, "k", taker)
    assert await store.holder(TENANT, "k") is None
    assert not await store.release(TENANT, "k", taker)  # nothing left to free
    # Free as a key never claimed: a claim (as the release before makes it: a create expecting
    # revision 0) takes it.
    assert await store.claim(TENANT, "k", later, until=until) == later


async def test_a_nats_failure_taking_over_a_stale_claim_answers_unavailable_naming_the_claim(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bound a claim's readers apply (1 s here): past it, a duplicate takes the claim over.
    monkeypatch.setattr(batches, "CREATE_RECORD_WITHIN_S", 1.0)
    monkeypatch.setattr(batches, "CREATE_WRITE_MARGIN_S", 0.0)
    stack = await start_stack(keyed_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), config.nats), stack.nc)
    ghost = new_job_id()
    assert await store.claim(TENANT, "nightly-t1", ghost, until=time.time() + 3600) == ghost  # its gateway died
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="nightly-t1")
    with monkeypatch.context() as failing:
        refused = fail_claim_writes(failing, takeovers=True)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.CreateBatch(request)
    assert refused, "the takeover was not tried"
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    info = error_info(failed.value)
    assert (info.reason, info.metadata["batch_id"]) == ("NATS_UNAVAILABLE", ghost)
    assert "take over the idempotency key" in (failed.value.details() or "")
    held = await store.holder(TENANT, "nightly-t1")  # nothing changed
    assert held is not None
    assert held[0] == ghost
    created = await stub.CreateBatch(request)  # NATS answers again: the retry takes it over
    assert not created.deduplicated
    held = await store.holder(TENANT, "nightly-t1")
    assert held is not None
    assert held[0] == created.batch.batch_id


# Far above what a create over a marker takes (a refused create, a read, a compare-and-set), far
# below forever, which is what one took before.
CREATE_TIMEOUT_S = 15.0


async def remove_claim(stack: Any, config: Config, idempotency_key: str, removal: str) -> None:
    """Removes the key's claim as an operator's `nats kv del` or `nats kv purge` does: a marker,
    with no TTL (the batches bucket gives markers none)."""
    kv = await stack.nc.jetstream().key_value(config.nats.batches_bucket)
    key = batch_claim_key(TENANT, idempotency_key)
    if removal == "delete":
        await kv.delete(key)
    else:
        await kv.purge(key)


@pytest.mark.parametrize("removal", ["delete", "purge"])
async def test_a_create_over_a_removed_claim_creates_the_batch_at_once(
    config: Config, start_stack: StartStack, removal: str
) -> None:
    """A claim over a marker creates the key expecting revision 0, is refused, and reads no holder:
    it tried again without end (2,255 refused creates in 2 s). Now it writes over the marker's
    revision."""
    stack = await start_stack(keyed_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), config.nats), stack.nc)
    ghost = new_job_id()
    assert await store.claim(TENANT, "nightly-m1", ghost, until=time.time() + 3600) == ghost
    await remove_claim(stack, config, "nightly-m1", removal)
    assert await store.holder(TENANT, "nightly-m1") is None
    assert len(await claim_subjects(stack, config)) == 1  # the marker
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="nightly-m1")
    created = await stub.CreateBatch(request, timeout=CREATE_TIMEOUT_S)
    assert not created.deduplicated
    assert created.batch.batch_id != ghost
    held = await store.holder(TENANT, "nightly-m1")
    assert held is not None
    assert held[0] == created.batch.batch_id
    again = await stub.CreateBatch(request, timeout=CREATE_TIMEOUT_S)
    assert (again.batch.batch_id, again.deduplicated) == (created.batch.batch_id, True)
    listed = await stub.ListBatches(batch_service_pb2.ListBatchesRequest())
    assert [b.batch_id for b in listed.batches] == [created.batch.batch_id]


async def test_concurrent_creates_over_a_removed_claim_make_one_batch(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(keyed_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), config.nats), stack.nc)
    assert await store.claim(TENANT, "nightly-m2", new_job_id(), until=time.time() + 3600)
    await remove_claim(stack, config, "nightly-m2", "delete")
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="nightly-m2")
    answers = await asyncio.gather(*(stub.CreateBatch(request, timeout=CREATE_TIMEOUT_S) for _ in range(3)))
    assert sorted(a.deduplicated for a in answers) == [False, True, True]
    batch_ids = {a.batch.batch_id for a in answers}
    assert len(batch_ids) == 1
    held = await store.holder(TENANT, "nightly-m2")
    assert held is not None
    assert held[0] in batch_ids
    listed = await stub.ListBatches(batch_service_pb2.ListBatchesRequest())
    assert {b.batch_id for b in listed.batches} == batch_ids


async def test_a_claim_refused_round_after_round_answers_unavailable(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key is removed again before every claim's write (an operator's `kv del` in a loop): each
    create is refused, each read finds a marker. The claim gives up after CLAIM_ROUNDS rounds,
    UNAVAILABLE IDEMPOTENCY_CONTENDED saying so; it tried again without end."""
    stack = await start_stack(keyed_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    kv = await stack.nc.jetstream().key_value(config.nats.batches_bucket)
    claim = batch_claim_key(TENANT, "nightly-m3")
    put = batch_store.kv_put_expecting
    claim_writes: list[int] = []

    async def removed_before_each(
        bucket: KvBucket, key: str, value: bytes, *, last_revision: int, **options: Any
    ) -> int:
        if key == claim:
            claim_writes.append(last_revision)
            await kv.delete(claim)
        return await put(bucket, key, value, last_revision=last_revision, **options)

    monkeypatch.setattr(batch_store, "kv_put_expecting", removed_before_each)
    request = create_request(await upload(stack.jobs, jsonl(demo_records(5))), idempotency_key="nightly-m3")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.CreateBatch(request, timeout=CREATE_TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    info = error_info(refused.value)
    assert info.reason == "IDEMPOTENCY_CONTENDED"
    assert info.metadata["claim_attempts"] == str(batch_store.CLAIM_ROUNDS)
    assert len(claim_writes) == batch_store.CLAIM_ROUNDS
    assert claim_writes[0] == 0
    assert all(revision > 0 for revision in claim_writes[1:])  # each over the marker it read
    listed = await stub.ListBatches(batch_service_pb2.ListBatchesRequest())
    assert list(listed.batches) == []


@pytest.mark.unit
def test_a_refused_claim_reads_a_holder_or_the_revision_to_create_at() -> None:
    assert holder_or_revision((b"batch-1", 7)) == "batch-1"
    assert holder_or_revision((b"", 7)) == 7  # a delete or purge marker: create over it
    assert holder_or_revision(None) == 0  # no write left (purged, expired): create as new
