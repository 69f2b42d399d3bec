"""ListJobs: the caller's own jobs, newest first, filtered by state, model and labels, paged. A
batch's chunk jobs are left out unless the labels filter names their batch label, and so are the
idempotency fence's withdrawals (asyncinfer.job_errors.is_withdrawal: told apart by the record
each page reads anyway); services/gateway/job_selection.py holds that rule, which WatchJobs by
label follows too.

How. Job IDs are UUIDv7, so a tenant's keys "<tenant>.<job_id>" sorted descending are its jobs
newest first. A job still queued has no key yet: its work message is its record, so the tenant's
job IDs are its keys and its queued jobs' work subjects ("asyncinfer.work.*.*.<tenant>.*", from the
work stream's subject index: one stream info answer per 100,000 of them, of which a page keeps only the
newest it can read). A page (1) takes the
tenant's keys with a live record from the gateway's TenantKeyIndex (services/gateway/tenant_keys.py):
the first listing of a tenant scans its keys with an ephemeral pull consumer whose filter
subject is "$KV.<jobs bucket>.<tenant>.>" (headers only, last message per subject, a bounded batch
per pull so the loop is never held long), later ones read
only the keys written since (the same filter, from the next stream sequence); the server filters,
so another tenant's records are never delivered, let alone read. nats-py's
`KeyValue.keys(filters=...)` would not do: it watches every key of the bucket and filters by
substring on the client. Then (2) it reads the records after the cursor, newest first, a chunk at
a time, and keeps those that match until the page is full, its jobs' inline outputs would pass
`max_page_bytes` (a response must fit gRPC's message limit; a page always holds at least one job),
or MAX_RECORDS_READ_PER_PAGE were read (a page may then be short, with a token to go on: AIP-158
allows it).

Cost: a tenant's first listing (and one every tenant_keys.FULL_RESCAN_S) is O(its retained jobs
and the markers of its expired ones) for the key scan (headers only, ~15 us of the event loop a
key, in pieces of at most tenant_keys.SCAN_BATCH keys, ~5 ms); every other page costs the keys written
since the last, a stream info of each stream, the records read, and a bisect into the index. For
millions of jobs per tenant the better index is a per-tenant, time-partitioned one (e.g. a KV
"<tenant>.<hour>.<job_id>" -> state/model/labels written with each record), so a page reads only
the partitions it needs and filters without reading records.

Page tokens are opaque: base64url of {after: the last job ID returned, filter: a fingerprint of the
tenant and filters}; a token used with other filters (or by another tenant) is INVALID_ARGUMENT.
page_size: 0 means DEFAULT_PAGE_SIZE; above MAX_PAGE_SIZE it is clamped (AIP-158); negative is
INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.contract import tenant_work_subjects
from asyncinfer.errors import FieldViolation, InvalidArgument, Unavailable
from asyncinfer.ids import is_job_id
from asyncinfer.job_store import NATS_FAILURES, JobStore, UnreadableJob, UnreadableOnce
from asyncinfer.jobs import JobRecord, JobState, job_key
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Client
from asyncinfer.nats.streams import subject_pages
from asyncinfer.v1 import job_pb2, job_service_pb2
from services.gateway.job_selection import selects
from services.gateway.newest_ids import NewestIds
from services.gateway.submit_request import label_violations
from services.gateway.tenant_keys import TenantKeyIndex
from services.gateway.transitions import Expiry

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
MAX_RECORDS_READ_PER_PAGE = 5000
READ_CHUNK = 64
# A stream info answer listing the queued jobs' subjects (100,000 of them: ~8 MB of JSON).
WORK_SUBJECTS_TIMEOUT_S = 10.0
# A Job message without its outputs is well under this (labels and strings are bounded).
RECORD_OVERHEAD_BYTES = 8 * 1024
_STATE_PREFIX = "JOB_STATE_"


@dataclass(frozen=True, slots=True)
class ListQuery:
    page_size: int = DEFAULT_PAGE_SIZE
    page_token: str = ""
    states: frozenset[JobState] = frozenset()
    model_name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)

    def matches(self, record: JobRecord) -> bool:
        if self.states and record.state not in self.states:
            return False
        if self.model_name and record.model_name != self.model_name:
            return False
        return selects(self.labels, record)

    def fingerprint(self, tenant: str) -> str:
        obj = {
            "tenant": tenant,
            "states": sorted(state.value for state in self.states),
            "model": self.model_name,
            "labels": sorted(self.labels.items()),
        }
        return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class ListPage:
    records: tuple[JobRecord, ...]
    next_page_token: str = ""
    # How many of the records the page read it left out because it cannot decode them.
    unreadable_skipped: int = 0


def _bad_token(why: str) -> InvalidArgument:
    message = f"invalid page_token: {why}"
    return InvalidArgument(message, [FieldViolation("page_token", message)], reason="INVALID_PAGE_TOKEN")


def encode_token(after: str, fingerprint: str) -> str:
    raw = json.dumps({"after": after, "filter": fingerprint}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_token(token: str, fingerprint: str) -> str:
    """The job ID the page starts after."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        obj = json.loads(raw)
        after, seen = obj["after"], obj["filter"]
    except (ValueError, TypeError, KeyError, binascii.Error, RecursionError) as exc:  # RecursionError: deep JSON
        raise _bad_token("not a token from ListJobs") from exc
    if not isinstance(after, str) or not is_job_id(after):
        raise _bad_token("not a token from ListJobs")
    if seen != fingerprint:
        raise _bad_token("it was issued for other filters; pass the same filters as the first page")
    return after


