"""WatchJobs: many jobs on one stream, from the same feed as WatchJob (watch_hub.py).

By IDs: one queue registered under every job's key before the current records are read (so no
change falls between the read and the feed), the current records read together, then every
change until each job is terminal. A job that is not there answers NOT_FOUND and the others go on,
as does one whose record this release cannot decode (INTERNAL JOB_UNREADABLE in its entry, as GetJobs
answers it), at the start or once it is written so; a watched QUEUED job whose deadline passes is
expired by the watch, as WatchJob does. A label watch skips a record it cannot decode (the hub says
it once per key).

By label selector: every change, from now on, of the tenant's jobs that carry all the labels and
that ListJobs with them lists (services.gateway.job_selection: no withdrawal, no chunk job unless
the labels name its batch); it ends only when the client ends it (or the gateway stops). It
registers, then subscribes to the records' feed and the queued notices; a job queued before both are
subscribed shows no QUEUED change, so the watch calls `listening` once they are (the servicer sends
the stream's headers then: a client that waits for them before it submits sees its jobs from QUEUED
on). A client that also wants the jobs as they stand starts the watch first and then lists them
(ListJobs with the same labels): revisions tell which of the two saw the later record.

Changes that are queued together are answered together: one stream message for all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from asyncinfer.errors import AsyncInferError, Unavailable
from asyncinfer.ids import is_job_id
from asyncinfer.job_store import JobStore, UnreadableJob, job_not_found
from asyncinfer.jobs import JobRecord, JobState, job_key
from asyncinfer.lifecycle import is_overdue
from services.gateway.transitions import Expiry
from services.gateway.watch_hub import RecordUpdate, WatcherQueue, WatchHub

# Changes of one stream message at most (the rest go in the next one).
CHANGES_PER_MESSAGE = 256


@dataclass(frozen=True, slots=True)
class JobChange:
    job_id: str
    record: JobRecord | None = None
    error: AsyncInferError | None = None


def _closed(kind: str) -> Unavailable:
    return Unavailable(f"the gateway is shutting down; watch the {kind} again elsewhere")


async def _next_updates(queue: WatcherQueue, timeout_s: float | None) -> list[RecordUpdate | None]:
    """What is queued now (at least one, waiting up to timeout_s for it; [] when it passed)."""
    try:
        async with asyncio.timeout(timeout_s):
            first = await queue.get()
    except TimeoutError:
        return []
    updates = [first]
    while len(updates) < CHANGES_PER_MESSAGE and not queue.empty():
        updates.append(queue.get_nowait())
    return updates


async def _read(records: JobStore, key: str) -> JobRecord | UnreadableJob | None:
    try:
        return await records.get(key)
    except UnreadableJob as exc:
        return exc


async def _settle(expiry: Expiry, record: JobRecord) -> JobRecord | UnreadableJob | None:
    """expiry.settle, its UnreadableJob returned (a transition that loses re-reads the record,
    which may have been written unreadable since): that job's error, the others watched on."""
    try:
        return await expiry.settle(record)
    except UnreadableJob as exc:
        return exc


async def watch_ids(
    hub: WatchHub, records: JobStore, expiry: Expiry, tenant: str, job_ids: Sequence[str]
) -> AsyncGenerator[list[JobChange], None]:
    if hub.closed:
        raise _closed("jobs")
    unique = list(dict.fromkeys(job_ids))
    unknown = [JobChange(job_id, error=job_not_found(job_id)) for job_id in unique if not is_job_id(job_id)]
    ids_by_key = {job_key(tenant, job_id): job_id for job_id in unique if is_job_id(job_id)}
    queue = WatcherQueue()
    for key in ids_by_key:
        hub.register(key, queue)
    watching = set(ids_by_key)
    try:
        await hub.ensure_feed()  # before the reads: a change after them is then in the feed
        # A job this gateway just queued starts from the record kept for it (as WatchJob does,
        # services.gateway.recent_records); the rest are read.
        kept = {key: hub.recent.latest(key) for key in ids_by_key}
        unkept = [key for key, record in kept.items() if record is None]
        read = dict(zip(unkept, await asyncio.gather(*(_read(records, key) for key in unkept)), strict=True))
        currents = [kept[key] or read[key] for key in ids_by_key]
        latest: dict[str, JobRecord] = {}
        first: list[JobChange] = list(unknown)
        for key, record in zip(ids_by_key, currents, strict=True):
            job_id = ids_by_key[key]
            if record is not None and not isinstance(record, UnreadableJob):
                record = await _settle(expiry, record)
            if isinstance(record, UnreadableJob):  # that job's error (INTERNAL JOB_UNREADABLE); the others watched
                first.append(JobChange(job_id, error=record))
                watching.discard(key)
                hub.unregister(key, queue)
                continue
            if record is None:
                first.append(JobChange(job_id, error=await records.not_found(key, job_id)))
                watching.discard(key)
                hub.unregister(key, queue)
                continue
            latest[key] = record
            first.append(JobChange(job_id, record=record))
            if record.state.is_terminal:
                watching.discard(key)
        if first:
            yield first
        # A job's deadline is fixed at submit: only the jobs that have one are ever looked at for
        # expiry (not every watched job at every change).
        deadlined = {key for key in watching if latest[key].deadline is not None}
        while watching:
            changes: list[JobChange] = []
            deadlined &= watching
            for update in await _next_updates(queue, _until_first_deadline(latest, deadlined, expiry)):
                if update is None:
                    raise _closed("jobs")
                if update.key not in watching or (change := _change(update, latest, ids_by_key)) is None:
                    continue
                changes.append(change)
                if change.record is None or change.record.state.is_terminal:
                    watching.discard(update.key)
            if deadlined:
                changes += await _expire_overdue(latest, deadlined & watching, watching, expiry, ids_by_key)
            if changes:
                yield changes
    finally:
        for key in ids_by_key:
            hub.unregister(key, queue)


