"""The dispatch loop of one model.

It runs only while a connected batcher has a credit for the model, the model's queue is not
paused and the scheduler is not draining. With credits reserved it chooses the next jobs at that moment (no-wait pulls of at most
that many messages, weighted across priorities: see services.scheduler.priority), so a job is
never taken from the queue before there is somewhere to run it. When every queue is empty it sleeps
until a queued notice for the model rings the doorbell (asyncinfer.queued_notice), or until the
poll interval passes (which catches redeliveries, delayed retries, messages published while it was
down and any whose notice was lost). With `hold_pulls_open`, an idle dispatcher instead holds a pull
open on each priority's queue (services.scheduler.held_pulls), so that a job reaches it as the
stream stores it rather than a notice and a pull later; while every one is open there is nothing
to poll for, and it polls again only once one ends (see `_idle`). Under a steady stream of jobs that
outpaces its rounds, a small round is followed by a short wait (`dispatch_linger_ms`,
services.scheduler.dispatch_linger), so that jobs arriving one at a time go out together. A round waits for its dispatches
before the next pull, except a dispatch that reads a claim-checked input first (a file batch's
chunk): that one goes on alone, owned here, and `stop` and `settled` wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator

import structlog

from asyncinfer.contract import WORK_SUBJECT_PREFIX, queued_subjects
from asyncinfer.failure_lines import FailureLines
from asyncinfer.jobs import PRIORITIES_BY_RANK, Priority
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg, Subscription
from asyncinfer.nats.pull_inbox import PullEnd
from asyncinfer.queued_notice import decode_queued_notice
from asyncinfer.supervision import Supervisor
from services.scheduler.batchers import BatcherRegistry, BatcherSession
from services.scheduler.dispatch_linger import DispatchLinger
from services.scheduler.held_pulls import CONNECTION_CHECK_S, HeldPulls
from services.scheduler.job_dispatch import INPUT_READ_STARTED, PUT_BACK_UNRUN
from services.scheduler.jobs_flow import JobFlow
from services.scheduler.owned_tasks import OwnedTasks
from services.scheduler.queued_records import QueuedRecords
from services.scheduler.work_queue import ModelQueues

log = structlog.get_logger("asyncinfer.scheduler.dispatcher")

PRIORITY_BY_SUBJECT_TOKEN = {p.subject_token: p for p in PRIORITIES_BY_RANK}
# The most jobs taken from the queue in one round (bounded by free credits anyway).
MAX_PULL_PER_ROUND = 64


class RoundWait:
    """The dispatches of a round it still waits for: each leaves once, when it ends or goes on to
    read an input."""

    def __init__(self, count: int) -> None:
        self._waiting = set(range(count))
        self._all_left = asyncio.Event()

    def leave(self, index: int) -> None:
        self._waiting.discard(index)
        if not self._waiting:
            self._all_left.set()

    async def wait(self) -> None:
        if self._waiting:
            await self._all_left.wait()


class ModelDispatcher:
    def __init__(
        self,
        *,
        nc: NatsClient,
        queues: ModelQueues,
        batchers: BatcherRegistry,
        flow: JobFlow,
        poll_interval_s: float,
        queued_records: QueuedRecords,
        supervisor: Supervisor,
        resumed: asyncio.Event | None = None,
        undrained: asyncio.Event | None = None,
        on_queued: Callable[[str], None] | None = None,
        hold_pulls_open: bool = False,
        linger_s: float = 0.0,
        on_linger: Callable[[str], None] | None = None,
    ) -> None:
        self.model_name = queues.model_name
        self._supervisor = supervisor
        self._nc = nc
        self._queues = queues
        self._batchers = batchers
        self._flow = flow
        self._poll_interval_s = poll_interval_s
        # Both set while dispatching may go on: the model is not paused, the scheduler not draining.
        self._gates = tuple(gate for gate in (resumed, undrained) if gate is not None)
        self._on_queued = on_queued
        # Set while no round (and no held pull's dispatch) is under way: `settled` waits on it, so
        # that a drain knows no pull is under way.
        self._between_rounds = asyncio.Event()
        self._between_rounds.set()
        self._rounds_under_way = 0
        self._queued_records = queued_records
        self._doorbell = asyncio.Event()
        self._stopping = asyncio.Event()
        self._subscription: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._linger = DispatchLinger(linger_s)
        self._on_linger = on_linger
        # A round that fails fails again at the next poll: one line per interval, not one a round.
        self._pull_failures = FailureLines()
        self._held = (
            HeldPulls(queues, deliver=self._deliver_held, failures=self._pull_failures) if hold_pulls_open else None
        )
        # A round's dispatches, some of which outlast it (reading an input: see _round).
        self._dispatches = OwnedTasks(f"dispatch-{self.model_name}")

    async def start(self) -> None:
        # Queued notices ring the doorbell: they are sent once the job can be pulled (a core
        # subscription to the work subjects can see a publish before the stream has stored it).
        self._subscription = await self._nc.subscribe(queued_subjects(self.model_name), cb=self._ring)
        self._task = self._supervisor.start(f"dispatch-{self.model_name}", self._run())

    @property
    def queues(self) -> ModelQueues:
        return self._queues

    async def stop(self) -> Counter[PullEnd]:
        """Stops taking new work; returns once the loop has ended (mid-dispatch work completes),
        with how the pulls held open at the stop ended (HeldPulls.close). Idempotent."""
        self._stopping.set()
        if self._task is not None:
            await self._task
        await self._dispatches.close()
        held_ends: Counter[PullEnd] = Counter()
        if self._held is not None:
            held_ends = await self._held.close()  # what they brought is put back
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None
        await self._queues.close()
        return held_ends

    async def settled(self) -> None:
        """Returns once no round is under way (a round that had begun has dispatched what it pulled),
        nor a dispatch of what a held pull brought. A pull may still be held open (for up to
        services.scheduler.held_pulls.HOLD_S): what it brings once dispatching stopped is put back (_deliver_held)."""
        await self._between_rounds.wait()

    async def _ring(self, msg: Msg) -> None:
        try:
            key, revision, record_data = decode_queued_notice(msg.data)
        except ValueError:
            log.warning("queued_notice_malformed", subject=msg.subject)
        else:
            # A submit's notice (revision 0) announces a record its work message carries itself:
            # only a replay's (the record in the bucket) saves the dispatch a read.
            if revision:
                self._queued_records.put(key, revision, record_data)
            if self._on_queued is not None:
                self._on_queued(self.model_name)
        self.wake(msg.subject)

    def holding(self, priority: Priority) -> bool:
        """Whether a pull of this dispatcher's is held open on the priority's queue."""
        return self._held is not None and self._held.holding(priority)

    def wake(self, subject: str) -> None:
        """A message was published to (or put back on) the queue that `subject` names (a queued
        notice's subject, or the priority's token alone): it is worth asking again."""
        priority = PRIORITY_BY_SUBJECT_TOKEN.get(subject.rpartition(".")[2])
        if priority is not None:
            self._queues.note_publish(priority)
            if self._held is not None and self._held.holding(priority):
                return  # the held pull brings it
        self._doorbell.set()

    async def _run(self) -> None:
        credit = self._batchers.credit_event(self.model_name)
        while await self._wait(credit):
            closed = next((gate for gate in self._gates if not gate.is_set()), None)
            if closed is not None:
                await self._wait(closed)
                continue
            with self._under_way():
                pulled = await self._round()
            linger_s = self._linger.after_round(pulled or 0, self._queues.found_waiting)
            if linger_s:
                if self._on_linger is not None:
                    self._on_linger(self.model_name)
                await self._wait(self._stopping, timeout_s=linger_s)
            if pulled == 0:
                await self._idle()

    async def _idle(self) -> None:
        """Waits, after a round found the queues empty, until the doorbell rings or they are worth
        asking again. While a pull is held open on every priority's queue, whatever a queue gets
        next reaches one (a job, a redelivery, a retry whose delay passed): no poll, until one
        ends (it brought a job, expired or was refused) or their connection is lost or back (the
        client's callbacks say so; looked at every CONNECTION_CHECK_S besides: no request). Otherwise, or after that, every poll interval as
        without them (so a pull that cannot be held, NATS away, does not make a loop of rounds)."""
        held = self._held
        if held is not None:
            held.open()
            while True:
                while True:
                    changed = self._queues.connection_changed()  # before the look: no change missed
                    if not held.holding_all() or held.one_ended.is_set():
                        break
                    if not await self._wait(self._doorbell, held.one_ended, changed, timeout_s=CONNECTION_CHECK_S):
                        return  # stopping
                    if self._doorbell.is_set():
                        return
                if not held.only_expired() or not self._may_dispatch():
                    break  # a round decides (or the loop waits for a credit, a resume, an undrain)
                held.open()  # they expired empty: a round (a pull per priority) would find nothing
        await self._wait(self._doorbell, timeout_s=self._poll_interval_s)

    def _may_dispatch(self) -> bool:
        """Whether a round could run now: a credit free, the gates open, not stopping."""
        return self._batchers.credit_event(self.model_name).is_set() and self._gates_open()

    async def _round(self) -> int | None:
        """Reserves credits, pulls at most that many jobs and dispatches them; how many it
        pulled (0: the queues had nothing to give; None: no credit was left)."""
        # Reserve the credits first, then pull at most that many: nothing is taken from the
        # queue without somewhere to run it. Pulling several at once (rather than one per
        # round trip) is what lets the batcher form batches under load.
        sessions: list[BatcherSession] = []
        while len(sessions) < MAX_PULL_PER_ROUND:
            session = self._batchers.reserve(self.model_name)
            if session is None:
                break
            sessions.append(session)
        if not sessions:
            return None
        self._doorbell.clear()
        try:
            msgs = await self._queues.pull_next(len(sessions))
        except Exception as exc:
            self._pull_failures.failed(log, "pull_failed", exc, model=self.model_name)
            msgs = []
        for session in sessions[len(msgs) :]:
            self._batchers.release(session, self.model_name)
        if not msgs:
            return 0
        if not self._gates_open():
            # A pause or a drain came while the pull was out (a loaded machine: tens of ms; the
            # round's gates were open when it began): what it brought waits as a held pull's
            # delivery does, so that no job starts once PauseQueue has answered (CI: a job
            # submitted after the pause was pulled by a round begun before it, and ran). Nor do
            # their tenants and priorities pay for them: the pull's charges are refunded.
            self._queues.refund_last_pull()
            for msg, session in zip(msgs, sessions, strict=False):
                self._batchers.release(session, self.model_name)
                await self._put_back(msg, self._priority_of(msg))
            return len(msgs)
        # The round waits for its dispatches (the jobs published meanwhile are then pulled
        # together), except one that goes on to read a claim-checked input (a file batch's chunk:
        # megabytes, tens to hundreds of ms): that one goes on alone, so that a job of any priority
        # published meanwhile is not held behind it (session 17: an interactive job waited 0.18 s
        # for a round of eight chunks' reads).
        waiting = RoundWait(len(msgs))
        for index, (msg, session) in enumerate(zip(msgs, sessions, strict=False)):
            self._dispatches.spawn(self._dispatch(msg, session, functools.partial(waiting.leave, index)))
        await waiting.wait()  # one still reading its input stays under way until it ends (_dispatch)
        return len(msgs)

    async def _dispatch(self, msg: Msg, session: BatcherSession, leave_round: Callable[[], None]) -> None:
        """One job of a round, its credit given back when it was not sent (dispatch never raises)."""
        with self._under_way():
            INPUT_READ_STARTED.set(leave_round)  # in this task's own context
            PUT_BACK_UNRUN.set(functools.partial(self._queues.refund_job, self._priority_of(msg), msg))
            try:
                if not await self._flow.dispatch(msg, session):
                    self._batchers.release(session, self.model_name)
            finally:
                leave_round()

    async def _deliver_held(self, msg: Msg, priority: Priority) -> None:
        """Dispatches a message a held pull brought, or puts it back when it cannot run here now."""
        closed = not self._gates_open()
        # A higher priority's queue whose pull is no longer held open may hold jobs that this one
        # must not overtake: the round's choice (services.scheduler.priority) decides then.
        rank = PRIORITIES_BY_RANK.index(priority)
        held = self._held
        unheld = [p for p in PRIORITIES_BY_RANK[:rank] if held is not None and not held.holding(p)]
        session = None if closed or unheld else self._batchers.reserve(self.model_name)
        if session is None:
            for higher in unheld:
                # Asked by that round even if a round found it empty lately (within the poll
                # interval): else a job queued there since, whose notice has not come, is skipped,
                # and the round takes this one back at once (put back for nothing, and ahead of
                # that job after all).
                self._queues.unmark_empty(higher)
            await self._put_back(msg, priority)
            self._doorbell.set()  # the loop goes to wait on what held it (a pause ends, a credit comes)
            return
        self._queues.selector.charge(priority, 1)
        # Held pulls deliver in their own tasks (services.scheduler.held_pulls): set per delivery.
        PUT_BACK_UNRUN.set(functools.partial(self._queues.refund_job, priority, msg))
        with self._under_way():
            if not await self._flow.dispatch(msg, session):
                self._batchers.release(session, self.model_name)
        self._doorbell.set()  # a job came: there may be more

    async def _put_back(self, msg: Msg, priority: Priority) -> None:
        """A pulled message that does not run here now goes back to its queue (nak), still counted
        in the queue's depth."""
        self._queues.note_publish(priority)
        self._queues.put_back(priority, msg)
        with contextlib.suppress(Exception):
            await msg.nak()

    def _priority_of(self, msg: Msg) -> Priority:
        """The priority whose queue a pulled message came from: its subject's token after the
        model's (asyncinfer.contract.job_work_subject, or a queue's own subject from before)."""
        token = msg.subject.removeprefix(f"{WORK_SUBJECT_PREFIX}.{self.model_name}.").partition(".")[0]
        return PRIORITY_BY_SUBJECT_TOKEN.get(token, Priority.NORMAL)

    def _gates_open(self) -> bool:
        """Whether dispatching may go on: the model not paused, the scheduler not draining or stopping."""
        return all(gate.is_set() for gate in self._gates) and not self._stopping.is_set()

    @contextlib.contextmanager
    def _under_way(self) -> Iterator[None]:
        self._rounds_under_way += 1
        self._between_rounds.clear()
        try:
            yield
        finally:
            self._rounds_under_way -= 1
            if not self._rounds_under_way:
                self._between_rounds.set()

    async def _wait(self, *events: asyncio.Event, timeout_s: float | None = None) -> bool:
        """Waits for one of the events (or the timeout); False once stopping."""
        if self._stopping.is_set():
            return False
        if any(event.is_set() for event in events):
            return True
        waiters = {asyncio.ensure_future(e.wait()) for e in (*events, self._stopping)}
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        return not self._stopping.is_set()
