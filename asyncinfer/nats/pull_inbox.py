"""Pulls of a pull consumer's messages on an inbox of their own: the scheduler's dispatcher (its
rounds' and its held pulls, services.scheduler.work_queue), its webhook consumers'
(services.scheduler.webhooks.held_pull) and the gateway's key scans (asyncinfer.nats.scan).

nats-py's `fetch` cannot ask for messages without waiting, so `PullInbox` speaks the JetStream pull
API directly: a no-wait request answers at once with the messages available and, when fewer than
asked, a status (404 No Messages, 408 Request Timeout); a request with `expires` is held by the
server until its messages came or it expired (408).

The request goes out on an inbox subscription of its own rather than `nc.request`: JetStream
delivers the message to the inbox under the message's own subject, so nats-py's shared request
inbox, which routes replies by subject, cannot match it to the request. A subscription routes by
its ID.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Literal

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeoutError
from nats.errors import UnexpectedEOF

from asyncinfer.contract import consumer_next_subject
from asyncinfer.log_throttle import Throttle

log = structlog.get_logger("asyncinfer.nats")
# A pull refused while a leader is elected came ~50 times a second: one line per consumer every 5 s.
_REFUSALS = Throttle(5.0)

_NO_WAIT_ONE = json.dumps({"batch": 1, "no_wait": True}).encode()
_EMPTY_STATUSES = frozenset({"404", "408"})
# The header of the message an inbox sends itself to end the pull it holds open (`interrupt`).
_INTERRUPT_HEADER = "Asyncinfer-Pull-Interrupted"
# After a pull's timer fired: how long a round trip to the server may take to show whether its
# answer was only unread (this process stalled: a frozen process or VM, a long pause), and how long
# each answer then already read may take to come out of the subscription.
CATCH_UP_S = 1  # whole seconds: nats-py's flush is annotated so
LATE_READ_S = 0.05

# How a pull ended: with the messages it asked for; on the server's word that nothing (more) was
# there (404/408: for a held pull, that the queue had nothing for it all along); refused (another
# status: 409 while a leader is elected, a batch or a number of waiting pulls past the consumer's
# limit); lost (not sent, or its answer did not come in time; also a pull asked with NATS away);
# or interrupted.
PullEnd = Literal["answered", "empty", "refused", "lost", "interrupted"]


class PullInbox:
    """Pulls of durable pull consumers' messages, answered on one inbox subscription that they
    share, one pull at a time.

    A fresh inbox per pull costs a SUB and an UNSUB (and a change to nats-server's subscription
    index) on every pull. Sharing one is safe because a pull's answer is complete before the next
    pull is asked: `count` messages, or fewer and a status. After a timeout or an interrupt the inbox
    is abandoned, so a late answer cannot be read as the next pull's.

    A returned Msg carries the client, so `ack`, `nak(delay=)`, `in_progress` and `term` work, and
    its reply subject gives `metadata` (num_delivered, sequence, timestamp)."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._subscription: Subscription | None = None
        self._lock = asyncio.Lock()
        self._held: asyncio.Future[Msg] | None = None  # the answer a pull with `wait_s` waits for
        self._interrupted = False
        self.ended: PullEnd = "answered"  # how the last pull ended

    async def pull(
        self,
        stream: str,
        consumer: str,
        count: int,
        *,
        timeout_s: float = 2.0,
        wait_s: float | None = None,
        handle: Callable[[Msg], Awaitable[None]] | None = None,
    ) -> list[Msg]:
        """Up to `count` messages. Without `wait_s`, those available now (a no-wait pull: the
        available messages, then, when fewer than asked, a 404/408 status that ends the batch; no
        status follows `count` messages). With `wait_s`, the server holds the pull until `count`
        messages came or wait_s passed (then 408): those there at once come at once, the others as
        they are stored. With `handle`, each message is awaited with it as it comes (a held pull of
        several need not wait for the last to hand over the first); they are returned too, handled.
        `ended` says how it ended."""
        self.ended = "interrupted" if self._interrupted else "answered"
        if count <= 0 or self._interrupted:
            return []
        if not self._nc.is_connected:
            # A pull request would wait in nats-py's buffer and its answer out the timeout: a
            # dispatcher's round would last a timeout per priority, and so would a stop.
            self.ended = "lost"
            return []
        async with self._lock:
            if self._subscription is None:
                self._subscription = await self._nc.subscribe(self._nc.new_inbox())
            subscription = self._subscription
            sent_on = connection_epoch(self._nc)
            connection = sent_on if wait_s is not None else None
            if wait_s is not None:
                request = json.dumps({"batch": count, "expires": int(wait_s * 1e9)}).encode()
                timeout_s += wait_s
            elif count == 1:
                request = _NO_WAIT_ONE
            else:
                request = json.dumps({"batch": count, "no_wait": True}).encode()
            msgs: list[Msg] = []
            late = False  # the timer fired and a round trip since showed the answer had come
            # A held pull's answer may come a message at a time: all of it within the hold and
            # timeout_s, however many messages.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
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
                self.ended = "lost"
                return []
            try:
                while len(msgs) < count and not self._interrupted:
                    try:
                        if wait_s is None:
                            reply = await subscription.next_msg(timeout=timeout_s)
                        else:
                            left_s = timeout_s if late else max(deadline - loop.time(), LATE_READ_S)
                            answer = self._held = asyncio.ensure_future(subscription.next_msg(timeout=left_s))
                            try:
                                reply = await answer
                            except asyncio.CancelledError:
                                if not _ended_by_interrupt(answer):
                                    raise
                                await self._abandon()
                                self.ended = "interrupted"
                                break
                            finally:
                                self._held = None
                    except NatsTimeoutError:
                        # A process that stalled past the timer (SIGSTOP, a paused VM) wakes to an
                        # expired timer and an answer still unread in its socket: the timer fires
                        # first. Abandoned, the inbox dropped the messages the server had delivered
                        # to it, and they waited out AckWait (30 s) in the scheduler's hands. After
                        # a round trip, everything the server sent before it has been read.
                        if late or connection_epoch(self._nc) != sent_on or not await caught_up(self._nc):
                            raise
                        late, timeout_s = True, LATE_READ_S
                        continue
                    headers = reply.headers or {}
                    if headers.get(_INTERRUPT_HEADER) is not None:
                        await self._abandon()  # its answer may still come: not to be read as another's
                        self.ended = "interrupted"
                        break
                    status = headers.get("Status")
                    if status is not None and connection is not None and connection_epoch(self._nc) != connection:
                        # The server sends a held pull's end to its reply subject, which the inbox
                        # subscribed again on the new connection: a 408 can come there while what
                        # the server handed the pull before it went down the lost connection. Not
                        # "empty" (a dispatcher reads that as nothing queued all along): lost.
                        log.debug("pull_lost_with_its_connection", stream=stream, consumer=consumer, received=len(msgs))
                        await self._abandon()
                        self.ended = "lost"
                        break
                    if status is not None:
                        self.ended = "empty" if status in _EMPTY_STATUSES else "refused"
                        held = _REFUSALS.allow((consumer, status)) if self.ended == "refused" else None
                        if held is not None:
                            log.warning(
                                "pull_refused",
                                stream=stream,
                                consumer=consumer,
                                status=status,
                                description=headers.get("Description", ""),
                                **({"more_since_last": held} if held else {}),
                            )
                        break
                    if not reply.reply:
                        log.warning("pull_reply_without_ack_subject", stream=stream, consumer=consumer)
                        continue
                    msgs.append(reply)
                    if handle is not None:
                        await handle(reply)
            except NatsTimeoutError:
                # A message answered after this returns to the queue when its AckWait passes.
                if connection is None or connection_epoch(self._nc) == connection:
                    log.warning("pull_timed_out", stream=stream, consumer=consumer, received=len(msgs), late=late)
                else:  # sent on a connection since lost: the server that had it may be gone (the
                    # loss is logged once, nats_disconnected; this came once per consumer)
                    log.debug("pull_lost_with_its_connection", stream=stream, consumer=consumer, received=len(msgs))
                await self._abandon()
                self.ended = "lost"
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
            # next_msg is woken by a message (the scheduler's NATS user may publish to its own
            # inbox): cancelling it could drop one it had taken (back in the queue only after
            # AckWait).
            with contextlib.suppress(Exception):
                await self._nc.publish(subscription.subject, b"", headers={_INTERRUPT_HEADER: "1"})
                return
        # With NATS away no message can wake it, and none it took could be acked: it is cancelled.
        # (It waited out its hold and 2 s: a stop after `up`'s nats-server died took ~7 s.)
        held.cancel()

    @property
    def interrupted(self) -> bool:
        return self._interrupted

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


async def caught_up(nc: NatsClient) -> bool:
    """Whether a round trip to the server completed within CATCH_UP_S: then every answer it sent
    before has been read (a pull's timer that fired first was this process's stall, not the
    server's silence)."""
    try:
        await nc.flush(timeout=CATCH_UP_S)
    except Exception:  # the server away, or the connection lost meanwhile: the pull is abandoned
        return False
    return True


def connection_epoch(nc: NatsClient) -> int:
    """Which connection the client is on: a different number after a reconnect, -1 while down."""
    return int(nc.stats["reconnects"]) if nc.is_connected else -1
