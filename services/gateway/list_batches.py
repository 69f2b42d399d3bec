"""ListBatches' pages: a tenant's batches newest first (batch IDs are UUIDv7), a page's token the
last batch ID it read. The IDs come from the batches bucket's subjects (BatchStore.newest_ids,
every stream info answer, keeping only the newest few below the token); the records are read a
chunk at a time. A withdrawal (asyncinfer.batches.is_withdrawn) is a fence, not a batch of its
caller's, whose create was answered UNAVAILABLE or with the key's other batch, and a key read as
no record (removed since it was listed) is none either: both are left out and read past. So is
a record this release cannot decode (a later release's, during a rolling upgrade, or corrupted):
the page still shows the others and counts it (unreadable_skipped), as ListJobs does (a ListBatches answer has no per-batch error, and
an error for the page stopped the listing there for as long as the record stayed); the gateway says
it once per key (`batch_unreadable`), and GetBatch answers it INTERNAL BATCH_UNREADABLE.

A page reads on, taking more IDs below the last it read, until it holds a batch, the listing ends,
or it read MAX_BATCHES_READ_PER_PAGE of them: an empty page with a token, where batches follow,
makes a client that stops at an empty page miss them and one that follows every token ask again
and again. Once it holds one it may be short, with a token (AIP-158 allows it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from asyncinfer.batches import BatchRecord, is_withdrawn
from asyncinfer.job_store import UnreadableOnce
from services.gateway.batch_store import BatchStore, UnreadableBatch
from services.gateway.list_jobs import read_size

# A page reads at most this many batch IDs past its token (plus the rest of its last chunk) in
# search of a batch to answer; past as many withdrawals it answers none, with a token.
MAX_BATCHES_READ_PER_PAGE = 1000
# Each further look for IDs takes this many times as many as the last (at first 2 x page_size):
# a look reads every stream info answer of the tenant's keys, so a few of them, however many
# withdrawals a page reads past.
WIDER_BY = 4


@dataclass(frozen=True)
class BatchPage:
    """A ListBatches page: its batches, newest first; the token of the page after them ("" at
    the end); how many records it read past because it cannot decode them."""

    records: list[BatchRecord]
    next_page_token: str
    unreadable_skipped: int


async def _readable(
    store: BatchStore, tenant: str, batch_id: str, unreadable: UnreadableOnce
) -> BatchRecord | UnreadableBatch | None:
    try:
        return await store.get(tenant, batch_id)
    except UnreadableBatch as exc:
        unreadable.say(exc)
        return exc


async def batch_page(
    store: BatchStore, tenant: str, *, after: str | None, size: int, unreadable: UnreadableOnce
) -> BatchPage:
    """The tenant's next `size` batches older than `after` (from the first when None), newest
    first."""
    records: list[BatchRecord] = []
    last = after  # the last ID this page read: where the next page starts
    read = 0
    most = 2 * size  # enough to read past a few withdrawals in one look
    skipped = False
    unreadable_skipped = 0
    while True:
        ids, older_left_out = await store.newest_ids(tenant, before=last, most=most)
        consumed = 0
        while len(records) < size and consumed < len(ids):
            chunk = ids[consumed : consumed + read_size(size - len(records), filtered=False, skipped=skipped)]
            for batch_id, record in zip(
                chunk, await asyncio.gather(*(_readable(store, tenant, i, unreadable) for i in chunk)), strict=True
            ):
                consumed += 1
                last = batch_id
                if isinstance(record, UnreadableBatch):
                    unreadable_skipped += 1
                    record = None
                if record is None or is_withdrawn(record):
                    skipped = True
                    continue
                records.append(record)
                if len(records) == size:
                    break
        read += consumed
        more = consumed < len(ids) or older_left_out
        if records or not more or read >= MAX_BATCHES_READ_PER_PAGE:
            return BatchPage(records, (last or "") if more else "", unreadable_skipped)
        most = min(WIDER_BY * most, MAX_BATCHES_READ_PER_PAGE - read)
