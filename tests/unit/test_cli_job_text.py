"""`asyncinfer get JOB_ID` as text: a job with a callback shows its URL and each delivery (event,
state, HTTP status, attempts, and for a failing one its error and next try), which only --json
showed before."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest

from asyncinfer.client import (
    Callback,
    CallbackDelivery,
    CallbackDeliveryState,
    CallbackEvent,
    Job,
    JobError,
    JobProgress,
    JobState,
    ModelInfo,
    ModelVersion,
    Priority,
    QueuePosition,
    WaitingReason,
)
from asyncinfer.commands.ops import attempts_text
from asyncinfer.commands.output import job_summary, job_text
from asyncinfer.errors import FieldViolation
from asyncinfer.jobs import BATCH_LABEL, CHUNK_LABEL

pytestmark = pytest.mark.unit


def delivery(state: CallbackDeliveryState, **fields: object) -> CallbackDelivery:
    values: dict[str, object] = {
        "webhook_id": "msg_1",
        "event": CallbackEvent.COMPLETED,
        "state": state,
        "attempts": 1,
        "last_attempt_time": None,
        "last_status_code": 0,
        "last_error": "",
        "next_attempt_time": None,
        **fields,
    }
    return CallbackDelivery(**values)  # type: ignore[arg-type]


def a_job(**fields: Any) -> Job:
    values: dict[str, Any] = {
        "job_id": "j1",
        "model_name": "demo",
        "model_version": "1",
        "state": JobState.SUCCEEDED,
        "priority": Priority.NORMAL,
        "attempt": 1,
        "max_attempts": 3,
        "revision": 7,
        **fields,
    }
    return Job(**values)


def test_a_jobs_callback_and_its_deliveries_are_shown() -> None:
    job = a_job(
        callback=Callback("http://127.0.0.1:8765/hook"),
        callback_deliveries=(
            delivery(CallbackDeliveryState.DELIVERED, last_status_code=200),
            delivery(
                CallbackDeliveryState.PENDING,
                event=CallbackEvent.RUNNING,
                attempts=2,
                last_status_code=503,
                last_error="HTTP 503",
                next_attempt_time=datetime(2026, 12, 6, 1, 40, tzinfo=UTC),
            ),
        ),
    )
    lines = job_text(job).splitlines()
    at = lines.index("callback    http://127.0.0.1:8765/hook")
    assert lines[at + 1] == "  webhook   COMPLETED DELIVERED (HTTP 200, 1 attempt)"
    assert lines[at + 2].startswith("  webhook   RUNNING PENDING (HTTP 503, 2 attempts, next 2026-12-06 01:40")


def test_a_models_versions_read_in_one_cell() -> None:
    model = ModelInfo("demo", "2", (), (), 32, 3, 10, None)
    assert model.versions_summary == "2"  # a gateway that lists no versions
    listed = dataclasses.replace(
        model, versions=(ModelVersion("1", "READY"), ModelVersion("2", "READY"), ModelVersion("3", "LOADING"))
    )
    assert listed.versions_summary == "1, 2, 3 (loading)"


def test_a_running_jobs_progress_is_shown() -> None:
    job = a_job(
        state=JobState.RUNNING,
        progress=JobProgress(fraction=0.39, message="window 47 of 119", partial_outputs={}),
    )
    assert "progress    39%  window 47 of 119" in job_text(job).splitlines()
    finished = dataclasses.replace(job, state=JobState.SUCCEEDED)
    assert not any(line.startswith("progress") for line in job_text(finished).splitlines())


def test_watch_lines_are_stamped_in_the_order_they_are_printed() -> None:
    from datetime import timedelta

    from asyncinfer.commands.jobs import line_stamp

    ended = datetime(2026, 12, 6, 4, 14, 17, 502000, tzinfo=UTC)
    running = a_job(
        state=JobState.RUNNING,
        update_time=ended - timedelta(seconds=5),
    )
    heard = ended + timedelta(milliseconds=14)  # the last progress report, heard after the end
    progress_stamp = line_stamp(running, running, running.update_time, heard)
    assert progress_stamp == heard
    succeeded = dataclasses.replace(running, state=JobState.SUCCEEDED, update_time=ended)
    assert line_stamp(running, succeeded, progress_stamp, heard) == heard, "not before the line above"
    assert line_stamp(None, running, None, heard) == running.update_time, "a state is stamped with its record's time"


def test_a_dead_letter_written_before_its_limit_was_kept_reads_without_an_of() -> None:
    """A letter from a scheduler that kept no `allowed_attempts` (0) says its count alone, not "of
    0"; one that kept it reads as the job's attempt does."""
    letter = {"attempts": 6, "allowed_attempts": 0, "given_back_attempts": 0}
    assert attempts_text(letter) == "6"
    assert attempts_text({**letter, "attempts": 2, "given_back_attempts": 4}) == "2 (4 given back)"
    assert attempts_text({**letter, "attempts": 1, "allowed_attempts": 3}) == "1 of 3"


def test_a_queued_job_says_how_many_jobs_are_ahead_and_when_it_should_start() -> None:
    """The first-hour pass, session 32: the first job of a paused queue read `queue       position 0,
    waiting: PAUSED` (the proto's 0-based count of the jobs ahead, read as a place in a line), and
    the estimated start GetJob gives was not shown."""
    start = datetime(2026, 12, 7, 3, 45, 2, tzinfo=UTC)
    first = a_job(
        state=JobState.QUEUED,
        attempt=0,
        queue=QueuePosition(position=0, estimated_start_time=start, waiting_reason=WaitingReason.PAUSED),
    )
    expected = start.astimezone().strftime("%H:%M:%S")
    assert f"queue       nothing ahead, starts about {expected}, waiting: PAUSED" in job_text(first).splitlines()
    assert job_summary(first) == "j1  QUEUED  nothing ahead  waiting: PAUSED"
    third = dataclasses.replace(first, queue=QueuePosition(position=2, estimated_start_time=None, waiting_reason=None))
    assert "queue       2 jobs ahead, waiting: -" in job_text(third).splitlines()
    second = dataclasses.replace(third, queue=QueuePosition(position=1, estimated_start_time=None, waiting_reason=None))
    assert job_summary(second) == "j1  QUEUED  1 job ahead"


