"""WatchJob: one job's record, then each change, until a terminal state (the hub fans the changes out;
services.gateway.watch_many watches many jobs at once).

A watch registers its queue before it reads the current record, so no change can fall between the
read and the first queued update; revisions (the KV stream sequence) drop what was already sent. A
watched QUEUED job with a deadline is expired by the watch itself when the deadline passes, so the
watcher sees EXPIRED on time even if no scheduler pulls the job.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from asyncinfer.errors import FieldViolation, InvalidArgument, Unavailable
from asyncinfer.job_store import UnreadableJob, job_not_found
from asyncinfer.jobs import JobRecord, JobState, job_key
from services.gateway.watch_hub import Aside, RecordUpdate, WatcherQueue, WatchHub


async def watch_job(
    hub: WatchHub, tenant: str, job_id: str, after_revision: int = 0, queue: WatcherQueue | None = None
) -> AsyncGenerator[JobRecord | Aside, None]:
    """The current record (if newer than after_revision), then every change, until a terminal
    state; an Aside put on the watch's queue (the one given) is passed on as it comes. A current
    record at after_revision comes as an Aside holding it (the watcher has it; nothing to send).
    NotFound for an unknown job or when its record is deleted; UnreadableJob when its record is
    one this release cannot decode, at the start or once it is written so (a later release's during
    a rolling upgrade, or corrupted): the watch would otherwise hear nothing more of it."""
    if hub.closed:
        raise Unavailable("the gateway is shutting down; watch again elsewhere")
    key = job_key(tenant, job_id)
    queue = hub.register(key, queue)
    try:
        await hub.ensure_feed()  # before the read: a change after it is then in the feed
        # A job this gateway queued a moment ago is known without a read (recent_records).
        current = hub.recent.latest(key) or await hub.records.get(key)
        if current is not None:
            current = await hub.expiry.settle(current)
        if current is None:
            raise await hub.records.not_found(key, job_id)
        if after_revision > current.revision:
            raise InvalidArgument(
                f"after_revision {after_revision} is ahead of the job's revision {current.revision}",
                [FieldViolation("after_revision", f"at most the job's revision, {current.revision}")],
            )
        last_sent = after_revision
        # after_revision 0 sends the current record first, whatever its revision (a queued
        # job's is 0: its record is its work message, not yet in the bucket).
        if current.revision > last_sent or not after_revision:
            yield current
            last_sent = current.revision
        else:
            # The watcher has this record already (it resumes after it): not sent again, but what
            # rides on the watch starts from it (a running attempt's progress, which is sent only
            # once its record is known: a resumed watch heard none until the record next changed).
            yield Aside(revision=current.revision, record=current)
        latest = current
        while not latest.state.is_terminal:
            update = await _next_update(hub, queue, latest)
            if update is None:  # the hub closed
                raise Unavailable(
                    f"the gateway is shutting down; watch again with after_revision={last_sent}",
                    metadata={"after_revision": str(last_sent)},
                )
            if isinstance(update, Aside):
                yield update
                continue
            if update.revision <= last_sent:
                continue
            if (unreadable := update.unreadable) is not None:  # as GetJob answers it (INTERNAL JOB_UNREADABLE)
                # Its own copy: the hub's is every watcher's, and a raise writes its traceback on it.
                raise UnreadableJob(unreadable.key, unreadable.error)
            if update.record is None:
                raise job_not_found(job_id)
            yield update.record
            last_sent = update.revision
            latest = update.record
    finally:
        hub.unregister(key, queue)


async def _next_update(hub: WatchHub, queue: WatcherQueue, latest: JobRecord) -> RecordUpdate | None:
    """The next update from the feed; when a queued job's deadline comes first, the record after
    expiring it (or what won instead)."""
    if latest.state is not JobState.QUEUED or latest.deadline is None:
        return await queue.get()
    try:
        async with asyncio.timeout(max(latest.deadline - hub.expiry.clock(), 0.0)):
            return await queue.get()
    except TimeoutError:
        pass
    settled = await hub.expiry.settle(latest)
    return RecordUpdate(settled.revision if settled is not None else latest.revision + 1, settled)
