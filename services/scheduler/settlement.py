"""Settlement: what an attempt's end makes of its job — result → record → ack.

The order keeps every crash safe: the record is written first (a compare-and-set decided by
asyncinfer.lifecycle), and the work message is acked only once the record is terminal, so a crash
anywhere leaves the message to be redelivered and the next attempt takes the record over. A job
put back is nak'ed (with the retry's delay) even when its record could not be written. A dead
letter is written before the record that says FAILED (a retry after a crash writes the same one,
which the stream drops as a duplicate).
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable

import structlog

from asyncinfer import job_errors, lifecycle
from asyncinfer.backoff import retry
from asyncinfer.blob_meta import attempt_result_ref
from asyncinfer.config import Config
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import CHUNK_LABEL, BatchInfo, JobError, JobRecord, JobState, ProgressReport
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Msg
from services.scheduler.blobs import ClaimCheckIO
from services.scheduler.dead_letters import DeadLetter, DeadLetterStore
from services.scheduler.leases import InFlightJob
from services.scheduler.messages import WorkResult
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.progress_relay import with_progress
from services.scheduler.stale_results import StaleResults, older_attempts_result

log = structlog.get_logger("asyncinfer.scheduler.jobs")
# A requeue's record write is tried again for this long at most (half the AckWait, if less).
REQUEUE_RETRY_S = 10.0

JobLog = structlog.typing.FilteringBoundLogger

# The ends an operator must see, at info with the job's ID. The rest (a job that succeeded or was
# canceled) are at debug: a line per job at info was ~850 bytes a job over three services, and
# jobs_summary counts them instead (asyncinfer/work_summary.py).
ENDS_TO_SEE = frozenset({JobState.FAILED, JobState.TIMED_OUT, JobState.EXPIRED})
# Of a failed job's error message, what its line quotes (a model's error can be long).
ERROR_LOGGED_CHARS = 200


def batch_info(job: InFlightJob, result: WorkResult | None) -> BatchInfo | None:
    if result is None:
        return None
    return BatchInfo(batcher_id=job.session.batcher_id, batch_size=result.batch_size, compute_s=result.compute_s)


class Settlement:
    def __init__(
        self,
        *,
        store: JobStore,
        config: Config,
        metrics: SchedulerMetrics,
        dead_letters: DeadLetterStore,
        claim_check: ClaimCheckIO | None,
        stale_results: StaleResults,
        rng: random.Random,
    ) -> None:
        self._store = store
        self._config = config
        self._metrics = metrics
        self._dead_letters = dead_letters
        self._claim_check = claim_check
        self._stale_results = stale_results
        self._rng = rng
        # A job's failure, requeue, dead letter, timeout and hand-back, at most once per interval per
        # model and reason (the rest at debug): a model that always fails fails every job.
        self._failure_lines = RepeatedLines()
        # Told of every message put back (nak'ed), its delay and whether that is the job's backoff,
        # just before its nak: waiting again, though the consumer counts it delivered until it is
        # pulled again, so the model's queues count it (ModelQueues.put_back); and no publish rings
        # the dispatcher's doorbell for one back at once.
        self.on_put_back: Callable[[Msg, float, bool], None] = _ignore

    # --- an attempt's answer ------------------------------------------------------------------

    async def result(self, job: InFlightJob, result: WorkResult) -> None:
        now = time.time()
        if result.dropped:
            await self._dropped(job, now)
            return
        if result.error is not None and result.error.reason == job_errors.EXECUTION_TIMEOUT:
            # The batcher timed the run out, counted from its batch's start (WorkerHello.times_out_runs).
            await self.timed_out(job, result=result)
            return
        if result.error is not None:
            await self.failed_attempt(job, result.error, final_state=JobState.FAILED, result=result)
            return
        size = sum(t.nbytes for t in result.outputs)
        limit = self._config.scheduler.inline_result_max_bytes
        batch = batch_info(job, result)
        if result.output_ref is not None:
            # Stored by the batcher (batcher.claim_check_io), under the name its order gave.
            if result.output_ref.ref != attempt_result_ref(job.job_id, job.attempt):
                error = job_errors.invalid_result(
                    f"output_ref {result.output_ref.ref!r} is not the order's output_name"
                )
                stale = older_attempts_result(job.job_id, job.attempt, result.output_ref)
                self._stale_results.delete(job.record.tenant, job.job_id, stale, why="refused")
                event = lifecycle.Finish(attempt=job.attempt, state=JobState.FAILED, error=error, batch=batch)
            else:
                event = lifecycle.Finish(
                    attempt=job.attempt, state=JobState.SUCCEEDED, result_ref=result.output_ref, batch=batch
                )
        elif size > limit and self._claim_check is not None:
            # Too big for the record: stored as an object, the record keeps the reference.
            stored = await self._claim_check.store_result(job.record, result.outputs, now)
            event = lifecycle.Finish(attempt=job.attempt, state=JobState.SUCCEEDED, result_ref=stored, batch=batch)
        elif size > limit:
            error = job_errors.result_too_large(size, limit)
            event = lifecycle.Finish(attempt=job.attempt, state=JobState.FAILED, error=error, batch=batch)
        else:
            event = lifecycle.Finish(attempt=job.attempt, state=JobState.SUCCEEDED, outputs=result.outputs, batch=batch)
        latest = await self.end(job.record, job.msg, job.log, event, now, progress=job.progress)
        stored_ref = event.result_ref
        # A cancel that won over the result stored for it: no record will name the object (a
        # CANCELED job is not replayed), which was kept counted against its tenant until the job's
        # result retention passed.
        if (
            stored_ref is not None
            and latest is not None
            and latest.state is JobState.CANCELED
            and latest.result_ref is None
        ):
            self._stale_results.delete(job.record.tenant, job.job_id, stored_ref.ref, why="canceled")

    async def failed_attempt(
        self, job: InFlightJob, error: JobError, *, final_state: JobState, result: WorkResult | None = None
    ) -> None:
        """A non-retriable error ends the job; a retriable one retries it, or dead-letters it when
        its attempts are spent."""
        decision = lifecycle.after_failure(
            job.record,
            error,
            final_state=final_state,
            policy=self._retry_policy(job.model_name),
            jitter=self._rng.random(),
        )
        batch = batch_info(job, result)
        match decision:
            case lifecycle.EndJob(state=state, error=final_error):
                event = lifecycle.Finish(attempt=job.attempt, state=state, error=final_error, batch=batch)
                await self.end(job.record, job.msg, job.log, event, time.time(), progress=job.progress)
            case lifecycle.RetryAfter(delay_s=delay_s):
                self._metrics.retries.labels(model=job.model_name, reason=error.reason).inc()
                await self.requeue(job.record, job.msg, job.log, error, delay_s=delay_s)
            case lifecycle.DeadLetterJob(state=state, last_error=last_error):
                await self.dead_letter(job.record, job.msg, job.log, last_error, state=state, batch=batch)

    def _retry_policy(self, model_name: str) -> lifecycle.RetryPolicy:
        model = self._config.model(model_name)
        if model is None:
            return lifecycle.RetryPolicy()
        return lifecycle.RetryPolicy(backoff_base_s=model.retry_backoff_base_s, backoff_max_s=model.retry_backoff_max_s)

    async def _dropped(self, job: InFlightJob, now: float) -> None:
        """The batcher dropped the item before running it: canceled, expired, or (neither) handed
        back, put back as lifecycle.after_hand_back says (at once and its attempt given back,
        unless it was handed back before in a row by batchers that still serve the version)."""
        latest, written = await self._store.transition(job.record, lifecycle.decider(lifecycle.Drop(job.attempt), now))
        if latest is not None and latest.state.is_terminal:
            await self.settle(job.msg, latest, written, job.log)
            return
        # Put back as this attempt, fenced on its own record: `latest` is another attempt's when
        # this one's lease lapsed and its expiry's write lost the race, and a requeue of that record
        # would put the other attempt back.
        running = latest if latest is not None and latest.attempt == job.attempt else job.record
        still_served = job.session.still_serves(job.model_name, running.model_version)
        decision = lifecycle.after_hand_back(
            running, policy=self._retry_policy(job.model_name), jitter=self._rng.random(), still_served=still_served
        )
        in_a_row = running.handed_back_in_a_row + 1
        match decision:
            case lifecycle.PutBack(delay_s=delay_s, refund=refund, error=error):
                if in_a_row > 1:
                    self._failure_lines.say(
                        job.log,
                        "info",
                        "job_handed_back_again",
                        kind=(job.model_name, refund),
                        in_a_row=in_a_row,
                        delay_s=delay_s,
                        counted=not refund,
                    )
                if not refund:
                    self._metrics.retries.labels(model=job.model_name, reason=error.reason).inc()
                await self.requeue(
                    running,
                    job.msg,
                    job.log,
                    error,
                    delay_s=delay_s,
                    refund=refund,
                    handed_back=True,
                    out_of_reach=not still_served,
                )
            case lifecycle.DeadLetterJob(state=state, last_error=last_error):
                await self.dead_letter(running, job.msg, job.log, last_error, state=state)

    # --- the writes -----------------------------------------------------------------------------

    async def end(
        self,
        record: JobRecord,
        msg: Msg,
        job_log: JobLog,
        event: lifecycle.Finish,
        now: float,
        *,
        progress: ProgressReport | None = None,
    ) -> JobRecord | None:
        """The attempt's terminal write (with its latest progress), then the ack; the record it
        found or wrote (None: gone)."""
        decide = with_progress(lifecycle.decider(event, now), progress)
        latest, written = await self._store.transition(record, decide)
        await self.settle(msg, latest, written, job_log)
        return latest

    async def settle(self, msg: Msg, latest: JobRecord | None, written: bool, job_log: JobLog) -> None:
        """Acks the message once the record is terminal. A record another attempt owns is left
        alone: acking would remove the message that attempt still depends on."""
        if latest is None:
            job_log.error("job_record_missing")
            await msg.term()
            return
        if written:
            self._metrics.job_transition(latest)
            if latest.state in ENDS_TO_SEE:
                error = latest.error or latest.last_error
                self._failure_lines.say(
                    job_log,
                    "info",
                    "job_finished",
                    kind=(latest.model_name, latest.state, error.reason if error else None),
                    state=latest.state.value,
                    reason=error.reason if error else None,
                    error=error.message[:ERROR_LOGGED_CHARS] if error else None,
                )
            else:
                job_log.debug("job_finished", state=latest.state.value)
        if latest.state.is_terminal:
            await msg.ack()
        else:
            self._failure_lines.say(
                job_log,
                "warning",
                "result_discarded",
                kind=(latest.model_name, latest.state),
                state=latest.state.value,
                attempt_in_record=latest.attempt,
            )

    async def dead_letter(
        self,
        record: JobRecord,
        msg: Msg,
        job_log: JobLog,
        last_error: JobError | None,
        *,
        state: JobState,
        batch: BatchInfo | None = None,
    ) -> None:
        """Attempts spent: the dead letter first, then the record, then the ack. A letter whose
        record did not end as it says (a cancel came first: the give-up made it CANCELED; or another
        attempt holds it) is deleted again: a cancel wins over the attempt's failure, and no letter
        may say the job failed (it was listed, counted by the dead-letter alert, and its replay was
        refused NOT_REPLAYABLE)."""
        letter = DeadLetter(
            job_id=record.job_id,
            tenant=record.tenant,
            model_name=record.model_name,
            reason=job_errors.MAX_ATTEMPTS,
            attempts=record.spent_attempts,
            dead_time=time.time(),
            original=msg.data,
            last_error=last_error,
            given_back_attempts=record.given_back_attempts,
            last_attempt=record.attempt,
            allowed_attempts=record.max_attempts - record.given_back_attempts,
        )
        stored = await self._dead_letters.add(letter, retention_s=record.result_retention_s)
        event = lifecycle.give_up_event(
            record, last_error, state=state, batch=batch, dead_letter_sequence=stored.sequence
        )
        latest, written = await self._store.transition(record, lifecycle.decider(event, time.time()))
        if latest is not None and latest.state is not state:
            await self._withdraw_letter(stored, latest, job_log)
        else:
            if CHUNK_LABEL in record.labels:
                self._metrics.chunk_dead_letters.labels(model=record.model_name).inc()
            else:
                self._metrics.dead_letters.labels(model=record.model_name, reason=letter.reason).inc()
            self._failure_lines.say(
                job_log,
                "warning",
                "job_dead_lettered",
                kind=(record.model_name, last_error.reason if last_error else None),
                sequence=stored.sequence,
                attempts=record.spent_attempts,
                given_back_attempts=record.given_back_attempts,
                reason=last_error.reason if last_error else None,
            )
        await self.settle(msg, latest, written, job_log)

    async def _withdraw_letter(self, letter: DeadLetter, latest: JobRecord, job_log: JobLog) -> None:
        try:
            await self._dead_letters.delete(letter.sequence)
        except Exception as exc:  # left listed: its replay is refused, a purge removes it
            job_log.warning("dead_letter_not_withdrawn", sequence=letter.sequence, error=str(exc))
            return
        job_log.info("dead_letter_withdrawn", sequence=letter.sequence, state=latest.state.value)

    async def requeue(
        self,
        running: JobRecord,
        msg: Msg,
        job_log: JobLog,
        error: JobError,
        *,
        delay_s: float,
        refund: bool = False,
        handed_back: bool = False,
        out_of_reach: bool = False,
    ) -> None:
        """RUNNING -> QUEUED with last_error, then the message is nak'ed so it is redelivered
        after delay_s (0: at once), or at the job's deadline if that comes first. The nak happens
        even when the record cannot be written; not when the record names another attempt (this
        one's lease lapsed and another took the job over): a nak names its message by stream
        sequence, so it would send that attempt's delivery back, to run again beside it."""
        delay_s = lifecycle.put_back_delay_s(running, delay_s, time.time())
        event = lifecycle.Requeue(
            attempt=running.attempt, error=error, refund=refund, handed_back=handed_back, out_of_reach=out_of_reach
        )
        latest: JobRecord | None = None

        async def write() -> tuple[JobRecord | None, bool]:
            return await self._store.transition(running, lifecycle.decider(event, time.time()))

        try:
            # Through a leader election (~5 s), within half the message's AckWait: a write given up
            # left the record RUNNING, so the message, back at once, was taken for a lapsed lease
            # and the attempt spent (LEASE_EXPIRED), a refund included (a job on its last attempt
            # was dead-lettered after its batcher gave it back unrun, in a cluster failover run).
            retry_for_s = min(REQUEUE_RETRY_S, self._config.scheduler.ack_wait_s / 2)
            latest, written = await retry(write, on=Unavailable, retry_for_s=retry_for_s, what="a requeue")
            if latest is not None and written:
                self._metrics.job_transition(latest)
                self._failure_lines.say(
                    job_log,
                    "info",
                    "job_requeued",
                    kind=(latest.model_name, error.reason),
                    state=latest.state.value,
                    reason=error.reason,
                    delay_s=delay_s,
                )
        finally:
            if latest is not None and latest.state.is_terminal:
                await quietly(msg.ack())
            elif latest is not None and latest.attempt != running.attempt:
                self._failure_lines.say(
                    job_log,
                    "warning",
                    "put_back_refused",
                    kind=(latest.model_name, error.reason),
                    reason=error.reason,
                    attempt_in_record=latest.attempt,
                )
            else:
                await self.put_back(msg, delay_s, backoff=True)

    async def put_back(self, msg: Msg, delay_s: float, *, backoff: bool = False) -> None:
        """Naks the message, offered again after delay_s (0: at once; `backoff`: the delay is the
        job's backoff, not a wait for something to run it). Told first (on_put_back), so that a
        pull that brings it back at once finds it counted, and forgets it."""
        self.on_put_back(msg, delay_s, backoff)
        await quietly(msg.nak(delay=delay_s) if delay_s > 0 else msg.nak())

    async def timed_out(self, job: InFlightJob, result: WorkResult | None = None) -> None:
        """Past its execution timeout: as its batcher answered (`result`), or by this scheduler's
        timer (from dispatch; a backstop `job.backstop_s` later when its batcher times runs out)."""
        model = self._config.model(job.model_name)
        action = model.timeout_action if model is not None else "fail"
        backstop_s = 0.0 if result is not None else job.backstop_s
        # A pipeline's batcher names the step that was running (a model's says only how long it ran).
        where = (
            result.error.message if result is not None and result.error is not None and model and model.steps else ""
        )
        error = job_errors.execution_timeout(
            job.attempt, job.timeout_s or 0.0, retriable=action == "retry", backstop_s=backstop_s, where=where
        )
        self._failure_lines.say(
            job.log,
            "warning",
            "job_timed_out",
            kind=(job.model_name, action),
            timeout_s=job.timeout_s,
            action=action,
            by="batcher" if result is not None else "scheduler",
        )
        try:
            await self.failed_attempt(job, error, final_state=JobState.TIMED_OUT, result=result)
        except Unavailable as exc:
            # NATS away (a leader election): expected, and AckWait brings the message back. A line,
            # not a traceback per job drawn on the event loop (see JobDispatch.dispatch).
            self._failure_lines.say(
                job.log, "warning", "timeout_not_stored", kind=(job.model_name, exc.reason), error=exc.message
            )
        except Exception:
            job.log.exception("timeout_not_stored")


def _ignore(_msg: Msg, _delay_s: float, _backoff: bool) -> None:
    pass


async def quietly(action: Awaitable[None]) -> None:
    """Awaits an ack-type publish, logging instead of raising (the message comes back anyway)."""
    try:
        await action
    except Exception as exc:
        log.warning("ack_failed", error=str(exc))
