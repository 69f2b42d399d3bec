"""Job records in the jobs KV bucket, as domain `JobRecord`s — the one place that reads and writes
them, for the gateway and the scheduler alike.

A queued job's record is its work message (asyncinfer.jobs.WorkEnvelope.is_record): a submit
makes one durable write. Its first transition creates it in the bucket, and a read of a job the
bucket does not hold looks for its work message by the job's own subject (read at revision 0).

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

import structlog

from asyncinfer.codecs.envelope import decode_envelope
from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.contract import KV_OPERATION_HEADER, job_work_lookup, job_work_subject
from asyncinfer.errors import AsyncInferError, NotFound, Unavailable
from asyncinfer.ids import is_job_id
from asyncinfer.jobs import JobRecord
from asyncinfer.nats import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError, NatsError
from asyncinfer.nats.kv import KvBucket, kv_last_write, kv_latest, kv_put_expecting
from asyncinfer.nats.streams import delete_messages_on, last_stored

log = structlog.get_logger("asyncinfer.job_store")

# The keys an UnreadableOnce remembers having said (then it forgets them all and says each again).
UNREADABLE_KEYS_KEPT = 10_000

# What a KV call raises when NATS is unreachable or the request times out.
NATS_FAILURES = (NatsError, asyncio.TimeoutError)

KV_OP_HEADER = KV_OPERATION_HEADER.encode()

# Given the current record, the record to write instead, or None to leave it as it is.
Decide = Callable[[JobRecord], JobRecord | None]
# Told of each write `transition` made: the record it replaced, then the one written. Must not block
# or raise (asyncinfer.claim_lifetimes queues work of its own).
AfterWrite = Callable[[JobRecord, JobRecord], None]


class UnreadableJob(AsyncInferError):
    """A job record this release cannot decode: written by a later release (a state or a field
    shape it does not know, during a rolling upgrade), or corrupted. INTERNAL JOB_UNREADABLE to a
    caller (GetJob, CancelJob, WatchJob, ...), naming the job and its key; the scheduler leaves the
    job alone (a scheduler that reads it runs it). It was the decoder's ValueError: UNKNOWN with a
    traceback to a caller, and a traceback per pass in the scheduler's loops."""

    def __init__(self, key: str, error: str) -> None:
        job_id = key.partition(".")[2]
        super().__init__(
            f"job {job_id}'s record (key {key!r}) cannot be read by this release: {error}; written by a "
            "later release (a rolling upgrade), or corrupted",
            reason="JOB_UNREADABLE",
            metadata={"job_id": job_id, "key": key},
        )
        self.key = key
        self.job_id = job_id
        self.error = error


def decode_job(key: str, data: bytes, revision: int) -> JobRecord:
    """decode_record, its ValueError as UnreadableJob (naming the job at `key`)."""
    try:
        return decode_record(data, revision=revision)
    except ValueError as exc:
        raise UnreadableJob(key, str(exc)) from exc


class UnreadableOnce:
    """Says `event` (`job_unreadable`, or `batch_unreadable` for the gateway's batch records) once
    per key for a reader that meets the same record again and again (a loop's passes, a listing's
    pages), not once each time; `where` names the reader, the line the record (the error's
    ErrorInfo metadata: its ID and key, and the caller's `fields`) and why. A reader that reads the
    record again, readable, may `forget` it: written unreadable once more, it is said again (the
    batch driver's adoption pass does)."""

    def __init__(self, where: str, *, event: str = "job_unreadable") -> None:
        self._where = where
        self._event = event
        self._said: set[str] = set()

    def say(self, exc: AsyncInferError, **fields: object) -> None:
        key = exc.metadata["key"]
        if key in self._said:
            return
        if len(self._said) >= UNREADABLE_KEYS_KEPT:
            self._said.clear()
        self._said.add(key)
        error = getattr(exc, "error", exc.message)
        log.warning(self._event, where=self._where, error=error, **exc.metadata, **fields)

    def forget(self, key: str) -> None:
        """The record at `key` was read, readable: said again if it is met unreadable again."""
        self._said.discard(key)


