"""`batch watch` and `batch create --wait` where stderr is not a terminal (a CI log, a pipe): the
progress bar is silent there, so the follow prints one line per state change and at most one
every PROGRESS_LINE_EVERY_S while the batch runs."""

from __future__ import annotations

import dataclasses
import io

import pytest

from asyncinfer.client import Batch, BatchReadProgress, BatchState
from asyncinfer.commands.batches import PROGRESS_LINE_EVERY_S, _ProgressLines, batch_summary

pytestmark = pytest.mark.unit


def batch(state: BatchState, completed: int) -> Batch:
    return Batch(
        batch_id="b1",
        state=state,
        model_name="demo",
        total=1000,
        completed=completed,
        failed=0,
        records_per_second=0.0,
        chunks_total=1,
        chunks_done=0,
        create_time=None,
        expires_at=None,
    )


def test_a_line_per_state_change_and_at_most_one_per_interval_while_it_runs() -> None:
    now = [0.0]
    out = io.StringIO()
    lines = _ProgressLines(out, clock=lambda: now[0])
    lines.show(batch(BatchState.VALIDATING, 0))
    lines.show(batch(BatchState.IN_PROGRESS, 0))
    for done in range(100, 1000, 100):  # updates every second: one line at the interval
        now[0] += 1.0
        lines.show(batch(BatchState.IN_PROGRESS, done))
    now[0] += 0.5
    lines.show(batch(BatchState.COMPLETED, 1000))  # a change is shown at once
    shown = [line.split("  ", 1)[1] for line in out.getvalue().splitlines()]
    assert PROGRESS_LINE_EVERY_S == 10.0
    assert shown == [
        "b1  VALIDATING  0/1000 done",
        "b1  IN_PROGRESS  0/1000 done",
        "b1  COMPLETED  1000/1000 done",
    ]


def test_a_running_batch_is_shown_again_once_the_interval_passes() -> None:
    now = [0.0]
    out = io.StringIO()
    more = _ProgressLines(out, clock=lambda: now[0])
    more.show(batch(BatchState.IN_PROGRESS, 0))
    now[0] += PROGRESS_LINE_EVERY_S
    more.show(batch(BatchState.IN_PROGRESS, 500))
    assert [line.split("  ", 1)[1] for line in out.getvalue().splitlines()] == [
        "b1  IN_PROGRESS  0/1000 done",
        "b1  IN_PROGRESS  500/1000 done",
    ]


def test_a_batch_whose_records_are_not_counted_yet_reads_so() -> None:
    """The first-hour pass, session 32: `batch create --wait` began `VALIDATING  0/0 done`, which reads
    as a batch with nothing to do; its total is 0 until the input is read."""
    out = io.StringIO()
    lines = _ProgressLines(out, clock=lambda: 0.0)
    lines.show(dataclasses.replace(batch(BatchState.VALIDATING, 0), total=0))
    assert [line.split("  ", 1)[1] for line in out.getvalue().splitlines()] == ["b1  VALIDATING  reading its input"]
    empty = dataclasses.replace(batch(BatchState.FAILED, 0), total=0)  # an ended batch keeps its counts
    assert batch_summary(empty) == "b1  FAILED  0/0 done"


def test_a_batch_ended_before_its_input_was_read_says_so() -> None:
    """A fresh-eyes pass, session 33: a batch cancelled while VALIDATING ended `CANCELLED  0/0 done`,
    which read as an empty file; so did one whose completion window ended then. A FAILED one keeps
    its counts, its failure message saying why."""
    for state in (BatchState.CANCELLED, BatchState.EXPIRED):
        ended = dataclasses.replace(batch(state, 0), total=0)
        assert batch_summary(ended) == f"b1  {state}  before its input was read"
    # Its records that never ran are neither completed nor failed (OpenAI's request_counts): the
    # summary said `990 failed` where GetBatch counted them failed, and now says they did not run.
    cancelled = batch(BatchState.CANCELLED, 10)
    assert cancelled.not_run == 990
    assert batch_summary(cancelled) == "b1  CANCELLED  10/1000 done  990 not run"
    assert (
        batch_summary(dataclasses.replace(cancelled, failed=3)) == "b1  CANCELLED  10/1000 done  3 failed  987 not run"
    )
    assert batch(BatchState.CANCELLING, 10).not_run == 0  # not known until it ends


def test_a_batch_being_read_says_how_far_it_has_come() -> None:
    """The batch walk-through, session 33: an 800,000-record file sat for minutes at `VALIDATING
    reading its input`, nothing saying it moved. The gateway's last report of its reading is shown."""
    reading = BatchReadProgress(
        bytes_read=12_600_000,
        bytes_total=48_000_000,
        records_read=210_000,
        records_per_second=1234.4,
        estimated_end_time=None,
        update_time=None,
    )
    validating = dataclasses.replace(batch(BatchState.VALIDATING, 0), total=0, read_progress=reading)
    assert batch_summary(validating) == (
        "b1  VALIDATING  reading its input  12.6 MB/48.0 MB (26%)  210000 records  1234 records/s"
    )
