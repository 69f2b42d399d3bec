"""WatchJob fan-out: one ordered JetStream subscription per gateway process on the jobs bucket's
update subjects, dispatched to per-watcher queues, instead of one consumer per watcher. The
watches themselves are services.gateway.watch_one (WatchJob) and watch_many (WatchJobs).

The subscription runs only while someone watches or polls: it starts with the first watcher (before
that watcher reads the record, so nothing falls between) or poll (`note_polls`), and stops once none
has watched or polled for `idle_stop_s` (`gateway.watch_feed_idle_s`). Otherwise every gateway would
read every record write of every job (two per job) whether or not anyone asked, which is most of the
time for clients that take webhooks: a feed running for them costs about a fifth of their jobs/s
(session 18, bench/results/ab_feed_for_submits.md). A stopped feed resumes where it stopped when
it starts again, replaying the changes it missed (at most REPLAY_MAX_CHANGES), so the jobs queued
while nobody watched or polled are known without a read each (services.gateway.recent_records;
session 19, bench/results/ab_feed_resume.md).

A new job's QUEUED record is its work message, not a write to the bucket: while a label selector
watches (WatchJobs), the hub also hears the queued notices (asyncinfer.queued_notice, core NATS)
so that the selector sees jobs from their submit on. A watch of given jobs reads a queued job's
record itself, so only selectors need them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from dataclasses import dataclass

import structlog

from asyncinfer.codecs.record import decode_record
from asyncinfer.contract import QUEUED_SUBJECT_PREFIX, kv_stream, kv_subject_prefix
from asyncinfer.job_store import JobStore, UnreadableJob, UnreadableOnce, decode_job
from asyncinfer.jobs import JobRecord
from asyncinfer.nats import KV_MARKER_REASON, KV_OP, DeliverPolicy, JetStreamContext, Msg, Subscription, api
from asyncinfer.nats import Client as NatsClient
from asyncinfer.queued_notice import decode_queued_notice
from asyncinfer.supervision import Supervisor
from services.gateway.job_selection import selects
from services.gateway.recent_records import DEFAULT_CAPACITY, RecentRecords
from services.gateway.transitions import Expiry
from services.gateway.watcher_queue import LatestQueue

log = structlog.get_logger("asyncinfer.gateway.watch")


@dataclass(frozen=True, slots=True)
class RecordUpdate:
    revision: int
    record: JobRecord | None  # None: the record was deleted or purged, or cannot be read (below)
    key: str = ""
    # The record written cannot be read by this release (a later release's, or corrupted): a watch
    # of that job ends with it (INTERNAL JOB_UNREADABLE), as GetJob answers it; a label watch skips it.
    unreadable: UnreadableJob | None = None


@dataclass(frozen=True, slots=True)
class Aside(RecordUpdate):
    """Not a change of the record: something a watch passes on as it comes, between the changes
    (a running job's progress: services.gateway.progress_watch puts these on a watch's queue)."""

    item: object = None


# Queued to every watcher when the hub stops.
_HUB_CLOSED = None
# Newest update per job only: a slow watcher is owed the latest record, not every copy.
WatcherQueue = LatestQueue[RecordUpdate]
# The feed stops after this long without a watcher (restarting it costs one consumer creation).
IDLE_STOP_S = 10.0
# A stopped feed resumes where it stopped, replaying the changes it missed, when there are fewer than
# this (about two per job queued meanwhile, for as many jobs as the recent records keep); past it the
# replay would cost more than the reads it saves (every change is read, of any gateway's job), and
# the feed starts afresh.
REPLAY_MAX_CHANGES = 2 * DEFAULT_CAPACITY


def _no_older(waiting: RecordUpdate, update: RecordUpdate) -> bool:
    """Whether a label watch's waiting update stays rather than give way to `update`: a job's
    QUEUED comes as a queued notice, sent once its work message's publish is acknowledged, and its
    later changes on the feed, so the notice can come after them (a scheduler holding a pull open
    has the job as the stream stores it). Put in their place, it took them away: the watch sent
    the job's QUEUED (or dropped it, having sent it) and never a later state."""
    return waiting.revision >= update.revision


