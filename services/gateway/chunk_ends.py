"""The batch driver hears its chunk jobs end from the gateway's watch feed, instead of finding out
at its next tick.

A driver that learns of a chunk's end only by reading its job at a tick (`batches.drive_interval_s`,
0.2 s) holds the chunk's slot in the window until then: a slot turns at most once per tick, so a
batch whose chunks compute faster than a tick runs at `chunks_in_flight` chunks per tick or two,
whatever its batchers could do. On an H100 an MLP file batch ran at ~186,000 records/s with 4 and
with 8 batchers alike: 32 chunks of 2,048 records turning every ~0.33 s (session 20,
bench/results/batch_files_ab_gpu_now.md).

So each chunk job the driver submits is watched on the gateway's one record feed
(services.gateway.watch_hub, started for it), from before its submit: its terminal record wakes the
driver at once, which settles that chunk from the record heard (no read) and submits the next. The
ticks stay as they were, reading every queued chunk's job: they take over whatever the feed cannot
say (a chunk submitted by another gateway before this one adopted the batch, a feed that stopped
with the hub). So the feed only makes the driver earlier, never needed for a batch to finish.

While chunks are watched the feed runs, and brings this gateway every job's changes, as it does
while anyone watches or polls.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from asyncinfer.jobs import JobRecord
from services.gateway.watch_hub import WatcherQueue, WatchHub

log = structlog.get_logger("asyncinfer.gateway.batches")

BatchKey = tuple[str, str]  # (tenant, batch_id)


class ChunkEnds:
    def __init__(self, hub: WatchHub) -> None:
        self._hub = hub
        self._queue: WatcherQueue = WatcherQueue()
        self._watched: dict[str, BatchKey] = {}  # job key -> its batch
        self._ended: dict[str, JobRecord] = {}  # terminal records heard, not yet taken by a tick
        self._batches_ended: set[BatchKey] = set()  # batches with an end not yet taken
        self._closed = False

    @property
    def batches_with_ends(self) -> set[BatchKey]:
        """The batches a chunk end was heard for since their last tick."""
        return self._batches_ended

    def watching(self, job_key: str) -> bool:
        return job_key in self._watched

    async def watch(self, job_key: str, batch: BatchKey) -> None:
        """Watches a chunk's job from now on (call before its submit, so no change falls before).
        Without the feed (it could not start, or the hub has stopped) the job is not watched: the
        driver's ticks read it as before."""
        if self._closed or job_key in self._watched:
            return
        try:
            await self._hub.ensure_feed()
        except Exception as exc:
            log.warning("batch_chunk_watch_failed", error=str(exc))
            return
        if self._hub.closed or not self._hub.feeding:
            return
        self._watched[job_key] = batch
        self._hub.register(job_key, self._queue)

    def forget(self, job_key: str) -> None:
        """The chunk is settled (or was never submitted): no longer watched."""
        self._ended.pop(job_key, None)
        if self._watched.pop(job_key, None) is not None:
            self._hub.unregister(job_key, self._queue)

    def forget_batch(self, batch: BatchKey) -> None:
        for job_key in [key for key, owner in self._watched.items() if owner == batch]:
            self.forget(job_key)
        self._batches_ended.discard(batch)

    def take(self, batch: BatchKey) -> None:
        """A tick of the batch is starting: its ends heard so far are its to take (`ended`)."""
        self._batches_ended.discard(batch)

    def ended(self, job_key: str) -> JobRecord | None:
        """The terminal record heard for a watched chunk, if any."""
        return self._ended.get(job_key)

    async def run(self, wake: Callable[[], None]) -> None:
        """Hears the watched jobs' changes until the hub stops; calls `wake` on each end."""
        try:
            while (update := await self._queue.get()) is not None:
                record = update.record
                batch = self._watched.get(update.key)
                if batch is None or record is None or not record.state.is_terminal:
                    continue  # RUNNING, or no longer watched
                self._ended[update.key] = record
                self._batches_ended.add(batch)
                wake()
        finally:
            # The hub stopped (or this loop did): the ticks read every chunk from now on.
            self._closed = True
            for job_key in list(self._watched):
                self.forget(job_key)
