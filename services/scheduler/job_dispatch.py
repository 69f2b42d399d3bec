"""Dispatch: a pulled work message becomes a RUNNING attempt and a work order on a batcher.

The RUNNING write is a compare-and-set decided by asyncinfer.lifecycle (Dispatch): it counts the
attempt (the fencing token), expires a job whose deadline passed, and finishes the cancel of a job
that was CANCELLING; a job with no attempt left is dead-lettered instead. The message stays unacked
while the attempt runs (leases.py keeps it alive); only a job that needs no run is acked here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextvars import ContextVar

import structlog

from asyncinfer import job_errors, lifecycle
from asyncinfer.blob_meta import attempt_result_ref
from asyncinfer.codecs.envelope import decode_envelope
from asyncinfer.config import Config
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES, JobStore, UnreadableJob, UnreadableOnce
from asyncinfer.jobs import JobError, JobRecord, JobState, WorkEnvelope
from asyncinfer.log_throttle import RepeatedLines, Throttle
from asyncinfer.nats import Msg
from asyncinfer.tracing import AttributeValue, Tracing, trace_id_of
from services.scheduler import version_routing
from services.scheduler.batchers import BatcherRegistry, BatcherSession
from services.scheduler.blobs import ClaimCheckIO
from services.scheduler.leases import InFlightJob, Leases
from services.scheduler.messages import CancelOrder, WorkOrder
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.queued_records import QueuedRecords
from services.scheduler.settlement import JobLog, Settlement, quietly

log = structlog.get_logger("asyncinfer.scheduler.jobs")
# A scheduler that stalled past AckWait (a frozen process or VM, a laptop's suspend) has every
# message it holds redelivered at once: one warning per model this often, the others at debug.
REDELIVERED_LOG_INTERVAL_S = 5.0

# After a NATS failure mid-dispatch, the message comes back after this pause.
DISPATCH_RETRY_DELAY_S = 1.0
# A job whose record this release cannot decode (asyncinfer.job_store.UnreadableJob): its message
# comes back after this pause, for a scheduler that can read it (a later release's).
UNREADABLE_RETRY_DELAY_S = 30.0
# Set by a dispatcher round in each of its dispatches' own context (services.scheduler.dispatcher):
# called when the dispatch goes on to read a claim-checked input, so that the round stops waiting
# for it. A contextvar rather than a parameter through the five calls between the two.
INPUT_READ_STARTED: ContextVar[Callable[[], None] | None] = ContextVar("input_read_started", default=None)
# Set likewise: called when the dispatch puts its job back unrun, to be chosen again (it waits for
# its version: no batcher serves it, or those that do have no free slot; a NATS failure stopped its
# dispatch; its record is not written yet; its batcher left during its write, its order not sent;
# another writer's attempt came between its order and its write), or finds it is a redelivery of an
# attempt running here, which that attempt adopts (nothing new runs), so that the dispatcher refunds
# what choosing it charged (services.scheduler.work_queue.ModelQueues.refund_job). Called once at
# most (_refund_choice).
PUT_BACK_UNRUN: ContextVar[Callable[[], None] | None] = ContextVar("put_back_unrun", default=None)
# Pauses while waiting for a record that an older gateway writes right after its publish. An idle
# scheduler is woken by that very publish and pulls the message while the gateway is still waiting
# for the publish's ack before it sends the record: the record is usually there a millisecond or
# two later, so the first pauses are short (a coarser first pause was most of the queued time of a
# job at light load); the total stays about what it was (~60 ms) before a nak.
RECORD_WAITS_S = (0.001, 0.002, 0.004, 0.008, 0.015, 0.03)


def _first_delivery(msg: Msg) -> bool:
    try:
        return msg.metadata.num_delivered <= 1
    except Exception:  # no JetStream reply subject: take the safe path (read the record)
        return False


def _refund_choice() -> None:
    """Refunds what choosing this dispatch's job charged (PUT_BACK_UNRUN), before its nak: a pull
    that brings it back finds it refunded. Once: a put-back that fails on its way is not refunded twice."""
    refund = PUT_BACK_UNRUN.get()
    if refund is not None:
        PUT_BACK_UNRUN.set(None)  # in the dispatch's own context (its task's)
        refund()


def _stored_time(msg: Msg) -> float | None:
    """nats-server's stamp on the message (its metadata is parsed once per message, and
    _first_delivery has parsed it already)."""
    try:
        return msg.metadata.timestamp.timestamp()
    except Exception:  # no JetStream reply subject: unknown
        return None


class JobDispatch:
    def __init__(
        self,
        *,
        store: JobStore,
        config: Config,
        metrics: SchedulerMetrics,
        leases: Leases,
        settlement: Settlement,
        queued_records: QueuedRecords,
        claim_check: ClaimCheckIO | None,
        on_timeout: Callable[[InFlightJob], None],
        instance_id: str = "",
        batchers: BatcherRegistry | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        """`batchers`: routes each job to a batcher that serves its version (version_routing.py);
        None: the reserved batcher runs it, whatever it serves."""
        self._batchers = batchers
        self._instance_id = instance_id
        self._tracing = tracing or Tracing.off()
        self._store = store
        self._config = config
        self._metrics = metrics
        self._leases = leases
        self._settlement = settlement
        self._queued_records = queued_records
        self._claim_check = claim_check
        self._on_timeout = on_timeout
        self._redelivered_lines = Throttle(REDELIVERED_LOG_INTERVAL_S)
        # A dispatch's failure lines, once per interval per model and kind (the rest at debug): a
        # NATS outage or a lost input fails every job pulled meanwhile.
        self._failure_lines = RepeatedLines()
        self._unreadable = UnreadableOnce("dispatch")

    async def dispatch(self, msg: Msg, session: BatcherSession) -> bool:
        """Runs a pulled message on the session. True when a work order was sent (the reserved
        credit is used); False when the message needed no run (it was acked, termed or put back)."""
        try:
            envelope = decode_envelope(msg.data)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("work_message_undecodable", error=str(exc), subject=msg.subject)
            await quietly(msg.term())
            return False
        job_log = log.bind(job_id=envelope.job_id, model=envelope.model_name, tenant=envelope.tenant)
        if envelope.traceparent:
            job_log = job_log.bind(trace_id=trace_id_of(envelope.traceparent))
        try:
            if self._tracing.enabled and envelope.traceparent:
                return await self._traced_dispatch(msg, envelope, session, job_log)
            return await self._dispatch(msg, envelope, session, job_log)
        except Exception as exc:
            await self._failed(msg, envelope.model_name, job_log, exc)
            return False

    async def _failed(self, msg: Msg, model_name: str, job_log: JobLog, exc: Exception) -> None:
        """A dispatch that raised: its job goes back to the queue. The caller says whether its
        credit was spent (an order sent ahead of its write: _run)."""
        # NATS trouble mid-way: the message comes back after a pause, and the record (if
        # RUNNING) is taken over by the next attempt. A NATS failure is said in one line, raw
        # or as the store's Unavailable (a leader election logged a traceback per job; one
        # with locals, rendered on the event loop, takes 0.4-1.5 s on 2 loaded cores: a
        # burst of them held the whole process). Anything else is a bug: its traceback.
        if isinstance(exc, UnreadableJob):
            # A record this release cannot decode (its read, or the RUNNING write's re-read after
            # losing its create; an order sent ahead was cancelled, its answer dropped): not run
            # blind, nor dropped as an undecodable work message is (termed), since the job lives:
            # a later release's record (a rolling upgrade) is run by a scheduler of that release,
            # which pulls the message when it comes back. Once per key (it was a traceback a pass).
            self._unreadable.say(exc)
            _refund_choice()  # unrun: not its tenant's turn
            await self._settlement.put_back(msg, UNREADABLE_RETRY_DELAY_S)
            return
        # Once per interval per model and kind of failure (the rest at debug): NATS away fails
        # every dispatch, and a bug may fail every job's.
        if isinstance(exc, Unavailable):
            self._failure_lines.say(
                job_log, "warning", "dispatch_failed", kind=(model_name, exc.reason), error=exc.message
            )
        elif isinstance(exc, NATS_FAILURES):
            self._failure_lines.say(
                job_log,
                "warning",
                "dispatch_failed",
                kind=(model_name, type(exc)),
                error=f"{type(exc).__name__}: {exc}",
            )
        else:
            self._failure_lines.say(job_log, "error", "dispatch_failed", kind=(model_name, type(exc)), exc_info=exc)
        if isinstance(exc, (Unavailable, *NATS_FAILURES)):
            # Unrun: NATS is met only before the order is held here (an order sent ahead of
            # a write that failed was cancelled, its answer dropped), so choosing it again
            # must not charge its tenant and priority twice. A bug may strike after: no refund.
            _refund_choice()
        await self._settlement.put_back(msg, DISPATCH_RETRY_DELAY_S)

    async def _traced_dispatch(
        self, msg: Msg, envelope: WorkEnvelope, session: BatcherSession, job_log: JobLog
    ) -> bool:
        """_dispatch in a `dispatch` span, a child of the job's submit span (the record's
        traceparent); the work order carries the span on to the batcher."""
        attributes = {"asyncinfer.job_id": envelope.job_id, "asyncinfer.model": envelope.model_name}
        with self._tracing.span("dispatch", parent=envelope.traceparent, attributes=attributes) as span:
            sent = await self._dispatch(msg, envelope, session, job_log, trace=span.traceparent)
            span.set("asyncinfer.sent", sent)
            return sent

    async def _record_of(self, msg: Msg, envelope: WorkEnvelope, job_log: JobLog) -> JobRecord | None:
        """The job's record. A submit's message is the QUEUED record itself: on its first delivery
        the RUNNING write is the record's create (which a cancel or expiry may have won: the write
        then reads what won). Redelivered, the bucket has the record if any write was made.

        A replay's message (or one from before messages were records) has its record in the
        bucket; a replay's queued notice may have brought it already. Such a message from a
        gateway that wrote the record after its publish may arrive first: wait a moment for the
        record, and drop a message whose record never came once it is older than
        orphan_message_grace_s (its submit failed; nobody was told it was accepted)."""
        if envelope.is_record:
            if _first_delivery(msg):
                return envelope.queued_record()
            record = await self._store.get(envelope.key)
            if record is None:
                job_log.error("job_record_missing")
                await quietly(msg.term())
            return record
        # A notice is for its message's first delivery: one that came after the dispatch read the
        # record (it is published after the message) is stale by the next delivery (a retry).
        record = self._queued_records.take(envelope.key)
        if record is not None and _first_delivery(msg):
            return record
        record = await self._store.recorded(envelope.key)
        for pause_s in RECORD_WAITS_S:
            if record is not None:
                return record
            await asyncio.sleep(pause_s)
            record = await self._store.recorded(envelope.key)
        if record is not None:
            return record
        age_s = time.time() - envelope.create_time
        if age_s < self._config.scheduler.orphan_message_grace_s:
            self._failure_lines.say(
                job_log, "info", "job_record_not_written_yet", kind=envelope.model_name, age_s=round(age_s, 3)
            )
            _refund_choice()  # unrun, waiting for its gateway's write: not its tenant's turn
            await self._settlement.put_back(msg, DISPATCH_RETRY_DELAY_S)
        else:
            self._failure_lines.say(
                job_log, "warning", "orphan_work_message_dropped", kind=envelope.model_name, age_s=round(age_s, 1)
            )
            await quietly(msg.term())
        return None

    async def _dispatch(
        self, msg: Msg, envelope: WorkEnvelope, session: BatcherSession, job_log: JobLog, *, trace: str = ""
    ) -> bool:
        record = await self._record_of(msg, envelope, job_log)
        if record is None:
            return False
        if self._adopts_redelivery(msg, record, job_log):
            # Nothing new runs (its credit goes back: False), so its choice is refunded too: the
            # attempt it belongs to charged its tenant's turn and its priority's count already.
            _refund_choice()
            return False
        now = time.time()
        version = envelope.model_version
        runnable = record.state in (JobState.QUEUED, JobState.RUNNING)
        if self._batchers is not None and runnable and (record.deadline is None or now < record.deadline):
            routed = version_routing.route(self._batchers, self._config, envelope.model_name, version, session)
            if isinstance(routed, version_routing.Waiting):
                if _first_delivery(msg):
                    self._failure_lines.say(
                        job_log,
                        "info",
                        "job_waits_for_version",
                        kind=(envelope.model_name, routed.version, routed.reason),
                        version=routed.version,
                        reason=routed.reason,
                    )
                _refund_choice()
                await self._settlement.put_back(msg, routed.delay_s)
                return False
            if routed.session is not session:
                # Another batcher's credit was taken: the reserved one goes back to the dispatcher.
                sent = False
                try:
                    sent = await self._run(msg, envelope, routed.session, job_log, record, routed.version, trace)
                finally:
                    if not sent:
                        self._batchers.release(routed.session, envelope.model_name)
                return False
            version = routed.version
        return await self._run(msg, envelope, session, job_log, record, version, trace)

    def _adopts_redelivery(self, msg: Msg, record: JobRecord, job_log: JobLog) -> bool:
        """Whether `msg` is the message of an attempt running here under a live lease, delivered
        again: the attempt keeps running, and its renewals and final ack go to this delivery. A nak
        names its message by stream sequence, so nats-server applies one sent for an older delivery
        to the one pending now (services.scheduler.lease_reclaim: a sweep's nak that lost a race with
        AckWait's redelivery and this scheduler's dispatch); counting that as a lapsed lease spent an
        attempt of a job that was running fine (CI's kill -9 batch test, once three of three)."""
        held = self._leases.jobs.get(record.job_id)
        if (
            held is None
            or held.attempt != record.attempt
            or record.state not in (JobState.RUNNING, JobState.CANCELLING)
        ):
            return False
        held.msg = msg
        more = self._redelivered_lines.allow(record.model_name)
        if more is None:
            job_log.debug("live_attempt_redelivered", attempt=record.attempt)
        else:
            job_log.warning(
                "live_attempt_redelivered", attempt=record.attempt, **({"more_since_last": more} if more else {})
            )
        return True

    async def _run(
        self,
        msg: Msg,
        envelope: WorkEnvelope,
        session: BatcherSession,
        job_log: JobLog,
        record: JobRecord,
        version: str,
        trace: str,
    ) -> bool:
        """The RUNNING write, then the order. A queued job with its inputs inline has its order
        sent first and the write awaited after (the write's round trip off a job's path, ~1.3 ms
        at light load): the attempt the write will count is known (lifecycle.dispatch), the
        batcher's answer waits for the write (Leases.settled_before), and an attempt the write
        refuses or loses has its order cancelled and its answer dropped. Its credit stays spent
        either way, a write that raised included (True): the batcher took the order, and grants
        the credit again once the order leaves it (answered, or dropped at the cancel); given
        back here too, the scheduler counted one credit more than the batcher had free slots.
        Not for a job whose cancel was heard (a queued job's cancel is announced too): its write
        is likely refused, and nothing should run."""
        now = time.time()
        event = lifecycle.Dispatch(
            batcher_id=session.batcher_id,
            scheduler=self._instance_id,
            lease_subject=msg.reply or "",
            model_version=version,
            queued_server_time=_stored_time(msg),
        )
        # What the write will make of the record as it is known here (the pure decision): an
        # order goes out early only for an attempt it would start.
        expected = lifecycle.dispatch(record, event, now)
        if not (isinstance(expected, JobRecord) and self._sends_early(record, expected, envelope, session)):
            return await self._write_and_send(msg, envelope, session, job_log, record, event, now, trace, None)
        order = self._order(envelope, expected, version, trace, session)
        self._leases.expect(envelope.job_id, order.attempt)
        session.send(order)
        held = False
        failure: Exception | None = None
        try:
            held = await self._write_and_send(msg, envelope, session, job_log, record, event, now, trace, order)
        except Exception as exc:
            failure = exc  # put back once its order is cancelled
        finally:
            if not held and not session.closed:
                session.send(CancelOrder(job_id=order.job_id, attempt=order.attempt))
            self._leases.expected(order.job_id, order.attempt, held=held)
        if failure is not None:
            await self._failed(msg, envelope.model_name, job_log, failure)
        return True

    def _sends_early(
        self, record: JobRecord, expected: JobRecord, envelope: WorkEnvelope, session: BatcherSession
    ) -> bool:
        return (
            # The record a submit's message carries is the job's on its first delivery; one from a
            # notice may be older than the bucket's, and the order would be for a spent attempt.
            envelope.is_record
            and record.state == JobState.QUEUED
            and expected.state == JobState.RUNNING
            # A claim-checked input is read here after the write, unless the batcher reads it.
            and (envelope.input_ref is None or self._batcher_reads(session))
            and not session.closed
            and not self._leases.cancel_heard(envelope.job_id)  # the cancel has likely won the write
        )

    async def _write_and_send(
        self,
        msg: Msg,
        envelope: WorkEnvelope,
        session: BatcherSession,
        job_log: JobLog,
        record: JobRecord,
        event: lifecycle.Dispatch,
        now: float,
        trace: str,
        sent: WorkOrder | None,
    ) -> bool:
        """Whether the attempt is held (RUNNING, its order on the batcher); `sent`: the order
        already sent before the write (see _run)."""
        version = event.model_version
        latest, written = await self._store.transition(record, lifecycle.decider(event, now))
        if latest is None:
            job_log.error("job_record_missing")
            await msg.term()
            return False
        refusal = None if written else lifecycle.dispatch(latest, event, now)
        if isinstance(refusal, lifecycle.Refusal) and refusal.reason is lifecycle.Refused.ATTEMPTS_SPENT:
            if latest.state == JobState.RUNNING:
                self._metrics.lease_expiries.labels(model=latest.model_name).inc()
            last_error = lifecycle.spent_attempt_error(latest)
            await self._settlement.dead_letter(latest, msg, job_log, last_error, state=JobState.FAILED)
            return False
        if latest.state != JobState.RUNNING or not written:
            if written:
                self._metrics.job_transition(latest)
            self._failure_lines.say(
                job_log, "info", "job_not_runnable", kind=(latest.model_name, latest.state), state=latest.state.value
            )
            await msg.ack()
            return False
        job_log = job_log.bind(attempt=latest.attempt)
        if trace:  # the wait that ended here: from the job's (re)queueing to its RUNNING write
            queued: dict[str, AttributeValue] = {
                "asyncinfer.job_id": latest.job_id,
                "asyncinfer.attempt": latest.attempt,
            }
            self._tracing.record(
                "queued", parent=envelope.traceparent, start_s=record.update_time, end_s=now, attributes=queued
            )
        if record.state == JobState.RUNNING:
            self._metrics.lease_expiries.labels(model=latest.model_name).inc()
            self._failure_lines.say(
                job_log, "warning", "lease_expired", kind=latest.model_name, previous_attempt=record.attempt
            )
        if envelope.input_ref is not None and self._claim_check is not None and not self._batcher_reads(session):
            if (leave_round := INPUT_READ_STARTED.get()) is not None:
                leave_round()  # its round goes on without waiting for the read (dispatcher.py)
            resolved = await self._claim_check.resolve(envelope)
            if isinstance(resolved, JobError):
                await self._input_unusable(latest, msg, job_log, resolved)
                return False
            envelope = resolved
        if session.closed:
            # The batcher left while the record was being written: put the job straight back,
            # with its attempt given back unless its order went out before the write (it may have
            # run, as any job a lost batcher held). Not given back, a scheduler waking from a
            # freeze spent an attempt of each job it pulled for the batchers that had left.
            # Its choice is refunded on the same terms (its tenant's turn, its priority's count).
            error = job_errors.worker_lost(session.batcher_id, latest.attempt)
            if sent is None:
                _refund_choice()
            await self._settlement.requeue(latest, msg, job_log, error, delay_s=0.0, refund=sent is None)
            return False
        if sent is not None and sent.attempt != latest.attempt:
            # The write was decided on a newer record than the order (another writer came
            # between): the order is cancelled (by _run) and the job goes straight back, rather
            # than a second order on the credit the first one spent. Its attempt and its choice
            # are refunded: its order's answer is dropped, so it did not run for its tenant.
            self._failure_lines.say(
                job_log, "warning", "dispatch_attempt_mismatch", kind=latest.model_name, sent_attempt=sent.attempt
            )
            _refund_choice()
            await self._settlement.requeue(latest, msg, job_log, job_errors.dropped_unrun(), delay_s=0.0, refund=True)
            return False
        self._metrics.job_transition(latest)
        order = sent or self._order(envelope, latest, version, trace, session)
        if sent is None:
            session.send(order)
        job = InFlightJob(
            job_id=envelope.job_id,
            attempt=latest.attempt,
            model_name=envelope.model_name,
            session=session,
            msg=msg,
            record=latest,
            log=job_log,
            timeout_s=order.execution_timeout_s,
            backstop_s=self._config.scheduler.execution_timeout_backstop_s if session.times_out_runs else 0.0,
        )
        superseded = self._leases.hold(job, self._on_timeout)
        if superseded is not None:
            self._failure_lines.say(
                job_log, "warning", "attempt_superseded", kind=envelope.model_name, old_attempt=superseded.attempt
            )
        if self._leases.take_pending_cancel(envelope.job_id):
            session.send(CancelOrder(job_id=job.job_id, attempt=job.attempt))
        # At debug: a line per job at info was most of the scheduler's log; jobs_summary counts them.
        job_log.debug("job_dispatched", batcher_id=session.batcher_id, priority=envelope.priority.value)
        return True

    async def _input_unusable(self, running: JobRecord, msg: Msg, job_log: JobLog, error: JobError) -> None:
        """The claim-checked input cannot be read: retried later when that is NATS trouble, the
        job failed when the input is gone or unreadable for good."""
        self._failure_lines.say(
            job_log,
            "warning",
            "job_input_unusable",
            kind=(running.model_name, error.reason),
            reason=error.reason,
            retriable=error.retriable,
        )
        if error.retriable:  # NATS trouble: the job goes back unrun, its choice refunded
            _refund_choice()
            await self._settlement.requeue(running, msg, job_log, error, delay_s=DISPATCH_RETRY_DELAY_S, refund=True)
            return
        event = lifecycle.Finish(attempt=running.attempt, state=JobState.FAILED, error=error)
        await self._settlement.end(running, msg, job_log, event, time.time())

    def _batcher_reads(self, session: BatcherSession) -> bool:
        """Whether the batcher moves the claim-checked bytes itself (batcher.claim_check_io)."""
        return session.reads_claim_checks and self._claim_check is not None

    def _order(
        self, envelope: WorkEnvelope, record: JobRecord, version: str, trace: str, session: BatcherSession
    ) -> WorkOrder:
        timeout_s = record.execution_timeout_s or envelope.execution_timeout_s
        if timeout_s is None:
            model = self._config.model(envelope.model_name)
            timeout_s = model.default_execution_timeout_s if model is not None else None
        stores = self._batcher_reads(session)
        return WorkOrder(
            job_id=envelope.job_id,
            attempt=record.attempt,
            model_name=envelope.model_name,
            model_version=version,
            priority=envelope.priority,
            tenant=envelope.tenant,
            inputs=envelope.inputs,
            input_ref=envelope.input_ref,
            deadline=envelope.deadline,
            execution_timeout_s=timeout_s,
            traceparent=trace,
            store_outputs_over_bytes=self._config.scheduler.inline_result_max_bytes if stores else 0,
            output_name=attempt_result_ref(envelope.job_id, record.attempt) if stores else "",
            result_retention_s=record.result_retention_s if stores else 0.0,
            run_alone=lost_with_its_batcher(record),
        )


def lost_with_its_batcher(record: JobRecord) -> bool:
    """Whether the attempt about to start should run in a batch of its own: the job's previous
    attempt ended with its batcher gone (a crash: kill -9, a segfault, the machine; or its lease
    lapsed) and it is not its first (`record` is the dispatched record: `attempt` is the one
    starting). A job whose input crashes the model's process took the jobs batched with it down
    on every attempt (three good jobs dead-lettered WORKER_LOST with one poison, in a helper's run),
    where a model that raises is isolated by bisection. Not after a first loss: after any crash
    every job in flight was lost once, and running them all alone would slow the recovery of a
    model with large batches many times over (the crash tests' slow model: 0.3 s a batch)."""
    error = record.last_error
    lost = error is not None and error.reason in (job_errors.WORKER_LOST, job_errors.LEASE_EXPIRED)
    return lost and record.attempt >= 3
