"""jobs_summary (asyncinfer/work_summary.py): counts per model, a line per model that had any, none
for an interval without work, and a stop says what the last interval counted."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from asyncinfer.work_summary import WorkSummary

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flush_logs_a_line_per_model_with_its_counts_since_the_last() -> None:
    clock = Clock()
    summary = WorkSummary(60.0, clock=clock)
    for _ in range(3):
        summary.count("demo", "accepted")
    summary.count("embed", "accepted")
    summary.count("demo", "failed")
    clock.now += 61.0
    with capture_logs() as logs:
        summary.flush()
    assert logs == [
        {"event": "jobs_summary", "log_level": "info", "model": "demo", "over_s": 61.0, "accepted": 3, "failed": 1},
        {"event": "jobs_summary", "log_level": "info", "model": "embed", "over_s": 61.0, "accepted": 1},
    ]
    summary.count("demo", "accepted")
    clock.now += 60.0
    with capture_logs() as logs:
        summary.flush()
    assert [(line["model"], line["accepted"], line["over_s"]) for line in logs] == [("demo", 1, 60.0)]


def test_an_interval_without_work_logs_nothing() -> None:
    summary = WorkSummary(60.0, clock=Clock())
    with capture_logs() as logs:
        summary.flush()
        summary.count("demo", "accepted")
        summary.flush()
        summary.flush()
    assert [line["event"] for line in logs] == ["jobs_summary"]


async def test_a_stop_logs_what_the_last_interval_counted() -> None:
    summary = WorkSummary(3600.0)
    with capture_logs() as logs:
        task = asyncio.create_task(summary.run())
        await asyncio.sleep(0)  # it waits out its interval now
        summary.count("demo", "dispatched")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [(line["model"], line["dispatched"]) for line in logs] == [("demo", 1)]