def list_query_from_proto(request: job_service_pb2.ListJobsRequest) -> ListQuery:
    """Raises InvalidArgument (every violation) for a negative page size or an unknown state."""
    violations: list[FieldViolation] = []
    if request.page_size < 0:
        violations.append(FieldViolation("page_size", f"must be 0 (the default, {DEFAULT_PAGE_SIZE}) or positive"))
    states: set[JobState] = set()
    for value in request.states:
        name = job_pb2.JobState.Name(value) if value in job_pb2.JobState.values() else ""
        try:
            states.add(JobState(name.removeprefix(_STATE_PREFIX)))
        except ValueError:
            violations.append(FieldViolation("states", f"unknown job state {value}"))
    violations += label_violations(request.labels, selector=True)
    if violations:
        first = violations[0]
        raise InvalidArgument(f"invalid request: {first.field}: {first.description}", violations)
    return ListQuery(
        page_size=min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE),
        page_token=request.page_token,
        states=frozenset(states),
        model_name=request.model_name,
        labels=dict(request.labels),
    )


def estimated_bytes(record: JobRecord) -> int:
    """About the size of the record as a Job message: its inline outputs and the rest."""
    return RECORD_OVERHEAD_BYTES + sum(len(tensor.data) for tensor in record.outputs)


def read_size(needed: int, *, filtered: bool, skipped: bool) -> int:
    """How many records a page reads next, `needed` more to fill it. With filters, READ_CHUNK: any
    may be skipped. Without, what it needs until a record was skipped (a plain tenant's page reads
    no record it does not return), then READ_CHUNK too: a listing without filters also skips chunk
    jobs and withdrawals, and a batch's thousands of chunk jobs are read past a chunk at a time,
    not `needed` at a time (page_size 1: one record a round trip)."""
    return READ_CHUNK if filtered or skipped else min(needed, READ_CHUNK)


def newest_first(recorded: list[str], queued: set[str], after: str | None, most: int) -> list[str]:
    """The first `most` of the job IDs in `recorded` (ascending) and `queued` older than `after`
    (all when None), newest first: `sorted(set(recorded) | queued, reverse=True)` after `after`,
    cut, without sorting or copying the rest of a large tenant's IDs."""
    end = len(recorded) if after is None else bisect.bisect_left(recorded, after)
    window = recorded[max(0, end - most) : end]  # the newest `most` of them older than `after`
    if after is not None:
        queued = {job_id for job_id in queued if job_id < after}
    return sorted(queued.union(window), reverse=True)[:most]


def say_unreadable_skipped(lines: RepeatedLines, logger: Any, listing: str, tenant: str, count: int) -> None:
    """A page (of `listing`: ListJobs, ListBatches) that left out `count` records it cannot decode
    says so beside the per-record lines (once per key): `list_unreadable_skipped` at warning, once
    per interval per listing, the rest at debug (a client paging through them writes one a page).
    Nothing when `count` is 0."""
    if count:
        lines.say(
            logger,
            "warning",
            "list_unreadable_skipped",
            kind=listing,
            listing=listing,
            tenant=tenant,
            unreadable_skipped=count,
        )


