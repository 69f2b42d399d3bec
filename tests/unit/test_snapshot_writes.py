"""Which queue snapshots a stats round writes (services.scheduler.snapshot_writes)."""

from __future__ import annotations

import dataclasses

import pytest

from asyncinfer.jobs import Priority
from services.scheduler.queue_stats import ModelQueueSnapshot, PriorityQueueSnapshot
from services.scheduler.snapshot_writes import SnapshotWrites

pytestmark = pytest.mark.unit


def _snapshot(name: str, *, updated_at: float, depth: int = 0, submitted_per_s: float = 0.0) -> ModelQueueSnapshot:
    return ModelQueueSnapshot(
        model_name=name,
        priorities=tuple(PriorityQueueSnapshot(priority=p, depth=depth, oldest_age_s=None) for p in Priority),
        in_flight=0,
        connected_batchers=1,
        free_credits=2,
        desired_batchers=0,
        updated_at=updated_at,
        submitted_per_s=submitted_per_s,
    )


def _names(writes: SnapshotWrites, snapshots: list[ModelQueueSnapshot]) -> list[str]:
    return [s.model_name for s in writes.due(snapshots, scheduler="host:7001")]


def test_only_a_changed_snapshot_is_written_until_the_heartbeat() -> None:
    now = [0.0]
    writes = SnapshotWrites(heartbeat_s=5.0, clock=lambda: now[0])
    round_ = [_snapshot("a", updated_at=1.0), _snapshot("b", updated_at=1.0)]
    assert _names(writes, round_) == ["a", "b"]  # the first round writes every model
    writes.written()
    now[0] = 2.0
    same = [dataclasses.replace(s, updated_at=2.0) for s in round_]  # only the time moved
    assert _names(writes, same) == []
    writes.written()
    queued = [_snapshot("a", updated_at=4.0, depth=1), _snapshot("b", updated_at=4.0)]
    now[0] = 4.0
    assert _names(writes, queued) == ["a"]
    writes.written()
    # A job queued and dispatched within a round leaves the depths as they were; its submission
    # rate tells (the gateway counts it until a snapshot taken after it comes).
    now[0] = 4.5
    assert _names(writes, [_snapshot("a", updated_at=4.5, depth=1, submitted_per_s=0.1)]) == ["a"]
    writes.written()
    now[0] = 5.0
    assert _names(writes, [_snapshot("a", updated_at=5.0, depth=1, submitted_per_s=0.1), same[1]]) == ["b"]  # 5 s on
    writes.written()


def test_a_failed_round_writes_every_model_at_the_next() -> None:
    now = [0.0]
    writes = SnapshotWrites(heartbeat_s=5.0, clock=lambda: now[0])
    round_ = [_snapshot("a", updated_at=1.0), _snapshot("b", updated_at=1.0)]
    assert _names(writes, round_) == ["a", "b"]
    writes.written()
    now[0] = 1.0
    assert _names(writes, [_snapshot("a", updated_at=2.0, depth=3), round_[1]]) == ["a"]
    writes.failed()  # some of the group may not have landed
    now[0] = 2.0
    assert _names(writes, round_) == ["a", "b"]


def test_each_snapshot_names_the_scheduler_writing_it() -> None:
    """The gateway keeps each scheduler's latest snapshot of a model by this name
    (asyncinfer.snapshot_merge)."""
    writes = SnapshotWrites(heartbeat_s=5.0, clock=lambda: 0.0)
    due = writes.due([_snapshot("a", updated_at=1.0), _snapshot("b", updated_at=1.0)], scheduler="host:7001")
    assert [s.scheduler for s in due] == ["host:7001", "host:7001"]
