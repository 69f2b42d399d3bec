"""The job lifecycle (asyncinfer.lifecycle) without any server: random sequences of every event a
job can meet — dispatches by racing schedulers, answers of current and older attempts, drops,
retries, lost batchers, cancels, expiry, timeouts, dead letters, replays — and the invariants that
keep jobs safe, checked after every step."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncinfer import job_errors, lifecycle
from asyncinfer.jobs import BatchInfo, JobError, JobRecord, JobState, Priority
from asyncinfer.tensors import Tensor

pytestmark = pytest.mark.unit

Q, R, S, F = JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED
CING, CED, EXP, TO = JobState.CANCELLING, JobState.CANCELED, JobState.EXPIRED, JobState.TIMED_OUT

# Every edge a job may take; anything else is a bug.
ALLOWED_EDGES = {
    (Q, R), (Q, CED), (Q, EXP), (Q, F),
    (R, R), (R, Q), (R, S), (R, F), (R, TO), (R, CING), (R, EXP),
    (CING, CED),
    (F, Q), (TO, Q),
}  # fmt: skip

OUTPUT = Tensor(name="y", datatype="FP32", shape=(1,), data=b"\x00\x00\x80?")
RETRIABLE = JobError(code=13, reason="MODEL_ERROR", message="the model raised", retriable=True)
FINAL = JobError(code=3, reason="INVALID_INPUT", message="bad input", retriable=False)
POLICY = lifecycle.RetryPolicy(backoff_base_s=1.0, backoff_max_s=30.0)


def queued(now: float = 1_000.0, **changes: object) -> JobRecord:
    record = JobRecord(
        job_id="job-1",
        tenant="acme",
        model_name="demo",
        model_version="",
        state=Q,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        max_attempts=3,
        result_retention_s=60.0,
    )
    return record.evolve(**changes)


class JobLifecycle(RuleBasedStateMachine):
    """One job, its record as the KV holds it, and the scheduler's and gateway's events on it.
    Every event is decided on the current record, as the compare-and-set loop does; racing
    writers show up as events that carry an older attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1_000.0
        self.record = queued()
        self.terminal: JobState | None = None  # the terminal state reached (reset by a replay)
        self.replays = 0
        self.runs_after_cancel = 0
        self.failures_this_run = 0  # Requeues without a refund written since the submit or a replay
        self.given_back = 0  # Requeues with a refund written, over the job's life

    @initialize(
        max_attempts=st.integers(min_value=1, max_value=4),
        deadline_in_s=st.none() | st.floats(min_value=1.0, max_value=60.0),
    )
    def submit(self, max_attempts: int, deadline_in_s: float | None) -> None:
        deadline = None if deadline_in_s is None else self.now + deadline_in_s
        self.record = queued(self.now, max_attempts=max_attempts, deadline=deadline)

    # --- applying an event, as the store's compare-and-set would --------------------------------

    def apply(self, event: lifecycle.Event) -> lifecycle.Outcome:
        before = self.record
        outcome = lifecycle.apply(before, event, self.now)
        if isinstance(outcome, lifecycle.Refusal):
            assert outcome.state is before.state
            return outcome
        assert (before.state, outcome.state) in ALLOWED_EDGES, (before.state, outcome.state, event)
        assert outcome.job_id == before.job_id
        assert outcome.tenant == before.tenant
        if before.state.is_terminal:
            assert isinstance(event, lifecycle.Replay), f"a terminal job changed on {event}"
        if before.state in (CING, CED) and outcome.state is R:
            self.runs_after_cancel += 1
        if outcome.state.is_terminal:
            assert self.terminal is None, f"a second terminal state: {self.terminal} then {outcome.state}"
            self.terminal = outcome.state
        if isinstance(event, lifecycle.Replay):
            self.terminal = None
            self.replays += 1
            self.failures_this_run = 0
        if isinstance(event, lifecycle.Requeue) and outcome.state is Q and not event.refund:
            self.failures_this_run += 1
        if isinstance(event, lifecycle.Requeue) and outcome.state is Q and event.refund:
            self.given_back += 1
        self.record = outcome
        return outcome

    def attempt_of(self, age: int) -> int:
        """The attempt `age` dispatches ago (0: the current one)."""
        return max(self.record.attempt - age, 0)

    # --- time ----------------------------------------------------------------------------------

    @rule(seconds=st.floats(min_value=0.0, max_value=30.0))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    # --- the scheduler -------------------------------------------------------------------------

    @rule(batcher=st.sampled_from(["b1", "b2"]))
    def dispatch(self, batcher: str) -> None:
        """A scheduler pulled the message (again, if the lease lapsed)."""
        before = self.record
        outcome = self.apply(lifecycle.Dispatch(batcher_id=batcher))
        if isinstance(outcome, lifecycle.Refusal) and outcome.reason is lifecycle.Refused.ATTEMPTS_SPENT:
            # As job_dispatch does: no attempt left, so it is dead-lettered from where it is.
            event = lifecycle.give_up_event(before, lifecycle.spent_attempt_error(before), state=F)
            given_up = self.apply(event)
            assert isinstance(given_up, JobRecord)
            assert given_up.state is F
            assert given_up.error is not None
            assert not given_up.error.retriable
        elif isinstance(outcome, JobRecord) and outcome.state is R:
            assert outcome.attempt == before.attempt + 1
            assert outcome.batcher_id == batcher
            if before.state is R:
                assert outcome.last_error is not None
                assert outcome.last_error.reason == job_errors.LEASE_EXPIRED
        elif before.state is CING:
            assert isinstance(outcome, JobRecord)
            assert outcome.state is CED

    @rule(age=st.integers(min_value=0, max_value=2), state=st.sampled_from([S, F, TO]))
    def attempt_answers(self, age: int, state: JobState) -> None:
        """A result (or a final error) arrives for an attempt, maybe an older one."""
        attempt = self.attempt_of(age)
        before = self.record
        error = None if state is S else FINAL
        outputs = (OUTPUT,) if state is S else ()
        batch = BatchInfo(batcher_id="b1", batch_size=4, compute_s=0.01)
        outcome = self.apply(lifecycle.Finish(attempt=attempt, state=state, outputs=outputs, error=error, batch=batch))
        if attempt != before.attempt:
            assert outcome == lifecycle.Refusal(lifecycle.Refused.STALE_ATTEMPT, before.state)
        elif before.state is CING:
            assert isinstance(outcome, JobRecord)
            assert outcome.state is CED
            assert outcome.outputs == ()
        elif before.state is R:
            assert isinstance(outcome, JobRecord)
            assert outcome.state is state

    @rule(age=st.integers(min_value=0, max_value=1), retriable=st.booleans(), timed_out=st.booleans())
    def attempt_fails(self, age: int, retriable: bool, timed_out: bool) -> None:
        """The attempt failed (or ran past its execution timeout): the scheduler decides."""
        attempt = self.attempt_of(age)
        running = self.record.evolve(attempt=attempt) if age else self.record
        if running.state is not R:
            return
        error = RETRIABLE if retriable else FINAL
        final_state = TO if timed_out else F
        decision = lifecycle.after_failure(running, error, final_state=final_state, policy=POLICY, jitter=0.5)
        match decision:
            case lifecycle.EndJob(state=state, error=final_error):
                assert not retriable
                event: lifecycle.Event = lifecycle.Finish(attempt=attempt, state=state, error=final_error)
            case lifecycle.RetryAfter(delay_s=delay_s):
                assert retriable
                assert running.attempt < running.max_attempts
                # The step of this run's failures, this one included (jitter 0.5: three quarters).
                step = min(2.0**self.failures_this_run, POLICY.backoff_max_s)
                assert delay_s == pytest.approx(step * 0.75)
                event = lifecycle.Requeue(attempt=attempt, error=error)
            case lifecycle.DeadLetterJob(state=state, last_error=last_error):
                assert retriable
                assert running.attempt >= running.max_attempts
                event = lifecycle.give_up_event(running, last_error, state=state)
        before = self.record
        outcome = self.apply(event)
        if attempt != before.attempt:
            assert isinstance(outcome, lifecycle.Refusal)

    @rule(age=st.integers(min_value=0, max_value=1))
    def batcher_drops(self, age: int) -> None:
        attempt = self.attempt_of(age)
        before = self.record
        outcome = self.apply(lifecycle.Drop(attempt=attempt))
        if isinstance(outcome, lifecycle.Refusal) and outcome.reason is lifecycle.Refused.NOT_DROPPED:
            # Put back without spending the attempt.
            refunded = self.apply(lifecycle.Requeue(attempt=attempt, error=job_errors.dropped_unrun(), refund=True))
            if isinstance(refunded, JobRecord):
                assert refunded.max_attempts == before.max_attempts + 1

    @rule(age=st.integers(min_value=0, max_value=1), refund=st.booleans())
    def batcher_lost_or_scheduler_stopped(self, age: int, refund: bool) -> None:
        attempt = self.attempt_of(age)
        error = job_errors.scheduler_stopping() if refund else job_errors.worker_lost("b1", attempt)
        self.apply(lifecycle.Requeue(attempt=attempt, error=error, refund=refund))

    @rule(age=st.integers(min_value=1, max_value=2))
    def stale_give_up(self, age: int) -> None:
        """A scheduler that lost its lease gives up an attempt that is no longer the current one."""
        before = self.record
        outcome = self.apply(lifecycle.GiveUp(attempt=self.attempt_of(age), state=F, error=FINAL))
        if before.attempt >= age:
            assert outcome == lifecycle.Refusal(lifecycle.Refused.STALE_ATTEMPT, before.state)

    # --- the gateway and operators -------------------------------------------------------------

    @rule(reason=st.sampled_from(["", "changed my mind"]))
    def user_cancels(self, reason: str) -> None:
        before = self.record
        outcome = self.apply(lifecycle.Cancel(reason=reason))
        if before.state is R:
            assert isinstance(outcome, JobRecord)
            assert outcome.state is CING
            assert outcome.error is not None
            assert outcome.error.reason == job_errors.CANCELED_BY_USER

    @rule()
    def reader_expires(self) -> None:
        self.apply(lifecycle.Expire())

    @precondition(lambda self: self.replays < 2)
    @rule(budget=st.integers(min_value=1, max_value=3))
    def operator_replays(self, budget: int) -> None:
        before = self.record
        outcome = self.apply(lifecycle.Replay(budget=budget))
        if before.state in lifecycle.REPLAYABLE:
            assert isinstance(outcome, JobRecord)
            assert outcome.attempt == before.attempt
            assert outcome.max_attempts == before.attempt + budget
            assert outcome.last_error == before.error
            assert outcome.error is None

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def attempts_never_exceed_max_attempts(self) -> None:
        assert 0 <= self.record.attempt <= self.record.max_attempts

    @invariant()
    def failed_attempts_count_this_runs_failures(self) -> None:
        assert self.record.failed_attempts == self.failures_this_run

    @invariant()
    def the_attempts_spent_are_those_not_given_back(self) -> None:
        assert self.record.given_back_attempts == self.given_back
        assert self.record.spent_attempts == self.record.attempt - self.given_back >= 0

    @invariant()
    def one_terminal_state(self) -> None:
        if self.terminal is not None:
            assert self.record.state is self.terminal

    @invariant()
    def a_canceled_job_never_runs_again(self) -> None:
        assert self.runs_after_cancel == 0

    @invariant()
    def outputs_only_when_succeeded(self) -> None:
        if self.record.outputs:
            assert self.record.state is S

    @invariant()
    def terminal_records_say_when(self) -> None:
        if self.record.state.is_terminal:
            assert self.record.end_time is not None
        if self.record.state in (F, TO, EXP):
            assert self.record.error is not None


