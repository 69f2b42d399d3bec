"""Whether a scheduler still looks after a model, as a reader of its queue snapshots tells it: on
the reader's own monotonic clock, never the writer's wall clock against the reader's.

A snapshot's `updated_at` is the scheduler's wall clock, and readers (gateways, the other
schedulers) run on other hosts. Judged as `now - updated_at > SNAPSHOT_STALE_S` on the reader's
wall clock, a gateway 15 s ahead of a scheduler's host called every snapshot stale (NO_WORKER for
every queued job of a served model), and one 15 s behind kept a dead scheduler's batchers for 30 s.

So a reader keeps, with each snapshot, when it was written on the reader's monotonic clock
(`written_at`), and the snapshot is fresh while that is at most SNAPSHOT_STALE_S ago:
- a write the reader's watch delivers as it happens: when it arrived;
- a key's last value, which the watch delivers first as it starts, whose age the reader's clock
  cannot know: the time nats-server stored it against the server's time as the watch began (one
  stream info before subscribing: its `ts` and the stream's last sequence, so a message up to that
  sequence is one of those values), counted back from when the reader read that info. Both times
  are the server's: no host's skew enters. A server that does not say its time (older than 2.10):
  as it arrives, so a dead scheduler's last value counts for SNAPSHOT_STALE_S after the reader's
  start at most.
`updated_at` stays in the wire format: readers of the release before judge by it.

The rule alone, without I/O, so that the pure merge (asyncinfer.snapshot_merge) takes in no NATS
adapter with it; the watch that reads the server's times (`WriteTimes`) is asyncinfer.snapshot_watch's.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncinfer.queues import SNAPSHOT_STALE_S


@dataclass(frozen=True, slots=True)
class WatchStart:
    """What the queues bucket's stream said just before a reader's watch subscribed."""

    last_seq: int  # the stream's last sequence: a message up to it was written before the watch
    server_time: float | None  # the server's clock then (Unix seconds); None from a server before 2.10
    read_at: float  # the reader's monotonic clock as the answer came


def written_at(start: WatchStart | None, *, seq: int, stored_time: float | None, received_at: float) -> float:
    """When the snapshot of stream sequence `seq` was written, on the reader's monotonic clock.
    `stored_time`: the server's stamp on the message (Unix seconds, the server's clock), None when
    unknown; `received_at`: the reader's monotonic clock as it arrived. A message from before the
    watch (`seq <= start.last_seq`) is as old as the server says it was at `start`; any other, and
    any where the server's times are unknown, was written as it arrived."""
    if start is None or seq > start.last_seq or start.server_time is None or stored_time is None:
        return received_at
    age_s = max(start.server_time - stored_time, 0.0)  # a stamp past the server's time: just written
    return min(start.read_at - age_s, received_at)


def is_fresh(written_at: float, now: float) -> bool:
    """Whether a snapshot written at `written_at` still says its scheduler looks after the model, at
    `now` (both the reader's monotonic clock)."""
    return now - written_at <= SNAPSHOT_STALE_S
