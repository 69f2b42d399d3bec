"""Pulling work messages, only as many as there are credits for: a model's rounds share one inbox
(asyncinfer.nats.pull_inbox), and each priority's held pull has its own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncinfer.codecs.envelope import tenant_of_envelope
from asyncinfer.contract import JOB_ID_HEADER, TENANT_HEADER, work_consumer_name
from asyncinfer.jobs import PRIORITIES_BY_RANK, JobRecord, Priority, job_key
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg
from asyncinfer.nats.connection import connection_changes
from asyncinfer.nats.pull_inbox import PullEnd, PullInbox, connection_epoch
from services.scheduler.priority import PrioritySelector, TenantRoundRobin

# How long a pull may wait for a message it was woken for that cannot be pulled yet.
STORE_WAIT_S = 0.005


def tenant_of(msg: Msg) -> str:
    """The tenant of a work message, from its routing header; a message from a gateway that
    predates the header is read for its tenant alone (its inputs, perhaps megabytes, skipped)."""
    tenant = (msg.headers or {}).get(TENANT_HEADER)
    return tenant if tenant is not None else tenant_of_envelope(msg.data)


class ModelQueues:
    """A model's queues, one durable consumer per priority, and the choice between them (see
    services.scheduler.priority).

    A priority found empty is not asked again until a publish to it is seen (`note_publish`, from
    the dispatcher's doorbell) or `empty_for_s` has passed: at light load this saves a round trip
    to nats-server per job (asking HIGH, empty, before NORMAL). Messages that come back without a
    publish (AckWait expiries, delayed naks) are found once the mark expires; the scheduler's own
    immediate naks call `note_publish` too."""

    def __init__(
        self,
        nc: NatsClient,
        stream: str,
        model_name: str,
        selector: PrioritySelector,
        *,
        empty_for_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nc = nc
        self._stream = stream
        self.model_name = model_name
        self.consumers = {p: work_consumer_name(model_name, p) for p in PRIORITIES_BY_RANK}
        self.selector = selector
        self._tenants = {p: TenantRoundRobin() for p in PRIORITIES_BY_RANK}
        self._inbox = PullInbox(nc)
        # One per priority: held pulls (services.scheduler.held_pulls) wait side by side.
        self._hold_inboxes = {p: PullInbox(nc) for p in PRIORITIES_BY_RANK}
        self._empty_for_s = empty_for_s
        self._clock = clock
        self._empty_until: dict[Priority, float] = {}
        # Publishes seen per priority: a publish seen while a pull was out may have missed it.
        self._publishes = dict.fromkeys(PRIORITIES_BY_RANK, 0)
        self._pulled_at = dict.fromkeys(PRIORITIES_BY_RANK, 0)
        # The jobs whose messages this scheduler pulled and put back (a nak: a held pull's that
        # could not run, a tenant window's jobs not taken, an attempt's end that gives the job back:
        # shed by its batcher, the batcher lost, a retry; a dispatch that waits for a version):
        # waiting again, but the consumer counts them as delivered, not pending, until they are
        # pulled again. By job, not a count: one cancelled meanwhile has its message deleted, never
        # pulled, and a count kept it in the queue's depth (and the desired batchers) for good.
        # Each with when its message was stored (Unix seconds; None if unknown): they are the
        # queue's oldest jobs, which the stream's next undelivered message does not say.
        self._put_back: dict[Priority, dict[str, _PutBack]] = {p: {} for p in PRIORITIES_BY_RANK}
        # When each was last checked against its record (put_back_to_check), by a count of checks.
        self._checked: dict[str, int] = {}
        self._checks = 0
        # Whether the last pull_next found jobs already waiting, not only one it waited for
        # (services.scheduler.dispatch_linger: a stream of jobs outpacing the rounds).
        self.found_waiting = False
        # What the last pull_next charged, per priority: the jobs it took, and the tenant served
        # last before it (refund_last_pull undoes both).
        self._charged: dict[Priority, tuple[int, str | None]] = {}
        # Each job the last pull_next chose: its priority, and the tenant served last and the job
        # whose choice made it so, before its own choice (refund_job gives its turn back).
        self._picks: dict[str, tuple[Priority, str | None, str | None]] = {}
        # Per priority, the job whose choice made the round robin's tenant served last what it is.
        self._last_pick: dict[Priority, str | None] = {}

    def put_back(self, priority: Priority, msg: Msg, *, backoff_s: float = 0.0) -> None:
        """A message of the priority's queue was pulled and is put back (nak). `backoff_s`: how
        long the job's own policy keeps it from running (a retry's backoff, a hand-back's)."""
        job_id = _job_id(msg)
        self._put_back[priority][job_id] = _PutBack(
            _stored_at(msg), self._clock() + max(backoff_s, 0.0), job_key(tenant_of(msg), job_id), msg.reply or ""
        )

    def put_back_jobs(self, priority: Priority) -> frozenset[str]:
        return frozenset(self._put_back[priority])

    def put_back_oldest(self, priority: Priority) -> float | None:
        """When the oldest message put back on the priority's queue and past its backoff was stored
        (Unix seconds). One still in its backoff counts in the depth (it waits, and will want a
        batcher) but not here: nothing may run it yet, and its age (since its submit) would say
        the queue stalled (priority aging, the deadline sweep's backlog, the oldest-age alert)
        while a retry's backoff ran, up to retry_backoff_max_s (300 s). A job put back for a short
        while because nothing could run it (a version no batcher serves, NATS trouble) waits as
        any queued job does, and counts at once."""
        now = self._clock()
        return min(
            (p.stored_at for p in self._put_back[priority].values() if p.stored_at is not None and p.due <= now),
            default=None,
        )

    def put_back_count(self, priority: Priority) -> int:
        return len(self._put_back[priority])

    def put_back_to_check(self, most: int) -> list[tuple[str, str]]:
        """Up to `most` of the jobs put back here, (job ID, record key), those checked longest ago
        first (services.scheduler.put_back_checks)."""
        found: list[tuple[str, str]] = []
        for jobs in self._put_back.values():
            found.extend((job_id, entry.key) for job_id, entry in jobs.items())
        found.sort(key=lambda job: self._checked.get(job[0], 0))
        return found[:most]

    def checked(self, job_id: str, record: JobRecord | None) -> None:
        """A job put back here, its record as read now (None: gone, or not written yet). The
        record says whether another scheduler took the job since: it names a later delivery of
        the job's message than the one put back here (its `lease_subject`, written as a delivery
        is dispatched: RUNNING there, or given back there since), or the job ended. Such a job is
        forgotten: the consumer's pending does not count it, and its putter counted it as waiting
        until the stats round's listing no longer held its message (its result stored, however
        long it ran or waited elsewhere). A record naming the delivery put back here (its requeue's
        write failed, NATS away) or an earlier one (a held pull's put-back of a job an earlier
        attempt ran) leaves it counted, as does a job pulled elsewhere and put back there unrun
        and unwritten (a version no batcher serves): both count it."""
        self._checks += 1
        for jobs in self._put_back.values():
            entry = jobs.get(job_id)
            if entry is None:
                continue
            if record is not None and (
                record.state.is_terminal or _delivered(record.lease_subject) > _delivered(entry.delivery) > 0
            ):
                del jobs[job_id]
                self._checked.pop(job_id, None)
                return
            self._checked[job_id] = self._checks

    def forget(self, job_id: str) -> None:
        """The job's message is gone (deleted when it was cancelled while queued)."""
        for jobs in self._put_back.values():
            jobs.pop(job_id, None)
        self._checked.pop(job_id, None)

    def _pulled(self, priority: Priority, msgs: list[Msg]) -> list[Msg]:
        if msgs and (put_back := self._put_back[priority]):
            for msg in msgs:
                job_id = _job_id(msg)
                if put_back.pop(job_id, None) is not None:
                    self._checked.pop(job_id, None)
        return msgs

    def note_publish(self, priority: Priority) -> None:
        """A message was published to (or put back on) the priority's queue."""
        self._publishes[priority] += 1
        self._empty_until.pop(priority, None)

    def unmark_empty(self, priority: Priority) -> None:
        """The priority's queue is asked at the next round even if one found it empty lately: it
        may have jobs whose notice has not come, and no pull held open on it brings them."""
        self._empty_until.pop(priority, None)

    def known_empty(self, priority: Priority) -> bool:
        until = self._empty_until.get(priority)
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._empty_until[priority]
        return False

    async def _pull(self, priority: Priority, count: int) -> list[Msg]:
        rung = self._publishes[priority] != self._pulled_at[priority]
        self._pulled_at[priority] = self._publishes[priority]
        msgs = await self._inbox.pull(self._stream, self.consumers[priority], count)
        if msgs:
            self.found_waiting = True
        if not msgs and rung:
            # A wake can come before its message can be pulled (an immediate nak the server has
            # not applied yet; a publish seen on core NATS before the stream stored it): hold one
            # message's pull open briefly rather than sleep a whole poll interval.
            msgs = await self._inbox.pull(self._stream, self.consumers[priority], 1, wait_s=STORE_WAIT_S)
        return self._pulled(priority, msgs)

    async def pull_next(self, count: int = 1) -> list[Msg]:
        """The next `count` jobs to run (fewer when fewer wait), chosen now."""
        chosen: list[Msg] = []
        self.found_waiting = False
        self._charged = {}
        self._picks = {}
        eligible = {p for p in PRIORITIES_BY_RANK if not self.known_empty(p)}
        while len(chosen) < count and eligible:
            plan = self.selector.plan(count - len(chosen), eligible)
            for priority, slots in plan.items():
                if slots == 0:
                    continue
                tenants = self._tenants[priority]
                publishes = self._publishes[priority]
                msgs = await self._pull(priority, tenants.window(slots))
                taken, last_served = self._charged.get(priority, (0, tenants.last_served))
                before = (tenants.last_served, self._last_pick.get(priority))
                picked, rest = tenants.choose([(tenant_of(m), m) for m in msgs], slots)
                self._charged[priority] = (taken + len(picked), last_served)
                # choose() serves the picked in order: each one's turn came after the one before.
                for msg in picked:
                    job_id = _job_id(msg)
                    self._picks[job_id] = (priority, *before)
                    self._last_pick[priority] = job_id
                    before = (tenant_of(msg), job_id)
                for msg in rest:
                    # Waiting again, though the consumer counts it delivered: counted here, as a
                    # held pull's put-back is, until a pull brings it back.
                    self.put_back(priority, msg)
                    with contextlib.suppress(Exception):
                        await msg.nak()
                self.selector.charge(priority, len(picked))
                if len(picked) < slots:
                    self.selector.mark_empty(priority)
                    eligible.discard(priority)
                if not msgs and self._empty_for_s > 0 and self._publishes[priority] == publishes:
                    self._empty_until[priority] = self._clock() + self._empty_for_s
                chosen += picked
        return chosen

    def refund_last_pull(self) -> None:
        """Every job the last pull_next brought went back unrun (its round found the queue paused,
        or the scheduler draining, once the pull was back: services.scheduler.dispatcher): what the
        pull charged is undone, each priority's count of jobs served and each tenant's turn, as if
        it had not pulled. Charged, the jobs a pause held back counted as served: the next round
        began after the tenant whose job it put back (another tenant's job, queued behind, went
        first at the resume), and their priority's share of the next rounds was that much smaller."""
        for priority, (taken, last_served) in self._charged.items():
            self.selector.charge(priority, -taken)
            self._tenants[priority].give_turn_back(last_served)
            self._last_pick[priority] = None  # a job of an earlier pull: not refunded here
        self._charged = {}
        self._picks = {}

    def refund_job(self, priority: Priority, msg: Msg) -> None:
        """A job this dispatcher charged (its round's pull_next, or a held pull's delivery) went back
        unrun, to wait for its version (services.scheduler.version_routing: no batcher serves it, or
        those that do have no free slot), after a NATS failure at its dispatch (its RUNNING write,
        its input's read), or for another reason not its own (its record not written yet, its
        batcher gone during its write, another writer's attempt between its order and its write:
        services.scheduler.job_dispatch), or was a redelivery of an attempt running here, which
        that attempt adopted (nothing new ran: AckWait's redelivery, or a nak that hit the newer
        delivery). Its priority's count of jobs served is refunded, and its
        tenant's turn when its choice is still the last one of its priority (undone in reverse
        order, as several of a round's jobs may be): charged, a job that cannot run used its
        tenant's turn (and every WAIT_UNSERVED_S again while it waited, every WAIT_BUSY_S while its
        version's batchers were busy), so when a batcher for its version came, the tenant's next job
        went after another tenant's queued behind it; and its priority's share of the next rounds
        was smaller by every charge, however long it waited. A later choice of its priority's
        (another job of the round, a later pull) keeps the turn where it is: the turn has passed on
        since, as it would have had the job run."""
        self.selector.charge(priority, -1)
        job_id = _job_id(msg)
        pick = self._picks.pop(job_id, None)
        if pick is None or pick[0] is not priority or self._last_pick.get(priority) != job_id:
            return  # a held pull's (no turn taken) or one whose turn has passed on
        _, last_served, last_pick = pick
        self._tenants[priority].give_turn_back(last_served)
        self._last_pick[priority] = last_pick

    async def hold(self, priority: Priority, wait_s: float) -> list[Msg]:
        """The priority's next message once it is stored, or [] after wait_s (a pull held open),
        or sooner when `interrupt_holds` ends it."""
        return self._pulled(
            priority, await self._hold_inboxes[priority].pull(self._stream, self.consumers[priority], 1, wait_s=wait_s)
        )

    def hold_expired(self, priority: Priority) -> bool:
        """Whether the priority's last held pull ended as it expired with nothing (the server's
        408): nothing reached the queue while it was held."""
        return self.hold_ended(priority) == "empty"

    def hold_ended(self, priority: Priority) -> PullEnd:
        """How the priority's last held pull ended (asyncinfer.nats.pull_inbox.PullEnd)."""
        return self._hold_inboxes[priority].ended

    def connection(self) -> int:
        """The client's connection_epoch: a pull sent on another one is gone."""
        return connection_epoch(self._nc)

    def connection_changed(self) -> asyncio.Event:
        """Set at the client's next change of connection (lost, or back)."""
        return connection_changes(self._nc).next()

    async def interrupt_holds(self) -> None:
        """Ends the pulls held open now, and every later one (see PullInbox.interrupt)."""
        for inbox in self._hold_inboxes.values():
            await inbox.interrupt()

    async def close(self) -> None:
        await self._inbox.close()
        for inbox in self._hold_inboxes.values():
            await inbox.close()


@dataclass(frozen=True, slots=True)
class _PutBack:
    stored_at: float | None  # when its message was stored (Unix seconds; None if unknown)
    due: float  # when its backoff ends (the queues' clock)
    key: str  # its record's key
    delivery: str  # the ack subject of the delivery put back (a record's lease_subject names it)


def _job_id(msg: Msg) -> str:
    """The job a work message is for: its header, else its subject's last token (a job's own)."""
    return (msg.headers or {}).get(JOB_ID_HEADER) or msg.subject.rsplit(".", 1)[-1]


def _delivered(ack_subject: str) -> int:
    """Which delivery of its message an ack subject is (its delivery count:
    $JS.ACK.<stream>.<consumer>.<delivered>..., or with a domain and an account hash after ACK, as
    nats-py reads it; services.scheduler.lease_reclaim reads the stream sequence so); 0 if not one."""
    tokens = ack_subject.split(".")
    if len(tokens) == 9:
        tokens = [*tokens[:2], "", "", *tokens[2:]]
    if len(tokens) < 11 or tokens[:2] != ["$JS", "ACK"] or not tokens[6].isdigit():
        return 0
    return int(tokens[6])


def _stored_at(msg: Msg) -> float | None:
    """When a pulled message was stored (its ack subject says it), in Unix seconds."""
    try:
        return msg.metadata.timestamp.timestamp()
    except Exception:  # not a JetStream delivery (no ack subject to read)
        return None