JobLifecycle.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestJobLifecycle = JobLifecycle.TestCase


# --- single rules, exactly ------------------------------------------------------------------------


def test_dispatch_counts_the_attempt_and_measures_the_queue_time() -> None:
    started = lifecycle.apply(queued(), lifecycle.Dispatch(batcher_id="b1"), 1_002.5)
    assert isinstance(started, JobRecord)
    assert (started.state, started.attempt, started.batcher_id) == (R, 1, "b1")
    assert (started.start_time, started.queue_duration_s, started.update_time) == (1_002.5, 2.5, 1_002.5)


def test_dispatch_past_the_deadline_expires_the_job() -> None:
    expired = lifecycle.apply(queued(deadline=1_001.0), lifecycle.Dispatch(batcher_id="b1"), 1_001.0)
    assert isinstance(expired, JobRecord)
    assert expired.state is EXP
    assert expired.error is not None
    assert expired.error.reason == job_errors.DEADLINE_EXCEEDED


def test_a_reader_expires_an_overdue_job_and_nothing_else() -> None:
    overdue = queued(deadline=1_001.0)
    assert lifecycle.apply(overdue, lifecycle.Expire(), 1_000.5) == lifecycle.Refusal(lifecycle.Refused.NOT_OVERDUE, Q)
    expired = lifecycle.apply(overdue, lifecycle.Expire(), 1_001.0)
    assert isinstance(expired, JobRecord)
    assert expired.state is EXP
    # A reader's expiry and a dispatch's write the same error (they wrote two reasons).
    at_dispatch = lifecycle.apply(overdue, lifecycle.Dispatch(batcher_id="b1"), 1_001.0)
    assert isinstance(at_dispatch, JobRecord)
    assert expired.error == at_dispatch.error
    assert expired.error is not None
    assert expired.error.reason == job_errors.DEADLINE_EXCEEDED
    assert expired.error.reason in job_errors.EXPIRED_REASONS


