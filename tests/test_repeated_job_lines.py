"""The per-job lines said in plain functions (a cancel notice not sent, a submit's wait ended early,
a stale result not deleted): each is said once per interval per kind above debug
(asyncinfer.log_throttle.RepeatedLines, owned by the service that calls the function), the rest at
debug, whole. These need NATS or an object store failing on cue; the two a real service says cheaply
are tested there: `bulk_item_failed` (tests/test_gateway_bulk.py) and `progress_outputs_invalid`
(tests/test_progress.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

import pytest
import structlog

from asyncinfer.errors import Unavailable
from asyncinfer.jobs import JobRecord, JobState, Priority
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import NatsError
from services.gateway import submit_wait, transitions
from services.scheduler.owned_tasks import OwnedTasks
from services.scheduler.stale_results import StaleResults

pytestmark = pytest.mark.unit

REPEATS = 20


def a_record(n: int, state: JobState = JobState.RUNNING) -> JobRecord:
    now = time.time()
    return JobRecord(
        job_id=f"job-{n}",
        tenant="t",
        model_name="m",
        model_version="1",
        state=state,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        max_attempts=3,
        result_retention_s=3600.0,
        attempt=1,
    )


def said(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event]


def assert_throttled(logs: list[dict[str, Any]], event: str, level: str) -> None:
    lines = said(logs, event)
    assert len(lines) == REPEATS  # each job's line is still there, at debug past the first
    above_debug = [e for e in lines if e["log_level"] != "debug"]
    assert [e["log_level"] for e in above_debug] == [level], above_debug
    assert above_debug[0]["job_id"] == "job-0"  # the first at once, naming its job
    assert "more_since_last" not in above_debug[0]


class RefusingNats:
    async def publish(self, subject: str, payload: bytes) -> None:
        raise NatsError("nats: connection closed")


class CancellingStore:
    async def transition(self, record: JobRecord, decide: Any) -> tuple[JobRecord, bool]:
        return record.evolve(state=JobState.CANCELLING), True


async def test_cancel_notices_not_sent_are_one_line_an_interval() -> None:
    lines = RepeatedLines()
    with structlog.testing.capture_logs() as logs:
        for n in range(REPEATS):
            latest = await transitions.cancel(
                CancellingStore(),  # type: ignore[arg-type]
                RefusingNats(),  # type: ignore[arg-type]
                a_record(n),
                reason="",
                now=time.time(),
                lines=lines,
            )
            assert latest.state is JobState.CANCELLING
    assert_throttled(logs, "cancel_notice_not_sent", "warning")
    assert said(logs, "cancel_notice_not_sent")[0]["model"] == "m"


async def test_submit_waits_ended_early_are_one_line_an_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    async def gateway_stopping(*args: Any, **kwargs: Any) -> AsyncGenerator[JobRecord, None]:
        raise Unavailable("the gateway is stopping")
        yield  # an async generator

    monkeypatch.setattr(submit_wait, "watch_job", gateway_stopping)
    lines = RepeatedLines()
    with structlog.testing.capture_logs() as logs:
        for n in range(REPEATS):
            record = a_record(n, JobState.QUEUED)
            assert await submit_wait.wait_for_end(None, record, 5.0, lines) is record  # type: ignore[arg-type]
    assert_throttled(logs, "submit_wait_ended", "warning")


class UnreachableStore:
    async def delete_result(self, tenant: str, ref: str) -> bool:
        raise Unavailable("object store: connection refused")


async def test_stale_results_not_deleted_are_one_line_an_interval() -> None:
    tasks = OwnedTasks("test")
    stale = StaleResults(UnreachableStore(), tasks)  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        for n in range(REPEATS):
            stale.delete("t", f"job-{n}", f"out/job-{n}.1", why="abandoned")
        await tasks.close()
    assert_throttled(logs, "stale_result_not_deleted", "info")