class JobLister:
    def __init__(
        self,
        nc: Client,
        records: JobStore,
        expiry: Expiry,
        *,
        bucket: str,
        work_stream: str,
        max_page_bytes: int,
    ) -> None:
        self._nc = nc
        self._work_stream = work_stream
        self._max_page_bytes = max_page_bytes
        self._records = records
        self._unreadable = UnreadableOnce("list_jobs")
        self._expiry = expiry
        self._keys = TenantKeyIndex(nc, bucket=bucket)

    async def tenant_job_ids(self, tenant: str) -> list[str]:
        """The tenant's job IDs with a live record, newest first: its keys and its queued jobs."""
        queued = await self._queued_job_ids(tenant)
        return sorted(set(await self._keys.recorded_ids(tenant)) | queued, reverse=True)

    async def _newest_first(self, tenant: str, after: str | None, most: int) -> list[str]:
        # The queued jobs first: a job that leaves the queue between the two reads has its record
        # written by then (the work message goes only after the result is stored).
        queued = await self._queued_job_ids(tenant, after, most)
        return newest_first(await self._keys.recorded_ids(tenant), queued, after, most)

    async def _queued_job_ids(self, tenant: str, after: str | None = None, most: int | None = None) -> set[str]:
        """The IDs of the tenant's queued jobs (every one, or the newest `most` older than `after`:
        all a page can read), from every answer of the work stream's subjects: the server lists
        100,000 at most in one, sorted by model first, and a backlog past that lost the rest from
        every page. Kept to `most` answer by answer, so a listing holds a page's worth of them
        beside the answer it reads, however large the backlog."""
        newest = NewestIds(before=after, most=most)
        try:
            async for subjects in subject_pages(
                self._nc, self._work_stream, tenant_work_subjects(tenant), timeout_s=WORK_SUBJECTS_TIMEOUT_S
            ):
                newest.add(job_id for subject in subjects if is_job_id(job_id := subject.rpartition(".")[2]))
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot list the jobs: {exc}") from exc
        return newest.kept

    async def _read(self, tenant: str, job_id: str) -> JobRecord | UnreadableJob | None:
        """The job's record; the error (left out of the page, counted in its unreadable_skipped,
        said once in the log) when this release cannot decode it: the page still shows the others
        (a ListJobs answer has no per-job error, and an error for the page would stop the listing
        there for as long as the record stays). GetJob and GetJobs answer that job INTERNAL
        JOB_UNREADABLE."""
        try:
            record = await self._records.get(job_key(tenant, job_id))
        except UnreadableJob as exc:
            self._unreadable.say(exc)
            return exc
        return None if record is None else await self._expiry.settle(record)

    async def page(self, tenant: str, query: ListQuery) -> ListPage:
        fingerprint = query.fingerprint(tenant)
        after = decode_token(query.page_token, fingerprint) if query.page_token else None
        # Enough that a page never reaches the end of the list unless it is the end: a page reads
        # at most MAX_RECORDS_READ_PER_PAGE records, plus the rest of its last chunk.
        ids = await self._newest_first(tenant, after, MAX_RECORDS_READ_PER_PAGE + READ_CHUNK + 1)
        found: list[JobRecord] = []
        page_bytes = 0
        consumed = 0  # ids[:consumed] were returned or skipped; the token resumes after them
        filtered = bool(query.states or query.model_name or query.labels)
        skipped = False
        unreadable = 0
        full = False
        while not full and consumed < len(ids) and consumed < MAX_RECORDS_READ_PER_PAGE:
            size = read_size(query.page_size - len(found), filtered=filtered, skipped=skipped)
            reading = ids[consumed : consumed + size]
            records = await asyncio.gather(*(self._read(tenant, job_id) for job_id in reading))
            for record in records:
                if isinstance(record, UnreadableJob):
                    unreadable += 1
                    record = None
                if record is not None and query.matches(record):
                    record_bytes = estimated_bytes(record)
                    if found and page_bytes + record_bytes > self._max_page_bytes:
                        full = True  # this one opens the next page
                        break
                    found.append(record)
                    page_bytes += record_bytes
                else:
                    skipped = True
                consumed += 1
                if len(found) == query.page_size:
                    full = True
                    break
        more = consumed < len(ids)
        token = encode_token(ids[consumed - 1], fingerprint) if more and consumed else ""
        return ListPage(tuple(found), token, unreadable)
