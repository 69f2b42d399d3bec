"""A job's way through the scheduler, from a pulled work message to a stored result: the one
object the dispatcher, the WorkerService and the app talk to. It only wires the parts together:

- job_dispatch.py: a pulled message -> the RUNNING record -> a work order on a batcher;
- leases.py: the attempts in flight, their in-progress acks, execution timeouts, fencing;
- settlement.py: an attempt's end -> the record -> the ack (retries, dead letters, put-backs);
- progress_relay.py: a running attempt's progress -> the gateways (and now and then the record);
- completions.py: completion rates and the tenants' queued counters.

Which state a job moves to is never decided here or there: asyncinfer.lifecycle decides, on the
record each compare-and-set finds.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import structlog

from asyncinfer import job_errors
from asyncinfer.backoff import retrying
from asyncinfer.config import Config
from asyncinfer.errors import AsyncInferError, Unavailable
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState, job_key
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg
from asyncinfer.queues import CancelNotice
from asyncinfer.tracing import AttributeValue, Tracing
from services.scheduler.batchers import BatcherRegistry, BatcherSession
from services.scheduler.blobs import ClaimCheckIO
from services.scheduler.completions import CompletionRates
from services.scheduler.dead_letters import DeadLetterStore
from services.scheduler.job_dispatch import JobDispatch
from services.scheduler.leases import InFlightJob, Leases
from services.scheduler.messages import CancelOrder, WorkProgress, WorkResult
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.owned_tasks import OwnedTasks
from services.scheduler.progress_relay import ProgressRelay
from services.scheduler.queue_stats import BatchSizeCount
from services.scheduler.queued_records import QueuedRecords
from services.scheduler.settlement import Settlement
from services.scheduler.stale_results import StaleResults, own_attempts_result
from services.scheduler.superseded import superseded

log = structlog.get_logger("asyncinfer.scheduler.jobs")

# How long a computed result is kept trying to be stored while NATS cannot take it, and the waits
# between tries (doubling, asyncinfer.backoff's rule).
RESULT_STORE_RETRY_S = 120.0
RESULT_RETRY_FIRST_S = 0.5
RESULT_RETRY_MAX_S = 5.0
# Of the attempts a renewal round lets go (another scheduler took them over), the IDs its line names.
SUPERSEDED_IDS_LOGGED = 5


class JobFlow:
    def __init__(
        self,
        *,
        store: JobStore,
        config: Config,
        metrics: SchedulerMetrics,
        dead_letters: DeadLetterStore,
        rng: random.Random | None = None,
        claim_check: ClaimCheckIO | None = None,
        queued_records: QueuedRecords | None = None,
        nc: NatsClient | None = None,
        instance_id: str = "",
        batchers: BatcherRegistry | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._store = store
        self._tracing = tracing or Tracing.off()
        self._metrics = metrics
        self._queued_records = QueuedRecords() if queued_records is None else queued_records
        self._tasks = OwnedTasks("scheduler-jobs")
        self._closing = False
        # A line said of each of many jobs (a NATS outage while results come in, a file batch's
        # thousand jobs cancelled, a batcher answering late): once per interval per model and kind,
        # the rest at debug.
        self._repeated_lines = RepeatedLines()
        # A cancelled job's message deleted while queued (the dispatchers forget it was put back).
        # (model, job ID) of a cancelled job whose work message was deleted.
        self.on_message_dropped: Callable[[str, str], None] = lambda _model, _job_id: None
        self._leases = Leases()
        self._stale_results = StaleResults(claim_check, self._tasks)
        self._rates = CompletionRates(metrics)
        self._progress = ProgressRelay(
            nc=nc,
            store=store,
            leases=self._leases,
            tasks=self._tasks,
            record_interval_s=config.scheduler.progress_record_interval_s,
            record_outputs_max_bytes=config.scheduler.inline_result_max_bytes,
        )
        self._settlement = Settlement(
            store=store,
            config=config,
            metrics=metrics,
            dead_letters=dead_letters,
            claim_check=claim_check,
            stale_results=self._stale_results,
            rng=rng or random.Random(),
        )
        self._dispatch = JobDispatch(
            store=store,
            config=config,
            metrics=metrics,
            leases=self._leases,
            settlement=self._settlement,
            queued_records=self._queued_records,
            claim_check=claim_check,
            on_timeout=self._on_timeout,
            instance_id=instance_id,
            batchers=batchers,
            tracing=self._tracing,
        )

    @property
    def in_flight(self) -> dict[str, InFlightJob]:
        return self._leases.jobs

    @property
    def on_put_back(self) -> Callable[[Msg, float, bool], None]:
        return self._settlement.on_put_back

    @on_put_back.setter
    def on_put_back(self, callback: Callable[[Msg, float, bool], None]) -> None:
        """Told of every message put back (nak'ed), its delay and whether that is the job's
        backoff, just before its nak."""
        self._settlement.on_put_back = callback

    async def dispatch(self, msg: Msg, session: BatcherSession) -> bool:
        """Runs a pulled message on the session: True when a work order was sent."""
        return await self._dispatch.dispatch(msg, session)

    async def handle_result(self, session: BatcherSession, result: WorkResult) -> None:
        job = self._leases.fenced(session, result.job_id, result.attempt)
        if job is None:
            # Its order may have gone out before its RUNNING write was answered (job_dispatch.py).
            await self._leases.settled_before(result.job_id, result.attempt)
            job = self._leases.fenced(session, result.job_id, result.attempt)
        if job is None:
            self._discard(session, result)
            return
        self._leases.release(job)
        if not result.dropped:
            self._rates.completed(job.model_name, result.batch_size)
        await self._store_result(job, result)

    def _discard(self, session: BatcherSession, result: WorkResult) -> None:
        """An answer of an attempt not in flight here: dropped, and the result it stored deleted
        where no record can name it (services.scheduler.stale_results)."""
        own_result = own_attempts_result(result.job_id, result.attempt, result.output_ref)
        abandoned = self._leases.abandoned(result.job_id, result.attempt)
        if abandoned is not None:
            log.debug("abandoned_attempt_answered", job_id=result.job_id, attempt=result.attempt)
            if abandoned.tenant:
                self._stale_results.delete(abandoned.tenant, result.job_id, own_result, why="abandoned")
            return
        held = self._leases.jobs.get(result.job_id)
        self._repeated_lines.say(
            log,
            "warning",
            "stale_result_discarded",
            kind=session.batcher_id,
            job_id=result.job_id,
            attempt=result.attempt,
            attempt_in_flight=held.attempt if held is not None else None,
            batcher_id=session.batcher_id,
        )
        if held is not None and held.attempt > result.attempt:
            self._stale_results.delete(held.record.tenant, result.job_id, own_result, why="superseded")

    async def _store_result(self, job: InFlightJob, result: WorkResult) -> None:
        """Settles the attempt, trying again while NATS cannot take the write (away, or its store
        full) for up to RESULT_STORE_RETRY_S, the message kept meanwhile by in-progress acks: a
        result computed is not thrown away for a moment's outage (it was: the job ran again after
        AckWait, and one on its last attempt ended FAILED LEASE_EXPIRED though it had succeeded).
        Past that, or while this scheduler stops, the message comes back after AckWait and the next
        attempt takes the record over."""
        tries = 0
        try:
            async for attempt in retrying(
                Unavailable,
                retry_for_s=RESULT_STORE_RETRY_S,
                first_delay_s=RESULT_RETRY_FIRST_S,
                max_delay_s=RESULT_RETRY_MAX_S,
            ):
                with attempt:
                    tries += 1
                    if tries > 1:
                        if self._closing:
                            self._repeated_lines.say(
                                job.log,
                                "warning",
                                "result_not_stored",
                                kind=(job.model_name, "stopping"),
                                reason="the scheduler is stopping",
                                tries=tries - 1,
                            )
                            return
                        await self._keep_message(job)
                    try:
                        await self._settle(job, result)
                    except Unavailable as exc:
                        # NATS away (an outage, a failover) or its store full: expected, said in a line.
                        if tries == 1:
                            self._repeated_lines.say(
                                job.log,
                                "warning",
                                "result_not_stored_yet",
                                kind=(job.model_name, exc.reason),
                                error=exc.message,
                                retrying_for_s=RESULT_STORE_RETRY_S,
                            )
                        raise
        except Unavailable as exc:
            self._repeated_lines.say(
                job.log,
                "warning",
                "result_not_stored",
                kind=(job.model_name, exc.reason),
                error=exc.message,
                tries=tries,
            )
            return
        except Exception:
            job.log.exception("result_not_stored")  # AckWait's recovery; a traceback, being unexpected
            return
        if tries > 1:
            self._repeated_lines.say(job.log, "info", "result_stored", kind=job.model_name, tries=tries)

    async def _settle(self, job: InFlightJob, result: WorkResult) -> None:
        if self._tracing.enabled and job.record.traceparent:
            await self._traced_result(job, result)
        else:
            await self._settlement.result(job, result)

    @staticmethod
    async def _keep_message(job: InFlightJob) -> None:
        """An in-progress ack (before each try after the first): the message is not redelivered
        while its result waits to be stored."""
        try:
            await job.msg.in_progress()
        except Exception as exc:  # NATS away: AckWait runs on; a later try may still land first
            job.log.debug("in_progress_ack_failed", error=str(exc))

    async def _traced_result(self, job: InFlightJob, result: WorkResult) -> None:
        """The result's commit (the terminal write or the retry, then the ack) in a span, a child
        of the job's submit span."""
        attributes: dict[str, AttributeValue] = {"asyncinfer.job_id": job.job_id, "asyncinfer.attempt": job.attempt}
        if result.error is not None:
            attributes["asyncinfer.error_reason"] = result.error.reason
        with self._tracing.span("result_commit", parent=job.record.traceparent, attributes=attributes) as span:
            if result.error is not None:  # the attempt failed (retried or final: the next span says)
                span.fail(f"{result.error.reason}: {result.error.message}")
            await self._settlement.result(job, result)

    async def handle_progress(self, session: BatcherSession, progress: WorkProgress) -> None:
        """Relays the progress of the attempt in flight on `session`; any other is dropped."""
        job = self._leases.fenced(session, progress.job_id, progress.report.attempt)
        if job is None:
            # As with a result: its order may have gone out before its RUNNING write was answered.
            # Awaited here, in the session's read loop, so it is relayed before the attempt's result
            # is stored; the wait is one KV write at most, and only for an attempt still pending.
            await self._leases.settled_before(progress.job_id, progress.report.attempt)
            job = self._leases.fenced(session, progress.job_id, progress.report.attempt)
        if job is None:
            log.debug("stale_progress_dropped", job_id=progress.job_id, attempt=progress.report.attempt)
            return
        await self._progress.relay(job, progress.report)

    # --- attempts that end without an answer ----------------------------------------------------

    def batcher_lost(self, session: BatcherSession) -> None:
        """Puts every job in flight on the session back in the queue at once (an owned task)."""
        jobs = self._leases.release_all(session)
        if jobs:
            log.warning("batcher_lost_with_jobs", batcher_id=session.batcher_id, jobs=len(jobs))
            self._tasks.spawn(self._return_jobs(jobs, session))

    async def _return_jobs(self, jobs: list[InFlightJob], session: BatcherSession) -> None:
        for job in jobs:
            self._metrics.retries.labels(model=job.model_name, reason=job_errors.WORKER_LOST).inc()
        await asyncio.gather(
            *(
                self._settlement.requeue(
                    job.record,
                    job.msg,
                    job.log,
                    job_errors.worker_lost(session.batcher_id, job.attempt),
                    delay_s=0.0,
                )
                for job in jobs
            ),
            return_exceptions=True,
        )

    async def return_all(self) -> None:
        """Puts everything still in flight back in the queue for another scheduler (on stop);
        the attempts are given back. A result still trying to be stored gives up at its next try."""
        self._closing = True
        jobs = self._leases.release_all()
        for job in jobs:
            if not job.session.closed:
                job.session.send(CancelOrder(job_id=job.job_id, attempt=job.attempt))
        error = job_errors.scheduler_stopping()
        await asyncio.gather(
            *(self._settlement.requeue(job.record, job.msg, job.log, error, delay_s=0.0, refund=True) for job in jobs),
            return_exceptions=True,
        )

    def _on_timeout(self, job: InFlightJob) -> None:
        # Its answer may still come (a model that does not stop at the cancel): expected, not stale.
        self._leases.abandon(job.job_id, job.attempt, tenant=job.record.tenant)
        if not job.session.closed:
            job.session.send(CancelOrder(job_id=job.job_id, attempt=job.attempt))
        self._tasks.spawn(self._settlement.timed_out(job))

    def cancel_heard(self, job_id: str) -> bool:
        """Whether this scheduler heard a cancel of a job it does not run (lately)."""
        return self._leases.cancel_heard(job_id)

    def cancel(self, notice: CancelNotice) -> None:
        """A job was cancelled (CANCELLING, or CANCELED while queued): if it runs here, its
        batcher is told to drop it; else it is remembered (a dispatch under way, or to come)."""
        job = self._leases.jobs.get(notice.job_id)
        if job is None:
            self._leases.remember_cancel(notice.job_id)
            self._tasks.spawn(self._drop_cancelled_message(notice))
            return
        self._repeated_lines.say(
            job.log, "info", "job_cancel_sent", kind=job.model_name, batcher_id=job.session.batcher_id
        )
        if not job.session.closed:
            job.session.send(CancelOrder(job_id=job.job_id, attempt=job.attempt))

    async def _drop_cancelled_message(self, notice: CancelNotice) -> None:
        """A job cancelled while queued (CANCELED at once) leaves its work message in the stream
        until a dispatch pulls and drops it: counted meanwhile in its queue's depth, the desired
        batchers and its tenant's queued jobs (a paused queue, a backlog, a cancelled file batch's
        thousand chunks). Its message goes now. One still CANCELLING runs somewhere: its attempt's
        end settles it. (Every scheduler hears the notice; a second delete finds no message.)"""
        key = job_key(notice.tenant, notice.job_id)
        try:
            record = await self._store.recorded(key)
            if record is not None and record.state is JobState.CANCELED:
                await self._store.drop_work_message(record)
                self.on_message_dropped(notice.model_name, notice.job_id)
        except AsyncInferError as exc:  # a dispatch drops it later, as before
            self._repeated_lines.say(
                log,
                "info",
                "cancelled_message_not_dropped",
                kind=(notice.model_name, exc.reason),
                job_id=notice.job_id,
                error=exc.message,
            )

    # --- leases, rates and shutdown ---------------------------------------------------------------

    async def renew_leases(self) -> None:
        """Lets go of the attempts another scheduler took over (services.scheduler.superseded),
        then renews the rest."""
        taken_over = await superseded(self._store, list(self._leases.jobs.values()))
        let_go = [found for found in taken_over if self._leases.jobs.get(found.job.job_id) is found.job]
        for found in let_go:
            self._let_go(found.job, found.latest)
        if let_go:
            log.warning(
                "attempts_superseded",
                jobs=len(let_go),
                job_ids=[found.job.job_id for found in let_go[:SUPERSEDED_IDS_LOGGED]],
            )
        await self._leases.renew()

    def _let_go(self, job: InFlightJob, latest: JobRecord) -> None:
        """Stops renewing an attempt another took over and drops whatever its batcher answers;
        the result it may store names this attempt, which was this scheduler's alone (its RUNNING
        write won), so it is deleted."""
        self._leases.release(job)
        self._leases.abandon(job.job_id, job.attempt, tenant=job.record.tenant)
        if not job.session.closed:
            job.session.send(CancelOrder(job_id=job.job_id, attempt=job.attempt))
        job.log.debug("attempt_superseded", attempt_in_record=latest.attempt, dispatched_by=latest.dispatched_by)

    def in_flight_count(self, model_name: str) -> int:
        return self._leases.count(model_name)

    def completed_per_s(self, model_name: str) -> float:
        return self._rates.per_s(model_name)

    def batch_sizes(self, model_name: str) -> tuple[BatchSizeCount, ...]:
        return self._rates.batch_sizes.distribution(model_name)

    async def wait_idle(self, timeout_s: float) -> bool:
        return await self._leases.wait_idle(timeout_s)

    async def close(self) -> None:
        """Awaits the background work still running."""
        await self._tasks.close()
