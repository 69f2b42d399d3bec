"""Progress, the pure parts: the batcher's per-item rate limit (services.batcher.progress), which
reports a watcher is sent (services.gateway.progress_watch.ProgressFilter), and how the scheduler
keeps the latest on the record (services.scheduler.progress_relay)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import numpy as np
import pytest

from asyncinfer.contract import progress_subject
from asyncinfer.jobs import JobRecord, JobState, Priority, ProgressReport, job_key
from asyncinfer.nats import Msg
from asyncinfer.progress_notice import encode_progress_notice
from services.batcher.progress import ItemProgress, ProgressReporter, ProgressUpdate
from services.gateway.progress_watch import ProgressFeed, ProgressFilter, record_progress
from services.gateway.watch_hub import Aside, WatcherQueue
from services.gateway.watcher_queue import LatestQueue
from services.scheduler.progress_relay import keep_progress, with_progress

pytestmark = pytest.mark.unit


def record(state: JobState, attempt: int, progress: ProgressReport | None = None) -> JobRecord:
    return JobRecord(
        job_id="j",
        tenant="t",
        model_name="m",
        model_version="1",
        state=state,
        priority=Priority.NORMAL,
        create_time=0.0,
        update_time=0.0,
        max_attempts=3,
        result_retention_s=60.0,
        attempt=attempt,
        progress=progress,
    )


def report(attempt: int, step: int, fraction: float = 0.5) -> ProgressReport:
    return ProgressReport(attempt=attempt, step=step, fraction=fraction)


async def test_a_thousand_reports_from_a_thread_send_a_few_the_latest_last() -> None:
    sent: list[tuple[float, ProgressUpdate]] = []
    interval_s = 0.05
    channel = ItemProgress(
        lambda update: sent.append((time.monotonic(), update)), interval_s=interval_s, max_bytes=1024
    )

    def model() -> None:
        for step in range(1, 1001):
            channel.offer(step / 1000, f"step {step}", ())
            time.sleep(0.0003)

    started = time.monotonic()
    thread = threading.Thread(target=model)
    thread.start()
    await asyncio.to_thread(thread.join)  # the loop runs meanwhile: it sends what is due
    elapsed = time.monotonic() - started
    channel.close()  # the item ended: what waits goes now
    assert 2 <= len(sent) <= elapsed / interval_s + 2
    assert [u.step for _at, u in sent] == list(range(1, len(sent) + 1))
    fractions = [u.fraction for _at, u in sent]
    assert fractions == sorted(fractions)
    assert fractions[-1] == 1.0
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(sent[:-1])]  # the last one went at close
    assert all(gap >= interval_s * 0.9 for gap in gaps)
    channel.offer(0.1, "after the end", ())
    await asyncio.sleep(interval_s * 2)
    assert sent[-1][1].message == "step 1000"


async def test_rows_of_one_item_report_together_and_big_outputs_are_left_out() -> None:
    sent: list[ProgressUpdate] = []
    channel = ItemProgress(sent.append, interval_s=0.0, max_bytes=64)
    other: list[ProgressUpdate] = []
    reporter = ProgressReporter(
        [(channel, 2), (None, 1), (ItemProgress(other.append, interval_s=0.0, max_bytes=64), 1)]
    )
    assert reporter.rows == 4
    reporter.report(0, fraction=1.0, outputs={"w": np.ones(2, dtype=np.float32)})
    reporter.report(2, fraction=0.5)  # nobody listens to row 2's item
    reporter.report(3, fraction=0.25, outputs={"w": np.ones(100, dtype=np.float32)})  # 400 bytes > 64
    await asyncio.sleep(0.01)
    assert [u.fraction for u in sent] == [0.5]  # mean of rows 0 and 1
    assert sent[0].outputs[0].shape == (2,)
    assert [(u.fraction, u.outputs) for u in other] == [(0.25, ())]


def test_a_watcher_gets_the_running_attempts_reports_in_order() -> None:
    watch = ProgressFilter()
    assert watch.on_record(record(JobState.QUEUED, 0)) is None
    early = report(1, 1)
    assert watch.on_progress(early) is None  # before its RUNNING record: held
    assert watch.on_record(record(JobState.RUNNING, 1)) is early  # goes with it
    assert watch.on_progress(report(1, 3)) == report(1, 3)
    assert watch.on_progress(report(1, 2)) is None  # late: older than what was sent
    assert watch.on_record(record(JobState.RUNNING, 1, report(1, 2))) is None  # a periodic write, behind
    assert watch.on_record(record(JobState.QUEUED, 1)) is None  # retried
    assert watch.on_progress(report(1, 9)) is None  # the old attempt's, after its end
    assert watch.on_record(record(JobState.RUNNING, 2)) is None  # the held one was attempt 1's
    assert watch.on_progress(report(1, 10)) is None  # superseded
    assert watch.on_progress(report(2, 1)) == report(2, 1)
    final = report(2, 4, 1.0)
    assert watch.on_record(record(JobState.SUCCEEDED, 2, final)) is final  # the terminal one carries the last


def test_the_record_keeps_the_latest_of_its_own_attempt() -> None:
    running = record(JobState.RUNNING, 2)
    kept = keep_progress(report(2, 5))(running)
    assert kept is not None
    assert kept.progress == report(2, 5)
    assert keep_progress(report(2, 4))(kept) is None  # older
    assert keep_progress(report(1, 9))(running) is None  # another attempt
    assert keep_progress(report(2, 6))(record(JobState.SUCCEEDED, 2)) is None  # it ended

    def finish(current: JobRecord) -> JobRecord | None:
        return current.evolve(state=JobState.SUCCEEDED)

    assert with_progress(finish, report(2, 7))(running).progress == report(2, 7)  # type: ignore[union-attr]
    assert with_progress(finish, report(1, 7))(running).progress is None  # type: ignore[union-attr]
    assert record_progress(record(JobState.QUEUED, 3, report(2, 7))) is None  # shown for its attempt only


async def test_a_late_notice_of_an_older_attempt_does_not_displace_a_waiting_newer_one() -> None:
    """Notices come by different paths (the scheduler's relay, or forged on the subject), so an old
    attempt's can arrive after the new one's while the watcher has not read it: the new one stays
    (CI on 1856037 lost attempt 2's "fresh" this way, and the watcher waited for it in vain)."""
    feed = ProgressFeed(nc=None)  # type: ignore[arg-type]  # _on_notice alone: no subscription
    queue: WatcherQueue = LatestQueue()
    feed.register(job_key("t", "j"), queue)

    def notice(progress: ProgressReport) -> Msg:
        return Msg(None, subject=progress_subject("t", "j"), data=encode_progress_notice("j", progress))  # type: ignore[arg-type]

    await feed._on_notice(notice(report(2, 1)))
    await feed._on_notice(notice(report(1, 99)))  # older attempt, later
    waiting = queue.get_nowait()
    assert isinstance(waiting, Aside)
    assert waiting.item == report(2, 1)
    assert queue.empty()
    await feed._on_notice(notice(report(2, 2)))  # a later step takes the place
    await feed._on_notice(notice(report(3, 1)))
    assert [u.item for u in (queue.get_nowait(),) if isinstance(u, Aside)] == [report(3, 1)]
    assert queue.empty()


async def test_a_cancel_reaches_the_rows_of_its_item_and_a_pipeline_steps_channel() -> None:
    def channel(parent: ItemProgress | None = None) -> ItemProgress:
        return ItemProgress(lambda update: None, interval_s=0.0, max_bytes=0, parent=parent)

    first, second = channel(), channel()
    step = channel(parent=second)  # a pipeline's step model reports through its own channel
    reporter = ProgressReporter([(first, 2), (None, 1), (second, 1)])
    second.cancel()
    assert [reporter.cancelled(row) for row in range(4)] == [False, False, False, True]
    assert step.cancelled
    first.cancel()
    assert [reporter.cancelled(row) for row in range(4)] == [True, True, False, True]  # no one listens to row 2
