"""One model's queue as every scheduler reports it: each scheduler writes the model's one snapshot
key with its own view (its batchers, their free credits, its jobs in flight and completion rate,
its drain), so the key's latest value is one scheduler's alone. With one batcher on scheduler A,
each write of scheduler B (no batcher) made every queued job say NO_WORKER, estimated starts used
B's rate alone, and a drain of B made every queued job say DRAINING while A dispatched.

The gateway keeps each scheduler's latest snapshot (`SchedulerSnapshots`, fed by the queue view's
watch) and answers from their merge (`merge_snapshots`), made when a snapshot arrives, not per
request. Pure, and here rather than in services/gateway, so that a scheduler can merge the same
way (services import asyncinfer; services/gateway and services/scheduler import neither). A stale snapshot (SNAPSHOT_STALE_S) leaves the merge at the model's next arrival: while
another scheduler runs, at most SNAPSHOT_HEARTBEAT_S after it went stale. With none fresh the
merge is the newest snapshot, stale, as with one scheduler.
"""

from __future__ import annotations

from collections.abc import Collection

from asyncinfer.queues import SNAPSHOT_STALE_S, QueueSnapshot


def merge_snapshots(snapshots: Collection[QueueSnapshot], now: float) -> QueueSnapshot | None:
    """What the model's schedulers report together, from each one's latest snapshot (of the same
    model). Over the fresh ones: batchers and jobs in flight summed; free credits and completion
    rates summed over those not draining (a draining scheduler takes no queued job), or over all
    when all drain; draining when every scheduler with a batcher drains (none has one: when every
    scheduler drains), since only those could dispatch. Depths, their oldest and newest times and
    the pause are the shared consumers' and the shared key's, read by each: the newest snapshot's,
    as are its time and name. None fresh: the newest, stale (it says nobody looks after the model)."""
    # One pass and no dataclasses.replace: this runs for every snapshot the watch delivers
    # (a generator per field and dataclasses.replace took about twice as long, at 2 schedulers).
    newest: QueueSnapshot | None = None
    fresh: list[QueueSnapshot] = []
    for snapshot in snapshots:
        if newest is None or snapshot.updated_at > newest.updated_at:
            newest = snapshot
        if now - snapshot.updated_at <= SNAPSHOT_STALE_S:
            fresh.append(snapshot)
    if newest is None or len(fresh) <= 1:
        return fresh[0] if fresh else newest
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


class SchedulerSnapshots:
    """Per model, each scheduler's latest snapshot. `arrived` is called for every snapshot the
    watch delivers and returns the merge (one model's snapshots from S schedulers: O(S))."""

    def __init__(self) -> None:
        self._by_model: dict[str, dict[str, QueueSnapshot]] = {}

    def arrived(self, snapshot: QueueSnapshot, now: float) -> QueueSnapshot:
        """Keeps `snapshot` as its scheduler's latest, drops the other schedulers' stale ones (a
        scheduler gone for good, or a process that named itself differently before a restart), and
        returns the new merge. Snapshots naming no scheduler (the release before's) are one
        scheduler's, "": the last write wins among them, as it did."""
        schedulers = self._by_model.get(snapshot.model_name)
        if schedulers is None:
            schedulers = self._by_model[snapshot.model_name] = {}
        schedulers[snapshot.scheduler] = snapshot
        if len(schedulers) > 1:
            for name, held in list(schedulers.items()):
                if name != snapshot.scheduler and now - held.updated_at > SNAPSHOT_STALE_S:
                    del schedulers[name]
        merged = merge_snapshots(schedulers.values(), now)
        assert merged is not None  # it holds `snapshot` at least
        return merged

    def forget(self, model_name: str) -> None:
        """The model's key was deleted: no scheduler reports it."""
        self._by_model.pop(model_name, None)
