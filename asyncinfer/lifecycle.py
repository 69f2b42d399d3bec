"""The job lifecycle: every transition of a job record, as pure functions of (record, event, now).

Each function returns the record to write, or a `Refusal` saying why this event changes nothing
now. The services never decide a state themselves: they build an event, let this module decide on
the record they hold, and write the answer with a compare-and-set on the record's revision
(`JobStore.transition`); when another writer won, they decide again on what won. So a cancel and a
completion can never both win, whatever the order they arrive in.

    QUEUED ──Dispatch──> RUNNING ──Finish──> SUCCEEDED | FAILED | TIMED_OUT
      ^ │                  │ │ └──GiveUp (attempts spent)──> FAILED | TIMED_OUT
      │ │                  │ └──Cancel──> CANCELLING ──(any event of the attempt)──> CANCELED
      │ │                  └──Requeue (retry, batcher lost, scheduler stopping)──┐
      │ └──Cancel──> CANCELED; Expire / Dispatch past deadline──> EXPIRED         │
      └───────────────────────────────────────────────────────────────────────────┘
    FAILED | TIMED_OUT ──Replay──> QUEUED (a new budget of attempts)

The rules that keep jobs safe, each written once below:
- Fencing: the record's `attempt` goes up by one at every Dispatch; an event of any other attempt
  is refused (STALE_ATTEMPT), so a late result of an older attempt never wins.
- A cancel wins over whatever its attempt does next: CANCELLING becomes CANCELED on the attempt's
  next event (its result is discarded), and a CANCELLING job is never dispatched again.
- A terminal record changes only by an operator's Replay (from FAILED or TIMED_OUT).
- `attempt` never exceeds `max_attempts`: Dispatch is refused with ATTEMPTS_SPENT instead, and
  the caller dead-letters the job (GiveUp). An attempt that ended through no fault of the job
  gives its attempt back (Requeue with refund raises `max_attempts` by one).
- A job whose deadline passed while it waited becomes EXPIRED and never runs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from asyncinfer import job_errors
from asyncinfer.jobs import BatchInfo, BlobRef, JobError, JobRecord, JobState
from asyncinfer.tensors import Tensor

REPLAYABLE = frozenset({JobState.FAILED, JobState.TIMED_OUT})


class Refused(enum.StrEnum):
    STALE_ATTEMPT = "STALE_ATTEMPT"  # the event belongs to another attempt than the record's
    NOT_RUNNABLE = "NOT_RUNNABLE"  # dispatch of a job that is neither queued nor running
    ATTEMPTS_SPENT = "ATTEMPTS_SPENT"  # dispatch of a job with no attempt left: dead-letter it
    NOT_RUNNING = "NOT_RUNNING"  # an attempt's event when the record is not running it
    NOT_DROPPED = "NOT_DROPPED"  # a drop that ends nothing: put the job back (refunded)
    ALREADY_ENDED = "ALREADY_ENDED"  # a cancel of a job already cancelling or terminal
    NOT_OVERDUE = "NOT_OVERDUE"  # expiry of a job that is not queued past its deadline
    NOT_REPLAYABLE = "NOT_REPLAYABLE"  # replay of a job that is not FAILED or TIMED_OUT


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: Refused
    state: JobState  # the record's state when refused


Outcome = JobRecord | Refusal


# --- events ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A scheduler pulled the job's message and means to run it on `batcher_id`; `scheduler` is
    that scheduler's instance, `lease_subject` the ack subject of the message's delivery."""

    batcher_id: str
    scheduler: str = ""
    lease_subject: str = ""
    # The version it runs on (the one it asked for, or the model's default now); empty: unchanged.
    model_version: str = ""
    # nats-server's stamp on the message pulled (JobRecord.queued_server_time); None: unchanged.
    queued_server_time: float | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    """The attempt ended for good: a stored result (SUCCEEDED), or a final error (FAILED, TIMED_OUT)."""

    attempt: int
    state: JobState
    outputs: tuple[Tensor, ...] = ()
    result_ref: BlobRef | None = None
    error: JobError | None = None
    batch: BatchInfo | None = None