def test_cancel_of_a_queued_job_ends_it_and_of_a_running_one_asks_it_to_stop() -> None:
    canceled = lifecycle.apply(queued(), lifecycle.Cancel(reason="x" * 600), 1_001.0)
    assert isinstance(canceled, JobRecord)
    assert canceled.state is CED
    assert canceled.error is not None
    assert len(canceled.error.message) == len("canceled by the user: ") + 512
    running = queued(state=R, attempt=1)
    cancelling = lifecycle.apply(running, lifecycle.Cancel(), 1_001.0)
    assert isinstance(cancelling, JobRecord)
    assert cancelling.state is CING
    assert cancelling.end_time is None
    refused = lifecycle.apply(cancelling, lifecycle.Cancel(), 1_002.0)
    assert refused == lifecycle.Refusal(lifecycle.Refused.ALREADY_ENDED, CING)


def test_a_result_after_a_cancel_is_discarded_and_the_cancel_error_kept() -> None:
    running = queued(state=R, attempt=1, start_time=1_000.5)
    cancelling = lifecycle.apply(running, lifecycle.Cancel(reason="stop"), 1_001.0)
    assert isinstance(cancelling, JobRecord)
    done = lifecycle.apply(cancelling, lifecycle.Finish(attempt=1, state=S, outputs=(OUTPUT,)), 1_002.0)
    assert isinstance(done, JobRecord)
    assert (done.state, done.outputs, done.end_time) == (CED, (), 1_002.0)
    assert done.error == cancelling.error
    assert done.run_duration_s == 1.5  # the attempt ran until its answer, as a finished one counts
    dropped = lifecycle.apply(cancelling, lifecycle.Drop(attempt=1), 1_001.5)
    assert isinstance(dropped, JobRecord)
    assert (dropped.state, dropped.run_duration_s) == (CED, None)  # dropped unrun: it did not run