def test_every_date_and_time_the_cli_prints_is_local_to_the_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """One instant printed three ways: `list` "2026-12-07 01:40:05" (local), `get`
    "2026-12-07T01:40:05.123+02:00" (ISO 8601 with milliseconds and the offset) and `dlq list` /
    `dlq show` "2026-12-06T23:40:05.123+00:00" (ISO 8601 in UTC, the JSON field as it is). Each is
    the local time to the second now (output.TIME_FORMAT); --json keeps ISO 8601 in UTC."""
    import time

    from google.protobuf import timestamp_pb2

    from asyncinfer.commands.jobs import job_row
    from asyncinfer.commands.ops import dead_letter_json, dead_letter_row, dead_letter_text
    from asyncinfer.commands.output import job_json
    from asyncinfer.v1 import ops_service_pb2

    monkeypatch.setenv("TZ", "XYZ-2")  # POSIX: two hours east of UTC, no zone database needed
    time.tzset()
    try:
        instant = datetime(2026, 12, 6, 23, 40, 5, 123000, tzinfo=UTC)
        shown = "2026-12-07 01:40:05"
        job = a_job(
            create_time=instant,
            end_time=instant,
            callback=Callback("http://127.0.0.1:8765/hook"),
            callback_deliveries=(delivery(CallbackDeliveryState.PENDING, next_attempt_time=instant),),
        )
        assert job_row(job)[4] == shown
        text = job_text(job)
        assert f"created     {shown}\n" in text
        assert f"ended       {shown}\n" in text
        assert f"next {shown})" in text
        assert job_json(job)["create_time"] == "2026-12-06T23:40:05.123000+00:00"

        stamp = timestamp_pb2.Timestamp()
        stamp.FromDatetime(instant)
        letter = dead_letter_json(
            ops_service_pb2.DeadLetter(
                sequence=1, job_id="j1", model_name="demo", reason="MAX_ATTEMPTS", dead_time=stamp
            )
        )
        assert letter["dead_time"] == "2026-12-06T23:40:05.123+00:00"  # --json
        assert dead_letter_row(letter)[6] == shown
        assert f"dead        {shown}" in dead_letter_text(letter).splitlines()
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_failed_jobs_error_says_each_violation_once() -> None:
    """A job failed on its inputs: the message names the first violation (`invalid inputs:
    inputs[0].shape: ...`, as tensor_codec words it), which `asyncinfer get` printed again under
    it; the other violations follow, as the SDK's error text and the CLI's report do."""
    first = FieldViolation("inputs[0].shape", "input 'x' must have shape [-1, 4] (-1: any), got [3]")
    other = FieldViolation("inputs[1].name", "unknown input 'y'")
    error = JobError(
        grpc.StatusCode.INVALID_ARGUMENT, "", f"invalid inputs: {first.field}: {first.description}", (first, other)
    )
    lines = job_text(a_job(state=JobState.FAILED, error=error)).splitlines()
    at = lines.index(f"error       INVALID_ARGUMENT: invalid inputs: {first.field}: {first.description}")
    assert lines[at + 1 :] == [f"            {other.field}: {other.description}"]


def test_a_dead_lettered_job_names_its_letter_for_the_dlq_commands() -> None:
    """`asyncinfer get` of a dead-lettered job said its error; to replay it one listed the model's
    dead letters and looked for the job. Its Job now names the letter (dead_letter_sequence): the
    line under the error gives the commands that show and replay it. A job without one says none."""
    error = JobError(grpc.StatusCode.UNKNOWN, "MAX_ATTEMPTS", "the model raised (gave up after 3 attempts)", ())
    lines = job_text(a_job(state=JobState.FAILED, attempt=3, error=error, dead_letter_sequence=42)).splitlines()
    at = lines.index("error       UNKNOWN MAX_ATTEMPTS: the model raised (gave up after 3 attempts)")
    assert lines[at + 1] == "dead letter 42 (asyncinfer dlq show 42; dlq replay 42 runs it again)"
    assert not any(
        line.startswith("dead letter") for line in job_text(a_job(state=JobState.FAILED, error=error)).splitlines()
    )


def test_a_dead_lettered_chunk_of_a_file_batch_is_not_offered_a_replay() -> None:
    """A file batch's chunk job is not run again by a replay (the scheduler refuses it:
    BATCH_CHUNK_NOT_REPLAYABLE; its failed records are in the batch's error file), so the line
    naming its letter gave a command that fails; it names the letter and says why instead, as
    the console's job page does."""
    error = JobError(grpc.StatusCode.UNKNOWN, "MAX_ATTEMPTS", "the model raised (gave up after 3 attempts)", ())
    chunk = a_job(
        state=JobState.FAILED,
        attempt=3,
        error=error,
        dead_letter_sequence=42,
        labels={BATCH_LABEL: "b1", CHUNK_LABEL: "0"},
    )
    lines = job_text(chunk).splitlines()
    at = lines.index("error       UNKNOWN MAX_ATTEMPTS: the model raised (gave up after 3 attempts)")
    assert lines[at + 1] == (
        "dead letter 42 (asyncinfer dlq show 42; a file batch's chunk: not replayed, its records are in the "
        "batch's error file)"
    )