@dataclass(frozen=True, slots=True)
class Drop:
    """The batcher dropped the attempt before running it (canceled, past its deadline, or shed)."""

    attempt: int


@dataclass(frozen=True, slots=True)
class Requeue:
    """The attempt goes back to the queue with `error` as last_error. `refund`: not the job's fault
    (it does not count against max_attempts)."""

    attempt: int
    error: JobError
    refund: bool = False
    # A batcher handed it back unrun (handed_back_in_a_row counts it); any other requeue ends the row.
    handed_back: bool = False
    # ... and no longer served the version as it did (its Triton out of reach): handed_back_by
    # names it (the attempt's batcher_id).
    out_of_reach: bool = False


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The job's attempts are spent (it is dead-lettered): it ends in `state` with `error`."""

    attempt: int
    state: JobState
    error: JobError
    batch: BatchInfo | None = None
    # The job's dead letter, stored before the record is written (0: none stored).
    dead_letter_sequence: int = 0


@dataclass(frozen=True, slots=True)
class Cancel:
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Expire:
    """A reader found the job; it expires if it is still queued past its deadline."""


@dataclass(frozen=True, slots=True)
class Replay:
    """An operator replays a dead letter: `budget` fresh attempts."""

    budget: int


Event = Dispatch | Finish | Drop | Requeue | GiveUp | Cancel | Expire | Replay


# --- the rules ------------------------------------------------------------------------------------


def is_overdue(record: JobRecord, now: float) -> bool:
    return record.state is JobState.QUEUED and record.deadline is not None and record.deadline <= now


def _refuse(record: JobRecord, reason: Refused) -> Refusal:
    return Refusal(reason=reason, state=record.state)


def _canceled(record: JobRecord, now: float, batch: BatchInfo | None = None, *, ran: bool = False) -> JobRecord:
    """A cancel asked while the attempt ran wins over the attempt's next event (the error the
    cancel wrote stays). `ran`: the event is the running attempt's own, which keeps its run time
    (as a finish or a give-up does)."""
    run_duration_s = max(now - (record.start_time or now), 0.0) if ran else record.run_duration_s
    return record.evolve(
        state=JobState.CANCELED,
        end_time=now,
        update_time=now,
        batch=batch if batch is not None else record.batch,
        run_duration_s=run_duration_s,
    )


def _attempt_event(
    record: JobRecord, attempt: int, now: float, batch: BatchInfo | None = None, *, ran: bool = False
) -> Outcome | None:
    """What every event of a running attempt shares: fencing, then the cancel that came first.
    None when the event's own rule decides. `ran`: the event says the attempt computed (its
    result or its failure), so a cancel that wins keeps its run time."""
    if record.attempt != attempt:
        return _refuse(record, Refused.STALE_ATTEMPT)
    if record.state is JobState.CANCELLING:
        return _canceled(record, now, batch, ran=ran)
    return None


def dispatch(record: JobRecord, event: Dispatch, now: float) -> Outcome:
    if record.state is JobState.CANCELLING:
        # Cancel was asked while an earlier attempt ran; nothing runs it now.
        return _canceled(record, now)
    if record.state not in (JobState.QUEUED, JobState.RUNNING):
        return _refuse(record, Refused.NOT_RUNNABLE)
    if record.deadline is not None and now >= record.deadline:
        return record.evolve(
            state=JobState.EXPIRED, error=job_errors.deadline_passed("started"), end_time=now, update_time=now
        )
    if record.attempt >= record.max_attempts:
        return _refuse(record, Refused.ATTEMPTS_SPENT)
    return record.evolve(
        state=JobState.RUNNING,
        attempt=record.attempt + 1,
        last_error=spent_attempt_error(record),
        start_time=now,
        queue_duration_s=max(now - record.create_time, 0.0),
        update_time=now,
        batcher_id=event.batcher_id,
        dispatched_by=event.scheduler,
        lease_subject=event.lease_subject,
        model_version=event.model_version or record.model_version,
        queued_server_time=record.queued_server_time if event.queued_server_time is None else event.queued_server_time,
    )


