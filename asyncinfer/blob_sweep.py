"""The object store's sweep: deletes every object past its expiry, finishes the deletes a crash
interrupted, and purges the chunks (or files) of objects that never got a meta (asyncinfer.blob_writer writes
the layout; the scheduler's sweeper, services.scheduler.blobs, runs this on a timer).

Removing is the store's compare-and-set (`BlobStore.remove`: a tombstone on the meta's subject
sequence first), so a sweep can never delete an object that a submit has just extended.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime

import structlog

from asyncinfer.blob_files import file_name
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
from asyncinfer.nats.streams import subject_pages

log = structlog.get_logger("asyncinfer.blobs")

LIST_IDLE_TIMEOUT_S = 2.0
# A stream info answer listing objects' chunk subjects (100,000 of them: ~8 MB of JSON).
CHUNK_SUBJECTS_TIMEOUT_S = 10.0
# The listing's ephemeral consumer is deleted this soon after its subscription ends (the server's
# default is 5 s): a sweeper run every 50 ms, as in tests, kept ~100 of them alive on the stream.
LIST_CONSUMER_INACTIVE_S = 1.0


async def sweep(
    store: BlobStore,
    now: float | None = None,
    *,
    orphans_after_s: float | None = None,
    cursor: MetaCursor | None = None,
) -> int:
    """Deletes every object past its expiry (and finishes deletes a crash interrupted); how
    many were removed. With `orphans_after_s`, also the chunks (or, in the objects' directory,
    the files) of objects that never got a meta and saw no chunk (no write) for that long: an upload's whose gateway was killed mid-upload (they
    would count against their tenant's stored bytes for ever), and a result's whose scheduler
    or batcher (claim_check_io) died, or lost NATS, while storing it (counted against no
    tenant, they would fill the store for ever). A live put stores a chunk far more often:
    see docs/ARCHITECTURE.md, "Orphaned chunks". With `cursor` (a sweeper's, kept between
    passes), only the metas written since its last pass are read (see MetaCursor); without,
    every meta is."""
    now = time.time() if now is None else now
    removed = 0
    # The chunk subjects are listed before the metas, so an object made visible meanwhile has
    # its meta in the list (and one made visible later wrote its last chunk just now).
    chunk_subjects = await _chunk_subjects(store) if orphans_after_s is not None else []
    # Likewise the objects' directory's files (asyncinfer.blob_files): a put that died leaves its file.
    files = store.files if orphans_after_s is not None else None
    file_names = await asyncio.to_thread(files.names) if files is not None else []
    if cursor is None:
        metas, complete, _ = await _listed_objects(store)
        listed: dict[str, ListedMeta] = {info.name: ListedMeta.of(info) for info in metas}
    else:
        complete = await cursor.refresh(store)
        listed = cursor.metas
    if orphans_after_s is not None:
        if complete:
            named = {meta.nuid for meta in listed.values()}
            removed += await _purge_orphans(store, chunk_subjects, named, now, orphans_after_s)
            if files is not None:
                named_files = {file_name(nuid) for nuid in named}
                removed += await asyncio.to_thread(files.remove_orphans, file_names, named_files, now, orphans_after_s)
        else:
            # A meta missing from the list would make a live object's chunks look orphaned.
            log.warning("blob_orphan_purge_skipped", reason="the listing of metas ended before its last")
    if cursor is None:
        for info in metas:
            if (info.deleted or info.expired(now)) and await _removed(store, info):
                removed += 1
        return removed
    for meta in [meta for meta in listed.values() if meta.due(now)]:
        # The listing keeps no meta's body (50,000 of them would be ~150 MB): the one to remove
        # is read again, and whatever it is now decides.
        latest = await store.latest_info(meta.name)
        if latest is None:
            cursor.forget(meta.name)  # deleted by another (DeleteInput, a stale result's delete)
            continue
        cursor.saw(latest)
        if (latest.deleted or latest.expired(now)) and await _removed(store, latest):
            cursor.forget(meta.name)
            removed += 1
    return removed


async def _removed(store: BlobStore, info: BlobInfo) -> bool:
    """Removes the object as `info` says it is; False when it changed meanwhile (extended or
    replaced: it lives on)."""
    try:
        await store.remove(info)
    except APIError as exc:
        if exc.err_code == WRONG_LAST_SEQUENCE:
            return False
        raise
    return True


@dataclass(frozen=True, slots=True)
class ListedMeta:
    """What the sweep needs of an object's meta (its body is not kept)."""

    name: str
    nuid: str
    expires_at: float | None
    deleted: bool
    meta_sequence: int

    @classmethod
    def of(cls, info: BlobInfo) -> ListedMeta:
        return cls(info.name, info.nuid, info.expires_at, info.deleted, info.meta_sequence)

    def due(self, now: float) -> bool:
        return self.deleted or (self.expires_at is not None and now >= self.expires_at)


