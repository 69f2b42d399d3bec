"""Noticing a peer scheduler that died: its jobs come back in seconds, not after AckWait.

The lease-reclaim sweep (services.scheduler.lease_reclaim) returns the jobs of an instance that no
longer runs, but it ran only at a scheduler's start (and once more a heartbeat TTL later). With two
schedulers or more, as the Kubernetes deployment runs them, one killed and not replaced at once (its
node lost: the pod is rescheduled minutes later) left its jobs to AckWait, 20-30 s after its last
lease renewal. So every scheduler watches the heartbeat keys (`scheduler.<run>` in the queues bucket,
one write a second each) and sweeps when a peer's beats stop for longer than their TTL:
- Its own beats are the watch's yardstick: a peer counts as silent only while this scheduler's own
  writes keep arriving (a watch stalled by a NATS outage delivers nobody's, and then judges no one);
  after a gap in its own, every peer's silence counts from then.
- A peer whose key was deleted stopped in order (its stop put its jobs back): nothing to sweep.
  A delete marker that stays for good (a release before session 38 deleted its key so at every stop)
  is deleted again with one that expires (`kv_delete_with_ttl`), so that the markers of past runs
  leave the bucket.
- Of the schedulers heard from, the one with the smallest run ID sweeps, so that two survivors do
  not both nak the same messages (a nak applies to the delivery pending now, which may already be
  the next attempt's: lease_reclaim's docstring).
- The sweep itself judges each record's holder again (`SchedulerInstance.is_gone`: its key gone on
  the server), so a peer that was only slow, its key still there, loses nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from asyncinfer.contract import SCHEDULER_KEY_PREFIX
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats.kv import KvBucket, kv_delete_with_ttl
from asyncinfer.nats.kv_watch import KeyUpdate, KeyWatch
from asyncinfer.supervision import end_if_cancelled
from services.scheduler.instances import DELETED_HEARTBEAT_TTL_S, HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S

log = structlog.get_logger("asyncinfer.scheduler.peer_watch")

# A peer silent this long is taken for dead: its key has expired on the server by then (the TTL
# counts from its last write; the watch delivers that write a few ms after it).
SILENT_AFTER_S = HEARTBEAT_TTL_S + 2.0
# Its own beats arriving further apart than this: the watch was stalled, and silences restart.
OWN_GAP_S = 3 * HEARTBEAT_INTERVAL_S
CHECK_INTERVAL_S = HEARTBEAT_INTERVAL_S


class PeerWatch:
    """Calls `reclaim` (the lease-reclaim sweep) when a peer scheduler's heartbeat stops without
    its key being deleted, if this scheduler is the one to sweep (the module's docstring)."""

    def __init__(
        self,
        queues: KvBucket,
        run: str,
        reclaim: Callable[[], Awaitable[int]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run = run
        self._reclaim = reclaim
        self._clock = clock
        self._own_seen: float | None = None
        self._peers: dict[str, float] = {}  # run -> when its latest beat (or our own return) arrived
        self._queues = queues
        self._lasting_markers: set[str] = set()  # keys to delete again with a marker that expires
        self._names: dict[str, str] = {}  # run -> its instance ID (`<name>/<run>`, the key's value), for the log
        self._watch = KeyWatch(
            queues.js, queues.name, self._update, keys=f"{SCHEDULER_KEY_PREFIX}*", name="scheduler-peers"
        )

    async def run(self) -> None:
        """Watches until cancelled (a stop)."""
        await self._watch.start()
        try:
            while True:
                end_if_cancelled()  # a stop's cancellation that the last round's NATS request lost
                await asyncio.sleep(CHECK_INTERVAL_S)
                lost = [self._names.pop(run, run) for run in self.silent_peers()]
                if lost and self.sweeps():
                    await self._sweep(lost)
                if self._lasting_markers:
                    await self._clear_lasting_markers()
        finally:
            await self._watch.stop()

    def _update(self, update: KeyUpdate) -> None:
        run = update.key.removeprefix(SCHEDULER_KEY_PREFIX)
        now = self._clock()
        if run == self._run:
            if self._own_seen is not None and now - self._own_seen > OWN_GAP_S:
                # The watch (or this scheduler) was stalled: nobody's silence counts from before.
                self._peers = dict.fromkeys(self._peers, now)
            self._own_seen = now
        elif update.removed:
            self._peers.pop(run, None)  # a stop in order: it put its jobs back
            self._names.pop(run, None)
            if update.lasting_marker:
                self._lasting_markers.add(update.key)
        else:
            self._peers[run] = now
            self._names[run] = update.value.decode(errors="replace")

    def silent_peers(self) -> list[str]:
        """The peers silent past SILENT_AFTER_S while this scheduler's own beats arrive; each is
        forgotten as it is returned (a peer that beats again is a peer again)."""
        now = self._clock()
        if self._own_seen is None or now - self._own_seen > OWN_GAP_S:
            return []
        lost = [run for run, seen in self._peers.items() if now - seen > SILENT_AFTER_S]
        for run in lost:
            del self._peers[run]
        return lost

    def sweeps(self) -> bool:
        """Whether this scheduler is the one to sweep: the smallest run ID of those heard from."""
        return all(self._run < run for run in self._peers)

    async def _clear_lasting_markers(self) -> None:
        """Deletes again, with a marker that expires, the keys whose delete marker would stay for
        good (a failure leaves the rest for the next tick)."""
        while self._lasting_markers:
            key = next(iter(self._lasting_markers))
            try:
                await kv_delete_with_ttl(self._queues, key, ttl_s=DELETED_HEARTBEAT_TTL_S)
            except NATS_FAILURES as exc:
                log.debug("heartbeat_marker_not_cleared", key=key, error=str(exc) or type(exc).__name__)
                return
            self._lasting_markers.discard(key)

    async def _sweep(self, peers: list[str]) -> None:
        """`peers`: the lost ones' instance IDs (`<name>/<run>`), for the log."""
        try:
            returned = await self._reclaim()
        except Exception as exc:  # AckWait still returns the jobs
            log.warning("peer_jobs_not_reclaimed", peers=peers, error=str(exc) or type(exc).__name__)
            return
        log.warning("peer_scheduler_lost", peers=peers, jobs_returned=returned)
