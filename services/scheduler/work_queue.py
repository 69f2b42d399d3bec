"""Pulling work messages, only as many as there are credits for.

nats-py's `fetch` cannot ask for messages without waiting, so `PullInbox` speaks the JetStream pull
API directly: a no-wait request answers at once with the messages available and, when fewer than
asked, a status (404 No Messages, 408 Request Timeout).

The request goes out on an inbox subscription of its own rather than `nc.request`: JetStream
delivers the message to the inbox under the message's own subject, so nats-py's shared request
inbox, which routes replies by subject, cannot match it to the request. A subscription routes by
its ID. A model's pulls share one such inbox (`PullInbox`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

import structlog

from asyncinfer.codecs.envelope import tenant_of_envelope
from asyncinfer.contract import JOB_ID_HEADER, TENANT_HEADER, consumer_next_subject, work_consumer_name
from asyncinfer.jobs import PRIORITIES_BY_RANK, Priority
from asyncinfer.log_throttle import Throttle
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg, NatsTimeoutError, Subscription, UnexpectedEOF
from asyncinfer.nats.connection import connection_changes
from services.scheduler.priority import PrioritySelector, TenantRoundRobin

log = structlog.get_logger("asyncinfer.scheduler.queue")
# A pull refused while a leader is elected came ~50 times a second: one line per consumer every 5 s.
_REFUSALS = Throttle(5.0)

_NO_WAIT_ONE = json.dumps({"batch": 1, "no_wait": True}).encode()
_EMPTY_STATUSES = frozenset({"404", "408"})
# How long a pull may wait for a message it was woken for that cannot be pulled yet.
STORE_WAIT_S = 0.005
# The header of the message an inbox sends itself to end the pull it holds open (`interrupt`).
_INTERRUPT_HEADER = "Asyncinfer-Pull-Interrupted"


class PullInbox:
    """Pulls of a durable pull consumer's messages, answered on one inbox subscription that a
    model's pulls share, one pull at a time.

    A fresh inbox per pull costs a SUB and an UNSUB (and a change to nats-server's subscription
    index) on every pull. Sharing one is safe because a pull's answer is complete before the next
    pull is asked: `count` messages, or fewer and a status. After a timeout the inbox is abandoned,
    so a late answer cannot be read as the next pull's.

    A returned Msg carries the client, so `ack`, `nak(delay=)`, `in_progress` and `term` work, and
    its reply subject gives `metadata` (num_delivered, sequence, timestamp)."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._subscription: Subscription | None = None
        self._lock = asyncio.Lock()
        self._held: asyncio.Future[Msg] | None = None  # the answer a pull with `wait_s` waits for
        self._interrupted = False
        # Whether the last pull ended on the server's word that nothing was left to give (404/408):
        # for a held pull, that the queue had nothing for it all along.
        self.ended_empty = False

    async def pull(
        self, stream: str, consumer: str, count: int, *, timeout_s: float = 2.0, wait_s: float | None = None
    ) -> list[Msg]:
        """Up to `count` messages. Without `wait_s`, those available now (a no-wait pull: the
        available messages, then, when fewer than asked, a 404/408 status that ends the batch; no
        status follows `count` messages). With `wait_s`, the server holds the pull until `count`
        messages came or wait_s passed (then 408)."""
        if count <= 0 or not self._nc.is_connected or self._interrupted:
            # While the connection is down a pull request would wait in nats-py's buffer and its
            # answer out the timeout: a round would last a timeout per priority, and so would a
            # stop. The dispatcher asks again at its next poll.
            return []
        self.ended_empty = False
        async with self._lock:
            if self._subscription is None:
                self._subscription = await self._nc.subscribe(self._nc.new_inbox())
            subscription = self._subscription
            connection = connection_epoch(self._nc) if wait_s is not None else None
            if wait_s is not None:
                request = json.dumps({"batch": count, "expires": int(wait_s * 1e9)}).encode()
                timeout_s += wait_s
            elif count == 1:
                request = _NO_WAIT_ONE
            else:
                request = json.dumps({"batch": count, "no_wait": True}).encode()
            msgs: list[Msg] = []
            try:
                await self._nc.publish(consumer_next_subject(stream, consumer), request, reply=subscription.subject)
            except (RuntimeError, UnexpectedEOF) as exc:
                # The connection was lost a moment ago and nats-py has not noticed yet: its write to
                # the closed transport raises this (uvloop's RuntimeError; UnexpectedEOF on the fast
                # path, asyncinfer.nats._fastpath.closed_transport_errors). As while disconnected:
                # nothing pulled, and no error of its own (the loss is logged where it is handled;
                # `up` stops on it).
                log.warning("pull_not_sent", stream=stream, consumer=consumer, error=str(exc))
                await self._abandon()
                return []
            try:
                while len(msgs) < count and not self._interrupted:
                    if wait_s is None:
                        reply = await subscription.next_msg(timeout=timeout_s)
                    else:
                        answer = self._held = asyncio.ensure_future(subscription.next_msg(timeout=timeout_s))
                        try:
                            reply = await answer
                        except asyncio.CancelledError:
                            if not _ended_by_interrupt(answer):
                                raise
                            await self._abandon()
                            break
                        finally:
                            self._held = None
                    if (reply.headers or {}).get(_INTERRUPT_HEADER) is not None:
                        await self._abandon()  # its answer may still come: not to be read as another's
                        break
                    status = (reply.headers or {}).get("Status")
                    if status is not None:
                        self.ended_empty = status in _EMPTY_STATUSES
                        held = _REFUSALS.allow((consumer, status)) if status not in _EMPTY_STATUSES else None
                        if held is not None:
                            description = (reply.headers or {}).get("Description", "")
                            log.warning(
                                "pull_refused",
                                stream=stream,
                                consumer=consumer,
                                status=status,
                                description=description,
                                **({"more_since_last": held} if held else {}),
                            )
                        break
                    if not reply.reply:
                        log.warning("pull_reply_without_ack_subject", stream=stream, consumer=consumer)
                        continue
                    msgs.append(reply)
            except NatsTimeoutError:
                # A message answered after this returns to the queue when its AckWait passes.
                if connection is None or connection_epoch(self._nc) == connection:
                    log.warning("pull_timed_out", stream=stream, consumer=consumer, received=len(msgs))
                else:  # sent on a connection since lost: the server that had it may be gone (the
                    # loss is logged once, nats_disconnected; this came once per consumer)
                    log.debug("pull_lost_with_its_connection", stream=stream, consumer=consumer, received=len(msgs))
                await self._abandon()
            return msgs

    async def interrupt(self) -> None:
        """Ends a pull held open now and any pull after it (a stop cannot wait out a hold): its
        answer may still come, to an inbox then abandoned, and its message returns to the queue
        after AckWait, as one delivered to a scheduler killed at that moment."""
        self._interrupted = True
        held, subscription = self._held, self._subscription
        if held is None or subscription is None:
            return
        if self._nc.is_connected:
            # next_msg is woken by a message: cancelling it could drop one it had taken (back in the
            # queue only after AckWait).
            with contextlib.suppress(Exception):
                await self._nc.publish(subscription.subject, b"", headers={_INTERRUPT_HEADER: "1"})
                return
        # With NATS away no message can wake it, and none it took could be acked: it is cancelled.
        # (It waited out its hold and 2 s: a stop after `up`'s nats-server died took ~7 s.)
        held.cancel()

    async def close(self) -> None:
        async with self._lock:
            await self._abandon()

    async def _abandon(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()


def _ended_by_interrupt(held: asyncio.Future[Msg]) -> bool:
    """Whether a held pull's wait was cancelled by `interrupt`, not the pull's own task."""
    task = asyncio.current_task()
    return held.cancelled() and (task is None or task.cancelling() == 0)


def connection_epoch(nc: NatsClient) -> int:
    """Which connection the client is on: a different number after a reconnect, -1 while down."""
    return int(nc.stats["reconnects"]) if nc.is_connected else -1


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
        # The jobs whose messages this scheduler pulled and put back (a nak): waiting again, but
        # the consumer counts them as delivered, not pending, until they are pulled again. By job,
        # not a count: one cancelled meanwhile has its message deleted, never pulled, and a count
        # kept it in the queue's depth (and the desired batchers) for good.
        self._put_back: dict[Priority, set[str]] = {p: set() for p in PRIORITIES_BY_RANK}
        # Whether the last pull_next found jobs already waiting, not only one it waited for
        # (services.scheduler.dispatch_linger: a stream of jobs outpacing the rounds).
        self.found_waiting = False

    def put_back(self, priority: Priority, msg: Msg) -> None:
        """A message of the priority's queue was pulled and put back (nak) without running."""
        self._put_back[priority].add(_job_id(msg))

    def put_back_count(self, priority: Priority) -> int:
        return len(self._put_back[priority])

    def forget(self, job_id: str) -> None:
        """The job's message is gone (deleted when it was cancelled while queued)."""
        for jobs in self._put_back.values():
            jobs.discard(job_id)

    def _pulled(self, priority: Priority, msgs: list[Msg]) -> list[Msg]:
        if msgs and self._put_back[priority]:
            self._put_back[priority].difference_update(_job_id(msg) for msg in msgs)
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
        eligible = {p for p in PRIORITIES_BY_RANK if not self.known_empty(p)}
        while len(chosen) < count and eligible:
            plan = self.selector.plan(count - len(chosen), eligible)
            for priority, slots in plan.items():
                if slots == 0:
                    continue
                tenants = self._tenants[priority]
                publishes = self._publishes[priority]
                msgs = await self._pull(priority, tenants.window(slots))
                picked, rest = tenants.choose([(tenant_of(m), m) for m in msgs], slots)
                for msg in rest:
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

    async def hold(self, priority: Priority, wait_s: float) -> list[Msg]:
        """The priority's next message once it is stored, or [] after wait_s (a pull held open),
        or sooner when `interrupt_holds` ends it."""
        return self._pulled(
            priority, await self._hold_inboxes[priority].pull(self._stream, self.consumers[priority], 1, wait_s=wait_s)
        )

    def hold_expired(self, priority: Priority) -> bool:
        """Whether the priority's last held pull ended as it expired with nothing (the server's
        408): nothing reached the queue while it was held."""
        return self._hold_inboxes[priority].ended_empty

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


def _job_id(msg: Msg) -> str:
    """The job a work message is for: its header, else its subject's last token (a job's own)."""
    return (msg.headers or {}).get(JOB_ID_HEADER) or msg.subject.rsplit(".", 1)[-1]
