"""WatchBatch's feed: an ordered JetStream consumer on the batch's one key of the batches bucket
(deliver LAST_PER_SUBJECT: the record as it stands, then every write), instead of reads on a
timer. A change reaches the watcher as soon as it is written.

Updates queue per watch, coalesced by state: a write replaces the one queued before it when both
have the same state (a slow watcher is owed the latest counts, not every copy), so every
distinct state still arrives, in order, and the queue holds at most one update per state. The
ordered consumer resets itself after a gap or a lost connection (nats-py re-creates it after the
last stream sequence it saw); a watcher that reconnects resumes with `after_revision`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

import structlog

from asyncinfer.batches import BatchRecord, decode_batch
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats import KV_OP, DeliverPolicy, Msg
from asyncinfer.nats.kv import KvBucket
from services.gateway.batch_store import batch_key

log = structlog.get_logger("asyncinfer.gateway.batches")

WATCH_CONSUMER_INACTIVE_S = 1.0


class BatchUpdates:
    """The writes of one batch record, as they come (None once the record is deleted)."""

    def __init__(self) -> None:
        self._queued: collections.deque[BatchRecord | None] = collections.deque()
        self._changed = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        if KV_OP in (msg.headers or {}) or not msg.data:
            self._put(None)
            return
        try:
            record = decode_batch(msg.data, revision=msg.metadata.sequence.stream)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("batch_watch_bad_record", subject=msg.subject, error=str(exc))
            return
        self._put(record)

    def _put(self, record: BatchRecord | None) -> None:
        last = self._queued[-1] if self._queued else None
        if last is not None and record is not None and last.state is record.state:
            self._queued[-1] = record
        else:
            self._queued.append(record)
        self._changed.set()

    async def next(self) -> BatchRecord | None:
        while not self._queued:
            self._changed.clear()
            await self._changed.wait()
        return self._queued.popleft()


@contextlib.asynccontextmanager
async def watch_batch(bucket: KvBucket, tenant: str, batch_id: str) -> AsyncIterator[BatchUpdates]:
    updates = BatchUpdates()
    try:
        subscription = await bucket.js.subscribe(
            bucket.subject_prefix + batch_key(tenant, batch_id),
            stream=bucket.stream,
            cb=updates.on_msg,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            # Gone this long after the watch ends (the server's default is 5 s); while it runs,
            # its subscription is the interest that keeps it.
            inactive_threshold=WATCH_CONSUMER_INACTIVE_S,
        )
    except NATS_FAILURES as exc:
        raise Unavailable(f"cannot watch the batch: {exc}") from exc
    try:
        yield updates
    finally:
        with contextlib.suppress(Exception):  # the connection may be gone already
            await subscription.unsubscribe()
