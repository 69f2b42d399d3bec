"""The gateway's recent records (services.gateway.recent_records): which finished records it
keeps for GetJob, and for how long. Pure: the feed's changes are handed in directly."""

from __future__ import annotations

import time

import pytest

from asyncinfer.jobs import JobRecord, JobState, Priority
from services.gateway.recent_records import RecentRecords

pytestmark = pytest.mark.unit

NOW = time.time()  # latest() asks the clock: the records end now


def record(job_id: str, state: JobState, *, end_time: float | None = NOW, retention_s: float = 60.0) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        tenant="t",
        model_name="m",
        model_version="",
        state=state,
        priority=Priority.NORMAL,
        create_time=NOW - 1,
        update_time=NOW,
        max_attempts=3,
        result_retention_s=retention_s,
        end_time=end_time if state.is_terminal else None,
    )


def feeding(capacity: int = 8, finished_bytes: int = 1000) -> RecentRecords:
    recent = RecentRecords(capacity, finished_bytes)
    recent.feed_started()
    return recent


def queued_then(recent: RecentRecords, final: JobRecord, size: int = 10) -> None:
    recent.expect(final.key)
    recent.changed(final.key, record(final.job_id, JobState.RUNNING), size)
    recent.changed(final.key, final, size)


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.CANCELED, JobState.EXPIRED])
def test_a_final_record_is_kept_for_reads(state: JobState) -> None:
    recent = feeding()
    final = record("a", state)
    queued_then(recent, final)
    assert recent.finished(final.key, now=NOW) is final
    assert recent.latest(final.key) is final
    assert recent.holds(final.key)


@pytest.mark.parametrize("state", [JobState.FAILED, JobState.TIMED_OUT])
def test_a_replayable_record_is_not_kept(state: JobState) -> None:
    """An operator's Replay may queue the job again: a read must see that."""
    recent = feeding()
    final = record("a", state)
    queued_then(recent, final)
    assert recent.finished(final.key, now=NOW) is None
    assert recent.latest(final.key) is None
    assert not recent.holds(final.key)


def test_a_record_not_queued_here_is_not_kept() -> None:
    recent = feeding()
    final = record("a", JobState.SUCCEEDED)
    recent.changed(final.key, final, 10)
    assert recent.finished(final.key, now=NOW) is None


def test_a_kept_record_goes_at_its_retention_end_or_deletion() -> None:
    recent = feeding()
    final = record("a", JobState.SUCCEEDED, retention_s=60.0)
    queued_then(recent, final)
    assert recent.finished(final.key, now=NOW + 59.9) is final
    assert recent.finished(final.key, now=NOW + 60.0) is None
    assert not recent.holds(final.key)
    other = record("b", JobState.SUCCEEDED)
    queued_then(recent, other)
    recent.changed(other.key, None)  # deleted
    assert recent.finished(other.key, now=NOW) is None


def test_kept_records_are_bounded_by_count_oldest_first() -> None:
    recent = feeding(capacity=3, finished_bytes=10_000)
    finals = [record(str(index), JobState.SUCCEEDED) for index in range(4)]
    for final in finals:
        queued_then(recent, final, size=100)
    assert [recent.finished(final.key, now=NOW) is not None for final in finals] == [False, True, True, True]


def test_kept_records_are_bounded_by_bytes_oldest_first() -> None:
    recent = feeding(capacity=8, finished_bytes=1000)
    finals = [record(str(index), JobState.SUCCEEDED) for index in range(3)]
    for final in finals:
        queued_then(recent, final, size=200)
    huge = record("huge", JobState.SUCCEEDED)
    queued_then(recent, huge, size=251)  # over a quarter of the budget: not kept, nothing dropped for it
    assert recent.finished(huge.key, now=NOW) is None
    assert all(recent.finished(final.key, now=NOW) is not None for final in finals)
    big = record("big", JobState.SUCCEEDED)
    queued_then(recent, big, size=250)  # 850 bytes: within the budget
    assert all(recent.finished(final.key, now=NOW) is not None for final in finals)
    last = record("last", JobState.SUCCEEDED)
    queued_then(recent, last, size=200)  # 1050: the oldest goes
    kept = [recent.finished(final.key, now=NOW) is not None for final in (*finals, big, last)]
    assert kept == [False, True, True, True, True]


def test_the_feed_stopping_forgets_everything() -> None:
    recent = feeding()
    final = record("a", JobState.SUCCEEDED)
    queued_then(recent, final)
    recent.feed_stopped()
    assert recent.finished(final.key, now=NOW) is None
    recent.feed_started()
    assert recent.finished(final.key, now=NOW) is None
    assert len(recent) == 0
