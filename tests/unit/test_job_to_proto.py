"""The Job message a record becomes (services.gateway.convert.job_to_proto): its times are set
without protobuf's FromNanoseconds (a Python-level call per field, on every submit answer, read
and watch update) and must be what FromNanoseconds gives."""

from __future__ import annotations

import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from asyncinfer.jobs import BatchInfo, JobRecord, JobState, Priority
from asyncinfer.v1 import job_pb2
from services.gateway.convert import _set_time, job_to_proto
from services.gateway.queue_view import QueueStanding, WaitingReason

pytestmark = pytest.mark.unit

SECONDS = [0.0, 1e-9, 0.4999999999, 1.5, 1_764_633_600.123456789, 253_402_300_799.0, 86_400.0 * 365 * 100]


@pytest.mark.parametrize("seconds", SECONDS)
def test_times_are_what_from_nanoseconds_gives(seconds: float) -> None:
    for kind in (timestamp_pb2.Timestamp, duration_pb2.Duration):
        expected, got = kind(), kind()
        expected.FromNanoseconds(round(seconds * 1e9))
        _set_time(got, seconds)
        assert (got.seconds, got.nanos) == (expected.seconds, expected.nanos)


@pytest.mark.parametrize("seconds", [-1e-9, -1.5, -86_400.25])
def test_a_negative_duration_is_normalized_as_protobuf_does(seconds: float) -> None:
    expected, got = duration_pb2.Duration(), duration_pb2.Duration()
    expected.FromNanoseconds(round(seconds * 1e9))
    _set_time(got, seconds)
    assert (got.seconds, got.nanos) == (expected.seconds, expected.nanos)
    assert got.nanos <= 0  # the sign of seconds, as Duration requires


def test_every_time_and_the_queue_standing_reach_the_message() -> None:
    now = 1_764_633_600.25
    record = JobRecord(
        job_id="j1",
        tenant="t",
        model_name="demo",
        model_version="1",
        max_attempts=3,
        state=JobState.SUCCEEDED,
        priority=Priority.HIGH,
        create_time=now,
        update_time=now + 3,
        start_time=now + 1,
        end_time=now + 2.5,
        result_retention_s=60.0,
        deadline=now + 100,
        execution_timeout_s=7.5,
        batch=BatchInfo(batcher_id="b", batch_size=4, compute_s=0.002),
    )
    job = job_to_proto(record, QueueStanding(position=3, waiting_reason=WaitingReason.PAUSED))
    assert job.create_time.ToNanoseconds() == round(now * 1e9)
    assert job.update_time.ToNanoseconds() == round((now + 3) * 1e9)
    assert job.start_time.ToNanoseconds() == round((now + 1) * 1e9)
    assert job.end_time.ToNanoseconds() == round((now + 2.5) * 1e9)
    assert job.expire_time.ToNanoseconds() == round((now + 62.5) * 1e9)
    assert job.deadline.ToNanoseconds() == round((now + 100) * 1e9)
    assert job.result_retention.ToNanoseconds() == 60 * 10**9
    assert job.execution_timeout.ToNanoseconds() == 7_500_000_000
    assert job.batch.compute_duration.ToNanoseconds() == 2_000_000
    assert (job.queue.position, job.queue.waiting_reason) == (3, job_pb2.WAITING_REASON_PAUSED)
    dispatching = job_to_proto(record, QueueStanding(position=0, waiting_reason=WaitingReason.DISPATCHING))
    assert dispatching.queue.waiting_reason == job_pb2.WAITING_REASON_UNSPECIFIED
