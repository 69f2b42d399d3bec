"""The records that queued notices carried (asyncinfer.queued_notice), kept until a dispatch takes
them, so the dispatch need not read the record back.

A record taken here may be stale (the job was cancelled since, or the notice came after its
dispatch had read the record): the RUNNING write is a compare-and-set on the notice's revision,
which then fails and reads the record afresh, and no order goes out before that write
(job_dispatch.py sends early only on a submit's own message). A notice is taken on its message's
first delivery only."""

from __future__ import annotations

import structlog

from asyncinfer.codecs.record import decode_record
from asyncinfer.jobs import JobRecord

log = structlog.get_logger("asyncinfer.scheduler.queued_records")

# A standby scheduler hears every notice and dispatches none: the oldest go first past this.
DEFAULT_CAPACITY = 4096


class QueuedRecords:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._records: dict[str, tuple[int, bytes]] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def put(self, key: str, revision: int, record_data: bytes) -> None:
        self._records.pop(key, None)
        self._records[key] = (revision, record_data)
        if len(self._records) > self._capacity:
            del self._records[next(iter(self._records))]

    def take(self, key: str) -> JobRecord | None:
        """The record announced for `key` (once), or None."""
        entry = self._records.pop(key, None)
        if entry is None:
            return None
        revision, data = entry
        try:
            return decode_record(data, revision=revision)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("queued_notice_undecodable", key=key, error=str(exc))
            return None
