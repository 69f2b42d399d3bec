"""The gateway's recent records (services.gateway.recent_records): which finished records it
keeps for GetJob, and for how long. Pure: the feed's changes are handed in directly."""

from __future__ import annotations

import time

import pytest

from asyncinfer.jobs import JobRecord, JobState, Priority
from services.gateway.recent_records import FeedState, RecentRecords

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
    # Ended now, not at NOW (the module's import): latest() asks the clock, and a loaded run
    # reached this test more than the 60 s of retention after the import (session 33).
    final = record("a", state, end_time=time.time())
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


def test_a_feed_started_afresh_forgets_everything() -> None:
    recent = feeding()
    final = record("a", JobState.SUCCEEDED)
    queued_then(recent, final)
    recent.feed_stopped()
    assert recent.finished(final.key, now=NOW) is None  # off: nothing is answered
    recent.feed_started(stream_last_seq=20)
    assert recent.finished(final.key, now=NOW) is None
    assert len(recent) == 0
    assert recent.resume_from() == 21


def test_a_resumed_feed_answers_the_jobs_queued_while_it_was_off_once_caught_up() -> None:
    """Stopped at sequence 10; a job queued meanwhile ran and ended at 12 and 14; the feed
    resumes from 11 with the stream at 14: while it replays, a kept record may be older than the
    bucket, so only finished records are answered; caught up, everything is."""
    recent = feeding()
    before = record("before", JobState.SUCCEEDED)
    queued_then(recent, before)
    running = record("running", JobState.RUNNING)
    recent.expect(running.key)
    recent.changed(running.key, running)
    recent.seen(10)
    recent.feed_stopped()
    meanwhile = record("meanwhile", JobState.SUCCEEDED)
    recent.expect(meanwhile.key)  # queued while the feed was off
    recent.queued(record("meanwhile", JobState.QUEUED))
    assert recent.latest(meanwhile.key) is None
    assert recent.resume_from() == 11
    recent.resume(stream_last_seq=14)
    assert recent.state is FeedState.CATCHING_UP
    assert recent.finished(before.key, now=NOW) is before  # final: never changes again
    assert recent.latest(running.key) is None  # maybe older than the bucket: read
    recent.changed(meanwhile.key, record("meanwhile", JobState.RUNNING))
    recent.seen(12)
    assert recent.latest(meanwhile.key) is None
    recent.changed(meanwhile.key, meanwhile)
    recent.seen(14)
    assert recent.state is FeedState.LIVE
    assert recent.finished(meanwhile.key, now=NOW) is meanwhile
    assert recent.latest(running.key) is running


def test_a_feed_resumed_with_nothing_missed_is_live_at_once() -> None:
    recent = feeding()
    recent.seen(10)
    recent.feed_stopped()
    recent.resume(stream_last_seq=10)
    assert recent.state is FeedState.LIVE


def test_a_feed_that_never_ran_cannot_resume() -> None:
    assert RecentRecords().resume_from() == 0
