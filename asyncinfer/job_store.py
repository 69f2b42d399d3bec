"""Job records in the jobs KV bucket, as domain `JobRecord`s — the one place that reads and writes
them, for the gateway and the scheduler alike.

Every write is a create or a compare-and-set on the revision the caller read, so two writers (a
cancel and a completion, two schedulers) can never both win; `transition` re-reads and decides
again when it loses. NATS failures surface as `Unavailable`.

Retention: the write that makes a record terminal carries a per-message TTL (`Nats-TTL`) of the
job's result retention, so NATS itself deletes it when the retention passes — no sweeper, and
a record can never outlive its retention by more than the server's expiry scan. The bucket asks
the server for a delete marker when that happens (`subject_delete_marker_ttl`); while the marker
lives, a read of that job says "retention passed" (NOT_FOUND, reason JOB_RETENTION_PASSED)
rather than "unknown job", so a client can tell an expired result from a wrong ID.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.contract import KV_OPERATION_HEADER
from asyncinfer.errors import NotFound, Unavailable
from asyncinfer.jobs import JobRecord
from asyncinfer.nats import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError, NatsError
from asyncinfer.nats.kv import KvBucket, kv_latest, kv_put_expecting

# What a KV call raises when NATS is unreachable or the request times out.
NATS_FAILURES = (NatsError, asyncio.TimeoutError)

KV_OP_HEADER = KV_OPERATION_HEADER.encode()

# Given the current record, the record to write instead, or None to leave it as it is.
Decide = Callable[[JobRecord], JobRecord | None]


class JobStore:
    def __init__(self, bucket: KvBucket) -> None:
        self._bucket = bucket
        self._kv = bucket.kv

    async def get(self, key: str) -> JobRecord | None:
        """The record at `key`, or None when there is none (never written, deleted or purged, or
        only the marker its expiry left)."""
        try:
            latest = await kv_latest(self._bucket, key)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the job record: {exc}") from exc
        if latest is None:
            return None
        data, revision = latest
        return decode_record(data, revision=revision)

    async def not_found(self, key: str, job_id: str) -> NotFound:
        """The NOT_FOUND for a job with no record: JOB_RETENTION_PASSED while the delete marker
        left by its expiry lives, else JOB_NOT_FOUND."""
        try:
            entry = await self._kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return job_not_found(job_id)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the job record: {exc}") from exc
        if entry.value:
            return job_not_found(job_id)
        return NotFound(
            f"job {job_id} ended and its retention passed: its record and result were deleted",
            reason="JOB_RETENTION_PASSED",
            metadata={"job_id": job_id},
        )

    async def create(self, record: JobRecord, *, data: bytes | None = None) -> JobRecord:
        """Writes a new record (`data`: encode_record(record), when the caller has it already);
        the returned copy carries its revision."""
        data = encode_record(record) if data is None else data
        try:
            try:
                revision = await self._publish(record, last=0, data=data)
            except KeyWrongLastSequenceError:
                # The key has history: a deleted record may be created again (KeyValue.create
                # finds the delete marker's revision and writes over it), a live one may not.
                revision = await self._kv.create(record.key, data)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot store the job record: {exc}") from exc
        return record.evolve(revision=revision)

    async def replace(self, record: JobRecord) -> JobRecord:
        """Compare-and-set: writes `record` only if the stored revision is still `record.revision`.
        Raises KeyWrongLastSequenceError when someone else wrote first, Unavailable when NATS fails."""
        try:
            revision = await self._publish(record, last=record.revision, data=encode_record(record))
        except KeyWrongLastSequenceError:
            raise
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot update the job record: {exc}") from exc
        return record.evolve(revision=revision)

    async def _publish(self, record: JobRecord, *, last: int, data: bytes) -> int:
        """A write expecting the key's last revision to be `last` (0: none), with the record's
        retention TTL (which KeyValue.update cannot send)."""
        return await kv_put_expecting(self._bucket, record.key, data, last_revision=last, ttl_s=retention_ttl(record))

    async def transition(self, record: JobRecord, decide: Decide) -> tuple[JobRecord | None, bool]:
        """Compare-and-set of decide(record); on a lost race, re-reads and decides again.

        Returns the latest record (None if it is gone) and whether this call wrote it."""
        current: JobRecord | None = record
        while current is not None:
            new = decide(current)
            if new is None:
                return current, False
            try:
                return await self.replace(new), True
            except KeyWrongLastSequenceError:
                current = await self.get(current.key)
        return None, False


def retention_ttl(record: JobRecord) -> int | None:
    """The per-message TTL of a record write: its retention once it is terminal (whole seconds,
    at least 1, as NATS requires), none before."""
    if not record.state.is_terminal:
        return None
    return max(1, math.ceil(record.result_retention_s))


def job_not_found(job_id: str) -> NotFound:
    return NotFound(f"job {job_id[:64]!r} not found", reason="JOB_NOT_FOUND", metadata={"job_id": job_id[:64]})
