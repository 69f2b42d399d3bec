"""The records of the jobs this gateway just queued, for a WatchJob that comes right after its
SubmitJob (the client's round trip): the watch starts from the record kept here instead of
reading it (a queued job's read is two: the jobs bucket, then its work message).

Kept only while the watch feed runs (services.gateway.watch_hub), and only from before the
publish on: a job's entry is made before its work message is published, a change the feed brings
for it replaces the entry (the hub decodes the changes of jobs held here even when nobody watches
them yet: the RUNNING change usually arrives before the client's WatchJob, which then starts from
it instead of a read), and the submit fills in its QUEUED record only if nothing came first. So
an entry is never older than what the feed has delivered, which is what a read would give a
watcher that registered before it (the watch's own guarantee). The oldest go first past `capacity`.

A final change (SUCCEEDED, CANCELED, EXPIRED) moves the entry among the finished records, which
GetJob and GetJobs answer from too (the unary client's poll for its result, no read): such a
record never changes again, so the one kept is the one a read would return — until the record is
deleted (the feed's change removes it) or its retention ends (not answered past
`end_time + result_retention_s`). FAILED and TIMED_OUT are not kept: an operator's Replay may
queue the job again (asyncinfer.lifecycle.REPLAYABLE), and a GetJob after it must see that.
They are bounded by count (`capacity`) and by their encoded bytes (`finished_bytes`; a record
larger than a quarter of it is not kept), the oldest going first.

While the feed is off (nobody watched or polled for a while) nothing is answered from here, but the
entries stay, the jobs queued meanwhile are still expected, and the last stream sequence the feed
brought is remembered. The feed then resumes from the next sequence when few enough changes came
since (`resume_from`, `resume`: the hub decides): the changes it missed come first, in order, and
each one lands here as it would have live, so a client that queued jobs while nobody watched and
polls for them later is answered without a read each. Until the replay has reached the stream's
last sequence at the restart (`caught_up`) an entry may be older than the bucket: only the
finished records are answered then (a terminal record never changes again), and a watch reads.
When the feed starts afresh instead (no resume: `feed_started`), everything kept is forgotten.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict

from asyncinfer.jobs import JobRecord
from asyncinfer.lifecycle import REPLAYABLE

DEFAULT_CAPACITY = 4096
DEFAULT_FINISHED_BYTES = 16 * 1024 * 1024
_NOTHING_YET = None


class FeedState(enum.Enum):
    OFF = "off"  # nothing is answered from here
    CATCHING_UP = "catching_up"  # resumed, replaying what it missed: finished records only
    LIVE = "live"


class RecentRecords:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, finished_bytes: int = DEFAULT_FINISHED_BYTES) -> None:
        self._capacity = capacity
        self._records: OrderedDict[str, JobRecord | None] = OrderedDict()
        # Terminal records, each with its encoded size.
        self._finished: OrderedDict[str, tuple[JobRecord, int]] = OrderedDict()
        self._finished_bytes = 0
        self._max_finished_bytes = finished_bytes
        self._state = FeedState.OFF
        self._last_seen = 0  # the last stream sequence the feed brought (or the stream stood at)
        self._has_run = False
        self._catch_up_to = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def state(self) -> FeedState:
        return self._state

    def feed_started(self, stream_last_seq: int = 0) -> None:
        """The feed starts afresh (from the next change on), the stream standing at
        `stream_last_seq`: what was kept is forgotten."""
        self._clear()
        self._state = FeedState.LIVE
        self._last_seen = stream_last_seq
        self._has_run = True

    def resume_from(self) -> int:
        """The stream sequence a resumed feed starts from (the one after the last it brought), or
        0 when it cannot resume (it never ran)."""
        return self._last_seen + 1 if self._has_run else 0

    def resume(self, stream_last_seq: int) -> None:
        """The feed resumed from `resume_from()`, the stream then standing at `stream_last_seq`:
        entries are answered again once the replay reaches it."""
        self._catch_up_to = stream_last_seq
        self._state = FeedState.CATCHING_UP if stream_last_seq > self._last_seen else FeedState.LIVE

    def seen(self, sequence: int) -> None:
        """The feed brought the stream's message `sequence` (held here or not)."""
        self._last_seen = sequence
        if self._state is FeedState.CATCHING_UP and sequence >= self._catch_up_to:
            self._state = FeedState.LIVE

    def feed_stopped(self) -> None:
        """Nothing is answered from here until the feed runs again; the entries stay for a resume."""
        self._state = FeedState.OFF

    def _clear(self) -> None:
        self._records.clear()
        self._finished.clear()
        self._finished_bytes = 0

    def expect(self, key: str) -> None:
        """A job is about to be queued (before its publish); also while the feed is off, for a resume."""
        self._records[key] = _NOTHING_YET
        if len(self._records) > self._capacity:
            self._records.popitem(last=False)

    def queued(self, record: JobRecord) -> None:
        """Its work message was stored: its QUEUED record, unless a change came first."""
        key = record.key
        if key in self._records and self._records[key] is _NOTHING_YET:
            self._records[key] = record

    def holds(self, key: str) -> bool:
        """Whether the key's changes are kept here (a job this gateway just queued, or its finished record)."""
        return key in self._records or key in self._finished

    def forget(self, key: str) -> None:
        """Its submit failed."""
        self._records.pop(key, None)

    def changed(self, key: str, record: JobRecord | None, size: int = 0) -> None:
        """A change the feed brought (None: the record was deleted), `size` its encoded bytes."""
        if key in self._finished:
            self._drop_finished(key)
        if key not in self._records:
            return
        if record is None or record.state.is_terminal:
            del self._records[key]
            if record is not None and record.state not in REPLAYABLE:
                self._keep_finished(key, record, size)
        else:
            self._records[key] = record

    def latest(self, key: str) -> JobRecord | None:
        """The job's latest record known here, or None (not kept, or not known to be the latest:
        read it)."""
        if self._state is not FeedState.LIVE:
            return None
        return self._records.get(key) or self.finished(key)

    def finished(self, key: str, now: float | None = None) -> JobRecord | None:
        """The job's terminal record if kept here and still retained, or None (read it)."""
        kept = self._finished.get(key) if self._state is not FeedState.OFF else None
        if kept is None:
            return None
        record = kept[0]
        ended = record.end_time if record.end_time is not None else record.update_time
        if (time.time() if now is None else now) >= ended + record.result_retention_s:
            self._drop_finished(key)
            return None
        return record

    def _keep_finished(self, key: str, record: JobRecord, size: int) -> None:
        if size * 4 > self._max_finished_bytes:
            return
        self._finished[key] = (record, size)
        self._finished_bytes += size
        while len(self._finished) > self._capacity or self._finished_bytes > self._max_finished_bytes:
            _, (_, dropped) = self._finished.popitem(last=False)
            self._finished_bytes -= dropped

    def _drop_finished(self, key: str) -> None:
        _, size = self._finished.pop(key)
        self._finished_bytes -= size
