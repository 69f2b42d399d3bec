"""WatchJob's progress: the progress notices of a watched running job (core NATS, from the
scheduler: asyncinfer.progress_notice), streamed between its state changes.

One subscription per gateway (`ProgressFeed`, on every job's progress subject, from the first
WatchJob on) hands each notice to the watches of its job, as an `Aside` on the watch's own queue
(services.gateway.watch_hub), so a report and the record's changes reach the watcher in the order
the gateway heard them, with no task per watch. A notice of an unwatched job is not decoded.

What a watcher is sent (`ProgressFilter`, pure): reports of the attempt its latest record runs,
each newer than the last one sent (a report of an older attempt, or one that arrives after a newer
one, is dropped); a report that comes before the RUNNING record of its attempt waits for it and
goes with it. A watch resumed after the current revision starts from that record unsent (the
watcher has it), so the reports of its attempt go at once. A record's own progress (kept by the scheduler now and then, and with the terminal
state) goes with that record when it is newer than what was sent; the terminal message always carries
the last progress (the one the terminal write kept), even if its notice was missed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import structlog

from asyncinfer.contract import PROGRESS_SUBJECT_PREFIX
from asyncinfer.jobs import JobRecord, JobState, ProgressReport, job_key
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg, Subscription
from asyncinfer.progress_notice import decode_progress_notice
from asyncinfer.tensor_codec import to_output_proto
from asyncinfer.v1 import job_service_pb2
from services.gateway.watch_hub import Aside, RecordUpdate, WatcherQueue, WatchHub
from services.gateway.watch_one import watch_job

log = structlog.get_logger("asyncinfer.gateway.progress")

_PREFIX = f"{PROGRESS_SUBJECT_PREFIX}."
_RUNS = frozenset({JobState.RUNNING, JobState.CANCELLING})


def record_progress(record: JobRecord) -> ProgressReport | None:
    """The record's progress, when it is of the record's attempt."""
    report = record.progress
    return report if report is not None and report.attempt == record.attempt else None


def progress_to_proto(report: ProgressReport) -> job_service_pb2.JobProgress:
    return job_service_pb2.JobProgress(
        fraction=-1.0 if report.fraction is None else report.fraction,
        message=report.message,
        partial_outputs=[to_output_proto(t) for t in report.outputs],
    )


class ProgressFilter:
    """Which progress one watcher is sent (see the module's doc)."""

    __slots__ = ("held", "latest", "sent")

    def __init__(self) -> None:
        self.latest: JobRecord | None = None
        self.sent: ProgressReport | None = None
        self.held: ProgressReport | None = None  # ahead of the records seen

    def on_record(self, record: JobRecord) -> ProgressReport | None:
        """The progress to send with this record, if any."""
        self.latest = record
        kept = record_progress(record)
        if record.state.is_terminal and kept is not None and not (self.sent and self.sent.is_newer_than(kept)):
            self.sent = kept
            return kept  # the end carries its last progress, even when it was sent already
        best = None
        for report in (record_progress(record), self.held):
            fits = report is not None and report.attempt == record.attempt and report.is_newer_than(self.sent)
            if fits and report is not None and report.is_newer_than(best):
                best = report
        if self.held is not None and (self.held.attempt < record.attempt or best is self.held):
            self.held = None
        if best is not None:
            self.sent = best
        return best

    def resumed_at(self, record: JobRecord) -> None:
        """The record a resumed watch starts after (its after_revision): the watcher has it and
        its progress, so nothing is sent; the reports of its attempt go from now on."""
        self.latest = record
        self.sent = record_progress(record)

    def on_progress(self, report: ProgressReport) -> ProgressReport | None:
        """The report, when it is to be sent now."""
        latest = self.latest
        if latest is None or report.attempt < latest.attempt or not report.is_newer_than(self.sent):
            return None
        if report.attempt > latest.attempt or latest.state not in _RUNS:
            if report.is_newer_than(self.held):
                self.held = report
            return None
        self.sent = report
        return report


class ProgressFeed:
    """Every job's progress notices, for the watches on this gateway (the subscription ends when
    the gateway drains its NATS connection)."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._queues: dict[str, set[WatcherQueue]] = {}
        self._subscription: Subscription | None = None
        self._lock = asyncio.Lock()

    async def ensure(self) -> None:
        if self._subscription is not None:
            return
        async with self._lock:
            if self._subscription is None:
                self._subscription = await self._nc.subscribe(f"{_PREFIX}>", cb=self._on_notice)

    def register(self, key: str, queue: WatcherQueue) -> None:
        self._queues.setdefault(key, set()).add(queue)

    def unregister(self, key: str, queue: WatcherQueue) -> None:
        queues = self._queues.get(key)
        if queues is not None:
            queues.discard(queue)
            if not queues:
                del self._queues[key]

    async def _on_notice(self, msg: Msg) -> None:
        queues = self._queues.get(msg.subject.removeprefix(_PREFIX))
        if not queues:
            return
        try:
            _job_id, report = decode_progress_notice(msg.data)
        except (ValueError, TypeError) as exc:
            log.warning("watch_bad_progress_notice", subject=msg.subject, error=str(exc))
            return
        aside = Aside(revision=-1, record=None, item=report)
        for queue in queues:
            queue.put_nowait(aside, keeps=_keeps_newer_progress)


def _keeps_newer_progress(waiting: RecordUpdate, notice: RecordUpdate) -> bool:
    """Whether a waiting progress notice stays in place of one that came after it: it does when it
    is of a later attempt or step (a notice of a superseded attempt, relayed late or forged, must
    not displace the fresh one that a slow watcher has not read yet)."""
    held, came = getattr(waiting, "item", None), getattr(notice, "item", None)
    return isinstance(held, ProgressReport) and isinstance(came, ProgressReport) and held.is_newer_than(came)


async def watch_with_progress(
    hub: WatchHub, feed: ProgressFeed, tenant: str, job_id: str, after_revision: int = 0
) -> AsyncGenerator[tuple[JobRecord, ProgressReport | None], None]:
    """The hub's watch of the job (records), with its progress between: (the latest record, the
    progress to send with it or None)."""
    key = job_key(tenant, job_id)
    # The newest of each kind waits (watcher_queue): a slow watcher gets the latest progress and
    # the latest record, in the order they last came.
    queue = WatcherQueue()
    feed.register(key, queue)
    progress = ProgressFilter()
    try:
        await feed.ensure()
        async with contextlib.aclosing(watch_job(hub, tenant, job_id, after_revision, queue)) as updates:
            async for update in updates:
                if isinstance(update, Aside) and update.item is None and update.record is not None:
                    progress.resumed_at(update.record)  # the record the watcher resumes after
                    continue
                if isinstance(update, Aside):
                    latest = progress.latest
                    report = progress.on_progress(update.item) if isinstance(update.item, ProgressReport) else None
                    if report is not None and latest is not None:
                        yield latest, report
                    continue
                yield update, progress.on_record(update)
    finally:
        feed.unregister(key, queue)
