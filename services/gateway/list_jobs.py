"""ListJobs: the caller's own jobs, newest first, filtered by state, model and labels, paged. A
batch's chunk jobs are left out unless the labels filter names their batch label.

How. Job IDs are UUIDv7, so a tenant's keys "<tenant>.<job_id>" sorted descending are its jobs
newest first. A job still queued has no key yet: its work message is its record, so the tenant's
job IDs are its keys and its queued jobs' work subjects ("asyncinfer.work.*.*.<tenant>.*", from the
work stream's subject index: one stream info, up to 100,000 of them). A page (1) scans the
tenant's keys with an ephemeral ordered consumer whose filter
subject is "$KV.<jobs bucket>.<tenant>.>" (headers only, last message per subject): the server
filters, so another tenant's records are never delivered, let alone read. nats-py's
`KeyValue.keys(filters=...)` would not do: it watches every key of the bucket and filters by
substring on the client. Then (2) it reads the records after the cursor, newest first, a chunk at
a time, and keeps those that match until the page is full, its jobs' inline outputs would pass
`max_page_bytes` (a response must fit gRPC's message limit; a page always holds at least one job),
or MAX_RECORDS_READ_PER_PAGE were read (a page may then be short, with a token to go on: AIP-158
allows it).

Cost: O(the tenant's retained jobs) per page for the key scan (headers only, ~100 bytes a key),
plus the records read. Fine for thousands of jobs per tenant; for millions the better index is a
per-tenant, time-partitioned one (e.g. a KV "<tenant>.<hour>.<job_id>" -> state/model/labels
written with each record), so a page reads only the partitions it needs and filters without
reading records.

Page tokens are opaque: base64url of {after: the last job ID returned, filter: a fingerprint of the
tenant and filters}; a token used with other filters (or by another tenant) is INVALID_ARGUMENT.
page_size: 0 means DEFAULT_PAGE_SIZE; above MAX_PAGE_SIZE it is clamped (AIP-158); negative is
INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from asyncinfer.contract import kv_stream, kv_subject, kv_subject_prefix, tenant_keys, tenant_work_subjects
from asyncinfer.errors import FieldViolation, InvalidArgument, Unavailable
from asyncinfer.ids import is_job_id
from asyncinfer.job_store import NATS_FAILURES, JobStore
from asyncinfer.jobs import BATCH_LABEL, JobRecord, JobState, job_key
from asyncinfer.nats import KV_MARKER_REASON, KV_OP, DeliverPolicy, JetStreamContext, Msg
from asyncinfer.nats.streams import stream_subjects
from asyncinfer.v1 import job_pb2, job_service_pb2
from services.gateway.submit_request import label_violations
from services.gateway.transitions import Expiry

log = structlog.get_logger("asyncinfer.gateway.list")

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
MAX_RECORDS_READ_PER_PAGE = 5000
READ_CHUNK = 64
# A Job message without its outputs is well under this (labels and strings are bounded).
RECORD_OVERHEAD_BYTES = 8 * 1024
SCAN_TIMEOUT_S = 30.0
# The scan's ephemeral consumer is gone this long after its subscription (its interest) is: a
# client paging at 20 calls/s kept ~100 of them alive on the jobs stream at the server's 5 s.
SCAN_CONSUMER_INACTIVE_S = 1.0
_STATE_PREFIX = "JOB_STATE_"


@dataclass(frozen=True, slots=True)
class ListQuery:
    page_size: int = DEFAULT_PAGE_SIZE
    page_token: str = ""
    states: frozenset[JobState] = frozenset()
    model_name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)

    def matches(self, record: JobRecord) -> bool:
        # A batch's chunk jobs are its own business (thousands for a large file): listed only when
        # the caller asks for a batch's, by its label, as the batch's own tests and tools do.
        if BATCH_LABEL in record.labels and BATCH_LABEL not in self.labels:
            return False
        if self.states and record.state not in self.states:
            return False
        if self.model_name and record.model_name != self.model_name:
            return False
        return all(record.labels.get(key) == value for key, value in self.labels.items())

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


def tenant_filter_subject(bucket: str, tenant: str) -> str:
    """The only subjects a listing of `tenant` ever consumes."""
    return kv_subject(bucket, tenant_keys(tenant))


class JobLister:
    def __init__(
        self,
        js: JetStreamContext,
        records: JobStore,
        expiry: Expiry,
        *,
        bucket: str,
        work_stream: str,
        max_page_bytes: int,
    ) -> None:
        self._js = js
        self._work_stream = work_stream
        self._max_page_bytes = max_page_bytes
        self._records = records
        self._expiry = expiry
        self._bucket = bucket

    async def tenant_job_ids(self, tenant: str) -> list[str]:
        """The tenant's job IDs with a live record, newest first: its keys and its queued jobs."""
        queued = await self._queued_job_ids(tenant)
        return sorted(set(await self._recorded_job_ids(tenant)) | queued, reverse=True)

    async def _queued_job_ids(self, tenant: str) -> set[str]:
        try:
            subjects = await stream_subjects(self._js, self._work_stream, tenant_work_subjects(tenant))
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot list the jobs: {exc}") from exc
        return {job_id for subject in subjects if is_job_id(job_id := subject.rpartition(".")[2])}

    async def _recorded_job_ids(self, tenant: str) -> set[str]:
        """The job IDs of the tenant's keys with a live record (a headers-only scan)."""
        prefix = kv_subject_prefix(self._bucket) + job_key(tenant, "")
        ids: set[str] = set()
        scanned = asyncio.Event()

        async def on_key(msg: Msg) -> None:
            job_id = msg.subject.removeprefix(prefix)
            headers = msg.headers or {}
            # The last message per key: a delete marker (ours or the server's, retention passed) is no job.
            if KV_OP in headers or KV_MARKER_REASON in headers or not is_job_id(job_id):
                ids.discard(job_id)
            else:
                ids.add(job_id)
            if msg.metadata.num_pending == 0:
                scanned.set()

        try:
            subscription = await self._js.subscribe(
                tenant_filter_subject(self._bucket, tenant),
                stream=kv_stream(self._bucket),
                cb=on_key,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                headers_only=True,
                inactive_threshold=SCAN_CONSUMER_INACTIVE_S,
            )
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot list the jobs: {exc}") from exc
        try:
            info = await subscription.consumer_info()
            # Nothing ever delivered and nothing pending: the tenant has no keys. (Not the client's
            # own count: the server may have pushed every key already, the callbacks not yet run.)
            if info.num_pending == 0 and (info.delivered is None or not info.delivered.consumer_seq):
                scanned.set()
            await asyncio.wait_for(scanned.wait(), SCAN_TIMEOUT_S)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot list the jobs: {exc}") from exc
        finally:
            try:
                await subscription.unsubscribe()
            except NATS_FAILURES as exc:  # the consumer goes away by itself once inactive
                log.warning("list_unsubscribe_failed", error=str(exc))
        return ids

    async def _read(self, tenant: str, job_id: str) -> JobRecord | None:
        record = await self._records.get(job_key(tenant, job_id))
        return None if record is None else await self._expiry.settle(record)

    async def page(self, tenant: str, query: ListQuery) -> ListPage:
        fingerprint = query.fingerprint(tenant)
        after = decode_token(query.page_token, fingerprint) if query.page_token else None
        ids = await self.tenant_job_ids(tenant)
        if after is not None:
            ids = [job_id for job_id in ids if job_id < after]
        found: list[JobRecord] = []
        page_bytes = 0
        consumed = 0  # ids[:consumed] were returned or skipped; the token resumes after them
        filtered = bool(query.states or query.model_name or query.labels)
        full = False
        while not full and consumed < len(ids) and consumed < MAX_RECORDS_READ_PER_PAGE:
            needed = query.page_size - len(found)
            chunk = ids[consumed : consumed + (READ_CHUNK if filtered else min(needed, READ_CHUNK))]
            records = await asyncio.gather(*(self._read(tenant, job_id) for job_id in chunk))
            for record in records:
                if record is not None and query.matches(record):
                    size = estimated_bytes(record)
                    if found and page_bytes + size > self._max_page_bytes:
                        full = True  # this one opens the next page
                        break
                    found.append(record)
                    page_bytes += size
                consumed += 1
                if len(found) == query.page_size:
                    full = True
                    break
        more = consumed < len(ids)
        return ListPage(tuple(found), encode_token(ids[consumed - 1], fingerprint) if more and consumed else "")
