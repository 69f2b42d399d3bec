"""A reader's watch of the queue snapshots: one ordered consumer on the queues bucket's snapshot keys
(each key's latest value, then every write), each scheduler's latest snapshot of each model kept
with when it was written on the reader's monotonic clock (asyncinfer.snapshot_freshness), and the
model's merge made as each arrives (asyncinfer.snapshot_merge).

Two readers: the gateway's queue view (services.gateway.queue_view), which keeps the merges for its
answers, and each scheduler's cluster-wide GetQueueStats (services.scheduler.cluster_queues), which
merges its own snapshot with the others' latest as it answers. What a reader does with a merge, or
with the server's clock the watch reads on the way, is its own (`on_merge`, `on_server_stamp`).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from asyncinfer.contract import kv_stream, kv_subject_prefix
from asyncinfer.nats import KV_OP, Client, DeliverPolicy, JetStreamContext, Msg
from asyncinfer.nats.streams import ATTEMPT_TIMEOUT_S, declaration, stream_position
from asyncinfer.queues import decode_snapshot
from asyncinfer.snapshot_freshness import WatchStart, written_at
from asyncinfer.snapshot_merge import HeldSnapshot, SchedulerSnapshots

log = structlog.get_logger("asyncinfer.snapshot_watch")

# Called with a model's name and its merge as a snapshot of it arrives, None as its key is deleted.
OnMerge = Callable[[str, HeldSnapshot | None], None]
# Called with a time on nats-server's clock (Unix seconds) and the reader's monotonic clock as it was
# read: the server's time as the watch begins, and its stamp on each snapshot written after that.
OnServerStamp = Callable[[float, float], None]


async def read_watch_start(nc: Client, bucket: str, monotonic: Callable[[], float]) -> WatchStart:
    """Asked just before a watch of the queues bucket subscribes (one stream info)."""
    position = await stream_position(nc, kv_stream(bucket), timeout_s=ATTEMPT_TIMEOUT_S)
    return WatchStart(last_seq=position.last_seq, server_time=position.server_time, read_at=monotonic())


class WriteTimes:
    """When each snapshot a reader's watch delivers was written, on the reader's monotonic clock:
    `begin` just before the watch subscribes, `of` for each message it delivers."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self._start: WatchStart | None = None  # None: not begun, or caught up (every write is live)

    async def begin(self, nc: Client, bucket: str) -> None:
        self._start = await read_watch_start(nc, bucket, self._monotonic)

    @property
    def start(self) -> WatchStart | None:
        """What the stream said as the watch began; None before `begin`, and once a live write came."""
        return self._start

    def is_live(self, msg: Msg) -> bool:
        """Whether the watch delivered `msg` as it was written (not a key's last value from before
        the watch began). Asked before `of`."""
        start = self._start
        return start is None or msg.metadata.sequence.stream > start.last_seq

    def of(self, msg: Msg, received_at: float) -> float:
        """`written_at` of a message the watch delivered at `received_at` (its stream sequence and
        the server's stamp come from its reply subject's metadata)."""
        start = self._start
        if start is None:
            return received_at
        metadata = msg.metadata
        if metadata.sequence.stream > start.last_seq:
            # The watch delivers in stream order: every later message is a live write too, and its
            # metadata need not be parsed (about 1.5 µs an arrival).
            self._start = None
            return received_at
        return written_at(
            start, seq=metadata.sequence.stream, stored_time=metadata.timestamp.timestamp(), received_at=received_at
        )


class SnapshotWatch:
    """`start` subscribes `$KV.<bucket>.*`: the snapshot keys, which are the bare model names (the
    `paused.*` and `scheduler.*` keys and the tenant counters of older releases have two tokens and
    are not delivered); `stop` ends it. `schedulers` holds each scheduler's latest snapshots."""

    def __init__(
        self,
        js: JetStreamContext,
        nc: Client,
        *,
        bucket: str,
        monotonic: Callable[[], float],
        on_merge: OnMerge | None = None,
        on_server_stamp: OnServerStamp | None = None,
    ) -> None:
        self._js = js
        self._nc = nc
        self._bucket = bucket
        self._subject_prefix = kv_subject_prefix(bucket)
        self._monotonic = monotonic
        self._on_merge = on_merge
        self._on_server_stamp = on_server_stamp
        self._schedulers = SchedulerSnapshots()
        self._write_times = WriteTimes(monotonic)  # of the snapshots the watch delivers
        self._subscription: JetStreamContext.PushSubscription | None = None

    @property
    def schedulers(self) -> SchedulerSnapshots:
        return self._schedulers

    async def start(self) -> None:
        async def watch(_timeout_s: float) -> JetStreamContext.PushSubscription:
            # Before subscribing: the keys' last values the watch delivers first are as old as the
            # server says (asyncinfer.snapshot_freshness).
            await self._write_times.begin(self._nc, self._bucket)
            start = self._write_times.start
            if self._on_server_stamp is not None and start is not None and start.server_time is not None:
                self._on_server_stamp(start.server_time, start.read_at)
            return await self._js.subscribe(
                f"{self._subject_prefix}*",
                stream=kv_stream(self._bucket),
                cb=self.deliver,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            )

        # At start, a leader election may be under way (a node lost as the service started).
        self._subscription = await declaration(watch, what="watch the queue snapshots")

    async def stop(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is None:
            return
        try:
            await subscription.unsubscribe()
        except Exception as exc:  # the connection may already be gone; nothing is left to free
            log.warning("snapshot_watch_unsubscribe_failed", error=str(exc))

    async def deliver(self, msg: Msg) -> None:
        """The watch's callback: each message it delivers, in stream order."""
        key = msg.subject.removeprefix(self._subject_prefix)
        if KV_OP in (msg.headers or {}):
            self._schedulers.forget(key)
            if self._on_merge is not None:
                self._on_merge(key, None)
            return
        try:
            snapshot = decode_snapshot(msg.data)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("queue_snapshot_unreadable", model=key, error=str(exc))
            return
        received_at = self._monotonic()
        if self._on_server_stamp is not None and self._write_times.is_live(msg):
            # Stored by the server as it was written, and here a moment later: a sample of the
            # server's clock against the reader's (a metadata parse per snapshot, ~5 µs).
            self._on_server_stamp(msg.metadata.timestamp.timestamp(), received_at)
        written = self._write_times.of(msg, received_at)
        merged = self._schedulers.arrived(snapshot, written_at=written, now=received_at)
        if self._on_merge is not None:
            self._on_merge(key, merged)
