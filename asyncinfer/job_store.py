"""Job records in the jobs KV bucket, as domain `JobRecord`s — the one place that reads and writes
them, for the gateway and the scheduler alike.

Every write is a create or a compare-and-set on the revision the caller read, so two writers (a
cancel and a completion, two schedulers) can never both win; `transition` re-reads and decides
again when it loses. NATS failures surface as `Unavailable`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import nats.errors
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from asyncinfer.errors import NotFound, Unavailable
from asyncinfer.jobs import JobRecord, decode_record, encode_record

# What a KV call raises when NATS is unreachable or the request times out.
NATS_FAILURES = (nats.errors.Error, asyncio.TimeoutError)

# Given the current record, the record to write instead, or None to leave it as it is.
Decide = Callable[[JobRecord], JobRecord | None]


class JobStore:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def get(self, key: str) -> JobRecord | None:
        """The record at `key`, or None when there is none (never written, deleted or purged)."""
        try:
            entry = await self._kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the job record: {exc}") from exc
        if entry.value is None or entry.revision is None:
            return None
        return decode_record(entry.value, revision=entry.revision)

    async def create(self, record: JobRecord) -> JobRecord:
        """Writes a new record; the returned copy carries its revision."""
        try:
            revision = await self._kv.create(record.key, encode_record(record))
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot store the job record: {exc}") from exc
        return record.evolve(revision=revision)

    async def replace(self, record: JobRecord) -> JobRecord:
        """Compare-and-set: writes `record` only if the stored revision is still `record.revision`.
        Raises KeyWrongLastSequenceError when someone else wrote first, Unavailable when NATS fails."""
        try:
            revision = await self._kv.update(record.key, encode_record(record), last=record.revision)
        except KeyWrongLastSequenceError:
            raise
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot update the job record: {exc}") from exc
        return record.evolve(revision=revision)

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


def job_not_found(job_id: str) -> NotFound:
    return NotFound(f"job {job_id[:64]!r} not found", reason="JOB_NOT_FOUND", metadata={"job_id": job_id[:64]})
