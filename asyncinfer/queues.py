"""What the scheduler tells everyone else about its queues, through NATS.

- The KV bucket `queues` (NatsConfig.queues_bucket) holds one `QueueSnapshot` per model (key =
  model name), written by each scheduler, with its own view and its name, at the first
  `queue_stats_interval_s` round where it changed, or `SNAPSHOT_HEARTBEAT_S` after its last write.
  The gateway keeps each scheduler's latest and merges them (asyncinfer.snapshot_merge) to
  answer a queued job's position, estimated start and waiting reason, and to admit or refuse new
  jobs against `max_queue_depth`; every scheduler does the same to answer GetQueueStats for the
  whole cluster. A snapshot its reader has not received for `SNAPSHOT_STALE_S` by the reader's own
  monotonic clock (asyncinfer.snapshot_freshness; `updated_at`, the writer's wall clock, is skewed
  across hosts) means its scheduler no longer looks after the model; a scheduler stopping in order
  says so at once (a last snapshot, `stopped`).
- The key `paused.<model>` in the same bucket exists while an operator has paused the model's
  queue; every scheduler honours it. A drain (OpsService.Drain) is one scheduler's: its snapshots
  say `draining` until it is undrained, so the gateway tells its queued jobs why they wait once
  every scheduler with a batcher for the model drains.
- Cancellation of a running job: after the gateway moves the record to CANCELLING it publishes a
  `CancelNotice` on the core subject `cancel_subject(model)`; every scheduler hears it, and the one
  that dispatched the job tells its batcher to drop it.
- Per-tenant admission (`GatewayConfig.max_queued_per_tenant`) keeps nothing here: the gateway
  counts the tenant's subjects in the work stream (services.gateway.tenant_quota). Keys
  `tenant.<tenant>` that older releases kept in this bucket are no longer read or written.
- Dead letters (`NatsConfig.dead_letter_stream`, subjects `asyncinfer.dead.<model>`) are the
  scheduler's own; the gateway only sees their effect: the record is FAILED (or TIMED_OUT) with
  its error, and back to QUEUED when an operator replays it.

This module holds their forms and codecs, without I/O (the pure merge, asyncinfer.snapshot_merge,
reads them): the bucket is declared in asyncinfer.declarations, and the scheduler writes its
snapshots in services.scheduler.snapshot_writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

# Named in asyncinfer.contract; re-exported for their callers here.
from asyncinfer.contract import CANCEL_SUBJECT_PREFIX as CANCEL_SUBJECT_PREFIX
from asyncinfer.contract import cancel_subject as cancel_subject
from asyncinfer.contract import paused_key as paused_key
from asyncinfer.jobs import Priority

SNAPSHOT_STALE_S = 15.0
# A model whose snapshot has not changed is written again this often (services.scheduler.
# snapshot_writes), well within SNAPSHOT_STALE_S at the default queue_stats_interval_s (2 s: every
# 6 s), which the release before also reads (15 s).
SNAPSHOT_HEARTBEAT_S = 5.0


@dataclass(frozen=True, slots=True)
class PriorityQueueSnapshot:
    depth: int = 0
    # create_time (Unix seconds) of the oldest waiting job, None when empty or unknown.
    oldest_create_time: float | None = None
    # ... and of the newest one: the waiting jobs lie between the two (a queue paused while a burst
    # came in holds jobs created within a second of each other, read a minute later). None when
    # unknown, as in a snapshot from the release before it: then the snapshot's time stands for it.
    newest_create_time: float | None = None
    # Of `depth`, the jobs the writing scheduler pulled and put back (a nak): the consumer counts
    # them delivered, not pending, and only their putter knows them, so each scheduler's are its
    # own; the rest of `depth` is the consumer's pending, read alike by every scheduler. A reader
    # merging several schedulers' snapshots (asyncinfer.snapshot_merge) takes the newest one's
    # pending plus every fresh one's put-backs. 0 from a scheduler of the release before (its
    # depth then reads as all pending).
    put_back: int = 0
    # When the oldest of those put back and past its backoff was stored (Unix seconds; None when
    # none or unknown): the merge's oldest time is the older of the newest snapshot's and these.
    put_back_oldest_create_time: float | None = None
    # The consumer's unacknowledged deliveries as the writer read them with its put-backs (None: not
    # read): every put-back's message is one of them, so the merge counts no more put-backs than
    # this (a job pulled and put back by two schedulers, neither writing its record, is in both).
    ack_pending: int | None = None


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    model_name: str
    updated_at: float
    priorities: dict[str, PriorityQueueSnapshot] = field(default_factory=dict)  # keyed by Priority value
    in_flight: int = 0
    connected_batchers: int = 0
    free_credits: int = 0
    # Completions per second over the recent past (for estimated start times).
    completed_per_s: float = 0.0
    paused: bool = False
    desired_batchers: int = 0
    # The scheduler that wrote it dispatches nothing until undrained.
    draining: bool = False
    # The scheduler that wrote it (its instance name, services.scheduler.instances: the same again
    # after a restart in place). Every scheduler writes the model's one key with its own batchers,
    # credits, rates and drain; the gateway keeps the latest of each and merges them
    # (asyncinfer.snapshot_merge). "" from a scheduler of the release before.
    scheduler: str = ""
    # The last snapshot of a scheduler stopping in order (asyncinfer.snapshot_merge.stopped_snapshot):
    # its name says whose entry to drop, and the rest says what the other schedulers report.
    stopped: bool = False

    def depth(self, priority: Priority) -> int:
        entry = self.priorities.get(priority.value)
        return entry.depth if entry is not None else 0

    @property
    def total_depth(self) -> int:
        return sum(p.depth for p in self.priorities.values())


@dataclass(frozen=True, slots=True)
class CancelNotice:
    job_id: str
    tenant: str
    model_name: str

    def encode(self) -> bytes:
        return encode_cancel_notice(self)

    @classmethod
    def decode(cls, data: bytes) -> CancelNotice:
        return decode_cancel_notice(data)


# --- codec --------------------------------------------------------------------------------------
# Codecs of what the queues bucket holds (queue snapshots at `<model>`, pauses at
# `paused.<model>`; heartbeats at `scheduler.<run>` are plain text) and of the cancel notice (core NATS,
# `asyncinfer.control.cancel.<model>`).
#
# Every form reads `v` (missing: version 0). Snapshots and cancel notices are still written as
# version 0 (no `v`, defaults left out): the release before the versioned codecs reads them with
# `Type(**fields)`, which refuses a field it does not know, so a `v` would make an older gateway
# blind to snapshots and an older scheduler deaf to cancels during a rolling upgrade. Once no
# process of that release is left, a change to them writes version 1. Pauses (nobody reads their
# value) are written as version 1. A field added since (a priority's `newest_create_time`) is
# optional and skipped by the msgspec readers of the release before, so it keeps version 0: only
# a reader two releases back, which an upgrade does not meet (docs/UPGRADING.md), would refuse it.

SNAPSHOT_VERSION = 0
CANCEL_NOTICE_VERSION = 0
PAUSE_VERSION = 1


class PrioritySnapshotWire(msgspec.Struct, omit_defaults=True):
    depth: int = 0
    oldest_create_time: float | None = None
    # Since session 24. The release before reads snapshots with msgspec, which skips a field it
    # does not know, so it is written in version 0.
    newest_create_time: float | None = None
    # Since session 32, left out while 0 / None; skipped by the release before as above (version 0).
    put_back: int = 0
    put_back_oldest_create_time: float | None = None
    ack_pending: int | None = None


class SnapshotWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 0  # missing: version 0
    model_name: str
    updated_at: float
    priorities: dict[str, PrioritySnapshotWire] = {}  # keyed by Priority value
    in_flight: int = 0
    connected_batchers: int = 0
    free_credits: int = 0
    completed_per_s: float = 0.0
    paused: bool = False
    desired_batchers: int = 0
    # Written only while true (defaults are left out), so that a reader of the release before
    # it, which refuses unknown fields, misses only the snapshots of a draining scheduler.
    draining: bool = False
    # Since session 29; left out while "" (as `draining`). The release before reads snapshots with
    # msgspec, which skips a field it does not know, so it is written in version 0.
    scheduler: str = ""
    # Since session 29, written only while true (a scheduler's last word as it stops in order); the
    # release before skips it, as `scheduler`, so it is written in version 0.
    stopped: bool = False


class CancelNoticeWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 0  # missing: version 0
    job_id: str
    tenant: str
    model_name: str


class PauseWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The value at `paused.<model>`: who paused it and when (its existence is what counts)."""

    v: int = 0  # missing: version 0
    paused_at: float
    by: str = ""


