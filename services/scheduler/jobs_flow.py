"""A job's way through the scheduler: from a pulled work message to a stored result.

Every record change is a compare-and-set on the record's KV revision; when another writer wins
(a cancel, another scheduler), the record is re-read and the decision made again on what is there
now. The work message stays unacked while the job runs (its lease renewed by `renew_leases`) and
is acked only once the record is terminal, so a crash at any point leaves the message to be
redelivered. The attempt number is the fencing token: a result that does not carry the attempt in
flight is discarded.

Failure handling is the walking skeleton's: invalid input fails at once; a retriable error goes
back to the queue with an exponential backoff until the record's max_attempts, then the job
FAILS (dead letters and configurable retry policies arrive with the retries issue).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from nats.aio.msg import Msg

from asyncinfer.config import Config
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import (
    BatchInfo,
    JobError,
    JobRecord,
    JobState,
    WorkEnvelope,
    decode_envelope,
)
from services.scheduler.batchers import BatcherSession
from services.scheduler.messages import WorkOrder, WorkResult
from services.scheduler.metrics import SchedulerMetrics

log = structlog.get_logger("asyncinfer.scheduler.jobs")

# Backoff before a retriable failure runs again: RETRY_BASE_DELAY_S * 2^(attempt-1), capped.
RETRY_BASE_DELAY_S = 1.0
RETRY_MAX_DELAY_S = 60.0


def retry_delay_s(attempt: int) -> float:
    return min(RETRY_BASE_DELAY_S * 2.0 ** max(attempt - 1, 0), RETRY_MAX_DELAY_S)


def _error(code: grpc.StatusCode, reason: str, message: str, *, retriable: bool) -> JobError:
    return JobError(code=code.value[0], reason=reason, message=message, retriable=retriable)


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


class JobFlow:
    def __init__(self, *, store: JobStore, config: Config, metrics: SchedulerMetrics) -> None:
        self._store = store
        self._config = config
        self._metrics = metrics
        self.in_flight: dict[str, InFlightJob] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    # --- dispatch ---------------------------------------------------------------------------

    async def dispatch(self, msg: Msg, session: BatcherSession) -> bool:
        """Runs a pulled message on the session. True when a work order was sent (the reserved
        credit is used); False when the message needed no run (it was acked, termed or put back)."""
        try:
            envelope = decode_envelope(msg.data)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("work_message_undecodable", error=str(exc), subject=msg.subject)
            await msg.term()
            return False
        job_log = log.bind(job_id=envelope.job_id, model=envelope.model_name, tenant=envelope.tenant)
        try:
            return await self._dispatch(msg, envelope, session, job_log)
        except Exception:
            # NATS trouble mid-way: the message comes back after a pause, and the record (if
            # RUNNING) is taken over by the next attempt.
            job_log.exception("dispatch_failed")
            await _quietly(msg.nak(delay=RETRY_BASE_DELAY_S))
            return False

    async def _dispatch(
        self,
        msg: Msg,
        envelope: WorkEnvelope,
        session: BatcherSession,
        job_log: structlog.typing.FilteringBoundLogger,
    ) -> bool:
        record = await self._store.get(envelope.key)
        if record is None:
            job_log.error("job_record_missing")
            await msg.term()
            return False
        delivered = msg.metadata.num_delivered
        now = time.time()

        def start(current: JobRecord) -> JobRecord | None:
            if current.state == JobState.CANCELLING:
                # Cancel was asked while an earlier attempt ran; nothing runs it now.
                return current.evolve(state=JobState.CANCELED, end_time=now, update_time=now)
            if current.state not in (JobState.QUEUED, JobState.RUNNING):
                return None
            # num_delivered normally; never reuse a fencing token if the consumer was recreated.
            attempt = max(delivered, current.attempt + 1)
            return current.evolve(
                state=JobState.RUNNING,
                attempt=attempt,
                start_time=now,
                queue_duration_s=max(now - current.create_time, 0.0),
                update_time=now,
            )

        latest, written = await self._store.transition(record, start)
        if latest is None:
            job_log.error("job_record_missing")
            await msg.term()
            return False
        if latest.state != JobState.RUNNING or not written:
            if written:
                self._metrics.job_transition(latest.model_name, latest.state)
            job_log.info("job_not_runnable", state=latest.state.value)
            await msg.ack()
            return False
        job_log = job_log.bind(attempt=latest.attempt)
        if session.closed:
            # The batcher left while the record was being written: put the job straight back.
            await self._requeue(latest, msg, job_log, self._worker_lost(session, latest.attempt), delay_s=0.0)
            return False
        self._metrics.job_transition(latest.model_name, JobState.RUNNING)
        superseded = self.in_flight.pop(envelope.job_id, None)
        if superseded is not None:
            # Its lease lapsed and the message came back; the older attempt is fenced out.
            superseded.session.in_flight.discard(envelope.job_id)
            job_log.warning("attempt_superseded", old_attempt=superseded.attempt)
        session.send(self._order(envelope, latest))
        session.in_flight.add(envelope.job_id)
        self.in_flight[envelope.job_id] = InFlightJob(
            job_id=envelope.job_id,
            attempt=latest.attempt,
            model_name=envelope.model_name,
            session=session,
            msg=msg,
            record=latest,
            log=job_log,
        )
        self._idle.clear()
        job_log.info("job_dispatched", batcher_id=session.batcher_id, priority=envelope.priority.value)
        return True

    def _order(self, envelope: WorkEnvelope, record: JobRecord) -> WorkOrder:
        timeout_s = envelope.execution_timeout_s
        if timeout_s is None:
            model = self._config.model(envelope.model_name)
            timeout_s = model.default_execution_timeout_s if model is not None else None
        return WorkOrder(
            job_id=envelope.job_id,
            attempt=record.attempt,
            model_name=envelope.model_name,
            model_version=envelope.model_version,
            priority=envelope.priority,
            tenant=envelope.tenant,
            inputs=envelope.inputs,
            input_ref=envelope.input_ref,
            deadline=envelope.deadline,
            execution_timeout_s=timeout_s,
        )

    # --- results ----------------------------------------------------------------------------

    async def handle_result(self, session: BatcherSession, result: WorkResult) -> None:
        job = self.in_flight.get(result.job_id)
        if job is None or job.attempt != result.attempt or job.session is not session:
            log.warning(
                "stale_result_discarded",
                job_id=result.job_id,
                attempt=result.attempt,
                attempt_in_flight=job.attempt if job is not None else None,
                batcher_id=session.batcher_id,
            )
            return
        self._detach(job)
        try:
            await self._finish(job, result)
        except Exception:
            # The record stays RUNNING and the message unacked: it comes back after AckWait and
            # the next attempt takes the record over.
            job.log.exception("result_not_stored")

    async def _finish(self, job: InFlightJob, result: WorkResult) -> None:
        now = time.time()
        running = job.record
        run_s = max(now - (running.start_time or now), 0.0)
        if result.dropped:
            await self._dropped(job, now)
            return
        if result.error is None:
            size = sum(t.nbytes for t in result.outputs)
            limit = self._config.scheduler.inline_result_max_bytes
            if size > limit:
                error = _error(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "RESULT_TOO_LARGE",
                    f"the result is {size} bytes; results over {limit} bytes cannot be stored yet",
                    retriable=False,
                )
                await self._end(job, JobState.FAILED, now, run_s, result, error=error)
            else:
                await self._end(job, JobState.SUCCEEDED, now, run_s, result)
            return
        error = result.error
        if error.retriable and job.attempt < running.max_attempts:
            delay = retry_delay_s(job.attempt)
            job.log.info("job_retrying", reason=error.reason, delay_s=delay)
            await self._requeue(running, job.msg, job.log, error, delay_s=delay)
            return
        await self._end(job, JobState.FAILED, now, run_s, result, error=error)

    async def _end(
        self,
        job: InFlightJob,
        state: JobState,
        now: float,
        run_s: float,
        result: WorkResult,
        *,
        error: JobError | None = None,
    ) -> None:
        batch = BatchInfo(batcher_id=job.session.batcher_id, batch_size=result.batch_size, compute_s=result.compute_s)

        def end(current: JobRecord) -> JobRecord | None:
            if current.attempt != job.attempt:
                return None
            if current.state == JobState.CANCELLING:
                return current.evolve(state=JobState.CANCELED, end_time=now, update_time=now, batch=batch)
            if current.state != JobState.RUNNING:
                return None
            return current.evolve(
                state=state,
                outputs=result.outputs if state == JobState.SUCCEEDED else (),
                error=error,
                end_time=now,
                run_duration_s=run_s,
                batch=batch,
                update_time=now,
            )

        latest, written = await self._store.transition(job.record, end)
        await self._settle(job.msg, latest, written, job.log)

    async def _dropped(self, job: InFlightJob, now: float) -> None:
        """The batcher dropped the item before running it (deadline passed, or canceled)."""
        deadline = job.record.deadline
        if deadline is not None and now >= deadline:
            error = _error(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "DEADLINE_EXCEEDED",
                "the deadline passed before it ran",
                retriable=False,
            )

            def expire(current: JobRecord) -> JobRecord | None:
                if current.attempt != job.attempt or current.state not in (JobState.RUNNING, JobState.CANCELLING):
                    return None
                return current.evolve(state=JobState.EXPIRED, error=error, end_time=now, update_time=now)

            latest, written = await self._store.transition(job.record, expire)
            await self._settle(job.msg, latest, written, job.log)
            return
        error = _error(grpc.StatusCode.ABORTED, "DROPPED", "the batcher dropped it before it ran", retriable=True)
        await self._requeue(job.record, job.msg, job.log, error, delay_s=0.0)

    async def _settle(
        self, msg: Msg, latest: JobRecord | None, written: bool, job_log: structlog.typing.FilteringBoundLogger
    ) -> None:
        """Acks the message once the record is terminal. A record another attempt owns is left
        alone: acking would remove the message that attempt still depends on."""
        if latest is None:
            job_log.error("job_record_missing")
            await msg.term()
            return
        if written:
            self._metrics.job_transition(latest.model_name, latest.state)
            job_log.info("job_finished", state=latest.state.value)
        if latest.state.is_terminal:
            await msg.ack()
        else:
            job_log.warning("result_discarded", state=latest.state.value, attempt_in_record=latest.attempt)

    # --- putting jobs back ------------------------------------------------------------------

    async def _requeue(
        self,
        running: JobRecord,
        msg: Msg,
        job_log: structlog.typing.FilteringBoundLogger,
        error: JobError,
        *,
        delay_s: float,
    ) -> None:
        """RUNNING -> QUEUED with last_error, then the message is nak'ed so it is redelivered
        after delay_s (0: at once). The nak happens even when the record cannot be written."""
        now = time.time()

        def back(current: JobRecord) -> JobRecord | None:
            if current.attempt != running.attempt:
                return None
            if current.state == JobState.CANCELLING:
                return current.evolve(state=JobState.CANCELED, end_time=now, update_time=now)
            if current.state != JobState.RUNNING:
                return None
            return current.evolve(state=JobState.QUEUED, last_error=error, update_time=now)

        latest: JobRecord | None = None
        try:
            latest, written = await self._store.transition(running, back)
            if latest is not None and written:
                self._metrics.job_transition(latest.model_name, latest.state)
                job_log.info("job_requeued", state=latest.state.value, reason=error.reason, delay_s=delay_s)
        finally:
            if latest is not None and latest.state.is_terminal:
                await _quietly(msg.ack())
            else:
                await _quietly(msg.nak(delay=delay_s) if delay_s > 0 else msg.nak())

    def batcher_lost(self, session: BatcherSession) -> None:
        """Puts every job in flight on the session back in the queue at once (an owned task)."""
        jobs = [job for job in self.in_flight.values() if job.session is session]
        for job in jobs:
            self._detach(job)
        if jobs:
            log.warning("batcher_lost_with_jobs", batcher_id=session.batcher_id, jobs=len(jobs))
            self._spawn(self._return_jobs(jobs, session))

    async def _return_jobs(self, jobs: list[InFlightJob], session: BatcherSession) -> None:
        await asyncio.gather(
            *(
                self._requeue(job.record, job.msg, job.log, self._worker_lost(session, job.attempt), delay_s=0.0)
                for job in jobs
            ),
            return_exceptions=True,
        )

    async def return_all(self, reason: str) -> None:
        """Puts everything still in flight back in the queue for another scheduler (on stop)."""
        jobs = list(self.in_flight.values())
        for job in jobs:
            self._detach(job)
        error = _error(grpc.StatusCode.UNAVAILABLE, reason, "the scheduler stopped while it ran", retriable=True)
        await asyncio.gather(
            *(self._requeue(job.record, job.msg, job.log, error, delay_s=0.0) for job in jobs), return_exceptions=True
        )

    @staticmethod
    def _worker_lost(session: BatcherSession, attempt: int) -> JobError:
        return _error(
            grpc.StatusCode.UNAVAILABLE,
            "WORKER_LOST",
            f"batcher {session.batcher_id} disconnected during attempt {attempt}",
            retriable=True,
        )

    # --- leases and bookkeeping -------------------------------------------------------------

    async def renew_leases(self) -> None:
        """One round of in-progress acks for every job in flight (fire-and-forget publishes)."""
        for job in list(self.in_flight.values()):
            try:
                await job.msg.in_progress()
            except Exception as exc:
                job.log.warning("lease_renewal_failed", error=str(exc))

    def in_flight_count(self, model_name: str) -> int:
        return sum(1 for job in self.in_flight.values() if job.model_name == model_name)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until nothing is in flight; False if the time ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Awaits the background returns still running."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _detach(self, job: InFlightJob) -> None:
        if self.in_flight.get(job.job_id) is job:
            del self.in_flight[job.job_id]
        job.session.in_flight.discard(job.job_id)
        if not self.in_flight:
            self._idle.set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- records ----------------------------------------------------------------------------


async def _quietly(action: Awaitable[None]) -> None:
    """Awaits an ack-type publish, logging instead of raising (the message comes back anyway)."""
    try:
        await action
    except Exception as exc:
        log.warning("ack_failed", error=str(exc))