def test_a_large_result_is_kept_by_reference_only() -> None:
    running = queued(state=R, attempt=1, start_time=1_000.0)
    from asyncinfer.jobs import BlobRef

    ref = BlobRef(ref="results/job-1", size_bytes=10_000_000, sha256="0" * 64)
    done = lifecycle.apply(running, lifecycle.Finish(attempt=1, state=S, outputs=(OUTPUT,), result_ref=ref), 1_003.0)
    assert isinstance(done, JobRecord)
    assert (done.outputs, done.result_ref, done.run_duration_s) == ((), ref, 3.0)


def test_a_refunded_attempt_does_not_count() -> None:
    running = queued(state=R, attempt=3, max_attempts=3)
    back = lifecycle.apply(running, lifecycle.Requeue(attempt=3, error=job_errors.dropped_unrun(), refund=True), 1.0)
    assert isinstance(back, JobRecord)
    assert (back.state, back.attempt, back.max_attempts) == (Q, 3, 4)


def test_hand_backs_in_a_row_back_off_then_count_and_anything_else_ends_the_row() -> None:
    """A batcher's hand-back: the first of a row at once, each after it the backoff of the
    hand-backs before it, each past FREE_HAND_BACKS an attempt (dead-lettered at the last); an
    attempt that ran and failed, or a put-back for another reason, starts the row again."""
    record = queued(max_attempts=3)
    now = 1_000.0

    def handed_back(queued_record: JobRecord) -> tuple[JobRecord, lifecycle.PutBack | lifecycle.DeadLetterJob]:
        running = lifecycle.apply(queued_record, lifecycle.Dispatch(batcher_id="b1"), now)
        assert isinstance(running, JobRecord)
        decision = lifecycle.after_hand_back(running, policy=POLICY, jitter=0.0)
        if isinstance(decision, lifecycle.DeadLetterJob):
            return running, decision
        back = lifecycle.Requeue(running.attempt, decision.error, refund=decision.refund, handed_back=True)
        requeued = lifecycle.apply(running, back, now)
        assert isinstance(requeued, JobRecord)
        return requeued, decision

    seen = []
    for _ in range(lifecycle.FREE_HAND_BACKS):
        record, decision = handed_back(record)
        assert isinstance(decision, lifecycle.PutBack)
        seen.append((decision.delay_s, decision.refund))
    assert seen == [(0.0, True), (0.5, True), (1.0, True), (2.0, True), (4.0, True)]
    assert (record.handed_back_in_a_row, record.given_back_attempts, record.spent_attempts) == (5, 5, 0)

    # A failed attempt ends the row: the next hand-back goes at once, free.
    running = lifecycle.apply(record, lifecycle.Dispatch(batcher_id="b1"), now)
    assert isinstance(running, JobRecord)
    record = lifecycle.apply(running, lifecycle.Requeue(attempt=running.attempt, error=RETRIABLE), now)
    assert isinstance(record, JobRecord)
    assert record.handed_back_in_a_row == 0
    for _ in range(lifecycle.FREE_HAND_BACKS):
        record, decision = handed_back(record)
    assert (record.attempt, record.max_attempts, record.spent_attempts) == (11, 13, 1)

    record, decision = handed_back(record)  # the 6th in a row counts
    assert decision == lifecycle.PutBack(delay_s=8.0, refund=False, error=job_errors.handed_back(6, 5))
    assert (record.attempt, record.max_attempts, record.spent_attempts, record.handed_back_in_a_row) == (12, 13, 2, 6)
    record, decision = handed_back(record)  # on attempt 13, the last
    assert decision == lifecycle.DeadLetterJob(state=F, last_error=job_errors.handed_back(7, 5))


