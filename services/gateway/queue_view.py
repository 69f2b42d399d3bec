"""What the gateway knows of each model's queue: the schedulers' latest `QueueSnapshot`s, merged
(asyncinfer.snapshot_merge; kept current by a watch on the queues bucket, so no KV read
happens per request), the `paused.<model>` keys, and the jobs this gateway queued since the
snapshot was written.

From these it answers two questions: may another job join the queue (`estimated_depth` against
max_queue_depth), and where does a queued job stand (`standing`: position, estimated start and
waiting reason, computed on read and never stored).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from asyncinfer.contract import PAUSED_KEY_PREFIX as PAUSED_PREFIX
from asyncinfer.contract import work_consumer_name
from asyncinfer.jobs import PRIORITIES_BY_RANK, JobRecord, JobState
from asyncinfer.nats import Client, JetStreamContext, NatsError
from asyncinfer.nats.kv_watch import KeyUpdate, KeyWatch
from asyncinfer.queues import QueueSnapshot
from asyncinfer.server_clock import ServerClockOffset
from asyncinfer.snapshot_freshness import is_fresh
from asyncinfer.snapshot_merge import HeldSnapshot
from asyncinfer.snapshot_watch import SnapshotWatch
from asyncinfer.supervision import outcome_seen

log = structlog.get_logger("asyncinfer.gateway.queues")


class WaitingReason:
    """Why a queued job has not started (the proto's WaitingReason names, without the prefix)."""

    NO_WORKER = "NO_WORKER"
    WAITING_FOR_CAPACITY = "WAITING_FOR_CAPACITY"
    PAUSED = "PAUSED"
    RETRY_BACKOFF = "RETRY_BACKOFF"
    DRAINING = "DRAINING"
    NO_VERSION = "NO_VERSION"
    # A batcher told to serve the version could not load it, and none serves it (ModelCatalog).
    MODEL_LOAD_FAILED = "MODEL_LOAD_FAILED"
    # No reason to wait: a batcher has a free slot for it, so it is about to be dispatched (the
    # proto's WAITING_REASON_UNSPECIFIED, which grpcurl omits and the SDK reads as None).
    DISPATCHING = "UNSPECIFIED"


# How long a queued count read from the work consumers (QueueView.confirm_depth) stands before a
# refusal reads it again.
CONFIRM_FRESH_S = 0.05
# How far past the newest queued job's time (nats-server's clock) a job's time on the server's clock
# may be and still be taken as that job: where the job's own stamp is unknown, its create_time moved
# to the server's clock by the measured offset is early by the publish's own round trip, and the
# offset by a message's way to the gateway.
NEWEST_SLACK_S = 0.05


@dataclass(frozen=True, slots=True)
class QueueStanding:
    position: int  # jobs ahead of this one, 0-based
    waiting_reason: str
    estimated_start_time: float | None = None  # Unix seconds; None when no throughput is measured


def waiting_reason(
    record: JobRecord,
    snapshot: QueueSnapshot | None,
    *,
    paused: bool,
    fresh: bool,
    written_wall_time: float,
    server_offset_s: float = 0.0,
) -> str:
    """`fresh`: whether `snapshot` says a scheduler looks after the model (asyncinfer.
    snapshot_freshness, on the gateway's monotonic clock); `written_wall_time` and `server_offset_s`
    as for jobs_ahead.
    PAUSED first (nothing starts while an operator holds the queue, workers or not), then DRAINING
    (every scheduler whose batchers serve the model drains: asyncinfer.snapshot_merge), then
    NO_WORKER (no scheduler reports the model, or no batcher serves it), then RETRY_BACKOFF (a
    failed attempt is waiting out its delay), then none (DISPATCHING: the snapshot's free credits
    outnumber the jobs ahead of it, as for a fresh job on an idle batcher), else
    WAITING_FOR_CAPACITY."""
    if paused or (fresh and snapshot is not None and snapshot.paused):
        return WaitingReason.PAUSED
    if fresh and snapshot is not None and snapshot.draining:
        return WaitingReason.DRAINING
    if snapshot is None or not fresh or snapshot.connected_batchers == 0:
        return WaitingReason.NO_WORKER
    if record.attempt > 0 and record.last_error is not None:
        return WaitingReason.RETRY_BACKOFF
    ahead = jobs_ahead(record, snapshot, written_wall_time=written_wall_time, server_offset_s=server_offset_s)
    if snapshot.free_credits > ahead:
        return WaitingReason.DISPATCHING
    return WaitingReason.WAITING_FOR_CAPACITY


def version_waiting_reason(reason: str, *, pinned: bool, served: bool, load_failed: bool) -> str:
    """The waiting reason once the model catalog is asked about the version the job waits for (its
    own, a default_version the configuration fixes, or else the one it would run on now). An
    operator's hold (PAUSED, DRAINING) stands, and so does anything while the version is served.
    Otherwise MODEL_LOAD_FAILED where a batcher told to serve the version could not load it: a job
    pinned to it, or one no batcher could take (NO_WORKER), waits for a fix and a batcher that loads
    it, not for scaling from zero (it read NO_WORKER with a batcher running). A pinned version no
    batcher serves is NO_VERSION; an unpinned job keeps the snapshot's reason (another version may
    take it)."""
    if reason in (WaitingReason.PAUSED, WaitingReason.DRAINING) or served:
        return reason
    if load_failed and (pinned or reason == WaitingReason.NO_WORKER):
        return WaitingReason.MODEL_LOAD_FAILED
    return WaitingReason.NO_VERSION if pinned else reason


def jobs_ahead(
    record: JobRecord, snapshot: QueueSnapshot | None, *, written_wall_time: float, server_offset_s: float = 0.0
) -> int:
    """Every job queued at a higher priority, plus an estimate of those ahead within its own.

    The snapshot has each priority's depth and its oldest and newest jobs' times, not the jobs
    themselves, so the estimate interpolates: the priority's jobs are taken as spread evenly between
    the oldest and the newest (when the snapshot was written, where a scheduler of the release
    before does not say the newest), and the job is behind the share queued before it. A job created
    after the snapshot was written, or after the newest, is behind all of them; one older than the
    oldest (a retried job) is first. Scheduling is weighted with aging, so this is the position
    under strict priority, an upper bound for LOW and a close estimate for HIGH.

    Whose clocks: every comparison is on nats-server's clock, which stamped the oldest and newest
    times on the queued messages. The job's time is the server's stamp on its work message where the
    reader had it (`work_message_time`: a queued job read from its message), else the stamp the
    scheduler read from the same message as it dispatched the job (`queued_server_time`: a job put
    back for a retry, its QUEUED record in the bucket, whichever gateway queued it; a nak keeps the
    message and its stamp), else its `create_time` (its gateway's wall clock) plus
    `server_offset_s`, the server's clock less the reader's as measured (asyncinfer.server_clock):
    within a publish's round trip for this gateway's own jobs (the QUEUED records its submits
    keep), off by the two gateways' skew for a job another gateway queued that this one hears of
    without its message (a queued notice: a label watch's QUEUED change, placed as it is queued,
    after the snapshot, where a skew of seconds reads it first rather than last).
    `written_wall_time`, when the snapshot was written on the reader's wall clock
    (asyncinfer.snapshot_freshness: its arrival, or the server's age of a key's last value, on the
    reader's monotonic clock), moves by the same offset. Compared as they were,
    a gateway more than NEWEST_SLACK_S ahead of nats-server put every job last, and one behind put
    it first. The snapshot's `updated_at` (the scheduler's wall clock, another host's) is not read:
    as "now" it put a burst queued within a skew's seconds of the snapshot behind all of them (each
    read the depth), and a job queued after a snapshot of one job first."""
    if snapshot is None:
        return 0
    # On nats-server's clock (see above).
    queued_at = record.work_message_time
    if queued_at is None:
        queued_at = record.queued_server_time
    if queued_at is None:
        queued_at = record.create_time + server_offset_s
    written_at = written_wall_time + server_offset_s
    rank = PRIORITIES_BY_RANK.index(record.priority)
    higher = sum(snapshot.depth(p) for p in PRIORITIES_BY_RANK[:rank])
    own = snapshot.priorities.get(record.priority.value)
    if own is None or own.depth == 0:
        return higher
    if queued_at > written_at:
        return higher + own.depth
    oldest = own.oldest_create_time
    if oldest is None or queued_at <= oldest:
        return higher
    newest = own.newest_create_time
    if newest is None:
        span = written_at - oldest
        fraction = 1.0 if span <= 0 else (queued_at - oldest) / span
        # The job itself is one of the `depth`, so at most depth - 1 are ahead of it.
        return higher + min(int(fraction * own.depth), own.depth - 1)
    if queued_at > newest + NEWEST_SLACK_S:
        return higher + own.depth  # queued after the snapshot read the newest
    if queued_at >= newest:
        return higher + own.depth - 1  # the newest itself
    fraction = (queued_at - oldest) / (newest - oldest)
    return higher + min(round(fraction * (own.depth - 1)), own.depth - 1)


def standing(
    record: JobRecord,
    snapshot: QueueSnapshot | None,
    *,
    paused: bool,
    fresh: bool,
    now: float,
    written_wall_time: float,
    server_offset_s: float = 0.0,
) -> QueueStanding:
    """`fresh` as for waiting_reason, `written_wall_time` and `server_offset_s` as for jobs_ahead;
    `now`: the gateway's wall clock, for the estimated start."""
    reason = waiting_reason(
        record,
        snapshot,
        paused=paused,
        fresh=fresh,
        written_wall_time=written_wall_time,
        server_offset_s=server_offset_s,
    )
    position = jobs_ahead(
        record, snapshot if fresh else None, written_wall_time=written_wall_time, server_offset_s=server_offset_s
    )
    estimate: float | None = None
    rate = snapshot.completed_per_s if snapshot is not None else 0.0
    if reason in (WaitingReason.WAITING_FOR_CAPACITY, WaitingReason.DISPATCHING) and rate > 0:
        estimate = now + position / rate
    return QueueStanding(position=position, waiting_reason=reason, estimated_start_time=estimate)


class QueueView:
    """Snapshots and pauses per model, kept current by two ordered consumers on the queues
    bucket: the snapshot keys' (asyncinfer.snapshot_watch) and `$KV.<bucket>.paused.*`."""

    def __init__(
        self,
        js: JetStreamContext,
        nc: Client,
        *,
        bucket: str,
        work_stream: str = "",
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._js = js
        self._nc = nc
        self._bucket = bucket
        self._work_stream = work_stream
        self._clock = clock
        self._monotonic = monotonic
        # Per model: each scheduler's latest snapshot (the watch's), and their merge, which every
        # question reads, held with when it was written on this gateway's monotonic clock (freshness
        # is judged on that alone: asyncinfer.snapshot_freshness).
        self._watch = SnapshotWatch(
            js,
            nc,
            bucket=bucket,
            monotonic=monotonic,
            on_merge=self._merged,
            on_server_stamp=self._server_stamp,
        )
        self._snapshots: dict[str, HeldSnapshot] = {}
        # nats-server's clock less this gateway's, from the times the watch brings anyway (a job's
        # position compares its time with the server's stamps: jobs_ahead).
        self._server_clock = ServerClockOffset()
        self._paused: set[str] = set()
        # Headers alone: a `paused.<model>` key's value (who paused it, and when) is not read here.
        self._paused_watch = KeyWatch(
            js, bucket, self._on_paused, keys=f"{PAUSED_PREFIX}*", headers_only=True, name="paused_queues"
        )
        # Per model: when this gateway queued each job not yet counted by a snapshot, on its
        # monotonic clock, in order. Never its wall clock against the snapshot's `updated_at` (the
        # scheduler's, another host's): 15 s ahead, a job stayed counted on top of the snapshot that
        # counted it, until the next; behind, or stepped back, jobs queued after it were dropped.
        self._submitted: dict[str, collections.deque[float]] = {}
        # Per model: the queued count read from its work consumers (confirm_depth) and when it was
        # asked (monotonic), where that is newer than the snapshot.
        self._confirmed: dict[str, tuple[int, float]] = {}
        self._confirming: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        await self._watch.start()
        await self._paused_watch.start()

    async def stop(self) -> None:
        await self._watch.stop()
        await self._paused_watch.stop()

    def snapshot(self, model_name: str) -> QueueSnapshot | None:
        held = self._snapshots.get(model_name)
        return held.snapshot if held is not None else None

    def is_fresh(self, model_name: str) -> bool:
        """Whether a scheduler looks after the model: a snapshot of it written within
        SNAPSHOT_STALE_S by this gateway's monotonic clock."""
        held = self._snapshots.get(model_name)
        return held is not None and is_fresh(held.written_at, self._monotonic())

    def is_paused(self, model_name: str) -> bool:
        return model_name in self._paused

    def reporting(self, model_name: str) -> list[str]:
        """The schedulers whose snapshots of the model are in its merge, by name."""
        return self._watch.schedulers.reporting(model_name, self._monotonic())

    def _on_paused(self, update: KeyUpdate) -> None:
        model_name = update.key.removeprefix(PAUSED_PREFIX)
        if update.removed:
            self._paused.discard(model_name)
        else:
            self._paused.add(model_name)

    def _server_stamp(self, server_time: float, read_at: float) -> None:
        # The server's clock as the watch read it, against this gateway's wall clock then.
        self._server_clock.sample(server_time, self._clock() - (self._monotonic() - read_at))

    def _merged(self, model_name: str, merged: HeldSnapshot | None) -> None:
        if merged is None:
            self._snapshots.pop(model_name, None)
            return
        self._snapshots[model_name] = merged
        # The merge's depths (its newest snapshot's) count the jobs this gateway queued, and those a
        # read of the queue counted, before that snapshot was written, by this gateway's monotonic
        # clock alone (asyncinfer.snapshot_freshness: a live write's arrival). Its depths were read
        # a little before its write: a job queued in between (a round's reads and its write,
        # milliseconds) is missing from the estimate until the next snapshot, as a publish in
        # flight is from a read. A stopped scheduler's last word leaves the merge to an older
        # snapshot, and the jobs queued since that one still count.
        counted_before = merged.written_at
        confirmed = self._confirmed.get(model_name)
        if confirmed is not None and confirmed[1] <= counted_before:
            del self._confirmed[model_name]
        submitted = self._submitted.get(model_name)
        while submitted and submitted[0] <= counted_before:
            submitted.popleft()

    # --- admission ------------------------------------------------------------------------------

    def estimated_depth(self, model_name: str) -> int:
        """The model's queued jobs as last reported (the snapshot, or a newer count read by
        `confirm_depth`), plus those this gateway queued since (by its monotonic clock: a snapshot
        counts those queued before it arrived). Other gateways' recent jobs are missing until the
        next report, so the limit is soft by (gateways - 1) x (jobs per snapshot interval), and by
        the jobs queued between a snapshot's read and its write. Jobs dispatched since the report
        still count: `confirm_depth` reads the count again before a refusal."""
        snapshot = self.snapshot(model_name)
        reported = snapshot.total_depth if snapshot is not None else 0
        confirmed = self._confirmed.get(model_name)
        if confirmed is not None:
            reported = confirmed[0]
        return reported + len(self._submitted.get(model_name, ()))

    async def confirm_depth(self, model_name: str) -> None:
        """Reads the model's queued count from its work consumers (each priority's messages
        pending, and those delivered but not acknowledged less the jobs running as of the last
        snapshot) and counts from it the jobs queued since. The snapshot comes every
        `queue_stats_interval_s` and the jobs this gateway queued meanwhile all count until it
        does, dispatched or not: a model limited to 50 was admitted 50 jobs per snapshot, a
        throughput cap where its queue was empty. Asked before a refusal; concurrent askers share
        one read, and a read with nothing queued since counts for CONFIRM_FRESH_S. A count that
        cannot be read leaves the estimate as it was."""
        confirmed = self._confirmed.get(model_name)
        if (
            confirmed is not None
            and not self._submitted.get(model_name)
            and self._monotonic() - confirmed[1] < CONFIRM_FRESH_S
        ):
            return  # a refusal on a count just read, with nothing queued since: it stands
        reading = self._confirming.get(model_name)
        if reading is None:
            reading = self._confirming[model_name] = asyncio.ensure_future(self._read_depth(model_name))
            reading.add_done_callback(lambda _t: self._confirming.pop(model_name, None))
            reading.add_done_callback(outcome_seen)  # its waiter reads it, unless it was cancelled
        await asyncio.shield(reading)

    async def _read_depth(self, model_name: str) -> None:
        issued = self._monotonic()
        try:
            infos = await asyncio.gather(
                *(
                    self._js.consumer_info(self._work_stream, work_consumer_name(model_name, p))
                    for p in PRIORITIES_BY_RANK
                )
            )
        except NatsError as exc:  # not made yet (no scheduler has run), or NATS away: the estimate stands
            log.debug("queue_depth_unread", model=model_name, error=str(exc))
            return
        # Pending: waiting to be delivered. Delivered and not yet acknowledged: running, or held by
        # a scheduler that put it back (it counts those in its snapshots' depth); less what ran as
        # of the last snapshot.
        pending = sum(info.num_pending or 0 for info in infos)
        unacknowledged = sum(info.num_ack_pending or 0 for info in infos)
        snapshot = self.snapshot(model_name)
        running = snapshot.in_flight if snapshot is not None else 0
        self._confirmed[model_name] = (pending + max(unacknowledged - running, 0), issued)
        submitted = self._submitted.get(model_name)
        # Published by the time of the read, so counted in it (a reservation whose publish is still
        # on its way is missed: the limit is soft by the submits in flight). Both are this
        # process's times: the monotonic clock orders them, whatever the wall clock did.
        while submitted and submitted[0] <= issued:
            submitted.popleft()

    def reserve(self, model_name: str) -> float:
        """Counts a job this gateway is about to queue; returns the token for `release`."""
        stamp = self._monotonic()
        self._submitted.setdefault(model_name, collections.deque()).append(stamp)
        return stamp

    def release(self, model_name: str, stamp: float) -> None:
        """Takes back a reservation whose job was not queued after all."""
        submitted = self._submitted.get(model_name)
        if submitted is None:
            return
        if stamp in submitted:
            submitted.remove(stamp)

    def standing(self, record: JobRecord) -> QueueStanding | None:
        if record.state is not JobState.QUEUED:
            return None
        held = self._snapshots.get(record.model_name)
        now, monotonic_now = self._clock(), self._monotonic()
        return standing(
            record,
            held.snapshot if held is not None else None,
            paused=self.is_paused(record.model_name),
            fresh=held is not None and is_fresh(held.written_at, monotonic_now),
            now=now,
            # When it was written, on this gateway's wall clock (its own clocks alone), and the
            # offset that moves it and a job's create_time to nats-server's clock, the stamps'.
            written_wall_time=now - (monotonic_now - held.written_at) if held is not None else now,
            server_offset_s=self._server_clock.offset_s,
        )