class MetaCursor:
    """A sweeper's listing of metas, kept between passes: every object's meta as of stream
    sequence `last_sequence`, so that a pass reads only the meta messages stored after it (a
    meta is rolled up: each write is a new message on its subject, the older one removed)
    where it read every meta each time (~50 us of CPU a meta here, 4% of a core at 50,000
    objects every 60 s: bench/results/blob_sweep_cost.txt).

    The orphan purge's rule holds: the listing is whole, or nothing is purged. It is whole
    after a whole first listing and each whole read since; a read that stalls, fails or finds
    the stream made again (another `created`, or fewer messages than the cursor's sequence)
    drops it, and the next pass lists every meta again. A meta purged without a new message (a
    delete) stays listed until its expiry, when its object is read again: a listed meta that
    is gone only names chunks the delete purged first, so it keeps nothing that is not there."""

    def __init__(self) -> None:
        self.metas: dict[str, ListedMeta] = {}
        self.last_sequence = 0
        self.metas_read = 0  # meta messages the last pass read (the bench's and tests' look)
        self._stream_created: datetime | None = None
        self._whole = False

    def forget(self, name: str) -> None:
        self.metas.pop(name, None)

    def saw(self, info: BlobInfo) -> None:
        self.metas[info.name] = ListedMeta.of(info)

    def reset(self) -> None:
        self.metas, self.last_sequence, self._whole = {}, 0, False

    async def refresh(self, store: BlobStore) -> bool:
        """Brings the listing up to date; whether it is whole."""
        self.metas_read = 0
        try:
            stream = await store.js.stream_info(store.stream)
            if not self._whole or stream.created != self._stream_created or stream.state.last_seq < self.last_sequence:
                self.reset()
                self._stream_created = stream.created
                first, complete, last = await _listed_objects(store, on_empty=stream.state.last_seq)
            else:
                first, complete, last = await _listed_objects(store, after=self.last_sequence)
        except BaseException:
            self.reset()
            raise
        for info in first:
            self.saw(info)
        self.metas_read = len(first)
        if not complete:
            self.reset()
            return False
        self.last_sequence, self._whole = last, True
        return True


async def list_objects(store: BlobStore) -> list[BlobInfo]:
    """Every object's latest meta (deleted ones included), via an ordered consumer; fewer when
    the listing stalled (see _listed_objects)."""
    metas, _complete, _ = await _listed_objects(store)
    return metas


async def _listed_objects(
    store: BlobStore, *, after: int | None = None, on_empty: int = 0
) -> tuple[list[BlobInfo], bool, int]:
    """Every object's latest meta, or with `after` those stored after that stream sequence;
    whether the list is whole; the stream sequence it is whole up to (the last meta read;
    `after`, or `on_empty`, when there is none). Not whole when the consumer went quiet for
    LIST_IDLE_TIMEOUT_S before its last message (a busy server) or sent nothing where a meta was
    seen. Only a whole list may tell an orphan's chunks from a live object's."""
    subject = OBJ_ALL_META_PRE_TEMPLATE.format(bucket=store.bucket)
    try:
        last = await store.js.get_last_msg(store.stream, subject)
    except NotFoundError:
        return [], True, on_empty if after is None else after
    if after is not None and (last.seq or 0) <= after:
        return [], True, after
    config = (
        api.ConsumerConfig(deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)
        if after is None
        else api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1)
    )
    sub = await store.js.subscribe(
        subject,
        # Named, so that nats-py does not look the stream up by subject ($JS.API.STREAM.NAMES):
        # the services' NATS users may not (asyncinfer.nats_users), and the sweep failed on it.
        stream=store.stream,
        ordered_consumer=True,
        config=config,
        inactive_threshold=LIST_CONSUMER_INACTIVE_S,
    )
    found: list[BlobInfo] = []
    complete = False
    read_up_to = after or 0
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=LIST_IDLE_TIMEOUT_S)
            except NatsTimeoutError:
                # Purged between the look and the subscribe, or a server too busy to send the
                # rest in time: which, this listing cannot tell.
                break
            read_up_to = msg.metadata.sequence.stream
            parsed = parse_meta(msg.data, read_up_to)
            if parsed is not None:
                found.append(parsed)
            if msg.metadata.num_pending == 0:
                complete = True
                break
    finally:
        await sub.unsubscribe()
    return found, complete, read_up_to


async def _chunk_subjects(store: BlobStore) -> list[str]:
    """Every object's chunk subject: uploads' (`in.<tenant>.<nuid>`) and results' (`<nuid>`), from
    every stream info answer: the server lists at most 100,000 subjects in one (then sorted, the
    rest behind an offset), and an orphan's chunks sorted past the first 100,000 were never purged."""
    subjects: list[str] = []
    async for page in subject_pages(
        store.nc,
        store.stream,
        OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=store.bucket, obj=">"),
        timeout_s=CHUNK_SUBJECTS_TIMEOUT_S,
    ):
        subjects += page
    return subjects


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