def spent_attempt_error(record: JobRecord) -> JobError | None:
    """The last error of a job about to be dispatched again: a RUNNING record here means the
    attempt's lease lapsed (its scheduler is gone)."""
    if record.state is JobState.RUNNING:
        return job_errors.lease_expired(record.attempt)
    return record.last_error


def finish(record: JobRecord, event: Finish, now: float) -> Outcome:
    shared = _attempt_event(record, event.attempt, now, event.batch, ran=True)
    if shared is not None:
        return shared
    if record.state is not JobState.RUNNING:
        return _refuse(record, Refused.NOT_RUNNING)
    keeps_outputs = event.state is JobState.SUCCEEDED and event.result_ref is None
    return record.evolve(
        state=event.state,
        outputs=event.outputs if keeps_outputs else (),
        result_ref=event.result_ref,
        error=event.error,
        end_time=now,
        run_duration_s=max(now - (record.start_time or now), 0.0),
        batch=event.batch,
        update_time=now,
    )


def drop(record: JobRecord, event: Drop, now: float) -> Outcome:
    shared = _attempt_event(record, event.attempt, now)
    if shared is not None:
        return shared
    if record.state is JobState.RUNNING and record.deadline is not None and now >= record.deadline:
        return record.evolve(
            state=JobState.EXPIRED, error=job_errors.deadline_passed("ran"), end_time=now, update_time=now
        )
    return _refuse(record, Refused.NOT_DROPPED)


def requeue(record: JobRecord, event: Requeue, now: float) -> Outcome:
    shared = _attempt_event(record, event.attempt, now)
    if shared is not None:
        return shared
    if record.state is not JobState.RUNNING:
        return _refuse(record, Refused.NOT_RUNNING)
    in_a_row = record.handed_back_in_a_row + 1 if event.handed_back else 0
    by = record.handed_back_by if event.handed_back else ()
    if event.handed_back and event.out_of_reach and record.batcher_id not in by:
        by = (*by, record.batcher_id)
    if event.refund:
        return record.evolve(
            state=JobState.QUEUED,
            last_error=event.error,
            max_attempts=record.max_attempts + 1,
            given_back_attempts=record.given_back_attempts + 1,
            handed_back_in_a_row=in_a_row,
            handed_back_by=by,
            update_time=now,
        )
    return record.evolve(
        state=JobState.QUEUED,
        last_error=event.error,
        failed_attempts=record.failed_attempts + 1,
        handed_back_in_a_row=in_a_row,
        handed_back_by=by,
        update_time=now,
    )


def give_up(record: JobRecord, event: GiveUp, now: float) -> Outcome:
    shared = _attempt_event(record, event.attempt, now, ran=True)
    if shared is not None:
        return shared
    # QUEUED too: a job found with no attempt left at dispatch is given up from the queue.
    if record.state not in (JobState.RUNNING, JobState.QUEUED):
        return _refuse(record, Refused.NOT_RUNNING)
    batch = event.batch if event.batch is not None else record.batch
    # An attempt that ran and failed for good keeps its run time, as one that finished does.
    ran = record.state is JobState.RUNNING
    run_duration_s = max(now - (record.start_time or now), 0.0) if ran else record.run_duration_s
    return record.evolve(
        state=event.state,
        error=event.error,
        end_time=now,
        update_time=now,
        batch=batch,
        run_duration_s=run_duration_s,
        dead_letter_sequence=event.dead_letter_sequence,
    )


def cancel(record: JobRecord, event: Cancel, now: float) -> Outcome:
    if is_overdue(record, now):
        return expire(record, Expire(), now)
    if record.state is JobState.QUEUED:
        error = job_errors.canceled_by_user(event.reason)
        return record.evolve(state=JobState.CANCELED, error=error, update_time=now, end_time=now)
    if record.state is JobState.RUNNING:
        return record.evolve(
            state=JobState.CANCELLING, error=job_errors.canceled_by_user(event.reason), update_time=now
        )
    return _refuse(record, Refused.ALREADY_ENDED)