_encoder = msgspec.json.Encoder()
_snapshot_decoder = msgspec.json.Decoder(SnapshotWire)
_cancel_decoder = msgspec.json.Decoder(CancelNoticeWire)
_pause_decoder = msgspec.json.Decoder(PauseWire)


def encode_snapshot(snapshot: QueueSnapshot) -> bytes:
    s = snapshot
    priorities = {
        name: PrioritySnapshotWire(
            p.depth,
            p.oldest_create_time,
            p.newest_create_time,
            p.put_back,
            p.put_back_oldest_create_time,
            p.ack_pending,
        )
        for name, p in s.priorities.items()
    }
    return _encoder.encode(
        SnapshotWire(
            v=SNAPSHOT_VERSION,
            model_name=s.model_name,
            updated_at=s.updated_at,
            priorities=priorities,
            in_flight=s.in_flight,
            connected_batchers=s.connected_batchers,
            free_credits=s.free_credits,
            completed_per_s=s.completed_per_s,
            paused=s.paused,
            desired_batchers=s.desired_batchers,
            draining=s.draining,
            scheduler=s.scheduler,
            stopped=s.stopped,
        )
    )


def decode_snapshot(data: bytes) -> QueueSnapshot:
    w = _snapshot_decoder.decode(data)
    return QueueSnapshot(
        model_name=w.model_name,
        updated_at=w.updated_at,
        priorities={
            name: PriorityQueueSnapshot(
                p.depth,
                p.oldest_create_time,
                p.newest_create_time,
                p.put_back,
                p.put_back_oldest_create_time,
                p.ack_pending,
            )
            for name, p in w.priorities.items()
        },
        in_flight=w.in_flight,
        connected_batchers=w.connected_batchers,
        free_credits=w.free_credits,
        completed_per_s=w.completed_per_s,
        paused=w.paused,
        desired_batchers=w.desired_batchers,
        draining=w.draining,
        scheduler=w.scheduler,
        stopped=w.stopped,
    )


def encode_cancel_notice(notice: CancelNotice) -> bytes:
    return _encoder.encode(
        CancelNoticeWire(
            v=CANCEL_NOTICE_VERSION, job_id=notice.job_id, tenant=notice.tenant, model_name=notice.model_name
        )
    )


def decode_cancel_notice(data: bytes) -> CancelNotice:
    w = _cancel_decoder.decode(data)
    return CancelNotice(job_id=w.job_id, tenant=w.tenant, model_name=w.model_name)


def encode_pause(*, paused_at: float, by: str) -> bytes:
    return _encoder.encode(PauseWire(v=PAUSE_VERSION, paused_at=paused_at, by=by))


def decode_pause(data: bytes) -> PauseWire:
    return _pause_decoder.decode(data)
