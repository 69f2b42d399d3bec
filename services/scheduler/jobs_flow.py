"""A job's way through the scheduler: from a pulled work message to a stored result.

Every record change is a compare-and-set on the record's KV revision; when another writer wins
(a cancel, another scheduler), the record is re-read and the decision made again on what is there
now. The work message stays unacked while the job runs (its lease renewed by `renew_leases`) and
is acked only once the record is terminal, so a crash at any point leaves the message to be
redelivered.

Attempts. The record's `attempt` goes up by one at every dispatch (compare-and-set), so it is the
fencing token: a result that does not carry the attempt in flight is discarded, and a late result
of an older attempt can never be stored. It is counted in the record rather than taken from the
message's delivery count, so messages given back unchosen (tenant round robin) spend nothing.
An attempt that ended through no fault of the job (the batcher dropped it before it ran, the
scheduler stopped gracefully) gives its attempt back by raising `max_attempts` by one.

Failures. Invalid input and other non-retriable errors fail the job at once. A retriable error (the
model raised, the batcher was lost, the run timed out under timeout_action "retry", the lease
expired because a scheduler died) goes back to QUEUED with last_error set and an exponential
backoff with jitter; once `max_attempts` attempts are spent the job is dead-lettered: a dead letter
is written first (idempotent), then the record FAILED (TIMED_OUT for timeouts), then the message
acked. A job whose deadline passed before it started is EXPIRED at dispatch and never runs.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from asyncinfer.config import Config, ModelConfig
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import (
    BatchInfo,
    BlobRef,
    JobError,
    JobRecord,
    JobState,
    WorkEnvelope,
    decode_envelope,
)
from asyncinfer.nats import KeyValue, Msg
from asyncinfer.queues import CancelNotice, take_from_tenant_count
from services.scheduler.batchers import BatcherSession
from services.scheduler.blobs import ClaimCheckIO, input_unusable
from services.scheduler.dead_letters import DeadLetter, DeadLetterStore
from services.scheduler.messages import CancelOrder, WorkOrder, WorkResult
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.queued_records import QueuedRecords

log = structlog.get_logger("asyncinfer.scheduler.jobs")

# After a NATS failure mid-dispatch, the message comes back after this pause.
DISPATCH_RETRY_DELAY_S = 1.0
# Pauses while waiting for a record that the gateway is writing right after its publish. An idle
# scheduler is woken by that very publish and pulls the message while the gateway is still waiting
# for the publish's ack before it sends the record: the record is usually there a millisecond or
# two later, so the first pauses are short (a coarser first pause was most of the queued time of a
# job at light load); the total stays about what it was (~60 ms) before a nak.
RECORD_WAITS_S = (0.001, 0.002, 0.004, 0.008, 0.015, 0.03)
# Cancel notices for jobs not (yet) in flight here are remembered this long: the notice can
# overtake the dispatch that made the job RUNNING.
PENDING_CANCEL_TTL_S = 30.0
# Completions are counted over this sliding window for completed_per_s.
RATE_WINDOW_S = 60.0
# How long "this tenant has no queued counter" is believed before the key is looked up again.
TENANT_KEY_MISSING_TTL_S = 5.0


def retry_delay_s(model: ModelConfig | None, attempt: int, rng: random.Random) -> float:
    """Exponential backoff with equal jitter: half the step fixed, half random."""
    base = model.retry_backoff_base_s if model is not None else 1.0
    cap = model.retry_backoff_max_s if model is not None else 300.0
    step = min(base * 2.0 ** max(attempt - 1, 0), cap)
    return step / 2 + rng.uniform(0.0, step / 2)


def _error(code: grpc.StatusCode, reason: str, message: str, *, retriable: bool) -> JobError:
    return JobError(code=code.value[0], reason=reason, message=message, retriable=retriable)


def lease_expired(attempt: int) -> JobError:
    return _error(
        grpc.StatusCode.UNAVAILABLE,
        "LEASE_EXPIRED",
        f"attempt {attempt} was not renewed in time (its scheduler stopped or lost NATS)",
        retriable=True,
    )


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
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class JobFlow:
    def __init__(
        self,
        *,
        store: JobStore,
        config: Config,
        metrics: SchedulerMetrics,
        dead_letters: DeadLetterStore,
        queues_kv: KeyValue | None = None,
        rng: random.Random | None = None,
        claim_check: ClaimCheckIO | None = None,
        queued_records: QueuedRecords | None = None,
    ) -> None:
        self._store = store
        self._queued_records = QueuedRecords() if queued_records is None else queued_records
        self._claim_check = claim_check
        self._config = config
        self._metrics = metrics
        self._dead_letters = dead_letters
        self._queues_kv = queues_kv
        self._rng = rng or random.Random()
        self.in_flight: dict[str, InFlightJob] = {}
        self._pending_cancels: dict[str, float] = {}
        self._completions: dict[str, deque[float]] = {}
        self._started = time.monotonic()
        self._tenant_key_missing: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        # Told the subject of every message put back for immediate redelivery (no publish rings
        # the dispatcher's doorbell for those).
        self.on_put_back: Callable[[str], None] = _ignore

    # --- dispatch ---------------------------------------------------------------------------

    async def dispatch(self, msg: Msg, session: BatcherSession) -> bool:
        """Runs a pulled message on the session. True when a work order was sent (the reserved
        credit is used); False when the message needed no run (it was acked, termed or put back)."""
        try:
            envelope = decode_envelope(msg.data)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("work_message_undecodable", error=str(exc), subject=msg.subject)
            await _quietly(msg.term())
            return False
        job_log = log.bind(job_id=envelope.job_id, model=envelope.model_name, tenant=envelope.tenant)
        try:
            return await self._dispatch(msg, envelope, session, job_log)
        except Exception:
            # NATS trouble mid-way: the message comes back after a pause, and the record (if
            # RUNNING) is taken over by the next attempt.
            job_log.exception("dispatch_failed")
            await _quietly(msg.nak(delay=DISPATCH_RETRY_DELAY_S))
            return False

    async def _record_of(
        self, msg: Msg, envelope: WorkEnvelope, job_log: structlog.typing.FilteringBoundLogger
    ) -> JobRecord | None:
        """The job's record. The gateway publishes the work message before it writes the record,
        so a very young message may arrive first: wait a moment for it. A message whose record never
        came (its submit failed or the gateway died in between; nobody was told it was accepted) is
        dropped once it is older than orphan_message_grace_s. A queued notice may have brought
        the record already."""
        record = self._queued_records.take(envelope.key)
        if record is not None:
            return record
        record = await self._store.get(envelope.key)
        for pause_s in RECORD_WAITS_S:
            if record is not None:
                return record
            await asyncio.sleep(pause_s)
            record = await self._store.get(envelope.key)
        if record is not None:
            return record
        age_s = time.time() - envelope.create_time
        if age_s < self._config.scheduler.orphan_message_grace_s:
            job_log.info("job_record_not_written_yet", age_s=round(age_s, 3))
            await _quietly(msg.nak(delay=DISPATCH_RETRY_DELAY_S))
        else:
            job_log.warning("orphan_work_message_dropped", age_s=round(age_s, 1))
            await _quietly(msg.term())
        return None

    async def _dispatch(
        self,
        msg: Msg,
        envelope: WorkEnvelope,
        session: BatcherSession,
        job_log: structlog.typing.FilteringBoundLogger,
    ) -> bool:
        record = await self._record_of(msg, envelope, job_log)
        if record is None:
            return False
        now = time.time()
        exhausted = False

        def start(current: JobRecord) -> JobRecord | None:
            nonlocal exhausted
            exhausted = False
            if current.state == JobState.CANCELLING:
                # Cancel was asked while an earlier attempt ran; nothing runs it now.
                return current.evolve(state=JobState.CANCELED, end_time=now, update_time=now)
            if current.state not in (JobState.QUEUED, JobState.RUNNING):
                return None
            if current.deadline is not None and now >= current.deadline:
                error = _error(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "DEADLINE_EXCEEDED",
                    "the job's deadline passed before it started",
                    retriable=False,
                )
                return current.evolve(state=JobState.EXPIRED, error=error, end_time=now, update_time=now)
            if current.attempt >= current.max_attempts:
                exhausted = True
                return None
            # A RUNNING record here means the attempt's lease lapsed: its scheduler is gone.
            last_error = lease_expired(current.attempt) if current.state == JobState.RUNNING else current.last_error
            return current.evolve(
                state=JobState.RUNNING,
                attempt=current.attempt + 1,
                last_error=last_error,
                start_time=now,
                queue_duration_s=max(now - current.create_time, 0.0),
                update_time=now,
                batcher_id=session.batcher_id,
            )

        latest, written = await self._store.transition(record, start)
        if latest is None:
            job_log.error("job_record_missing")
            await msg.term()
            return False
        if record.attempt == 0:
            self._left_queue(record.tenant)
        if exhausted:
            if latest.state == JobState.RUNNING:
                self._metrics.lease_expiries.labels(model=latest.model_name).inc()
            last_error = lease_expired(latest.attempt) if latest.state == JobState.RUNNING else latest.last_error
            await self._dead_letter(latest, msg, job_log, last_error, state=JobState.FAILED)
            return False
        if latest.state != JobState.RUNNING or not written:
            if written:
                self._metrics.job_transition(latest.model_name, latest.state)
            job_log.info("job_not_runnable", state=latest.state.value)
            await msg.ack()
            return False
        job_log = job_log.bind(attempt=latest.attempt)
        if record.state == JobState.RUNNING:
            self._metrics.lease_expiries.labels(model=latest.model_name).inc()
            job_log.warning("lease_expired", previous_attempt=record.attempt)
        if envelope.input_ref is not None and self._claim_check is not None:
            resolved = await self._claim_check.resolve(envelope)
            if isinstance(resolved, JobError):
                job_log.warning("job_input_unusable", reason=resolved.reason, retriable=resolved.retriable)
                if resolved.retriable:
                    await self._requeue(latest, msg, job_log, resolved, delay_s=DISPATCH_RETRY_DELAY_S, refund=True)
                else:
                    failed = await self._store.transition(latest, input_unusable(latest.attempt, resolved, time.time()))
                    await self._settle(msg, *failed, job_log)
                return False
            envelope = resolved
        if session.closed:
            # The batcher left while the record was being written: put the job straight back.
            await self._requeue(latest, msg, job_log, self._worker_lost(session, latest.attempt), delay_s=0.0)
            return False
        self._metrics.job_transition(latest.model_name, JobState.RUNNING)
        superseded = self.in_flight.pop(envelope.job_id, None)
        if superseded is not None:
            # Its lease lapsed and the message came back; the older attempt is fenced out.
            self._detach(superseded)
            job_log.warning("attempt_superseded", old_attempt=superseded.attempt)
        order = self._order(envelope, latest)
        session.send(order)
        session.in_flight.add(envelope.job_id)
        job = InFlightJob(
            job_id=envelope.job_id,
            attempt=latest.attempt,
            model_name=envelope.model_name,
            session=session,
            msg=msg,
            record=latest,
            log=job_log,
            timeout_s=order.execution_timeout_s,
        )
        self.in_flight[envelope.job_id] = job
        self._idle.clear()
        if job.timeout_s is not None:
            job.timer = asyncio.get_running_loop().call_later(job.timeout_s, self._on_timeout, job)
        if self._pending_cancels.pop(envelope.job_id, None) is not None:
            session.send(CancelOrder(job_id=job.job_id, attempt=job.attempt))
        job_log.info("job_dispatched", batcher_id=session.batcher_id, priority=envelope.priority.value)
        return True

    def _order(self, envelope: WorkEnvelope, record: JobRecord) -> WorkOrder:
        timeout_s = record.execution_timeout_s or envelope.execution_timeout_s
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
        if not result.dropped:
            self._completed(job.model_name)
        try:
            await self._finish(job, result)
        except Exception:
            # The record stays RUNNING and the message unacked: it comes back after AckWait and
            # the next attempt takes the record over.
            job.log.exception("result_not_stored")

    async def _finish(self, job: InFlightJob, result: WorkResult) -> None:
        now = time.time()
        if result.dropped:
            await self._dropped(job, now)
            return
        if result.error is None:
            size = sum(t.nbytes for t in result.outputs)
            limit = self._config.scheduler.inline_result_max_bytes
            if size > limit and self._claim_check is not None:
                # Too big for the record: stored as an object, the record keeps the reference.
                stored = await self._claim_check.store_result(job.record, result.outputs, now)
                await self._end(job, JobState.SUCCEEDED, now, result, result_ref=stored)
            elif size > limit:
                error = _error(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "RESULT_TOO_LARGE",
                    f"the result is {size} bytes; results over {limit} bytes cannot be stored yet",
                    retriable=False,
                )
                await self._end(job, JobState.FAILED, now, result, error=error)
            else:
                await self._end(job, JobState.SUCCEEDED, now, result)
            return
        await self._failed_attempt(job, result.error, final_state=JobState.FAILED, result=result)

    async def _failed_attempt(
        self,
        job: InFlightJob,
        error: JobError,
        *,
        final_state: JobState,
        result: WorkResult | None = None,
    ) -> None:
        """A non-retriable error ends the job; a retriable one retries it, or dead-letters it when
        its attempts are spent."""
        if not error.retriable:
            await self._end(job, final_state, time.time(), result, error=error)
            return
        if job.attempt < job.record.max_attempts:
            delay = retry_delay_s(self._config.model(job.model_name), job.attempt, self._rng)
            self._metrics.retries.labels(model=job.model_name, reason=error.reason).inc()
            await self._requeue(job.record, job.msg, job.log, error, delay_s=delay)
            return
        batch = _batch_info(job, result)
        await self._dead_letter(job.record, job.msg, job.log, error, state=final_state, batch=batch)

    async def _end(
        self,
        job: InFlightJob,
        state: JobState,
        now: float,
        result: WorkResult | None,
        *,
        error: JobError | None = None,
        result_ref: BlobRef | None = None,
    ) -> None:
        batch = _batch_info(job, result)
        run_s = max(now - (job.record.start_time or now), 0.0)

        def end(current: JobRecord) -> JobRecord | None:
            if current.attempt != job.attempt:
                return None
            if current.state == JobState.CANCELLING:
                # The cancel won: whatever was computed is discarded.
                return current.evolve(state=JobState.CANCELED, end_time=now, update_time=now, batch=batch)
            if current.state != JobState.RUNNING:
                return None
            return current.evolve(
                state=state,
                outputs=result.outputs if state == JobState.SUCCEEDED and result is not None and not result_ref else (),
                result_ref=result_ref,
                error=error,
                end_time=now,
                run_duration_s=run_s,
                batch=batch,
                update_time=now,
            )

        latest, written = await self._store.transition(job.record, end)
        await self._settle(job.msg, latest, written, job.log)

    async def _dropped(self, job: InFlightJob, now: float) -> None:
        """The batcher dropped the item before running it: canceled, expired, or (neither) put
        back without spending the attempt."""

        def decide(current: JobRecord) -> JobRecord | None:
            if current.attempt != job.attempt:
                return None
            if current.state == JobState.CANCELLING:
                return current.evolve(state=JobState.CANCELED, end_time=now, update_time=now)
            if current.state == JobState.RUNNING and current.deadline is not None and now >= current.deadline:
                error = _error(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "DEADLINE_EXCEEDED",
                    "the job's deadline passed before it ran",
                    retriable=False,
                )
                return current.evolve(state=JobState.EXPIRED, error=error, end_time=now, update_time=now)
            return None

        latest, written = await self._store.transition(job.record, decide)
        if latest is not None and latest.state.is_terminal:
            await self._settle(job.msg, latest, written, job.log)
            return
        error = _error(grpc.StatusCode.ABORTED, "DROPPED", "the batcher dropped it before it ran", retriable=True)
        await self._requeue(latest or job.record, job.msg, job.log, error, delay_s=0.0, refund=True)

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

    # --- dead letters -----------------------------------------------------------------------

    async def _dead_letter(
        self,
        record: JobRecord,
        msg: Msg,
        job_log: structlog.typing.FilteringBoundLogger,
        last_error: JobError | None,
        *,
        state: JobState,
        batch: BatchInfo | None = None,
    ) -> None:
        """Attempts spent: the dead letter first (a retry after a crash writes the same one, which
        the stream drops as a duplicate), then the record, then the ack."""
        now = time.time()
        attempts = record.attempt
        letter = DeadLetter(
            job_id=record.job_id,
            tenant=record.tenant,
            model_name=record.model_name,
            reason="MAX_ATTEMPTS",
            attempts=attempts,
            dead_time=now,
            original=msg.data,
            last_error=last_error,
        )
        stored = await self._dead_letters.add(letter)
        self._metrics.dead_letters.labels(model=record.model_name, reason=letter.reason).inc()
        job_log.warning(
            "job_dead_lettered",
            sequence=stored.sequence,
            attempts=attempts,
            reason=last_error.reason if last_error else None,
        )
        base = last_error or _error(grpc.StatusCode.ABORTED, "MAX_ATTEMPTS", "attempts spent", retriable=False)
        error = JobError(
            code=base.code,
            reason=base.reason,
            message=f"{base.message} (gave up after {attempts} attempts)",
            violations=base.violations,
            retriable=False,
        )

        def fail(current: JobRecord) -> JobRecord | None:
            if current.attempt != attempts:
                return None
            if current.state == JobState.CANCELLING:
                return current.evolve(state=JobState.CANCELED, end_time=now, update_time=now)
            if current.state not in (JobState.RUNNING, JobState.QUEUED):
                return None
            return current.evolve(state=state, error=error, end_time=now, update_time=now, batch=batch or current.batch)

        latest, written = await self._store.transition(record, fail)
        await self._settle(msg, latest, written, job_log)

    # --- putting jobs back ------------------------------------------------------------------

    async def _requeue(
        self,
        running: JobRecord,
        msg: Msg,
        job_log: structlog.typing.FilteringBoundLogger,
        error: JobError,
        *,
        delay_s: float,
        refund: bool = False,
    ) -> None:
        """RUNNING -> QUEUED with last_error, then the message is nak'ed so it is redelivered
        after delay_s (0: at once). The nak happens even when the record cannot be written.
        `refund`: the attempt was not the job's fault and does not count against max_attempts."""
        now = time.time()

        def back(current: JobRecord) -> JobRecord | None:
            if current.attempt != running.attempt:
                return None
            if current.state == JobState.CANCELLING:
                return current.evolve(state=JobState.CANCELED, end_time=now, update_time=now)
            if current.state != JobState.RUNNING:
                return None
            max_attempts = current.max_attempts + 1 if refund else current.max_attempts
            return current.evolve(state=JobState.QUEUED, last_error=error, max_attempts=max_attempts, update_time=now)

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
                if delay_s <= 0:
                    self.on_put_back(msg.subject)

    def batcher_lost(self, session: BatcherSession) -> None:
        """Puts every job in flight on the session back in the queue at once (an owned task)."""
        jobs = [job for job in self.in_flight.values() if job.session is session]
        for job in jobs:
            self._detach(job)
        if jobs:
            log.warning("batcher_lost_with_jobs", batcher_id=session.batcher_id, jobs=len(jobs))
            self._spawn(self._return_jobs(jobs, session))

    async def _return_jobs(self, jobs: list[InFlightJob], session: BatcherSession) -> None:
        for job in jobs:
            self._metrics.retries.labels(model=job.model_name, reason="WORKER_LOST").inc()
        await asyncio.gather(
            *(
                self._requeue(job.record, job.msg, job.log, self._worker_lost(session, job.attempt), delay_s=0.0)
                for job in jobs
            ),
            return_exceptions=True,
        )

    async def return_all(self, reason: str) -> None:
        """Puts everything still in flight back in the queue for another scheduler (on stop);
        the attempts are given back."""
        jobs = list(self.in_flight.values())
        for job in jobs:
            self._detach(job)
            if not job.session.closed:
                job.session.send(CancelOrder(job_id=job.job_id, attempt=job.attempt))
        error = _error(grpc.StatusCode.UNAVAILABLE, reason, "the scheduler stopped while it ran", retriable=True)
        await asyncio.gather(
            *(self._requeue(job.record, job.msg, job.log, error, delay_s=0.0, refund=True) for job in jobs),
            return_exceptions=True,
        )

    @staticmethod
    def _worker_lost(session: BatcherSession, attempt: int) -> JobError:
        return _error(
            grpc.StatusCode.UNAVAILABLE,
            "WORKER_LOST",
            f"batcher {session.batcher_id} disconnected during attempt {attempt}",
            retriable=True,
        )

    # --- execution timeouts and cancellation -----------------------------------------------

    def _on_timeout(self, job: InFlightJob) -> None:
        if self.in_flight.get(job.job_id) is not job:
            return
        self._detach(job)
        if not job.session.closed:
            job.session.send(CancelOrder(job_id=job.job_id, attempt=job.attempt))
        self._spawn(self._timed_out(job))

    async def _timed_out(self, job: InFlightJob) -> None:
        model = self._config.model(job.model_name)
        action = model.timeout_action if model is not None else "fail"
        error = _error(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "EXECUTION_TIMEOUT",
            f"attempt {job.attempt} ran longer than its execution timeout of {job.timeout_s:g} s",
            retriable=action == "retry",
        )
        job.log.warning("job_timed_out", timeout_s=job.timeout_s, action=action)
        try:
            await self._failed_attempt(job, error, final_state=JobState.TIMED_OUT)
        except Exception:
            job.log.exception("timeout_not_stored")

    def cancel(self, notice: CancelNotice) -> None:
        """A job was moved to CANCELLING: if it runs here, its batcher is told to drop it."""
        job = self.in_flight.get(notice.job_id)
        if job is None:
            # Maybe being dispatched right now: remembered for a while.
            cutoff = time.monotonic() - PENDING_CANCEL_TTL_S
            for job_id in [j for j, at in self._pending_cancels.items() if at < cutoff]:
                del self._pending_cancels[job_id]
            self._pending_cancels[notice.job_id] = time.monotonic()
            return
        job.log.info("job_cancel_sent", batcher_id=job.session.batcher_id)
        if not job.session.closed:
            job.session.send(CancelOrder(job_id=job.job_id, attempt=job.attempt))

    # --- leases, rates and bookkeeping ------------------------------------------------------

    async def renew_leases(self) -> None:
        """One round of in-progress acks for every job in flight (fire-and-forget publishes)."""
        for job in list(self.in_flight.values()):
            try:
                await job.msg.in_progress()
            except Exception as exc:
                job.log.warning("lease_renewal_failed", error=str(exc))

    def in_flight_count(self, model_name: str) -> int:
        return sum(1 for job in self.in_flight.values() if job.model_name == model_name)

    def completed_per_s(self, model_name: str) -> float:
        """Results received per second over the last RATE_WINDOW_S (or since start, if shorter)."""
        now = time.monotonic()
        times = self._completions.get(model_name)
        if not times:
            return 0.0
        while times and times[0] < now - RATE_WINDOW_S:
            times.popleft()
        span = min(RATE_WINDOW_S, max(now - self._started, 1.0))
        return len(times) / span

    def _completed(self, model_name: str) -> None:
        self._completions.setdefault(model_name, deque()).append(time.monotonic())
        self._metrics.completed.labels(model=model_name).inc()

    def _left_queue(self, tenant: str) -> None:
        """The tenant's queued counter goes down (only where the gateway keeps one)."""
        if self._queues_kv is None:
            return
        missing_since = self._tenant_key_missing.get(tenant)
        if missing_since is not None and time.monotonic() - missing_since < TENANT_KEY_MISSING_TTL_S:
            return
        self._spawn(self._take_from_tenant(self._queues_kv, tenant))

    async def _take_from_tenant(self, kv: KeyValue, tenant: str) -> None:
        try:
            if await take_from_tenant_count(kv, tenant) is None:
                self._tenant_key_missing[tenant] = time.monotonic()
            else:
                self._tenant_key_missing.pop(tenant, None)
        except Exception as exc:
            log.warning("tenant_count_not_updated", tenant=tenant, error=str(exc))

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until nothing is in flight; False if the time ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Awaits the background work still running."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _detach(self, job: InFlightJob) -> None:
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        if self.in_flight.get(job.job_id) is job:
            del self.in_flight[job.job_id]
        job.session.in_flight.discard(job.job_id)
        if not self.in_flight:
            self._idle.set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _batch_info(job: InFlightJob, result: WorkResult | None) -> BatchInfo | None:
    if result is None:
        return None
    return BatchInfo(batcher_id=job.session.batcher_id, batch_size=result.batch_size, compute_s=result.compute_s)


def _ignore(_subject: str) -> None:
    pass


async def _quietly(action: Awaitable[None]) -> None:
    """Awaits an ack-type publish, logging instead of raising (the message comes back anyway)."""
    try:
        await action
    except Exception as exc:
        log.warning("ack_failed", error=str(exc))
