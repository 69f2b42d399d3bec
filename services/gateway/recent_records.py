"""The records of the jobs this gateway just queued, for a WatchJob that comes right after its
SubmitJob (the client's round trip): the watch starts from the record kept here instead of
reading it (a queued job's read is two: the jobs bucket, then its work message).

Kept only while the watch feed runs (services.gateway.watch_hub), and only from before the
publish on: a job's entry is made before its work message is published, a change the feed brings
for it replaces the entry (the hub decodes the changes of jobs held here even when nobody watches
them yet: the RUNNING change usually arrives before the client's WatchJob, which then starts from
it instead of a read), and the submit fills in its QUEUED record only if nothing came first. So
an entry is never older than what the feed has delivered, which is what a read would give a
watcher that registered before it (the watch's own guarantee). A terminal change ends the entry
(a watch then reads the record, outputs and all: the entries stay small), as does the feed
stopping; the oldest go first past `capacity`.
"""

from __future__ import annotations

from collections import OrderedDict

from asyncinfer.jobs import JobRecord

DEFAULT_CAPACITY = 4096
_NOTHING_YET = None


class RecentRecords:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._records: OrderedDict[str, JobRecord | None] = OrderedDict()
        self._feeding = False

    def __len__(self) -> int:
        return len(self._records)

    def feed_started(self) -> None:
        self._records.clear()
        self._feeding = True

    def feed_stopped(self) -> None:
        self._feeding = False
        self._records.clear()

    def expect(self, key: str) -> None:
        """A job is about to be queued (before its publish)."""
        if not self._feeding:
            return
        self._records[key] = _NOTHING_YET
        if len(self._records) > self._capacity:
            self._records.popitem(last=False)

    def queued(self, record: JobRecord) -> None:
        """Its work message was stored: its QUEUED record, unless a change came first."""
        key = record.key
        if key in self._records and self._records[key] is _NOTHING_YET:
            self._records[key] = record

    def holds(self, key: str) -> bool:
        """Whether the key's changes are kept here (a job this gateway just queued)."""
        return key in self._records

    def forget(self, key: str) -> None:
        """Its submit failed."""
        self._records.pop(key, None)

    def changed(self, key: str, record: JobRecord | None) -> None:
        """A change the feed brought (None: the record was deleted)."""
        if key not in self._records:
            return
        if record is None or record.state.is_terminal:
            del self._records[key]
        else:
            self._records[key] = record

    def latest(self, key: str) -> JobRecord | None:
        """The job's latest record known here, or None (not kept: read it)."""
        return self._records.get(key) if self._feeding else None
