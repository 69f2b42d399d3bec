"""Lease keeping: the attempts in flight on this scheduler.

A dispatched attempt's work message stays unacked while it runs; `renew` keeps it alive with
in-progress acks, so a scheduler that dies leaves its messages to be redelivered after AckWait (and
the next attempt takes the record over: see asyncinfer.lifecycle). Each attempt may carry an
execution-timeout timer (a backstop, to a batcher that times its runs out itself). A result is accepted only from the session and attempt in flight
(`fenced`), so a late answer of an older attempt, or one over a replaced stream, is discarded.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from asyncinfer.jobs import JobRecord, ProgressReport
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Msg
from services.scheduler.batchers import BatcherSession

# Cancel notices for jobs not (yet) in flight here are remembered this long: the notice can
# overtake the dispatch that made the job RUNNING.
PENDING_CANCEL_TTL_S = 30.0


@dataclass(slots=True)
class InFlightJob:
    """A dispatched attempt: where it runs, its unacked message, and the RUNNING record written."""

    job_id: str
    attempt: int
    model_name: str
    session: BatcherSession
    msg: Msg
    record: JobRecord
    log: structlog.typing.FilteringBoundLogger
    timeout_s: float | None = None
    # How much later than timeout_s (from dispatch) the timer fires: 0, or the backstop for a
    # batcher that times its runs out itself, counted from their batch's start (WorkerHello).
    backstop_s: float = 0.0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    # The latest progress its batcher sent, and when it was last written to the record
    # (services.scheduler.progress_relay).
    progress: ProgressReport | None = field(default=None, repr=False)
    progress_written_at: float = field(default_factory=time.monotonic, repr=False)
    progress_writing: bool = field(default=False, repr=False)


@dataclass(frozen=True, slots=True)
class AbandonedAttempt:
    """An attempt whose order was cancelled here: whatever its batcher still answers is dropped."""

    at: float
    # The job's tenant when the attempt was this scheduler's alone (it timed out here, after its
    # RUNNING write): a result it stored names nothing a record will, and may be deleted. Empty
    # for an order whose RUNNING write was lost: another scheduler may own that attempt number,
    # its result stored under the same name (services.scheduler.stale_results).
    tenant: str = ""


class Leases:
    def __init__(self) -> None:
        self.jobs: dict[str, InFlightJob] = {}
        # Oldest first (a cancel heard again moves to the end): expired ones go from the front.
        self._pending_cancels: collections.OrderedDict[str, float] = collections.OrderedDict()
        # Attempts whose order went out before their RUNNING write was answered (job_dispatch.py):
        # a result that comes first waits for the write; one of an abandoned attempt is expected.
        self._arriving: dict[tuple[str, int], asyncio.Event] = {}
        self._abandoned: collections.OrderedDict[tuple[str, int], AbandonedAttempt] = collections.OrderedDict()
        self._idle = asyncio.Event()
        self._idle.set()
        # A renewal round is every job in flight: NATS away failed each, a line a job a round.
        self._renewal_lines = RepeatedLines()

    def hold(self, job: InFlightJob, on_timeout: Callable[[InFlightJob], None]) -> InFlightJob | None:
        """Holds the attempt's lease (and starts its timeout); returns the attempt it supersedes,
        if an older one of the same job was still held (its lease lapsed and the message came
        back: it is fenced out)."""
        superseded = self.jobs.pop(job.job_id, None)
        if superseded is not None:
            self.release(superseded)
        job.session.in_flight.add(job.job_id)
        self.jobs[job.job_id] = job
        self._idle.clear()
        if job.timeout_s is not None:
            job.timer = asyncio.get_running_loop().call_later(
                job.timeout_s + job.backstop_s, self._timed_out, job, on_timeout
            )
        return superseded

    def _timed_out(self, job: InFlightJob, on_timeout: Callable[[InFlightJob], None]) -> None:
        if self.jobs.get(job.job_id) is job:
            self.release(job)
            on_timeout(job)

    def fenced(self, session: BatcherSession, job_id: str, attempt: int) -> InFlightJob | None:
        """The attempt in flight that an answer (job_id, attempt) from `session` belongs to, or None."""
        job = self.jobs.get(job_id)
        if job is None or job.attempt != attempt or job.session is not session:
            return None
        return job

    def release(self, job: InFlightJob) -> None:
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        if self.jobs.get(job.job_id) is job:
            del self.jobs[job.job_id]
        job.session.in_flight.discard(job.job_id)
        if not self.jobs:
            self._idle.set()

    def release_all(self, session: BatcherSession | None = None) -> list[InFlightJob]:
        """Releases every attempt in flight (on `session`, when given) and returns them."""
        jobs = [job for job in self.jobs.values() if session is None or job.session is session]
        for job in jobs:
            self.release(job)
        return jobs

    def expect(self, job_id: str, attempt: int) -> None:
        """An order went out for this attempt before its RUNNING write was answered."""
        self._arriving[(job_id, attempt)] = asyncio.Event()

    def expected(self, job_id: str, attempt: int, *, held: bool) -> None:
        """The attempt's write was answered: held (in `jobs`), or abandoned (its order cancelled,
        whatever its batcher still answers is dropped quietly)."""
        arriving = self._arriving.pop((job_id, attempt), None)
        if arriving is not None:
            arriving.set()
        if not held:
            self.abandon(job_id, attempt)

    def abandon(self, job_id: str, attempt: int, *, tenant: str = "") -> None:
        """Whatever the attempt's batcher still answers is dropped quietly: its order was
        cancelled here (its RUNNING write lost, or it ran past its execution timeout: then with
        its `tenant`, its stored result being deletable; see AbandonedAttempt)."""
        now = time.monotonic()
        _forget_before(self._abandoned, now - PENDING_CANCEL_TTL_S, at=lambda abandoned: abandoned.at)
        self._abandoned[(job_id, attempt)] = AbandonedAttempt(at=now, tenant=tenant)

    async def settled_before(self, job_id: str, attempt: int) -> None:
        """Returns once the attempt's RUNNING write was answered (at once unless it is pending)."""
        arriving = self._arriving.get((job_id, attempt))
        if arriving is not None:
            await arriving.wait()

    def abandoned(self, job_id: str, attempt: int) -> AbandonedAttempt | None:
        return self._abandoned.get((job_id, attempt))

    def remember_cancel(self, job_id: str) -> None:
        """A cancel for a job not in flight here: maybe being dispatched right now, or queued."""
        now = time.monotonic()
        _forget_before(self._pending_cancels, now - PENDING_CANCEL_TTL_S, at=float)
        self._pending_cancels[job_id] = now
        self._pending_cancels.move_to_end(job_id)

    def take_pending_cancel(self, job_id: str) -> bool:
        return self._pending_cancels.pop(job_id, None) is not None

    def cancel_heard(self, job_id: str) -> bool:
        """Whether a cancel of the job was heard lately (and not yet taken)."""
        at = self._pending_cancels.get(job_id)
        return at is not None and at >= time.monotonic() - PENDING_CANCEL_TTL_S

    async def renew(self) -> None:
        """One round of in-progress acks for every job in flight (fire-and-forget publishes)."""
        for job in list(self.jobs.values()):
            try:
                await job.msg.in_progress()
            except Exception as exc:
                self._renewal_lines.say(
                    job.log,
                    "warning",
                    "lease_renewal_failed",
                    kind=(job.model_name, type(exc).__name__),
                    error=str(exc),
                )

    def count(self, model_name: str) -> int:
        return sum(1 for job in self.jobs.values() if job.model_name == model_name)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until nothing is in flight; False if the time ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


Remembered = TypeVar("Remembered")


def _forget_before(
    remembered: collections.OrderedDict[Any, Remembered], cutoff: float, *, at: Callable[[Remembered], float]
) -> None:
    """Drops the entries remembered before `cutoff` (oldest first: the front)."""
    while remembered:
        key, value = next(iter(remembered.items()))
        if at(value) >= cutoff:
            return
        del remembered[key]