def expire(record: JobRecord, event: Expire, now: float) -> Outcome:
    if not is_overdue(record, now):
        return _refuse(record, Refused.NOT_OVERDUE)
    # The same error as a dispatch's expiry (dispatch above): one situation, one reason.
    error = job_errors.deadline_passed("started")
    return record.evolve(state=JobState.EXPIRED, error=error, update_time=now, end_time=now)


def replay(record: JobRecord, event: Replay, now: float) -> Outcome:
    """`attempt` keeps counting (it is the fencing token); the job gets `budget` attempts more, and
    its retry backoff starts again from the base (`failed_attempts` counts this run's failures)."""
    if record.state not in REPLAYABLE:
        return _refuse(record, Refused.NOT_REPLAYABLE)
    return record.evolve(
        state=JobState.QUEUED,
        max_attempts=record.attempt + event.budget,
        last_error=record.error,
        error=None,
        end_time=None,
        run_duration_s=None,
        outputs=(),
        update_time=now,
        failed_attempts=0,
        handed_back_in_a_row=0,
        handed_back_by=(),
        dead_letter_sequence=0,  # a replay deletes the letter
    )


def apply(record: JobRecord, event: Event, now: float) -> Outcome:
    """The record `event` makes of `record` at `now`, or why it changes nothing."""
    match event:
        case Dispatch():
            return dispatch(record, event, now)
        case Finish():
            return finish(record, event, now)
        case Drop():
            return drop(record, event, now)
        case Requeue():
            return requeue(record, event, now)
        case GiveUp():
            return give_up(record, event, now)
        case Cancel():
            return cancel(record, event, now)
        case Expire():
            return expire(record, event, now)
        case Replay():
            return replay(record, event, now)


def decider(event: Event, now: float) -> Callable[[JobRecord], JobRecord | None]:
    """`apply` in the shape JobStore.transition takes: None for a refusal."""

    def decide(current: JobRecord) -> JobRecord | None:
        outcome = apply(current, event, now)
        return None if isinstance(outcome, Refusal) else outcome

    return decide


# --- what follows a failed attempt ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndJob:
    """A non-retriable error: the job ends in `state` now."""

    state: JobState
    error: JobError


@dataclass(frozen=True, slots=True)
class RetryAfter:
    delay_s: float


@dataclass(frozen=True, slots=True)
class DeadLetterJob:
    """Retriable, but the attempts are spent: dead-letter it (with `last_error`), then end it in
    `state` (`give_up`)."""

    state: JobState
    last_error: JobError | None


