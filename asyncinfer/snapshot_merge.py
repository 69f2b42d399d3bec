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
- killed (or cut off from NATS): its snapshot goes stale (SNAPSHOT_STALE_S) and leaves the merge at
  once for the merge, and from `SchedulerSnapshots` at the model's next arrival (while another
  scheduler runs, at most SNAPSHOT_HEARTBEAT_S after it went stale). A scheduler of port 0 and no
  configured ID names itself anew at each start, so its previous run leaves the same way.
With none fresh the merge is the newest snapshot, stale, as with one scheduler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from asyncinfer.queues import SNAPSHOT_STALE_S, QueueSnapshot


def is_reporting(snapshot: QueueSnapshot, now: float) -> bool:
    """Whether its scheduler counts in the merge: fresh, and not its last word as it stopped."""
    return not snapshot.stopped and now - snapshot.updated_at <= SNAPSHOT_STALE_S


def merge_snapshots(snapshots: Collection[QueueSnapshot], now: float) -> QueueSnapshot | None:
    """What the model's schedulers report together, from each one's latest snapshot (of the same
    model). Over the fresh ones: batchers and jobs in flight summed; free credits and completion
    rates summed over those not draining (a draining scheduler takes no queued job), or over all
    when all drain; draining when every scheduler with a batcher drains (none has one: when every
    scheduler drains), since only those could dispatch. Depths, their oldest and newest times and
    the pause are the shared consumers' and the shared key's, read by each: the newest snapshot's,
    as are its time and name. A `stopped` snapshot counts as not fresh. None fresh: the newest, stale
    (it says nobody looks after the model) or stopped (what the others reported as it stopped)."""
    # One pass and no dataclasses.replace: this runs for every snapshot the watch delivers
    # (a generator per field and dataclasses.replace took about twice as long, at 2 schedulers).
    newest: QueueSnapshot | None = None  # of them all
    newest_fresh: QueueSnapshot | None = None  # whose depths a merge carries
    fresh: list[QueueSnapshot] = []
    for snapshot in snapshots:
        if newest is None or snapshot.updated_at > newest.updated_at:
            newest = snapshot
        if is_reporting(snapshot, now):
            fresh.append(snapshot)
            if newest_fresh is None or snapshot.updated_at > newest_fresh.updated_at:
                newest_fresh = snapshot
    if newest_fresh is None or len(fresh) == 1:
        return newest_fresh or newest
    newest = newest_fresh
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
    return QueueSnapshot(
        model_name=newest.model_name,
        updated_at=newest.updated_at,
        priorities=newest.priorities,
        in_flight=in_flight,
        connected_batchers=batchers,
        free_credits=free[every_one_drains],
        completed_per_s=rate[every_one_drains],
        paused=newest.paused,
        desired_batchers=desired,
        draining=not serving_undrained if batchers else every_one_drains,
        scheduler=newest.scheduler,
    )


@dataclass(frozen=True, slots=True)
class ClusterQueue:
    """A model's queue as the whole cluster reports it, for GetQueueStats."""

    merged: QueueSnapshot  # merge_snapshots over the reporting schedulers, the asking one's first
    schedulers: int  # reporting the model: fresh and not stopped, the asking one included
    draining_schedulers: int  # of those, the ones draining


def cluster_queue(own: QueueSnapshot, latest: Mapping[str, QueueSnapshot], now: float) -> ClusterQueue:
    """`own`: the asking scheduler's snapshot, just taken (its depths are the freshest read);
    `latest`: each scheduler's latest snapshot of the model as its watch holds them, its own
    previous one among them (left out: `own` is newer)."""
    reporting = [own, *(s for name, s in latest.items() if name != own.scheduler and is_reporting(s, now))]
    merged = merge_snapshots(reporting, now)
    assert merged is not None  # it holds `own` at least
    return ClusterQueue(
        merged=merged,
        schedulers=len(reporting),
        draining_schedulers=sum(1 for snapshot in reporting if snapshot.draining),
    )


def stopped_snapshot(own: QueueSnapshot, latest: Mapping[str, QueueSnapshot], now: float) -> QueueSnapshot:
    """The last snapshot a scheduler stopping in order writes of a model, its batchers gone and its
    jobs in flight put back: `stopped`, naming it (so a reader drops its entry at once, not
    SNAPSHOT_STALE_S later), and saying what the other schedulers report without it (the merge of
    their fresh ones); none fresh: its own depths and pause, and nothing serving.

    Why the others' view rather than its own zeros: a gateway of the release before reads the key's
    last write as the whole queue (it skips `scheduler` and `stopped`). "0 batchers" would make it
    say NO_WORKER until the next write of another scheduler (up to SNAPSHOT_HEARTBEAT_S, 5 s, where
    nothing changed there), while the others' view is what it reads once they write. A gateway of
    this release that starts and reads only the key's last value reads the same view.
    """
    others = [s for name, s in latest.items() if name != own.scheduler and is_reporting(s, now)]
    rest = merge_snapshots(others, now) if others else None
    if rest is None:
        rest = dataclasses.replace(
            own, in_flight=0, connected_batchers=0, free_credits=0, completed_per_s=0.0, draining=False
        )
    return dataclasses.replace(rest, updated_at=now, scheduler=own.scheduler, stopped=True)


class SchedulerSnapshots:
    """Per model, each scheduler's latest snapshot. `arrived` is called for every snapshot the
    watch delivers and returns the merge (one model's snapshots from S schedulers: O(S))."""

    def __init__(self) -> None:
        self._by_model: dict[str, dict[str, QueueSnapshot]] = {}

    def arrived(self, snapshot: QueueSnapshot, now: float) -> QueueSnapshot:
        """Keeps `snapshot` as its scheduler's latest (a restarted scheduler's first replaces its
        previous run's: same name), drops the other schedulers' stale or stopped ones (a scheduler
        gone, or a process that named itself differently before a restart), and returns the new
        merge. Snapshots naming no scheduler (the release before's) are one scheduler's, "": the
        last write wins among them, as it did."""
        schedulers = self._by_model.get(snapshot.model_name)
        if schedulers is None:
            schedulers = self._by_model[snapshot.model_name] = {}
        schedulers[snapshot.scheduler] = snapshot
        if len(schedulers) > 1:
            for name, held in list(schedulers.items()):
                if name != snapshot.scheduler and not is_reporting(held, now):
                    del schedulers[name]
        merged = merge_snapshots(schedulers.values(), now)
        assert merged is not None  # it holds `snapshot` at least
        return merged

    def latest(self, model_name: str) -> Mapping[str, QueueSnapshot]:
        """Each scheduler's latest snapshot of the model, by name (stale and stopped ones too)."""
        return dict(self._by_model.get(model_name, {}))

    def reporting(self, model_name: str, now: float) -> list[str]:
        """The schedulers in the model's merge (fresh and not stopped), by name."""
        held = self._by_model.get(model_name, {})
        return sorted(name for name, snapshot in held.items() if is_reporting(snapshot, now))

    def models(self) -> Collection[str]:
        return list(self._by_model)

    def forget(self, model_name: str) -> None:
        """The model's key was deleted: no scheduler reports it."""
        self._by_model.pop(model_name, None)
