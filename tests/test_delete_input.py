"""Issue 17: DeleteInput and per-tenant limits on stored upload bytes, against a real nats-server.

DeleteInput removes the caller's own upload, chunks and meta (NOT_FOUND for another tenant's, a
missing one, a result's ref, or a second delete); a queued job whose input was deleted fails at
dispatch with INPUT_NOT_FOUND (FAILED, not retried) while the others run. With
`max_stored_upload_bytes_per_tenant` an upload that would pass the limit is refused
RESOURCE_EXHAUSTED TENANT_STORAGE_EXCEEDED with the figures, leaves nothing behind, and the
count is the store's own: a delete makes room at once, other tenants are not affected, and
concurrent uploads never leave more than the limit stored."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from asyncinfer.batches import CREATE_RECORD_WITHIN_S, CREATE_WRITE_MARGIN_S
from asyncinfer.blob_meta import CHUNK_BYTES, input_chunks_filter, meta_subject
from asyncinfer.blob_sweep import MetaCursor, list_objects, sweep
from asyncinfer.blobs import ensure_objects_bucket
from asyncinfer.config import Config
from asyncinfer.contract import EXPIRES_HEADER
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.ids import new_job_id
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import NatsTimeoutError
from asyncinfer.nats.streams import count_messages
from asyncinfer.v1 import batch_service_pb2, job_pb2, job_service_pb2
from services.scheduler.blobs import orphan_age_s
from tests.batch_helpers import (
    HeldCreate,
    batches_stub,
    create_request,
    demo_records,
    jsonl,
    minted_at,
    wait_ended,
    wait_until,
)
from tests.batch_helpers import upload as batch_upload
from tests.stack import Stack, StartStack
from tests.test_batches import batch_config
from tests.test_claim_check import (
    ACME,
    GLOBEX,
    bearer,
    by_ref,
    claim_check_config,
    finish,
    inputs_bytes,
    objects_stream_state,
    reason_of,
    rpc_error,
    upload,
)

pytestmark = pytest.mark.timeout(90)
LIMIT = 4 * CHUNK_BYTES  # 512 KiB
# nats-server's JSMaxSubjectDetails: the most subjects one stream info answer lists.
SERVER_SUBJECTS_PER_ANSWER = 100_000


def delete(stack: Stack, ref: str, key: str = ACME) -> object:
    return stack.jobs.DeleteInput(job_service_pb2.DeleteInputRequest(ref=ref), metadata=bearer(key))


async def stored_chunks(stack: Stack, tenant: str) -> int:
    bucket = stack.config.nats.objects_bucket
    return await count_messages(stack.nc, f"OBJ_{bucket}", input_chunks_filter(bucket, tenant), timeout_s=2.0)


@pytest.fixture
async def gateway_only(config: Config, start_stack: StartStack) -> Stack:
    limited = claim_check_config(config, max_upload_bytes=1024 * 1024, max_stored_upload_bytes_per_tenant=LIMIT)
    return await start_stack(limited, scheduler=False, batcher=False)


async def test_delete_input_removes_the_callers_own_upload(gateway_only: Stack) -> None:
    stack = gateway_only
    data = inputs_bytes(np.ones((20_000, 4)))  # ~320 KB: three chunks
    ref = await upload(stack.jobs, data)
    assert await stored_chunks(stack, "acme") == 3

    # Not another tenant's, not a result's ref, not a made-up one: NOT_FOUND, and nothing deleted.
    for key, candidate in ((GLOBEX, ref.ref), (ACME, "out/" + ref.ref[3:]), (ACME, "in/nope"), (ACME, "")):
        error = await rpc_error(delete(stack, candidate, key))
        assert error.code() == grpc.StatusCode.NOT_FOUND, candidate
        assert reason_of(error) == "INPUT_NOT_FOUND"
    assert await stored_chunks(stack, "acme") == 3

    deleted = (await delete(stack, ref.ref)).ref  # type: ignore[attr-defined]
    assert (deleted.ref, deleted.size_bytes, deleted.sha256) == (ref.ref, ref.size_bytes, ref.sha256)
    assert await objects_stream_state(stack.nc, stack.config) == (0, 0), "chunks and meta gone"
    again = await rpc_error(delete(stack, ref.ref))
    assert again.code() == grpc.StatusCode.NOT_FOUND
    submit = await rpc_error(stack.jobs.SubmitJob(by_ref(ref.ref), metadata=bearer(ACME)))
    assert (submit.code(), reason_of(submit)) == (grpc.StatusCode.NOT_FOUND, "INPUT_NOT_FOUND")


async def test_a_queued_job_whose_input_was_deleted_fails_at_dispatch(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(claim_check_config(config), batcher=False)
    kept = await upload(stack.jobs, inputs_bytes(np.ones((2, 4))))
    doomed = await upload(stack.jobs, inputs_bytes(np.ones((3, 4))))
    good = (await stack.jobs.SubmitJob(by_ref(kept.ref), metadata=bearer(ACME))).job
    orphan = (await stack.jobs.SubmitJob(by_ref(doomed.ref), metadata=bearer(ACME))).job
    await delete(stack, doomed.ref)  # type: ignore[misc]
    await stack.start_batcher()
    failed = await asyncio.wait_for(finish(stack.jobs, orphan.job_id), 30)
    assert failed.state == job_pb2.JOB_STATE_FAILED
    assert failed.error.reason == "INPUT_NOT_FOUND"
    assert failed.attempt == 1, "a deleted input is final: not retried"
    assert (await asyncio.wait_for(finish(stack.jobs, good.job_id), 30)).state == job_pb2.JOB_STATE_SUCCEEDED


async def test_uploads_past_the_tenants_stored_bytes_are_refused(gateway_only: Stack) -> None:
    stack = gateway_only
    two_chunks = inputs_bytes(np.ones((12_000, 4)))  # ~192 KB
    first = await upload(stack.jobs, two_chunks)
    await upload(stack.jobs, two_chunks)
    assert await stored_chunks(stack, "acme") == 4  # the limit, exactly
    before = await objects_stream_state(stack.nc, stack.config)

    # Declared, and streamed without a declared size: both refused, nothing kept.
    for size in (len(two_chunks), 0):
        error = await rpc_error(upload(stack.jobs, two_chunks, size=size))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = status_details(error)
        assert status is not None
        details = unpack_details(status)
        assert details["ErrorInfo"].reason == "TENANT_STORAGE_EXCEEDED"
        assert details["ErrorInfo"].metadata["stored_bytes"] == str(LIMIT)
        assert details["ErrorInfo"].metadata["limit_bytes"] == str(LIMIT)
        assert "RetryInfo" in details
        assert "DeleteInput" in (error.details() or "")
        assert await objects_stream_state(stack.nc, stack.config) == before

    # Another tenant has its own room.
    await upload(stack.jobs, two_chunks, key=GLOBEX)
    # A delete makes room at once.
    await delete(stack, first.ref)  # type: ignore[misc]
    assert await stored_chunks(stack, "acme") == 2
    await upload(stack.jobs, two_chunks)


async def test_concurrent_uploads_never_store_past_the_limit(gateway_only: Stack) -> None:
    stack = gateway_only
    one_chunk = inputs_bytes(np.ones((4_000, 4)))  # 64 KB: one chunk each

    async def slow_upload() -> str:
        async def requests() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
            yield job_service_pb2.UploadInputRequest(metadata=job_service_pb2.UploadInputMetadata())
            await asyncio.sleep(0)
            yield job_service_pb2.UploadInputRequest(chunk=one_chunk)

        try:
            reply = await stack.jobs.UploadInput(requests(), metadata=bearer(ACME))
        except grpc.aio.AioRpcError as error:
            return reason_of(error)
        return "OK" if reply.ref.ref else "?"

    outcomes = await asyncio.gather(*(slow_upload() for _ in range(12)))
    assert set(outcomes) <= {"OK", "TENANT_STORAGE_EXCEEDED"}, outcomes
    accepted = outcomes.count("OK")
    # Never past the limit. (Uploads racing near it may all be refused: each counts the others'
    # chunks in flight; on a loaded machine all twelve were once.)
    assert accepted <= LIMIT // CHUNK_BYTES, outcomes
    assert await stored_chunks(stack, "acme") == accepted  # refused ones left nothing
    # Nobody is locked out: one at a time, the room left is taken, then refused.
    for _ in range(LIMIT // CHUNK_BYTES - accepted):
        assert await slow_upload() == "OK"
    assert await slow_upload() == "TENANT_STORAGE_EXCEEDED"
    assert await stored_chunks(stack, "acme") == LIMIT // CHUNK_BYTES


async def test_the_sweeper_purges_chunks_a_crashed_upload_left_and_keeps_live_ones(gateway_only: Stack) -> None:
    """A gateway killed mid-upload leaves chunks no meta names: counted against the tenant until
    the sweeper purges them once they have been idle for its bound; a live upload is kept."""
    stack = gateway_only
    live = await upload(stack.jobs, inputs_bytes(np.ones((2, 4))))
    bucket = stack.config.nats.objects_bucket
    for _ in range(2):
        await stack.nc.jetstream().publish(f"$O.{bucket}.C.in.acme.CRASHEDUPLOAD", b"\x00" * 1000)
    assert await stored_chunks(stack, "acme") == 3

    store = stack.blobs
    assert await sweep(store, orphans_after_s=300) == 0  # written just now: maybe still streaming
    assert await stored_chunks(stack, "acme") == 3
    assert await sweep(store, time.time() + 301, orphans_after_s=300) == 1
    assert await stored_chunks(stack, "acme") == 1
    assert (await store.info("acme", live.ref, now=time.time())).ref.sha256 == live.sha256


@pytest.mark.parametrize("with_cursor", [False, True], ids=["every-meta", "since-last-pass"])
async def test_a_sweep_whose_listing_of_metas_stalls_purges_no_chunks(
    gateway_only: Stack, monkeypatch: pytest.MonkeyPatch, with_cursor: bool
) -> None:
    """The listing of metas ends on a quiet spell (LIST_IDLE_TIMEOUT_S): on a busy server it can
    stop before its last meta, and a live upload whose meta was not listed looked orphaned, its
    chunks purged once past the bound (every read of it then failed). The orphan purge now runs
    only on a whole listing. Played by a subscription that goes quiet after its first message;
    with a sweeper's cursor, in the read of the metas stored since its last pass, which then
    lists every meta again."""
    stack = gateway_only
    store = stack.blobs
    cursor = MetaCursor() if with_cursor else None
    if cursor is not None:
        await upload(stack.jobs, inputs_bytes(np.ones((2, 4)) * 7))
        assert await sweep(store, orphans_after_s=300, cursor=cursor) == 0
        assert cursor.metas_read == 1
    kept = [await upload(stack.jobs, inputs_bytes(np.ones((2, 4)) * i)) for i in range(2)]
    subscribe = store.js.subscribe

    async def stalling(*args: object, **kwargs: object) -> object:
        sub = await subscribe(*args, **kwargs)  # type: ignore[arg-type]
        next_msg = sub.next_msg
        sent = 0

        async def one_then_quiet(**wait: float) -> object:
            nonlocal sent
            if sent:
                raise NatsTimeoutError
            sent += 1
            return await next_msg(**wait)

        sub.next_msg = one_then_quiet  # type: ignore[method-assign]
        return sub

    monkeypatch.setattr(store.js, "subscribe", stalling)
    assert await sweep(store, time.time() + 301, orphans_after_s=300, cursor=cursor) == 0
    monkeypatch.undo()
    assert await stored_chunks(stack, "acme") == 2 + (cursor is not None)
    for ref in kept:
        assert (await store.info("acme", ref.ref, now=time.time())).ref.sha256 == ref.sha256
    if cursor is not None:
        assert await sweep(store, orphans_after_s=300, cursor=cursor) == 0
        assert cursor.metas_read == 3  # every meta again
        assert len(cursor.metas) == 3


@pytest.mark.timeout(600)
async def test_a_crashed_uploads_chunks_past_the_servers_100000_subjects_an_answer_are_purged(
    config: Config, nc: NatsClient
) -> None:
    """The sweep listed the objects' chunk subjects with one stream info, which nats-server answers
    with at most 100,000 subjects, sorted, the rest behind an offset: an orphan's chunks sorted past
    the first 100,000 were never purged (counted against their tenant, the store filling for good).
    Here 100,000 live uploads' chunk subjects, each named by its meta, sort before a crashed one's."""
    store = await ensure_objects_bucket(nc, config.nats)
    expires_at = repr(time.time() + 3600)
    for i in range(SERVER_SUBJECTS_PER_ANSWER):
        nuid = f"in.acme.{i:06d}"
        name = f"acme/in/{new_job_id()}"
        meta = {"name": name, "bucket": store.bucket, "nuid": nuid, "size": 1, "chunks": 1}
        meta["headers"] = {EXPIRES_HEADER: [expires_at]}
        await nc.publish(f"$O.{store.bucket}.C.{nuid}", b"x")
        await nc.publish(meta_subject(store.bucket, name), json.dumps(meta).encode())
    crashed = f"$O.{store.bucket}.C.in.zzz.CRASHEDUPLOAD"
    await nc.publish(crashed, b"\x00" * 1000)
    await nc.flush()
    while (await nc.jetstream().stream_info(store.stream)).state.messages < 2 * SERVER_SUBJECTS_PER_ANSWER + 1:
        await nc.flush()  # the server stores what it received in order: one more round trip each
    assert await sweep(store, time.time() + 301, orphans_after_s=300) == 1
    left = await nc.jetstream().stream_info(store.stream)
    assert left.state.messages == 2 * SERVER_SUBJECTS_PER_ANSWER  # the live uploads' chunks and metas


async def test_a_sweepers_pass_reads_only_the_metas_stored_since_its_last(gateway_only: Stack) -> None:
    """Each pass of the sweeper read every meta (~50 us of CPU each: 4% of a core at 50,000
    objects every minute). With its cursor a pass reads the metas stored since its last, and
    still tells a crashed upload's chunks from a live one's made visible since, deletes what
    expired, and drops what another deleted meanwhile."""
    stack = gateway_only
    store = stack.blobs
    cursor = MetaCursor()
    first = [await upload(stack.jobs, inputs_bytes(np.ones((2, 4)) * i)) for i in range(3)]
    assert await sweep(store, orphans_after_s=300, cursor=cursor) == 0
    assert cursor.metas_read == 3
    assert await sweep(store, orphans_after_s=300, cursor=cursor) == 0
    assert cursor.metas_read == 0  # nothing new

    late = await upload(stack.jobs, inputs_bytes(np.ones((2, 4)) * 9))
    await stack.nc.jetstream().publish(f"$O.{stack.config.nats.objects_bucket}.C.in.acme.CRASHED", b"\x00" * 100)
    assert await sweep(store, time.time() + 301, orphans_after_s=300, cursor=cursor) == 1  # the crashed one's
    assert cursor.metas_read == 1
    assert await stored_chunks(stack, "acme") == 4
    for ref in [*first, late]:
        assert (await store.info("acme", ref.ref, now=time.time())).ref.sha256 == ref.sha256

    await store.delete("acme", first[0].ref)  # its meta purged: no message for the cursor to read
    far = time.time() + 10 * 365 * 86400
    assert await sweep(store, far, orphans_after_s=300, cursor=cursor) == 3  # the others, expired
    assert cursor.metas == {}
    assert await stored_chunks(stack, "acme") == 0
    assert await list_objects(store) == []


async def test_a_sweepers_cursor_lists_every_meta_again_when_the_bucket_is_made_again(gateway_only: Stack) -> None:
    """A bucket deleted and made again numbers its messages from 1: a cursor that read only the
    metas past its old sequence would miss the new bucket's first objects, and purge their chunks
    as orphans. It lists every meta again when the stream is not the one it listed."""
    stack = gateway_only
    store = stack.blobs
    cursor = MetaCursor()
    for i in range(2):
        await upload(stack.jobs, inputs_bytes(np.ones((2, 4)) * i))
    assert await sweep(store, orphans_after_s=300, cursor=cursor) == 0
    assert cursor.last_sequence > 0
    await store.js.delete_stream(store.stream)
    await ensure_objects_bucket(stack.nc, stack.config.nats)
    again = [await upload(stack.jobs, inputs_bytes(np.ones((2, 4)) * i)) for i in range(4)]
    info = await store.js.stream_info(store.stream)
    assert info.state.last_seq > cursor.last_sequence  # past the old sequence: only `created` tells
    assert await sweep(store, time.time() + 301, orphans_after_s=300, cursor=cursor) == 0
    assert cursor.metas_read == 4
    assert await stored_chunks(stack, "acme") == 4
    for ref in again:
        assert (await store.info("acme", ref.ref, now=time.time())).ref.sha256 == ref.sha256


async def test_an_upload_whose_chunks_the_sweep_purged_as_it_streamed_is_refused_not_stored_cut(
    gateway_only: Stack,
) -> None:
    """The sweep takes an upload's chunks for a crashed upload's once none was stored for its bound
    (4 x upload_idle_timeout_s, at least 300 s). A live upload can go that long without storing one:
    the gateway stores 128 KiB chunks, and a client on a slow link sending 100 bytes every 20 s is
    never idle to the gateway (30 s) yet fills a chunk every 7 hours. Its first chunks were purged
    under it, and the upload was still made visible: a ref whose every read failed DATA_LOSS."""
    stack = gateway_only
    content = np.random.default_rng(7).bytes(2 * CHUNK_BYTES + 100)
    first_chunk_stored = asyncio.Event()
    swept = asyncio.Event()

    async def requests() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
        metadata = job_service_pb2.UploadInputMetadata(
            size_bytes=len(content), sha256=hashlib.sha256(content).hexdigest()
        )
        yield job_service_pb2.UploadInputRequest(metadata=metadata, chunk=content[:CHUNK_BYTES])
        await first_chunk_stored.wait()
        yield job_service_pb2.UploadInputRequest(chunk=content[CHUNK_BYTES : CHUNK_BYTES + 100])  # a drip
        await swept.wait()
        yield job_service_pb2.UploadInputRequest(chunk=content[CHUNK_BYTES + 100 :])

    bucket = stack.config.nats.objects_bucket
    # A consumer of the stream hears a chunk once it is stored.
    stored = await stack.nc.jetstream().subscribe(
        f"$O.{bucket}.C.in.acme.>", stream=f"OBJ_{bucket}", ordered_consumer=True
    )
    call = stack.jobs.UploadInput(requests(), metadata=bearer(ACME))
    try:
        await stored.next_msg(timeout=30)
    finally:
        await stored.unsubscribe()
    assert await stored_chunks(stack, "acme") == 1
    first_chunk_stored.set()
    # The sweep as it runs once the bound has passed since that chunk, the client dripping meanwhile.
    later = time.time() + orphan_age_s(stack.config) + 1
    assert await sweep(stack.blobs, later, orphans_after_s=orphan_age_s(stack.config)) == 1
    swept.set()

    error = await rpc_error(call)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert reason_of(error) == "UPLOAD_CHUNKS_LOST"
    assert "upload it again" in (error.details() or "")
    assert await stored_chunks(stack, "acme") == 0  # nothing of it is kept, nor counted
    assert [info.name for info in await list_objects(stack.blobs)] == []


async def test_an_upload_a_running_batch_reads_is_not_deleted_until_the_batch_ends(
    config: Config, start_stack: StartStack
) -> None:
    """An NPY batch's chunks read rows of its upload as they run: a DeleteInput while the batch
    has not ended is refused FAILED_PRECONDITION INPUT_IN_USE naming the batch (it was taken, and
    every record not yet run then failed NOT_FOUND), and is taken once the batch ended."""
    stack = await start_stack(batch_config(config), batcher=False)  # no batcher: the batch stays IN_PROGRESS
    batches = batches_stub(stack.channel)
    x = np.arange(250 * 4, dtype=np.float32).reshape(250, 4)
    buffer = io.BytesIO()
    np.save(buffer, x)
    ref = await batch_upload(stack.jobs, buffer.getvalue())
    created = (await batches.CreateBatch(create_request(ref))).batch
    running = await wait_until(
        batches, created.batch_id, lambda b: b.state == batch_service_pb2.BATCH_STATE_IN_PROGRESS
    )
    assert running.input_format == batch_service_pb2.BATCH_INPUT_FORMAT_NPY

    refused = await rpc_error(stack.jobs.DeleteInput(job_service_pb2.DeleteInputRequest(ref=ref)))
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(refused) == "INPUT_IN_USE"
    assert created.batch_id in (refused.details() or "")
    status = status_details(refused)
    assert status is not None
    assert unpack_details(status)["ErrorInfo"].metadata["batch_id"] == created.batch_id

    await stack.start_batcher()
    ended = await wait_ended(batches, created.batch_id)
    assert ended.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert (ended.request_counts.completed, ended.request_counts.failed) == (250, 0)
    deleted = await stack.jobs.DeleteInput(job_service_pb2.DeleteInputRequest(ref=ref))
    assert deleted.ref.ref == ref


async def test_an_upload_names_only_the_batches_that_may_still_read_it(config: Config, start_stack: StartStack) -> None:
    """Each CreateBatch over an upload named its batch on it (Asyncinfer-Batches) and none was ever
    dropped: a nightly batch over one file grew the header without bound, and every DeleteInput read
    every batch's record. A create drops the batches that have ended; DeleteInput still waits for a
    live one."""
    stack = await start_stack(batch_config(config), batcher=False)  # no batcher: a batch stays IN_PROGRESS
    batches = batches_stub(stack.channel)
    ref = await batch_upload(stack.jobs, jsonl(demo_records(3)))
    tenant = stack.config.gateway.default_tenant
    running = [(await batches.CreateBatch(create_request(ref))).batch.batch_id for _ in range(3)]
    assert (await stack.blobs.info(tenant, ref)).batches == tuple(running)  # none has ended: all kept
    for batch_id in running[:2]:
        await batches.CancelBatch(batch_service_pb2.CancelBatchRequest(batch_id=batch_id))
        assert (await wait_ended(batches, batch_id)).state == batch_service_pb2.BATCH_STATE_CANCELLED

    latest = (await batches.CreateBatch(create_request(ref))).batch.batch_id
    live = (running[2], latest)
    assert (await stack.blobs.info(tenant, ref)).batches == live  # the cancelled two are dropped
    refused = await rpc_error(stack.jobs.DeleteInput(job_service_pb2.DeleteInputRequest(ref=ref)))
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(refused) == "INPUT_IN_USE"
    assert running[2] in (refused.details() or "")  # the first live one it reads
    # Creates at once over the upload: each write is a compare-and-set, and a batch whose create has
    # named it but not written its record yet is kept, so none drops another.
    racing = await asyncio.gather(*(batches.CreateBatch(create_request(ref)) for _ in range(4)))
    live += tuple(created.batch.batch_id for created in racing)
    assert sorted((await stack.blobs.info(tenant, ref)).batches) == sorted(live)

    await stack.start_batcher()
    for batch_id in live:
        assert (await wait_ended(batches, batch_id)).state == batch_service_pb2.BATCH_STATE_COMPLETED
    deleted = await stack.jobs.DeleteInput(job_service_pb2.DeleteInputRequest(ref=ref))
    assert deleted.ref.ref == ref


async def test_an_upload_whose_batch_is_being_created_is_not_deleted(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create names its batch on the upload, then writes the batch's record. A DeleteInput between
    the two read the missing record as a batch that holds nothing and took the upload; the batch then
    failed NOT_FOUND. It is refused INPUT_IN_USE with a retry hint while the create may still write
    the record; once the create wrote it, as for any batch that has not ended."""
    stack = await start_stack(batch_config(config), batcher=False)
    batches = batches_stub(stack.channel)
    ref = await batch_upload(stack.jobs, jsonl(demo_records(3)))
    held = HeldCreate(monkeypatch)

    async def create() -> batch_service_pb2.CreateBatchResponse:
        return await batches.CreateBatch(create_request(ref))

    creating = asyncio.create_task(create())
    batch_id = await held.batch_id  # named on the upload, its record not written
    assert (await stack.blobs.info(stack.config.gateway.default_tenant, ref)).batches == (batch_id,)

    refused = await rpc_error(stack.jobs.DeleteInput(job_service_pb2.DeleteInputRequest(ref=ref)))
    assert (refused.code(), reason_of(refused)) == (grpc.StatusCode.FAILED_PRECONDITION, "INPUT_IN_USE")
    status = status_details(refused)
    assert status is not None
    info = unpack_details(status)["ErrorInfo"]
    assert info.metadata["batch_id"] == batch_id
    assert 0 < int(info.metadata["retry_after_s"]) <= CREATE_RECORD_WITHIN_S + CREATE_WRITE_MARGIN_S

    held.release.set()
    assert (await creating).batch.batch_id == batch_id
    still = await rpc_error(stack.jobs.DeleteInput(job_service_pb2.DeleteInputRequest(ref=ref)))
    assert reason_of(still) == "INPUT_IN_USE"
    await stack.start_batcher()
    assert (await wait_ended(batches, batch_id)).request_counts.completed == 3
    assert (await stack.jobs.DeleteInput(job_service_pb2.DeleteInputRequest(ref=ref))).ref.ref == ref


async def test_a_batch_whose_create_died_before_its_record_does_not_hold_its_upload(
    config: Config, start_stack: StartStack
) -> None:
    """A create that died between naming its batch on the upload and writing the record leaves a
    name with no record: once the create's bound has passed since its ID was minted, it blocks no delete."""
    stack = await start_stack(batch_config(config), scheduler=False, batcher=False)
    ref = await batch_upload(stack.jobs, jsonl(demo_records(3)))
    tenant = stack.config.gateway.default_tenant
    died = minted_at(time.time() - CREATE_RECORD_WITHIN_S - CREATE_WRITE_MARGIN_S)
    await stack.blobs.hold_for_batch(tenant, ref, died)
    assert (await stack.blobs.info(tenant, ref)).batches == (died,)
    assert (await stack.jobs.DeleteInput(job_service_pb2.DeleteInputRequest(ref=ref))).ref.ref == ref