FailureDecision = EndJob | RetryAfter | DeadLetterJob


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with equal jitter between a job's attempts: half the step fixed, half
    random (a retried job is never retried at once, and a burst of failures spreads out)."""

    backoff_base_s: float = 1.0
    backoff_max_s: float = 300.0

    def delay_s(self, failures: int, jitter: float) -> float:
        """The delay before the retry that follows the job's `failures`-th failure in this run (1:
        the base step). `jitter`: a number drawn uniformly from [0, 1)."""
        step = min(self.backoff_base_s * 2.0 ** max(failures - 1, 0), self.backoff_max_s)
        return step / 2 + jitter * step / 2


def after_failure(
    record: JobRecord, error: JobError, *, final_state: JobState, policy: RetryPolicy, jitter: float
) -> FailureDecision:
    """What follows attempt `record.attempt` failing with `error` (`record`: the RUNNING record of
    that attempt). `final_state`: FAILED, or TIMED_OUT for an execution timeout. The backoff grows
    with the failures since the submit or the last replay (this one included), not with `attempt`,
    which also counts the attempts given back and those before a replay."""
    if not error.retriable:
        return EndJob(state=final_state, error=error)
    if record.attempt < record.max_attempts:
        return RetryAfter(delay_s=policy.delay_s(record.failed_attempts + 1, jitter))
    return DeadLetterJob(state=final_state, last_error=error)


# A batcher's hand-back (an order answered dropped, unrun: it stops, its model is stuck, it does not
# serve the version, services/batcher/work_messages.is_handed_back) is the scheduler's routing, not
# the job's doing: the attempt is given back. The first of a row goes back at once (a rolling
# restart: another batcher takes it). A scheduler whose view of a batcher stays wrong would send it
# to the same refusal again and again, so each hand-back after the first waits the model's retry
# backoff, as a failed attempt does, and each past FREE_HAND_BACKS in a row counts as an attempt:
# such a job ends dead-lettered (FAILED, replayable) after max_attempts of them, as a job whose
# attempts keep failing does (Temporal's retry policy, Celery's max_retries), not queued forever.
# A hand-back whose batcher has since told the scheduler it no longer serves the version (LOADING
# while its Triton is out of reach, unloaded, stopping) does not count either, the first by that
# batcher in the row: the scheduler's view was put right, and the next batcher may not know yet
# (batchers sharing one Triton each learn of an outage on their own first call: past 5 of them a
# job spent attempts in one outage). A batcher does so once per outage (it takes no work for the
# model until its Triton answers again), so a second by the same batcher is a second outage with
# the job on it: a Triton going up and down, or one the job itself brings down. Those were free
# too, every time: a job could go round a flapping Triton until its deadline, or for good without
# one (each time after the row's backoff, up to retry_backoff_max_s). They count as any hand-back
# does now, past FREE_HAND_BACKS in a row (JobRecord.handed_back_by names the batchers).
FREE_HAND_BACKS = 5


@dataclass(frozen=True, slots=True)
class PutBack:
    """Back to the queue for `delay_s`; `refund`: its attempt given back."""

    delay_s: float
    refund: bool
    error: JobError


def after_hand_back(
    record: JobRecord, *, policy: RetryPolicy, jitter: float, still_served: bool = True
) -> PutBack | DeadLetterJob:
    """What follows a batcher handing attempt `record.attempt` back unrun (`record`: its RUNNING
    record, `batcher_id` the batcher's); `jitter` as for RetryPolicy.delay_s. `still_served`: the
    batcher still says it serves the version; when it no longer does, the hand-back is free however
    many came before it (its backoff still grows with them), unless that batcher handed the job
    back so before in the row (see FREE_HAND_BACKS)."""
    in_a_row = record.handed_back_in_a_row + 1
    delay_s = policy.delay_s(in_a_row - 1, jitter) if in_a_row > 1 else 0.0
    first_outage_here = not still_served and record.batcher_id not in record.handed_back_by
    if in_a_row <= FREE_HAND_BACKS or first_outage_here:
        return PutBack(delay_s=delay_s, refund=True, error=job_errors.dropped_unrun())
    error = job_errors.handed_back(in_a_row, FREE_HAND_BACKS)
    if record.attempt < record.max_attempts:
        return PutBack(delay_s=delay_s, refund=False, error=error)
    return DeadLetterJob(state=JobState.FAILED, last_error=error)


def put_back_delay_s(record: JobRecord, delay_s: float, now: float) -> float:
    """How long a job put back in the queue waits before it is offered again: `delay_s` (a retry's
    backoff), but not past its deadline, where the dispatch finds it overdue and ends it EXPIRED
    (a backoff longer than the time left kept it QUEUED past its deadline for the rest)."""
    if record.deadline is None:
        return delay_s
    return max(0.0, min(delay_s, record.deadline - now))


def give_up_event(
    record: JobRecord,
    last_error: JobError | None,
    *,
    state: JobState,
    batch: BatchInfo | None = None,
    dead_letter_sequence: int = 0,
) -> GiveUp:
    """The GiveUp that ends a dead-lettered job: its last error, marked final, with the attempts
    that counted (not `attempt`, which counts those given back too), and where its letter is."""
    error = job_errors.gave_up(last_error, record.spent_attempts, given_back=record.given_back_attempts)
    return GiveUp(
        attempt=record.attempt, state=state, error=error, batch=batch, dead_letter_sequence=dead_letter_sequence
    )
