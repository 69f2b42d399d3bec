"""Which of a stats round's queue snapshots are written to the queues bucket, and the writing of
them (`write_snapshots`): a model's when what the gateways read of it changed since its last write,
else once its last write is `SNAPSHOT_HEARTBEAT_S` old (asyncinfer.queues: a reader takes a
snapshot older than `SNAPSHOT_STALE_S` as no scheduler looking after the model).

A scale pass: a scheduler of 100 models wrote 50 snapshots a second, each model's every
`queue_stats_interval_s` (2 s) whether or not anything had changed, and every gateway's watch
decoded each. A change is anything the gateway reads (depths and their oldest and newest times,
jobs in flight, connected batchers, free credits, rates, pause, drain), and the submission rate,
which changes with every job queued: the gateway counts a job it queued until a snapshot taken
after it arrives, so a job dispatched and done within a round still gets one. A batcher that goes
away is a change, written at the next round as before; only an idle, unchanged model is written
less often.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from asyncinfer.contract import kv_subject, snapshot_key
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.requests import js_publish_many
from asyncinfer.nats.streams import ATTEMPT_TIMEOUT_S
from asyncinfer.queues import QueueSnapshot, encode_snapshot
from services.scheduler.queue_stats import ModelQueueSnapshot

_Seen = tuple[QueueSnapshot, float]  # the shared form less its time, and the submission rate


class SnapshotWrites:
    def __init__(self, *, heartbeat_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._heartbeat_s = heartbeat_s
        self._clock = clock
        self._last: dict[str, tuple[_Seen, float]] = {}  # model -> what was written, and when
        self._due: dict[str, _Seen] = {}

    def due(self, snapshots: Sequence[ModelQueueSnapshot], *, scheduler: str) -> list[QueueSnapshot]:
        """The shared forms to write this round, each naming `scheduler` (the instance writing it);
        `written` or `failed` is told how it went."""
        now = self._clock()
        self._due = {}
        shared = []
        for snapshot in snapshots:
            form = snapshot.to_shared(scheduler)
            seen = (dataclasses.replace(form, updated_at=0.0), snapshot.submitted_per_s)
            last = self._last.get(snapshot.model_name)
            if last is None or last[0] != seen or now - last[1] >= self._heartbeat_s:
                self._due[snapshot.model_name] = seen
                shared.append(form)
        return shared

    def written(self) -> None:
        now = self._clock()
        for name, seen in self._due.items():
            self._last[name] = (seen, now)
        self._due = {}

    def failed(self) -> None:
        """Some writes of the round may not have landed: the next round writes every model."""
        self._last.clear()
        self._due = {}


async def write_snapshots(js: JetStreamContext, bucket: str, snapshots: Sequence[QueueSnapshot]) -> None:
    """Each snapshot at its model's key, the whole group pipelined: every write leaves before any
    answer is awaited, so a round of N models costs one round trip, not N (an idle scheduler with
    100 models wrote 50 a second, each awaited before the next). Each key is written once per
    group and readers (the gateways' watch) take each key's latest, so nothing depends on the
    order of the writes within it. Raises the first write's error, if any, after the others were
    answered (the caller's next round writes them all again)."""
    publishes = [(kv_subject(bucket, snapshot_key(s.model_name)), encode_snapshot(s), None) for s in snapshots]
    results = await js_publish_many(js, publishes, timeout_s=ATTEMPT_TIMEOUT_S)
    failures = [result for result in results if isinstance(result, Exception)]
    if failures:
        raise failures[0]