def test_a_hand_back_whose_batcher_no_longer_serves_the_version_never_counts() -> None:
    """Batchers that each announce the version LOADING (their Triton out of reach), or stop, before
    they hand the job back: the row grows (and its backoff) but none counts, past FREE_HAND_BACKS as
    before it; the next hand-back by a batcher that still serves the version counts as before."""
    record = queued(max_attempts=1)
    now = 1_000.0
    delays = []
    for index, served in enumerate([False] * (lifecycle.FREE_HAND_BACKS + 3) + [True]):
        running = lifecycle.apply(record, lifecycle.Dispatch(batcher_id=f"b{index}"), now)
        assert isinstance(running, JobRecord)
        decision = lifecycle.after_hand_back(running, policy=POLICY, jitter=0.0, still_served=served)
        if served:
            assert decision == lifecycle.DeadLetterJob(state=F, last_error=job_errors.handed_back(9, 5))
            break
        assert isinstance(decision, lifecycle.PutBack)
        assert decision.refund
        delays.append(decision.delay_s)
        back = lifecycle.Requeue(running.attempt, decision.error, refund=True, handed_back=True, out_of_reach=True)
        requeued = lifecycle.apply(running, back, now)
        assert isinstance(requeued, JobRecord)
        record = requeued
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0]  # up to half of backoff_max_s at jitter 0
    assert (record.handed_back_in_a_row, record.given_back_attempts, record.spent_attempts) == (8, 8, 0)