class WatchHub:
    def __init__(
        self,
        nc: NatsClient,
        js: JetStreamContext,
        records: JobStore,
        *,
        bucket: str,
        expiry: Expiry,
        supervisor: Supervisor,
        idle_stop_s: float = IDLE_STOP_S,
    ) -> None:
        self._nc = nc
        self._js = js
        self._supervisor = supervisor
        self._records = records
        self._unreadable = UnreadableOnce("watch_feed")
        self._expiry = expiry
        self._bucket = bucket
        self._subject_prefix = kv_subject_prefix(bucket)
        self._watchers: dict[str, set[WatcherQueue]] = {}
        # Label-selector watches (WatchJobs): per tenant, each queue with the labels it selects.
        self._selectors: dict[str, dict[WatcherQueue, dict[str, str]]] = {}
        self._subscription: JetStreamContext.PushSubscription | None = None
        self._notices: Subscription | None = None
        # The jobs this gateway queued while the feed runs (see services.gateway.recent_records).
        self.recent = RecentRecords()
        self._stream_created: datetime.datetime | None = None  # the bucket's stream, when the feed last started
        self._feed_lock = asyncio.Lock()
        self._idle_stop_s = idle_stop_s
        self._idle_since: float | None = None  # loop time the last watcher left; None: watched
        self._became_idle = asyncio.Event()
        self._idle_stopper: asyncio.Task[None] | None = None
        self._feed_start: asyncio.Task[None] | None = None  # started by polls, awaited by stop()
        self._closed = False

    @property
    def watcher_count(self) -> int:
        return sum(len(queues) for queues in self._watchers.values()) + sum(map(len, self._selectors.values()))

    @property
    def hears_notices(self) -> bool:
        """Whether queued notices reach the label selectors (ensure_notices has subscribed): a label
        watch registers first, then subscribes, and a job queued in between shows no QUEUED change."""
        return self._notices is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def records(self) -> JobStore:
        return self._records

    @property
    def expiry(self) -> Expiry:
        return self._expiry

    @property
    def feeding(self) -> bool:
        """Whether the subscription to record writes runs (it does while anyone watches)."""
        return self._subscription is not None

    async def start(self) -> None:
        self._idle_stopper = self._supervisor.start("watch-feed-idle-stop", self._stop_feed_when_idle())

    async def stop(self) -> None:
        """Ends every watch (UNAVAILABLE: resume elsewhere with after_revision) and unsubscribes.
        Watches never end on their own, so the server's grace period would only wait for them."""
        if self._closed:
            return
        self._closed = True
        for queues in self._watchers.values():
            for queue in queues:
                queue.put_nowait(_HUB_CLOSED)
        for selectors in self._selectors.values():
            for queue in selectors:
                queue.put_nowait(_HUB_CLOSED)
        async with self._feed_lock:
            # Under the lock: an idle stop under way ends first. It has let go of the subscription
            # it stops (see _unsubscribe); cancelled part way, the consumer would be left to the server.
            for task in (self._idle_stopper, self._feed_start):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await self._unsubscribe()

    async def ensure_feed(self) -> None:
        if self._subscription is not None:
            return
        async with self._feed_lock:
            if self._subscription is not None or self._closed:
                return
            info = await self._js.stream_info(kv_stream(self._bucket))
            stream_last_seq = info.state.last_seq
            resume_from = self.recent.resume_from()
            # Not into a bucket made anew since (deleted and declared again): its sequences start over.
            same_stream = info.created == self._stream_created and resume_from <= stream_last_seq + 1
            self._stream_created = info.created
            if resume_from and same_stream and stream_last_seq - resume_from < REPLAY_MAX_CHANGES:
                # The changes since it stopped first (recent_records: the jobs queued meanwhile
                # are then known without a read each), then on as live.
                self._subscription = await self._subscribe(DeliverPolicy.BY_START_SEQUENCE, resume_from)
                self.recent.resume(stream_last_seq)
                # At debug, as the feed's start and stop: it resumes whenever a client polls or
                # watches after gateway.watch_feed_idle_s, an info line each time (5 in two minutes
                # of a first-hour pass), none of it the operator's to act on.
                log.debug("watch_feed_resumed", changes_missed=max(stream_last_seq - resume_from + 1, 0))
                return
            # DeliverPolicy.NEW: watches read the current record themselves after this, so only
            # later changes matter.
            self._subscription = await self._subscribe(DeliverPolicy.NEW)
            # After: only a job queued once the consumer exists has every change in the feed. One
            # queued while it was being made could change before it, unseen: that one is read.
            self.recent.feed_started(stream_last_seq)

    async def _subscribe(
        self, policy: DeliverPolicy, start_sequence: int | None = None
    ) -> JetStreamContext.PushSubscription:
        # An ordered consumer is ephemeral, in memory, and resumes after the last sequence it saw.
        return await self._js.subscribe(
            f"{self._subject_prefix}>",
            stream=kv_stream(self._bucket),
            cb=self._on_update,
            ordered_consumer=True,
            deliver_policy=policy,
            config=None if start_sequence is None else api.ConsumerConfig(opt_start_seq=start_sequence),
        )

    async def ensure_feed_quietly(self) -> None:
        """`ensure_feed` for a caller that can do without it (a read serves it instead): a
        failure to start it is logged, not raised. With nobody watching, its idle time counts from
        now (a watch that follows keeps it running)."""
        try:
            await self.ensure_feed()
        except Exception as exc:
            log.warning("watch_feed_start_failed", error=str(exc))
        if not self._closed:
            self._note_if_idle()

    def note_polls(self) -> None:
        """A client polls (GetJob, GetJobs): the feed keeps the final records of the jobs queued
        here from now on, and their polls are answered without a read each. So the feed runs
        while anyone polls, as while anyone watches: started in the background when it is off (the
        jobs queued before it are read), and stopped `idle_stop_s` after the last poll or watch.
        Not while jobs are only queued: for a client that never asks (results by webhook) the feed
        costs, and saves nothing (session 18: 0.79x the jobs/s of a submit-only burst)."""
        if self._closed:
            return
        if self._subscription is None and (self._feed_start is None or self._feed_start.done()):
            self._feed_start = asyncio.create_task(self._start_feed_for_polls(), name="watch-feed-start")
        if not self._watchers and not self._selectors:
            self._note_if_idle()  # its idle time counts from now

    async def _start_feed_for_polls(self) -> None:
        await self.ensure_feed_quietly()  # reads serve the polls meanwhile; the next poll or watch tries again

    async def ensure_notices(self) -> None:
        """Hears queued notices too (for label selectors), until the feed stops. Returns once the
        server has the subscription: a notice another connection sends after that reaches it (another
        gateway's submit, a scheduler's replay), not only this connection's own, which follow it."""
        async with self._feed_lock:
            if self._notices is None and not self._closed:
                notices = await self._nc.subscribe(f"{QUEUED_SUBJECT_PREFIX}.>", cb=self._on_notice)
                try:
                    await self._nc.flush()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await notices.unsubscribe()
                    raise
                self._notices = notices

    async def _on_notice(self, msg: Msg) -> None:
        if not self._selectors:
            return
        try:
            key, revision, data = decode_queued_notice(msg.data)
            if key.partition(".")[0] not in self._selectors:
                return
            record = decode_record(data, revision=revision)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("watch_bad_notice", subject=msg.subject, error=str(exc))
            return
        self._to_selectors(RecordUpdate(revision, record, key), key)

    async def _unsubscribe(self) -> None:
        """Unsubscribes and deletes the consumer (the server would only drop it some seconds later).
        Both subscriptions are let go of before the first await: ensure_feed's first look, without
        the lock, must not see one that is being stopped (a watch arriving meanwhile would take it
        as running and listen to nothing); it sees none, waits for the lock, and subscribes anew."""
        notices, self._notices = self._notices, None
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            self.recent.feed_stopped()
        if notices is not None:
            with contextlib.suppress(Exception):
                await notices.unsubscribe()
        if subscription is None:
            return
        try:
            consumer = (await subscription.consumer_info()).name
            await subscription.unsubscribe()
            await self._js.delete_consumer(kv_stream(self._bucket), consumer)
        except Exception as exc:  # the connection may already be gone; the server drops it then
            log.warning("watch_unsubscribe_failed", error=str(exc))

    async def _stop_feed_when_idle(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._became_idle.wait()
            self._became_idle.clear()
            while (idle_since := self._idle_since) is not None:
                left_s = idle_since + self._idle_stop_s - loop.time()
                if left_s > 0:
                    await asyncio.sleep(left_s)
                    continue
                async with self._feed_lock:
                    # Checked again under the lock: a watcher may have come (and gone) meanwhile.
                    if self._idle_since != idle_since or self._watchers or self._selectors:
                        continue
                    await self._unsubscribe()
                break

    async def _on_update(self, msg: Msg) -> None:
        key = msg.subject.removeprefix(self._subject_prefix)
        revision = msg.metadata.sequence.stream
        self.recent.seen(revision)
        queues = self._watchers.get(key)
        selectors = self._selectors.get(key.partition(".")[0]) if self._selectors else None
        if not queues and not selectors and not self.recent.holds(key):
            return  # unwatched and not just queued here: not decoded
        headers = msg.headers or {}
        record: JobRecord | None = None
        unreadable: UnreadableJob | None = None
        if KV_OP not in headers and KV_MARKER_REASON not in headers:
            try:
                record = decode_job(key, msg.data, revision)
            except UnreadableJob as exc:  # once per key: a later release's writes to it come one by one
                self._unreadable.say(exc)
                unreadable = exc
        # An unreadable record is forgotten here as a deleted one is (recent_records): a poll reads
        # it then, and answers what it is, not the last record this release could read.
        update = RecordUpdate(revision, record, key, unreadable)
        self.recent.changed(key, record, len(msg.data))
        for queue in queues or ():
            queue.put_nowait(update)
        if selectors:
            self._to_selectors(update, key)

    def _to_selectors(self, update: RecordUpdate, key: str) -> None:
        record = update.record
        selectors = self._selectors.get(key.partition(".")[0])
        if not selectors or record is None:
            return
        for queue, labels in selectors.items():
            if selects(labels, record):
                queue.put_nowait(update, keeps=_no_older)

    def register(self, key: str, queue: WatcherQueue | None = None) -> WatcherQueue:
        """Queues every change of the record at `key` (on a new queue, or the one given)."""
        if queue is None:
            queue = WatcherQueue()
        self._watchers.setdefault(key, set()).add(queue)
        self._idle_since = None
        return queue

    def unregister(self, key: str, queue: WatcherQueue) -> None:
        queues = self._watchers.get(key)
        if queues is None:
            return
        queues.discard(queue)
        if not queues:
            del self._watchers[key]
            self._note_if_idle()

    def register_selector(self, tenant: str, labels: dict[str, str]) -> WatcherQueue:
        """Queues every change of the tenant's records that a listing with `labels` shows
        (services.gateway.job_selection: all of the labels; no withdrawal, no chunk job unless
        `labels` names its batch)."""
        queue = WatcherQueue()
        self._selectors.setdefault(tenant, {})[queue] = dict(labels)
        self._idle_since = None
        return queue

    def unregister_selector(self, tenant: str, queue: WatcherQueue) -> None:
        selectors = self._selectors.get(tenant)
        if selectors is None:
            return
        selectors.pop(queue, None)
        if not selectors:
            del self._selectors[tenant]
            self._note_if_idle()

    def _note_if_idle(self) -> None:
        if not self._watchers and not self._selectors:
            self._idle_since = asyncio.get_running_loop().time()
            self._became_idle.set()
