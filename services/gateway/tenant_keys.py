"""A tenant's job IDs with a live record (its keys in the jobs bucket), kept between ListJobs calls
and brought up to date by reading only the keys written since, not all of them again.

Why. A full scan is one headers-only message per key through nats-py, ~15 us of the gateway's
event loop a key. With 20,000 jobs retained in a tenant each ListJobs took 0.33-0.50 s and held the
loop up to 80-125 ms at a time, and the console's Jobs page asked every 2 s. Now a call reads only
the keys written since the last one (BY_START_SEQUENCE from the next sequence, on the same tenant
filter): typically none or a few, and when nothing at all was written to the bucket no consumer
is made. A scan (the first, or a large catch-up) reads through an ephemeral pull consumer, SCAN_BATCH
keys a pull (asyncinfer.nats.scan): an ordered push consumer filled the socket, and nats-py parsed
all a read held (~900 keys) before anything else on the loop ran. Measured on the 2-core machine,
20,000 live keys and 2,000 expiry markers in one tenant, a fresh index each time (5 scans each):
worst stall of a 1 ms loop-lag probe 74-112 ms (3-5 over 20 ms a scan) -> 5-8 ms (none over 10 ms);
a scan's time 358-425 ms -> 288-346 ms (the pulls' round trips cost less than the push consumer's
per-message work in nats-py).

Why it gives the same answers as a full scan. The bucket keeps one message per key (history 1),
and every change to a key is a new message with a higher stream sequence: a write, our delete or
purge, or the marker the server places when a record's TTL removes it
(`subject_delete_marker_ttl`, asyncinfer.job_store). So "the IDs as of sequence S" plus every
message of the tenant's keys above S, applied in order, is the current set; messages above S
are exactly what a consumer from S + 1 delivers. S is the stream's last sequence read just before
the consumer was made (everything up to it is in what the consumer starts with) or the highest
sequence delivered, whichever is higher. What could slip past: a marker that expired before it was
read (so refreshes of one tenant may be at most half the marker TTL apart, else a full scan), the
stream made anew (its creation time and sequences change: full scan), or messages removed without
a marker (an operator's stream purge: a full scan at least every FULL_RESCAN_S bounds that). The
index is per gateway process and lives in memory: a restarted gateway, or a second one, starts
with a full scan of its own, so nothing depends on what any other process saw.

Weighed and not taken: yielding alone (measured above: the stalls stay); a cache of the scan for a
few seconds (its answers would lag: a job that finished inside the window has lost its work
message, the queued half of a listing, and its key is not yet known, so it would vanish from the
list for a while); an index fed by the watch hub's feed of every record write (that feed runs only
while someone watches or polls, and stops when idle, so the index would need its own catch-up after
each gap: this incremental read is that catch-up, and needs no other component's state).

Bounded: at most MAX_TENANTS tenants and MAX_CACHED_IDS IDs in all (least recently listed
first out; a tenant larger than that alone is scanned in full on each call, as before); one
unused for IDLE_S is dropped.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime

import structlog

from asyncinfer.contract import kv_stream, kv_subject, kv_subject_prefix, tenant_keys
from asyncinfer.errors import Unavailable
from asyncinfer.ids import is_job_id
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.jobs import job_key
from asyncinfer.nats import KV_MARKER_REASON, KV_OP, Client, DeliverPolicy, Msg
from asyncinfer.nats.scan import scan_headers

log = structlog.get_logger("asyncinfer.gateway.list")

SCAN_TIMEOUT_S = 30.0
# The scan's ephemeral consumer is deleted when the scan ends; should that delete fail, the server
# drops it this long after its last pull: a client paging at 20 calls/s kept ~100 of them alive
# on the jobs stream at the server's 5 s.
SCAN_CONSUMER_INACTIVE_S = 1.0
# Keys per pull of a scan: what nats-py parses, and the scan reads, without letting the loop run
# (~17 us a key: ~4 ms); 20,000 keys are 79 pulls, a local round trip each.
SCAN_BATCH = 256
MAX_TENANTS = 64
MAX_CACHED_IDS = 500_000  # ~45 MB of IDs at the most
IDLE_S = 600.0
FULL_RESCAN_S = 600.0
# More changes than this at once are merged by sorting again, not inserted one at a time.
INSERT_AT_MOST = 256


def tenant_filter_subject(bucket: str, tenant: str) -> str:
    """The only subjects a listing of `tenant` ever consumes."""
    return kv_subject(bucket, tenant_keys(tenant))


@dataclass(slots=True)
class _Known:
    ids: list[str] = field(default_factory=list)  # ascending
    seq: int = 0  # every message of the tenant's keys up to this stream sequence is in `ids`
    stream_created: datetime | None = None
    full_at: float = 0.0  # time.monotonic() of the last full scan
    refreshed_at: float = 0.0
    used_at: float = 0.0
    scanned: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(slots=True)
class ScanCounts:
    """What the index did, for tests and logs."""

    full: int = 0
    incremental: int = 0
    skipped: int = 0  # nothing was written to the bucket since


class TenantKeyIndex:
    def __init__(self, nc: Client, *, bucket: str) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._bucket = bucket
        self._stream = kv_stream(bucket)
        self._subject_prefix = kv_subject_prefix(bucket)
        self._known: OrderedDict[str, _Known] = OrderedDict()
        self.counts = ScanCounts()

    async def recorded_ids(self, tenant: str) -> list[str]:
        """The job IDs of the tenant's keys with a live record, ascending (the caller's own list)."""
        known = self._entry(tenant)
        async with known.lock:
            await self._refresh(tenant, known)
            ids = list(known.ids)
        self._trim()
        return ids

    def _entry(self, tenant: str) -> _Known:
        now = time.monotonic()
        for name in [name for name, known in self._known.items() if now - known.used_at >= IDLE_S]:
            if not self._known[name].lock.locked():
                del self._known[name]
        known = self._known.get(tenant)
        if known is None:
            known = self._known[tenant] = _Known()
        self._known.move_to_end(tenant)
        known.used_at = now
        return known

    def _trim(self) -> None:
        total = sum(len(known.ids) for known in self._known.values())
        for name in list(self._known):
            if len(self._known) <= MAX_TENANTS and total <= MAX_CACHED_IDS:
                break
            known = self._known[name]
            if not known.lock.locked():
                total -= len(known.ids)
                del self._known[name]

    async def _refresh(self, tenant: str, known: _Known) -> None:
        try:
            info = await self._js.stream_info(self._stream)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot list the jobs: {exc}") from exc
        now = time.monotonic()
        last_seq = info.state.last_seq or 0
        marker_ttl_s = info.config.subject_delete_marker_ttl or 0.0
        incremental = (
            known.scanned
            and info.created == known.stream_created
            and last_seq >= known.seq
            and now - known.full_at < FULL_RESCAN_S
            # A marker lives marker_ttl_s: refreshes closer than that cannot miss one.
            and now - known.refreshed_at < marker_ttl_s / 2
        )
        if incremental and last_seq == known.seq:
            self.counts.skipped += 1
            known.refreshed_at = now
            return
        changes, seq = await self._scan(tenant, start_seq=known.seq + 1 if incremental else None)
        seq = max(seq, last_seq)
        if incremental:
            self.counts.incremental += 1
            apply_changes(known.ids, changes)
        else:
            self.counts.full += 1
            known.ids = sorted(job_id for job_id, live in changes.items() if live)
            known.full_at = now
            known.stream_created = info.created
            known.scanned = True
        known.seq = seq
        known.refreshed_at = now

    async def _scan(self, tenant: str, *, start_seq: int | None) -> tuple[dict[str, bool], int]:
        """Each key's last message (from start_seq on, else all of them): job ID -> a live record,
        in stream order; and the highest sequence delivered (0 for none). Headers only."""
        prefix = self._subject_prefix + job_key(tenant, "")
        changes: dict[str, bool] = {}

        def on_keys(msgs: list[Msg]) -> None:
            for msg in msgs:
                job_id = msg.subject.removeprefix(prefix)
                headers = msg.headers or {}
                # The last message per key: a delete marker (ours or the server's, retention passed) is no job.
                changes[job_id] = not (KV_OP in headers or KV_MARKER_REASON in headers or not is_job_id(job_id))

        policy = DeliverPolicy.LAST_PER_SUBJECT if start_seq is None else DeliverPolicy.BY_START_SEQUENCE
        try:
            highest = await scan_headers(
                self._nc,
                stream=self._stream,
                filter_subject=tenant_filter_subject(self._bucket, tenant),
                deliver_policy=policy,
                start_seq=start_seq,
                on_batch=on_keys,
                batch=SCAN_BATCH,
                inactive_threshold_s=SCAN_CONSUMER_INACTIVE_S,
                timeout_s=SCAN_TIMEOUT_S,
            )
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot list the jobs: {exc}") from exc
        return changes, highest


def apply_changes(ids: list[str], changes: dict[str, bool]) -> None:
    """`changes` (job ID -> live) applied to the ascending `ids`, in place."""
    if len(changes) > INSERT_AT_MOST:
        merged = set(ids)
        for job_id, live in changes.items():
            if live:
                merged.add(job_id)
            else:
                merged.discard(job_id)
        ids[:] = sorted(merged)
        return
    for job_id, live in changes.items():
        at = bisect.bisect_left(ids, job_id)
        present = at < len(ids) and ids[at] == job_id
        if live and not present:
            ids.insert(at, job_id)
        elif not live and present:
            del ids[at]