def test_a_batcher_whose_triton_goes_down_again_with_the_job_on_it_counts_past_the_free_hand_backs() -> None:
    """A batcher hands a job back out of reach (its version LOADING) once per outage of its Triton:
    it takes no work for the model until the server answers again. The same batcher handing the same
    job back so again is a second outage with the job on it (a Triton flapping, or one the job
    brings down), and was free as the first: the job went round for as long as the Triton flapped,
    until its deadline, or for good without one. Now those count past FREE_HAND_BACKS in a row, as
    any hand-back does; another batcher's first is still free, and a replay starts a new row."""
    record = queued(max_attempts=2)
    now = 1_000.0
    decisions: list[lifecycle.PutBack | lifecycle.DeadLetterJob] = []

    def out_of_reach_on(batcher_id: str) -> JobRecord:
        running = lifecycle.apply(record, lifecycle.Dispatch(batcher_id=batcher_id), now)
        assert isinstance(running, JobRecord)
        decision = lifecycle.after_hand_back(running, policy=POLICY, jitter=0.0, still_served=False)
        decisions.append(decision)
        if isinstance(decision, lifecycle.DeadLetterJob):
            return running
        back = lifecycle.Requeue(
            running.attempt, decision.error, refund=decision.refund, handed_back=True, out_of_reach=True
        )
        requeued = lifecycle.apply(running, back, now)
        assert isinstance(requeued, JobRecord)
        return requeued

    for _ in range(lifecycle.FREE_HAND_BACKS):
        record = out_of_reach_on("flapping")
    assert record.handed_back_by == ("flapping",)
    record = out_of_reach_on("another")  # its own first outage with the job: free
    assert record.handed_back_by == ("flapping", "another")
    assert [isinstance(d, lifecycle.PutBack) and d.refund for d in decisions] == [True] * 6
    record = out_of_reach_on("flapping")  # the 7th in a row, this batcher's again: counts
    assert decisions[-1] == lifecycle.PutBack(delay_s=15.0, refund=False, error=job_errors.handed_back(7, 5))
    assert (record.state, record.spent_attempts, record.given_back_attempts) == (JobState.QUEUED, 1, 6)
    running = out_of_reach_on("flapping")  # on its last attempt
    assert decisions[-1] == lifecycle.DeadLetterJob(state=F, last_error=job_errors.handed_back(8, 5))
    assert running.state is JobState.RUNNING

    # A failed attempt that ran ends the row, and with it the batchers named.
    ran = lifecycle.apply(record, lifecycle.Dispatch(batcher_id="flapping"), now)
    assert isinstance(ran, JobRecord)
    failed = lifecycle.apply(ran, lifecycle.Requeue(attempt=ran.attempt, error=RETRIABLE), now)
    assert isinstance(failed, JobRecord)
    assert (failed.handed_back_in_a_row, failed.handed_back_by) == (0, ())


def test_the_backoff_counts_the_failures_of_this_run_not_the_attempts() -> None:
    """Four attempts given back (shed, a scheduler's stop) and then a failure: the base backoff, not
    2**4 times it; the next failure doubles it; a replay starts again from the base."""
    record = queued(max_attempts=3)
    now = 1_000.0
    for _ in range(4):
        running = lifecycle.apply(record, lifecycle.Dispatch(batcher_id="b1"), now)
        assert isinstance(running, JobRecord)
        back = lifecycle.Requeue(attempt=running.attempt, error=job_errors.scheduler_stopping(), refund=True)
        requeued = lifecycle.apply(running, back, now)
        assert isinstance(requeued, JobRecord)
        record = requeued
    assert (record.attempt, record.max_attempts, record.failed_attempts) == (4, 7, 0)

    def fails(queued_record: JobRecord) -> tuple[JobRecord, float]:
        """Dispatched, failed: the record put back and the retry's delay (jitter 0: half the step)."""
        running = lifecycle.apply(queued_record, lifecycle.Dispatch(batcher_id="b1"), now)
        assert isinstance(running, JobRecord)
        decision = lifecycle.after_failure(running, RETRIABLE, final_state=F, policy=POLICY, jitter=0.0)
        assert isinstance(decision, lifecycle.RetryAfter)
        requeued = lifecycle.apply(running, lifecycle.Requeue(attempt=running.attempt, error=RETRIABLE), now)
        assert isinstance(requeued, JobRecord)
        return requeued, decision.delay_s

    record, first_delay_s = fails(record)
    assert (record.attempt, record.failed_attempts, first_delay_s) == (5, 1, 0.5)
    record, second_delay_s = fails(record)
    assert (record.attempt, record.failed_attempts, second_delay_s) == (6, 2, 1.0)
    # Ended FAILED (by hand: a final error); replayed, its next failure waits the base step again.
    ended = lifecycle.apply(record.evolve(state=F, error=RETRIABLE, end_time=now), lifecycle.Replay(budget=3), now)
    assert isinstance(ended, JobRecord)
    assert (ended.attempt, ended.max_attempts, ended.failed_attempts) == (6, 9, 0)
    _, replayed_delay_s = fails(ended)
    assert replayed_delay_s == 0.5


def test_the_last_attempt_is_dead_lettered_with_its_error_marked_final() -> None:
    running = queued(state=R, attempt=3, max_attempts=3)
    decision = lifecycle.after_failure(running, RETRIABLE, final_state=F, policy=POLICY, jitter=0.0)
    assert decision == lifecycle.DeadLetterJob(state=F, last_error=RETRIABLE)
    event = lifecycle.give_up_event(running, RETRIABLE, state=F)
    assert event.error.message == "the model raised (gave up after 3 attempts)"
    assert not event.error.retriable


