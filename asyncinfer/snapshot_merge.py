"""One model's queue as every scheduler reports it: each scheduler writes the model's one snapshot
key with its own view (its batchers, their free credits, its jobs in flight and completion rate,
its drain), so the key's latest value is one scheduler's alone. With one batcher on scheduler A,
each write of scheduler B (no batcher) made every queued job say NO_WORKER, estimated starts used
B's rate alone, and a drain of B made every queued job say DRAINING while A dispatched.

Readers keep each scheduler's latest snapshot (`SchedulerSnapshots`, fed by a watch on the queues
bucket) and answer from their merge (`merge_snapshots`): the gateway's queue view, made when a
snapshot arrives, not per request; and each scheduler's GetQueueStats (`cluster_queue`), so an
operator asking either of two schedulers sees the whole cluster.

A scheduler leaves the merge:
- stopping in order: its last write of each model is `stopped` (`stopped_snapshot`), dropped as it
  arrives;
- restarted in place: its snapshots name it the same (its configured ID, or host and port), so the
  new process's first write replaces the old one's entry;
- killed (or cut off from NATS): its snapshot goes stale (SNAPSHOT_STALE_S after the reader received
  its last write, on the reader's monotonic clock: asyncinfer.snapshot_freshness) and leaves the
  merge at once for the merge, and from `SchedulerSnapshots` at the model's next arrival (while
  another scheduler runs, at most SNAPSHOT_HEARTBEAT_S after it went stale). A scheduler of port 0
  and no configured ID names itself anew at each start, so its previous run leaves the same way.
With none fresh the merge is the newest snapshot, stale, as with one scheduler.

Every snapshot is held with when it was written on the reader's monotonic clock (`HeldSnapshot`),
and freshness and "newest" are judged on that, never on `updated_at` (the writer's wall clock,
skewed against the reader's and the other writers' across hosts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from asyncinfer.queues import PriorityQueueSnapshot, QueueSnapshot
from asyncinfer.snapshot_freshness import is_fresh


@dataclass(frozen=True, slots=True)
class HeldSnapshot:
    """A snapshot as a reader holds it: with when it was written, on the reader's monotonic clock
    (asyncinfer.snapshot_freshness.written_at)."""

    snapshot: QueueSnapshot
    written_at: float


def is_reporting(held: HeldSnapshot, now: float) -> bool:
    """Whether its scheduler counts in the merge at `now` (the reader's monotonic clock): fresh, and
    not its last word as it stopped."""
    return not held.snapshot.stopped and is_fresh(held.written_at, now)


def merge_snapshots(snapshots: Collection[HeldSnapshot], now: float) -> HeldSnapshot | None:
    """What the model's schedulers report together, from each one's latest snapshot (of the same
    model). Over the fresh ones: batchers and jobs in flight summed; free credits and completion
    rates summed over those not draining (a draining scheduler takes no queued job, so its
    completions start none: this rate is the estimated starts'), or over all when all drain;
    draining when every scheduler with a batcher drains (none has one: when every scheduler
    drains), since only those could dispatch. A priority's depth is the consumer's pending, read
    alike by each (the newest snapshot's), plus every fresh scheduler's own put-backs
    (`put_back`: pulled and nak'ed, which the consumer counts delivered and only their putter
    knows); its oldest time the older of the newest snapshot's and the others' put-backs'
    (`_merged_priorities`). The newest times and the pause are the shared consumers' and the
    shared key's: the newest snapshot's, as are its time and name. A `stopped` snapshot counts as not fresh. None fresh: the newest, stale
    (it says nobody looks after the model) or stopped (what the others reported as it stopped).
    Newest and fresh by `written_at` and `now`, the reader's monotonic clock; the merge is held as
    written when its newest was."""
    # One pass and no dataclasses.replace: this runs for every snapshot the watch delivers
    # (a generator per field and dataclasses.replace took about twice as long, at 2 schedulers).
    newest: HeldSnapshot | None = None  # of them all
    newest_fresh: HeldSnapshot | None = None  # whose depths a merge carries
    fresh: list[QueueSnapshot] = []
    for held in snapshots:
        if newest is None or held.written_at > newest.written_at:
            newest = held
        if is_reporting(held, now):
            fresh.append(held.snapshot)
            if newest_fresh is None or held.written_at > newest_fresh.written_at:
                newest_fresh = held
    if newest_fresh is None or len(fresh) == 1:
        return newest_fresh or newest
    written = newest_fresh.written_at
    newest_snapshot = newest_fresh.snapshot
    in_flight = batchers = desired = 0
    free = {False: 0, True: 0}  # free credits and rates by whether their scheduler drains
    rate = {False: 0.0, True: 0.0}
    serving_undrained = False  # a scheduler with a batcher and not draining: it dispatches
    every_one_drains = True
    for snapshot in fresh:
        in_flight += snapshot.in_flight
        batchers += snapshot.connected_batchers
        desired = max(desired, snapshot.desired_batchers)  # each asks for the whole shared backlog
        free[snapshot.draining] += snapshot.free_credits
        rate[snapshot.draining] += snapshot.completed_per_s
        serving_undrained = serving_undrained or (snapshot.connected_batchers > 0 and not snapshot.draining)
        every_one_drains = every_one_drains and snapshot.draining
    # Free credits and rates: of the schedulers that dispatch, or, every one draining, of them all
    # (as with one scheduler).
    merged = QueueSnapshot(
        model_name=newest_snapshot.model_name,
        updated_at=newest_snapshot.updated_at,
        priorities=_merged_priorities(newest_snapshot, fresh),
        in_flight=in_flight,
        connected_batchers=batchers,
        free_credits=free[every_one_drains],
        completed_per_s=rate[every_one_drains],
        paused=newest_snapshot.paused,
        desired_batchers=desired,
        draining=not serving_undrained if batchers else every_one_drains,
        scheduler=newest_snapshot.scheduler,
    )
    return HeldSnapshot(merged, written)


def _merged_priorities(newest: QueueSnapshot, fresh: list[QueueSnapshot]) -> dict[str, PriorityQueueSnapshot]:
    """Each priority's depth: the newest snapshot's pending (its depth less its own put-backs) plus
    every fresh snapshot's put-backs. Taking the newest depth alone (as before) flipped between
    the schedulers' counts, each with its own put-backs and none of the others'; a sum of depths
    counts the pending once per scheduler."""
    if not any(p.put_back for snapshot in fresh for p in snapshot.priorities.values()):
        return newest.priorities  # the common case, and every snapshot of the release before
    merged: dict[str, PriorityQueueSnapshot] = {}
    for key in {key for snapshot in fresh for key in snapshot.priorities}:
        shared = newest.priorities.get(key) or PriorityQueueSnapshot()
        put_back = 0
        put_back_oldest: float | None = None
        oldest = shared.oldest_create_time  # the pending's first and the newest's own put-backs'
        unacknowledged: int | None = None  # the most any scheduler read with its put-backs
        for snapshot in fresh:
            own = snapshot.priorities.get(key)
            if own is None or not own.put_back:
                continue
            put_back += own.put_back
            if own.ack_pending is not None:
                unacknowledged = max(unacknowledged or 0, own.ack_pending, own.put_back)
            if (t := own.put_back_oldest_create_time) is not None:
                put_back_oldest = t if put_back_oldest is None else min(put_back_oldest, t)
                if snapshot is not newest:
                    oldest = t if oldest is None else min(oldest, t)
        if unacknowledged is not None:
            # Every put-back is an unacknowledged delivery: more put-backs than those counts a job
            # twice (pulled and put back by two schedulers, neither writing its record: a version
            # no batcher serves, pulled by each one's free slot in turn).
            put_back = min(put_back, unacknowledged)
        merged[key] = PriorityQueueSnapshot(
            depth=max(shared.depth - shared.put_back, 0) + put_back,
            oldest_create_time=oldest,
            newest_create_time=shared.newest_create_time,
            put_back=put_back,
            put_back_oldest_create_time=put_back_oldest,
        )
    return merged


@dataclass(frozen=True, slots=True)
class ClusterQueue:
    """A model's queue as the whole cluster reports it, for GetQueueStats."""

    merged: QueueSnapshot  # merge_snapshots over the reporting schedulers, the asking one's first
    schedulers: int  # reporting the model: fresh and not stopped, the asking one included
    draining_schedulers: int  # of those, the ones draining
    # Every reporting scheduler's completions per second, draining ones included: what the model
    # completed over the last minute (the merge's rate, which estimated starts read, leaves a
    # draining scheduler out, as its completions start no queued job).
    completed_per_s: float


def cluster_queue(own: QueueSnapshot, latest: Mapping[str, HeldSnapshot], now: float) -> ClusterQueue:
    """`own`: the asking scheduler's snapshot, just taken (its depths are the freshest read);
    `latest`: each scheduler's latest snapshot of the model as its watch holds them, its own
    previous one among them (left out: `own` is newer); `now`: the reader's monotonic clock."""
    others = [held for name, held in latest.items() if name != own.scheduler and is_reporting(held, now)]
    reporting = [HeldSnapshot(own, now), *others]
    merged = merge_snapshots(reporting, now)
    assert merged is not None  # it holds `own` at least
    return ClusterQueue(
        merged=merged.snapshot,
        schedulers=len(reporting),
        draining_schedulers=sum(1 for held in reporting if held.snapshot.draining),
        completed_per_s=sum(held.snapshot.completed_per_s for held in reporting),
    )


def stopped_snapshot(
    own: QueueSnapshot, latest: Mapping[str, HeldSnapshot], *, now: float, wall_time: float
) -> QueueSnapshot:
    """The last snapshot a scheduler stopping in order writes of a model, its batchers gone and its
    jobs in flight put back: `stopped`, naming it (so a reader drops its entry at once, not
    SNAPSHOT_STALE_S later), and saying what the other schedulers report without it (the merge of
    their fresh ones, at `now` on its monotonic clock); none fresh: its own depths and pause, and
    nothing serving. Its `updated_at` is `wall_time` (this scheduler's wall clock, as every write).

    Why the others' view rather than its own zeros: a gateway of the release before reads the key's
    last write as the whole queue (it skips `scheduler` and `stopped`). "0 batchers" would make it
    say NO_WORKER until the next write of another scheduler (up to SNAPSHOT_HEARTBEAT_S, 5 s, where
    nothing changed there), while the others' view is what it reads once they write. A gateway of
    this release that starts and reads only the key's last value reads the same view.
    """
    others = [held for name, held in latest.items() if name != own.scheduler and is_reporting(held, now)]
    merged = merge_snapshots(others, now) if others else None
    if merged is None:
        rest = dataclasses.replace(
            own, in_flight=0, connected_batchers=0, free_credits=0, completed_per_s=0.0, draining=False
        )
    else:
        rest = merged.snapshot
    return dataclasses.replace(rest, updated_at=wall_time, scheduler=own.scheduler, stopped=True)


class SchedulerSnapshots:
    """Per model, each scheduler's latest snapshot, held with when it was written on the reader's
    monotonic clock. `arrived` is called for every snapshot the watch delivers and returns the merge
    (one model's snapshots from S schedulers: O(S))."""

    def __init__(self) -> None:
        self._by_model: dict[str, dict[str, HeldSnapshot]] = {}

    def arrived(self, snapshot: QueueSnapshot, *, written_at: float, now: float) -> HeldSnapshot:
        """Keeps `snapshot` (written at `written_at`: asyncinfer.snapshot_freshness.written_at) as its
        scheduler's latest (a restarted scheduler's first replaces its previous run's: same name),
        drops the other schedulers' stale or stopped ones (a scheduler gone, or a process that named
        itself differently before a restart), and returns the new merge. Snapshots naming no
        scheduler (the release before's) are one scheduler's, "": the last write wins among them, as
        it did. `now`: the reader's monotonic clock."""
        schedulers = self._by_model.get(snapshot.model_name)
        if schedulers is None:
            schedulers = self._by_model[snapshot.model_name] = {}
        schedulers[snapshot.scheduler] = HeldSnapshot(snapshot, written_at)
        if len(schedulers) > 1:
            for name, held in list(schedulers.items()):
                if name != snapshot.scheduler and not is_reporting(held, now):
                    del schedulers[name]
        merged = merge_snapshots(schedulers.values(), now)
        assert merged is not None  # it holds `snapshot` at least
        return merged

    def latest(self, model_name: str) -> Mapping[str, HeldSnapshot]:
        """Each scheduler's latest snapshot of the model, by name (stale and stopped ones too)."""
        return dict(self._by_model.get(model_name, {}))

    def reporting(self, model_name: str, now: float) -> list[str]:
        """The schedulers in the model's merge (fresh and not stopped) at `now` (the reader's
        monotonic clock), by name."""
        held = self._by_model.get(model_name, {})
        return sorted(name for name, snapshot in held.items() if is_reporting(snapshot, now))

    def models(self) -> Collection[str]:
        return list(self._by_model)

    def forget(self, model_name: str) -> None:
        """The model's key was deleted: no scheduler reports it."""
        self._by_model.pop(model_name, None)
