"""The object store's sweep: deletes every object past its expiry, finishes the deletes a crash
interrupted, and purges the chunks of objects that never got a meta (asyncinfer.blobs writes
the layout; the scheduler's sweeper, services.scheduler.blobs, runs this on a timer).

Removing is the store's compare-and-set (`BlobStore.remove`: a tombstone on the meta's subject
sequence first), so a sweep can never delete an object that a submit has just extended.
"""

from __future__ import annotations

import time

import structlog

from asyncinfer.blob_meta import BlobInfo, parse_meta
from asyncinfer.blobs import WRONG_LAST_SEQUENCE, BlobStore
from asyncinfer.nats import (
    OBJ_ALL_META_PRE_TEMPLATE,
    OBJ_CHUNKS_PRE_TEMPLATE,
    APIError,
    NatsTimeoutError,
    NotFoundError,
    api,
)

log = structlog.get_logger("asyncinfer.blobs")

LIST_IDLE_TIMEOUT_S = 2.0
# The listing's ephemeral consumer is deleted this soon after its subscription ends (the server's
# default is 5 s): a sweeper run every 50 ms, as in tests, kept ~100 of them alive on the stream.
LIST_CONSUMER_INACTIVE_S = 1.0


async def sweep(store: BlobStore, now: float | None = None, *, orphans_after_s: float | None = None) -> int:
    """Deletes every object past its expiry (and finishes deletes a crash interrupted); how
    many were removed. With `orphans_after_s`, also the chunks of objects that never got a
    meta and saw no chunk for that long: an upload's whose gateway was killed mid-upload (they
    would count against their tenant's stored bytes for ever), and a result's whose scheduler
    or batcher (claim_check_io) died, or lost NATS, while storing it (counted against no
    tenant, they would fill the store for ever). A live put stores a chunk far more often:
    see docs/ARCHITECTURE.md, "Orphaned chunks"."""
    now = time.time() if now is None else now
    removed = 0
    # The chunk subjects are listed before the metas, so an object made visible meanwhile has
    # its meta in the list (and one made visible later wrote its last chunk just now).
    chunk_subjects = await _chunk_subjects(store) if orphans_after_s is not None else []
    metas, complete = await _listed_objects(store)
    if orphans_after_s is not None:
        if complete:
            named = {info.nuid for info in metas}
            removed += await _purge_orphans(store, chunk_subjects, named, now, orphans_after_s)
        else:
            # A meta missing from the list would make a live object's chunks look orphaned.
            log.warning("blob_orphan_purge_skipped", reason="the listing of metas ended before its last")
    for info in metas:
        if not (info.deleted or info.expired(now)):
            continue
        try:
            await store.remove(info)
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                continue  # extended (or replaced) meanwhile: it lives on
            raise
        removed += 1
    return removed


async def list_objects(store: BlobStore) -> list[BlobInfo]:
    """Every object's latest meta (deleted ones included), via an ordered consumer; fewer when
    the listing stalled (see _listed_objects)."""
    metas, _complete = await _listed_objects(store)
    return metas


async def _listed_objects(store: BlobStore) -> tuple[list[BlobInfo], bool]:
    """Every object's latest meta, and whether the list is whole: False when the consumer went
    quiet for LIST_IDLE_TIMEOUT_S before its last message (a busy server) or sent nothing where a
    meta was seen. Only a whole list may tell an orphan's chunks from a live object's."""
    subject = OBJ_ALL_META_PRE_TEMPLATE.format(bucket=store.bucket)
    try:
        await store.js.get_last_msg(store.stream, subject)
    except NotFoundError:
        return [], True
    sub = await store.js.subscribe(
        subject,
        # Named, so that nats-py does not look the stream up by subject ($JS.API.STREAM.NAMES):
        # the services' NATS users may not (asyncinfer.nats_users), and the sweep failed on it.
        stream=store.stream,
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        inactive_threshold=LIST_CONSUMER_INACTIVE_S,
    )
    found: list[BlobInfo] = []
    complete = False
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=LIST_IDLE_TIMEOUT_S)
            except NatsTimeoutError:
                # Purged between the look and the subscribe, or a server too busy to send the
                # rest in time: which, this listing cannot tell.
                break
            parsed = parse_meta(msg.data, msg.metadata.sequence.stream)
            if parsed is not None:
                found.append(parsed)
            if msg.metadata.num_pending == 0:
                complete = True
                break
    finally:
        await sub.unsubscribe()
    return found, complete


async def _chunk_subjects(store: BlobStore) -> list[str]:
    """Every object's chunk subject: uploads' (`in.<tenant>.<nuid>`) and results' (`<nuid>`)."""
    info = await store.js.stream_info(
        store.stream, subjects_filter=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=store.bucket, obj=">")
    )
    return list(info.state.subjects or {})


async def _purge_orphans(store: BlobStore, subjects: list[str], named: set[str], now: float, idle_s: float) -> int:
    prefix = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=store.bucket, obj="")
    purged = 0
    for subject in subjects:
        if subject.removeprefix(prefix) in named:
            continue
        try:
            last = await store.js.get_last_msg(store.stream, subject)
        except NotFoundError:
            continue
        if last.time is None or now - last.time.timestamp() < idle_s:
            continue  # an object still being stored, or just made visible
        await store.js.purge_stream(store.stream, subject=subject)
        log.warning("blob_orphan_chunks_purged", subject=subject)
        purged += 1
    return purged
