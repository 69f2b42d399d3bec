"""The gateway's own writes to job records besides creating them: expiry on read, cancellation.

Expiry on read: a QUEUED job whose deadline has passed is EXPIRED even if no scheduler has pulled
it yet. Readers (GetJob, WatchJob, CancelJob) write the EXPIRED record themselves, so what they
report is real and final; when another writer wins (the scheduler dispatched it just in time),
they report what won. The scheduler also checks the deadline at dispatch, so an expired job never
runs either way.

Cancellation: a QUEUED job becomes CANCELED at once (the scheduler acks terminal jobs at dispatch,
so it never runs). A RUNNING job becomes CANCELLING, and a CancelNotice on the model's cancel
subject tells the scheduler that dispatched it to have its batcher drop it; the scheduler writes
CANCELED (keeping the error written here) or, if the result was stored first, that state stands.
Every write is a compare-and-set that re-decides on what won, so a cancel and a completion never
both win, and the answer says which did.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from asyncinfer import lifecycle
from asyncinfer.errors import FailedPrecondition
from asyncinfer.job_store import NATS_FAILURES, JobStore, job_not_found
from asyncinfer.jobs import JobRecord, JobState
from asyncinfer.log_throttle import RepeatedLines
from asyncinfer.nats import Client as NatsClient
from asyncinfer.queues import CancelNotice, cancel_subject
from asyncinfer.tracing import trace_fields

log = structlog.get_logger("asyncinfer.gateway")

ALREADY_FINISHED_REASON = "JOB_ALREADY_FINISHED"


# --- expiry ---------------------------------------------------------------------------------------


async def expire_if_overdue(records: JobStore, record: JobRecord, now: float) -> tuple[JobRecord | None, bool]:
    """The record after expiring it if it is overdue (what won, if another writer was first;
    None if the record is gone), and whether this call expired it; the record itself when it is
    not overdue."""
    if not lifecycle.is_overdue(record, now):
        return record, False
    return await records.transition(record, lifecycle.decider(lifecycle.Expire(), now))


class Expiry:
    """expire_if_overdue with the gateway's clock, telling `on_expired` about each job it expired."""

    def __init__(
        self,
        records: JobStore,
        *,
        on_expired: Callable[[JobRecord], None] = lambda record: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._records = records
        self._on_expired = on_expired
        self.clock = clock
        self._expired_lines = RepeatedLines()

    async def settle(self, record: JobRecord) -> JobRecord | None:
        latest, wrote = await expire_if_overdue(self._records, record, self.clock())
        if wrote and latest is not None:
            about = {"job_id": latest.job_id, "model": latest.model_name, "tenant": latest.tenant}
            # Once per interval per model (the rest at debug): a client reading its thousand jobs
            # past their deadline expired each on the read.
            self._expired_lines.say(
                log, "info", "job_expired_on_read", kind=latest.model_name, **about, **trace_fields(latest.traceparent)
            )
            self._on_expired(latest)
        return latest


# --- cancellation ---------------------------------------------------------------------------------


def already_finished(record: JobRecord) -> FailedPrecondition:
    return FailedPrecondition(
        f"job {record.job_id} already finished ({record.state.value}); there is nothing to cancel",
        reason=ALREADY_FINISHED_REASON,
        metadata={"job_id": record.job_id, "state": record.state.value},
    )


async def cancel(
    records: JobStore, nc: NatsClient, record: JobRecord, *, reason: str, now: float, lines: RepeatedLines
) -> JobRecord:
    """The record after the cancel: CANCELED, or CANCELLING (the notice sent). FailedPrecondition
    when the job already ended (or its deadline passed: it is EXPIRED now). `lines`: the caller's
    (one per service), for the notice that could not be sent."""
    latest, wrote = await records.transition(record, lifecycle.decider(lifecycle.Cancel(reason=reason), now))
    if latest is None:
        raise job_not_found(record.job_id)
    if latest.state.is_terminal and not (wrote and latest.state is JobState.CANCELED):
        # Ended before this cancel: a completion that won the race, an earlier cancel, or the
        # deadline (expired just now by this call).
        raise already_finished(latest)
    if latest.state is JobState.CANCELLING or wrote:
        # Sent again on a repeated cancel too: core NATS delivers at most once, and schedulers
        # ignore notices for jobs they do not run, so a repeat only helps. A queued job's cancel
        # (CANCELED at once) is announced too: a scheduler that pulls its message then sends no
        # order ahead of the RUNNING write the cancel has won (services.scheduler.job_dispatch).
        notice = CancelNotice(job_id=latest.job_id, tenant=latest.tenant, model_name=latest.model_name)
        try:
            await nc.publish(cancel_subject(latest.model_name), notice.encode())
        except NATS_FAILURES as exc:
            # The record says CANCELLING; the scheduler also finds that when the result comes. Once
            # per interval per model and error (the rest at debug): with NATS down, a client
            # cancelling its thousand jobs, or a batch's cancel, wrote a line each.
            about = {"job_id": latest.job_id, "model": latest.model_name, **trace_fields(latest.traceparent)}
            lines.say(
                log, "warning", "cancel_notice_not_sent", kind=(latest.model_name, type(exc)), **about, error=str(exc)
            )
    return latest