def test_a_give_up_counts_the_attempts_spent_not_those_given_back() -> None:
    """max_attempts 2, given back four times (shed, a scheduler's stop), then failing twice: it gave
    up after 2 attempts, at attempt 6, and says the 4 given back apart."""
    record = queued(max_attempts=2)
    now = 1_000.0
    for given_back in (True, True, True, True, False, None):
        running = lifecycle.apply(record, lifecycle.Dispatch(batcher_id="b1"), now)
        assert isinstance(running, JobRecord)
        if given_back is None:
            break
        error = job_errors.scheduler_stopping() if given_back else RETRIABLE
        requeued = lifecycle.apply(
            running, lifecycle.Requeue(attempt=running.attempt, error=error, refund=given_back), now
        )
        assert isinstance(requeued, JobRecord)
        record = requeued
    assert (running.attempt, running.max_attempts, running.given_back_attempts, running.spent_attempts) == (6, 6, 4, 2)
    decision = lifecycle.after_failure(running, RETRIABLE, final_state=F, policy=POLICY, jitter=0.0)
    assert decision == lifecycle.DeadLetterJob(state=F, last_error=RETRIABLE)
    event = lifecycle.give_up_event(running, RETRIABLE, state=F)
    assert event.error.message == "the model raised (gave up after 2 attempts, not counting 4 given back)"
    ended = lifecycle.apply(running, event, now)
    assert isinstance(ended, JobRecord)
    # A replay keeps the count of the job's life: its next give-up says 2 + the replay's budget.
    replayed = lifecycle.apply(ended, lifecycle.Replay(budget=1), now)
    assert isinstance(replayed, JobRecord)
    assert (replayed.given_back_attempts, replayed.spent_attempts) == (4, 2)


def test_a_give_up_writes_its_letters_sequence_on_the_record_and_a_replay_clears_it() -> None:
    """The record that ends a dead-lettered job names its letter (its sequence in the dead-letter
    stream, stored before the record is written), so that its page and `asyncinfer get` link it
    without searching the model's letters; a replay deletes the letter, and the record stops naming it."""
    running = lifecycle.apply(queued(max_attempts=1), lifecycle.Dispatch(batcher_id="b1"), 1_000.0)
    assert isinstance(running, JobRecord)
    ended = lifecycle.apply(running, lifecycle.give_up_event(running, RETRIABLE, state=F, dead_letter_sequence=42), 1.0)
    assert isinstance(ended, JobRecord)
    assert (ended.state, ended.dead_letter_sequence) == (F, 42)
    replayed = lifecycle.apply(ended, lifecycle.Replay(budget=1), 2.0)
    assert isinstance(replayed, JobRecord)
    assert (replayed.state, replayed.dead_letter_sequence) == (JobState.QUEUED, 0)


@pytest.mark.parametrize(
    ("deadline", "delay_s"), [(None, 40.0), (1_100.0, 40.0), (1_010.0, 10.0), (1_000.0, 0.0), (990.0, 0.0)]
)
def test_a_put_back_job_waits_its_delay_or_until_its_deadline(deadline: float | None, delay_s: float) -> None:
    running = queued(state=R, attempt=1, deadline=deadline)
    assert lifecycle.put_back_delay_s(running, 40.0, 1_000.0) == delay_s


@pytest.mark.parametrize(
    ("failures", "jitter", "delay_s"), [(1, 0.0, 0.5), (1, 0.999, 0.9995), (3, 0.0, 2.0), (9, 1.0, 30.0)]
)
def test_retry_delays_double_with_equal_jitter_up_to_the_cap(failures: int, jitter: float, delay_s: float) -> None:
    assert POLICY.delay_s(failures, jitter) == pytest.approx(delay_s)


def test_retry_delays_stay_within_half_and_whole_step() -> None:
    rng = random.Random(7)
    for failures in range(1, 12):
        step = min(2.0 ** (failures - 1), POLICY.backoff_max_s)
        for _ in range(50):
            assert step / 2 <= POLICY.delay_s(failures, rng.random()) <= step


def test_decider_maps_refusals_to_no_write() -> None:
    decide = lifecycle.decider(lifecycle.Finish(attempt=5, state=S), 1.0)
    assert decide(queued(state=R, attempt=1)) is None
    assert decide(queued(state=R, attempt=5)) is not None