class JobStore:
    def __init__(self, bucket: KvBucket, *, work_stream: str, after_write: AfterWrite | None = None) -> None:
        self._bucket = bucket
        self._kv = bucket.kv
        self._work_stream = work_stream
        self.after_write = after_write

    async def get(self, key: str) -> JobRecord | None:
        """The job's record, or None when there is none (never submitted, deleted or purged, or
        only the marker its expiry left): from the bucket, else (still queued, the key never
        written) from its work message. A job that leaves the queue between the two reads has
        been written to the bucket by then (the work message goes only after its result is
        stored): read again. A removed record is never read from a work message that is left."""
        try:
            last = await kv_last_write(self._bucket, key)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the job record: {exc}") from exc
        if last is not None:
            data, revision = last
            return decode_job(key, data, revision) if data else None
        queued = await self.queued(key)
        if queued is not None:
            return queued
        return await self.recorded(key)

    async def queued(self, key: str) -> JobRecord | None:
        """The QUEUED record that the job's work message is, or None when it has none (or the
        message is a replay's, or one from before messages were records). It carries the server's
        stamp on the message (`work_message_time`, from the same answer: no request more)."""
        tenant, _, job_id = key.partition(".")
        try:
            stored = await last_stored(self._bucket.js, self._work_stream, job_work_lookup(tenant, job_id))
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the queued job: {exc}") from exc
        if stored is None or not stored[0]:
            return None
        data, stored_time = stored
        try:
            envelope = decode_envelope(data)
        except (ValueError, KeyError, TypeError):
            return None
        if not envelope.is_record:
            return None
        return envelope.queued_record(work_message_time=stored_time)

    async def recorded(self, key: str) -> JobRecord | None:
        """The record in the bucket at `key`, or None (see get)."""
        try:
            latest = await kv_latest(self._bucket, key)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the job record: {exc}") from exc
        if latest is None:
            return None
        data, revision = latest
        return decode_job(key, data, revision)

    async def drop_work_message(self, record: JobRecord) -> None:
        """Deletes the job's work message: for a job whose record in the bucket ended while it was
        queued (cancelled), whose message would otherwise count as queued until a dispatch pulls
        it. Never for a job that may run: the message is what runs it again after a lapsed lease.

        Found by the job's own subject (its model's and priority's), deleted by its sequence:
        nats-server then lets go of the consumer's delivery of it as well (as a term). A purge by a
        subject wider than that filter (`asyncinfer.work.*.*.<tenant>.<job>`) left a message that
        was delivered and put back pending on the consumer (its ack pending, which KEDA's
        nats-jetstream lag and the gateway's max_queue_depth count) until its delay ran out (a
        retry's backoff, up to 300 s) or a pull came for it (never, with no batcher)."""
        subject = job_work_subject(record.model_name, record.priority, record.tenant, record.job_id)
        try:  # by sequence, not a subject purge, which stranded older deliveries (delete_messages_on)
            await delete_messages_on(self._bucket.js, self._work_stream, subject, timeout_s=5.0)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot drop the job's work message: {exc}") from exc

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

    async def create_first(self, record: JobRecord, *, ttl_s: int | None) -> tuple[JobRecord | None, JobRecord | None]:
        """Writes `record` (with a TTL of `ttl_s`, None: none) only if its key was never written: a
        create expecting revision 0, which any earlier write refuses, a delete marker included.
        (the record written, None) when it won; (None, the live record there, or None where only
        a marker is) when refused. The fence between a keyed job's withdrawal and anything that
        would make it live: a scheduler's dispatch creates a queued job's record the same way."""
        try:
            try:
                revision = await kv_put_expecting(
                    self._bucket, record.key, encode_record(record), last_revision=0, ttl_s=ttl_s
                )
            except KeyWrongLastSequenceError:
                return None, await self.recorded(record.key)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot store the job record: {exc}") from exc
        return record.evolve(revision=revision), None

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

        Returns the latest record (None if it is gone) and whether this call wrote it.

        A record at revision 0 (a queued job's work message) is written by a create. A create that
        loses finds what won in the bucket; when the bucket holds nothing there (the winner's
        retention passed and only its marker is left) the job is gone."""
        current: JobRecord | None = record
        while current is not None:
            new = decide(current)
            if new is None:
                return current, False
            try:
                written = await self.replace(new)
            except KeyWrongLastSequenceError:
                current = await (self.recorded(current.key) if current.revision == 0 else self.get(current.key))
                continue
            if self.after_write is not None:
                self.after_write(current, written)
            return written, True
        return None, False


def retention_ttl(record: JobRecord) -> int | None:
    """The per-message TTL of a record write: its retention once it is terminal (whole seconds,
    at least 1, as NATS requires), none before."""
    if not record.state.is_terminal:
        return None
    return max(1, math.ceil(record.result_retention_s))


def job_not_found(job_id: str) -> NotFound:
    # Still NOT_FOUND when the text cannot be an ID at all (the contract: an unknown ID is
    # NOT_FOUND), but saying so: a truncated copy, or a batch's name, reads differently from a job
    # that has gone.
    why = "" if is_job_id(job_id) else f": not a job ID (job IDs are UUIDv7, like {EXAMPLE_JOB_ID})"
    return NotFound(f"job {job_id[:64]!r} not found{why}", reason="JOB_NOT_FOUND", metadata={"job_id": job_id[:64]})


EXAMPLE_JOB_ID = "0193a4f2-6c1e-7d3e-8f00-3b5c2a9e41d7"
