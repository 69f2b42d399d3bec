"""Progress of running jobs: from the batcher's work stream to the gateways, and onto the record.

A batcher sends an attempt's latest progress at most once per its progress interval
(services.batcher.progress). Here, progress of an attempt that is not the one in flight on that
batcher's session is dropped (fencing: JobFlow checks the lease before it calls `relay`), and so is
one older than what was relayed already. The rest is:

- published at once as a progress notice on core NATS (`progress_subject(tenant, job_id)`,
  asyncinfer.progress_notice), which the gateways watching the job hear — nothing is stored per
  report;
- kept on the attempt in flight (`InFlightJob.progress`), and written to the record
  (a) at most every `scheduler.progress_record_interval_s`, by a compare-and-set in an owned task
  that nothing waits for (dispatch and results never block on it; one at a time per job; a lost
  race with a terminal write is decided again on what won, and refused), and (b) with the
  attempt's terminal write (`with_progress`, in Settlement), so a finished job's record holds its
  last progress. GetJob shows the record's. Partial outputs over `inline_result_max_bytes` are
  left out of what the record keeps (the notices carry them), so a record stays well under NATS's
  message size with its own inline result.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import structlog

from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState, ProgressReport
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Client as NatsClient
from asyncinfer.progress_notice import announce_progress
from services.scheduler.leases import InFlightJob, Leases
from services.scheduler.owned_tasks import OwnedTasks

log = structlog.get_logger("asyncinfer.scheduler.progress")

Decide = Callable[[JobRecord], JobRecord | None]


def with_progress(decide: Decide, report: ProgressReport | None) -> Decide:
    """`decide`, with `report` kept on the record it writes when that record is of the report's
    attempt (the terminal write of the attempt that reported it)."""
    if report is None:
        return decide

    def decide_with_progress(current: JobRecord) -> JobRecord | None:
        new = decide(current)
        if new is not None and new.attempt == report.attempt and report.is_newer_than(new.progress):
            return new.evolve(progress=report)
        return new

    return decide_with_progress


def keep_progress(report: ProgressReport) -> Decide:
    """The periodic write: the report onto the record while its attempt still runs."""

    def decide(current: JobRecord) -> JobRecord | None:
        if current.state is not JobState.RUNNING or current.attempt != report.attempt:
            return None
        if not report.is_newer_than(current.progress):
            return None
        return current.evolve(progress=report)

    return decide


class ProgressRelay:
    def __init__(
        self,
        *,
        nc: NatsClient | None,
        store: JobStore,
        leases: Leases,
        tasks: OwnedTasks,
        record_interval_s: float,
        record_outputs_max_bytes: int,
    ) -> None:
        self._record_outputs_max_bytes = record_outputs_max_bytes
        self._nc = nc
        self._store = store
        self._leases = leases
        self._tasks = tasks
        # Once per interval per model and kind of failure (the rest at debug): NATS away fails the
        # progress write of every job that reports.
        self._failure_lines = RepeatedLines()
        self._record_interval_s = record_interval_s

    async def relay(self, job: InFlightJob, report: ProgressReport) -> None:
        """Publishes the report of the attempt in flight and keeps it (see the module's doc)."""
        if not report.is_newer_than(job.progress):
            return
        kept = report
        if report.outputs and sum(t.nbytes for t in report.outputs) > self._record_outputs_max_bytes:
            kept = dataclasses.replace(report, outputs=())
        job.progress = kept  # what the record will keep
        if self._nc is not None:
            await announce_progress(self._nc, job.record.tenant, job.job_id, report)
        if (
            self._record_interval_s > 0
            and not job.progress_writing
            and time.monotonic() - job.progress_written_at >= self._record_interval_s
        ):
            job.progress_writing = True
            self._tasks.spawn(self._write(job, kept))

    async def _write(self, job: InFlightJob, report: ProgressReport) -> None:
        try:
            latest, written = await self._store.transition(job.record, keep_progress(report))
            # The attempt's later writes start from this revision (no lost compare-and-set).
            if written and latest is not None and self._leases.jobs.get(job.job_id) is job:
                job.record = latest
        except Exception as exc:  # the next report, or the terminal write, writes it
            self._failure_lines.say(
                job.log, "warning", "progress_not_written", kind=(job.model_name, type(exc).__name__), error=str(exc)
            )
        finally:
            job.progress_writing = False
            job.progress_written_at = time.monotonic()
