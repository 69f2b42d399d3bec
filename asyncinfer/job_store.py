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
import base64
import json
import math
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.js.errors import APIError, InvalidKeyError, KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue, _is_key_valid

from asyncinfer.contract import EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER, KV_OPERATION_HEADER, MSG_TTL_HEADER
from asyncinfer.errors import NotFound, Unavailable
from asyncinfer.jobs import JobRecord, decode_record, encode_record
from asyncinfer.nats_requests import js_publish, request

# What a KV call raises when NATS is unreachable or the request times out.
NATS_FAILURES = (nats.errors.Error, asyncio.TimeoutError)

KV_OP_HEADER = KV_OPERATION_HEADER.encode()

# Given the current record, the record to write instead, or None to leave it as it is.
Decide = Callable[[JobRecord], JobRecord | None]


class JobStore:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def get(self, key: str) -> JobRecord | None:
        """The record at `key`, or None when there is none (never written, deleted or purged)."""
        try:
            latest = await self._latest(key)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the job record: {exc}") from exc
        if latest is None:
            return None
        data, revision = latest
        return decode_record(data, revision=revision)

    async def _latest(self, key: str) -> tuple[bytes, int] | None:
        """(value, revision) of the key's latest write; None when it has none, or when that write
        is a delete or purge, or a server-placed delete marker (retention passed: empty body).

        What KeyValue.get does (the same STREAM.MSG.GET request, not a direct get: see
        jetstream.ensure_jobs_bucket), without most of its CPU: nats-py 2.16 parses the stored
        headers with email.parser and builds dataclasses, and every dispatch and every read
        goes through here; the one header that matters, KV-Operation, is found by a byte scan.
        Uses the KeyValue's and JetStreamContext's private fields (as `replace` uses _update)."""
        if not _is_key_valid(key):
            raise InvalidKeyError(key)
        kv: Any = self._kv
        js: Any = kv._js
        subject = f"{kv._pre}{key}"
        reply = await request(
            js._nc,
            f"{js._prefix}.STREAM.MSG.GET.{kv._stream}",
            json.dumps({"last_by_subj": subject}).encode(),
            timeout_s=js._timeout,
        )
        answer = json.loads(reply.data)
        error = answer.get("error")
        if error is not None:
            if error.get("code") == 404:  # no message for the key
                return None
            APIError.from_error(error)  # raises
        message = answer["message"]
        if message.get("subject") != subject:
            return None
        headers = message.get("hdrs")
        if headers and _operation(base64.b64decode(headers)) in (KV_DEL, KV_PURGE):
            return None
        data = message.get("data")
        if not data:
            return None
        return base64.b64decode(data), int(message["seq"])

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
        """KeyValue._update (a write expecting the key's last revision to be `last`, 0: none) with
        the record's retention TTL, on the cheaper request path (asyncinfer.nats_requests)."""
        kv: Any = self._kv
        js: Any = kv._js
        headers = {EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER: str(last)}
        ttl = retention_ttl(record)
        if ttl is not None:
            headers[MSG_TTL_HEADER] = str(ttl)
        return await js_publish(js._nc, f"{kv._pre}{record.key}", data, timeout_s=js._timeout, headers=headers)

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


def _operation(headers: bytes) -> str | None:
    """The KV-Operation header (DEL, PURGE) of a raw NATS header block, if any."""
    for line in headers.split(b"\r\n")[1:]:  # the first line is the NATS/1.0 status line
        name, _, value = line.partition(b":")
        if name.strip() == KV_OP_HEADER:
            return value.strip().decode("ascii", "replace")
    return None


def job_not_found(job_id: str) -> NotFound:
    return NotFound(f"job {job_id[:64]!r} not found", reason="JOB_NOT_FOUND", metadata={"job_id": job_id[:64]})