def _change(update: RecordUpdate, latest: dict[str, JobRecord], ids_by_key: Mapping[str, str]) -> JobChange | None:
    """The change an update makes, or None when it was already sent (or is older)."""
    job_id = ids_by_key.get(update.key)
    if job_id is None:
        return None
    known = latest.get(update.key)
    if known is not None and update.revision <= known.revision:
        return None
    if update.unreadable is not None:  # its error, as GetJobs answers it; no more of it is heard
        return JobChange(job_id, error=update.unreadable)
    if update.record is None:
        return JobChange(job_id, error=job_not_found(job_id))
    latest[update.key] = update.record
    return JobChange(job_id, record=update.record)


def _until_first_deadline(latest: Mapping[str, JobRecord], deadlined: set[str], expiry: Expiry) -> float | None:
    """Seconds until the first deadline of a watched queued job (`deadlined`: the watched jobs
    that have one); None when there is none."""
    deadlines = [r.deadline for k in deadlined if (r := latest[k]).state is JobState.QUEUED and r.deadline is not None]
    return max(min(deadlines) - expiry.clock(), 0.0) if deadlines else None


async def _expire_overdue(
    latest: dict[str, JobRecord],
    deadlined: set[str],
    watching: set[str],
    expiry: Expiry,
    ids_by_key: Mapping[str, str],
) -> list[JobChange]:
    """Queued jobs (of `deadlined`, the watched ones with a deadline) whose deadline has passed
    become EXPIRED (or whatever won instead)."""
    now = expiry.clock()
    changes: list[JobChange] = []
    for key in [k for k in deadlined if is_overdue(latest[k], now)]:
        settled = await _settle(expiry, latest[key])
        if isinstance(settled, UnreadableJob):
            changes.append(JobChange(ids_by_key[key], error=settled))
            watching.discard(key)
        elif settled is None:
            changes.append(JobChange(ids_by_key[key], error=job_not_found(ids_by_key[key])))
            watching.discard(key)
        elif settled.revision != latest[key].revision:
            latest[key] = settled
            changes.append(JobChange(ids_by_key[key], record=settled))
            if settled.state.is_terminal:
                watching.discard(key)
    return changes


# Jobs whose last revision a label watch keeps (its oldest forgotten first): bounded memory per stream.
SELECTOR_REVISIONS_KEPT = 10_000


async def watch_labels(
    hub: WatchHub, tenant: str, labels: Mapping[str, str], listening: Callable[[], Awaitable[None]] | None = None
) -> AsyncGenerator[list[JobChange], None]:
    """`listening` is awaited once the watch hears every change of the jobs it selects."""
    if hub.closed:
        raise _closed("labels")
    queue = hub.register_selector(tenant, dict(labels))
    # The last revision sent of each job (its terminal one too): a job's QUEUED comes as a
    # core-NATS notice and its later changes on the records' feed, two paths, so its notice can
    # arrive after its RUNNING change, or after its end; a change no newer than one sent is dropped
    # (a client saw RUNNING or SUCCEEDED, then QUEUED). Only the jobs that changed least recently
    # are forgotten, past SELECTOR_REVISIONS_KEPT: a job's late notice follows its end closely.
    sent: dict[str, int] = {}
    try:
        await hub.ensure_feed()
        await hub.ensure_notices()
        if listening is not None:
            await listening()
        while True:
            changes: list[JobChange] = []
            for update in await _next_updates(queue, None):
                if update is None:
                    raise _closed("labels")
                record = update.record
                if record is None:  # a deleted record no longer shows its labels
                    continue
                if record.revision <= sent.get(record.key, -1):
                    continue
                # Kept when terminal too: a late notice of the job's QUEUED (revision 0, its record
                # not yet written, or the revision it was queued at) is older than its end and is
                # dropped; a replay's notice is newer and is sent.
                sent.pop(record.key, None)
                sent[record.key] = record.revision
                if len(sent) > SELECTOR_REVISIONS_KEPT:
                    del sent[next(iter(sent))]  # the job that changed least recently
                changes.append(JobChange(record.job_id, record=record))
            if changes:
                yield changes
    finally:
        hub.unregister_selector(tenant, queue)
