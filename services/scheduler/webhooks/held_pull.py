"""Pulls of a webhook consumer: what is there now while busy, a pull held open while idle.

Both webhook consumers (the sender's deliveries, the notifier's record writes) were read with
nats-py's `fetch(n, timeout=2)`. Measured on an idle `asyncinfer up`: ~0.87 pull requests a second
each, since an empty fetch sends two (a no-wait probe, answered 404 at once, then a pull for the
rest of the timeout) every ~2.3 s. And once one message came, fetch waited for the other n-1 until
its timeout, so a lone delivery due now could wait up to 2 s for company that never came.

Instead, as the scheduler's dispatcher does (held_pulls.py, DESIGN section 8): while messages come,
a no-wait pull of up to `count` takes what is there, a group at a time; once one finds nothing, a
pull of one message is held open for HOLD_S, and the server hands it over as it is stored (or as
its retry delay passes), to be handled at once; a pull that expired empty is followed by another
held one. Idle, that is one request per consumer every HOLD_S; a lone message costs two requests
(its held pull, then the no-wait pull that finds nothing after it); a burst, one per `count`, as
fetch did. HOLD_S is not longer, for the scheduler's reason: a scheduler whose host hangs (no
connection closed) may be handed the held message meanwhile, back after its consumer's AckWait.

A stop cannot wait out a hold: `interrupt` wakes the inbox with a message of its own (the
scheduler's NATS user may publish to its own inbox), and what the server was sending at that
moment goes back after AckWait, as with a scheduler killed then.

A pull outlives a reconnect to another node of a cluster (the inbox is subscribed again, and the
consumer's leader still holds the pull). One that a restart of the one server loses ends at its
timeout (the hold and ANSWER_MARGIN_S), and a delivery due meanwhile waits that long, once (a
restart in a test lost none: the next delivery went 1.1 s after it). Unlike the dispatcher's held
pulls (checked every second), no timer watches for it: webhooks are retried and at-least-once,
and a check would wake an idle scheduler again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

import structlog

from asyncinfer.contract import consumer_next_subject
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg, NatsTimeoutError, Subscription, UnexpectedEOF
from asyncinfer.supervision import cancel_and_wait

log = structlog.get_logger("asyncinfer.scheduler.webhooks")

# How long a pull is held open: a request per consumer this often while idle.
HOLD_S = 10.0
# Past the hold, how long to wait for the server's 408 before the pull is taken for lost (its
# connection was, most likely).
ANSWER_MARGIN_S = 2.0
_EMPTY_STATUSES = frozenset({"404", "408"})
# The header of the message the inbox sends itself to end the pull it holds (`interrupt`).
_INTERRUPT_HEADER = "Asyncinfer-Pull-Interrupted"

Handle = Callable[[Msg], Awaitable[None]]


class HeldPull:
    """Pulls of one durable consumer's messages, one pull at a time, on an inbox of their own."""

    def __init__(self, nc: NatsClient, stream: str, consumer: str, *, hold_s: float = HOLD_S) -> None:
        self._nc = nc
        self._stream = stream
        self._consumer = consumer
        self._hold_s = hold_s
        self._subscription: Subscription | None = None
        self._waiting = False  # for a pull's answer
        self._busy = False  # the last pull brought messages: the next asks for what is there
        self._interrupted = False

    async def pull(self, count: int, handle: Handle) -> int | None:
        """Up to `count` messages, then `handle` awaited with each: those there now after a pull
        that brought some, else one, waited for up to the hold. How many came; None
        when no pull could be made (NATS away, the pull refused or lost): the caller waits before
        the next, or it would ask in a loop."""
        if count <= 0 or self._interrupted:
            return 0
        if not self._nc.is_connected:
            return None
        if self._subscription is None:
            self._subscription = await self._nc.subscribe(self._nc.new_inbox())
        subscription = self._subscription
        held = not self._busy
        if held:
            wanted, timeout_s = 1, self._hold_s + ANSWER_MARGIN_S
            request = json.dumps({"batch": 1, "expires": int(self._hold_s * 1e9)}).encode()
        else:
            # Answered at once: the messages there, then (when fewer than asked) a 404 or 408.
            wanted, timeout_s = count, ANSWER_MARGIN_S
            request = json.dumps({"batch": count, "no_wait": True}).encode()
        self._busy = False  # unless this pull brings something
        try:
            await self._nc.publish(
                consumer_next_subject(self._stream, self._consumer), request, reply=subscription.subject
            )
        except (RuntimeError, UnexpectedEOF) as exc:  # the transport closed a moment ago
            log.warning("webhook_pull_not_sent", consumer=self._consumer, error=str(exc))
            await self._abandon()
            return None
        msgs: list[Msg] = []
        lost = False
        try:
            while len(msgs) < wanted and not self._interrupted:
                self._waiting = True
                try:
                    reply = await subscription.next_msg(timeout=timeout_s)
                finally:
                    self._waiting = False
                headers = reply.headers or {}
                if headers.get(_INTERRUPT_HEADER) is not None:
                    await self._abandon()  # the pull's answer may still come: not to be read as another's
                    break
                status = headers.get("Status")
                if status is not None:
                    if status not in _EMPTY_STATUSES:
                        log.warning(
                            "webhook_pull_refused",
                            consumer=self._consumer,
                            status=status,
                            description=headers.get("Description", ""),
                        )
                        lost = True
                    break
                if reply.reply:
                    msgs.append(reply)
        except NatsTimeoutError:
            log.info("webhook_pull_lost", consumer=self._consumer, held=held, received=len(msgs))
            await self._abandon()
            lost = True
        # Handled once the pull's answer is complete, as fetch did (a no-wait pull's comes at once,
        # a held pull brings one): their acks then leave together, in a few socket writes.
        for msg in msgs:
            await handle(msg)
        self._busy = bool(msgs) and not lost
        if lost and not msgs:
            return None
        return len(msgs)

    async def interrupt(self) -> None:
        """Ends the pull held now, and every later one (a stop)."""
        self._interrupted = True
        if self._waiting and self._subscription is not None and self._nc.is_connected:
            # next_msg is woken by a message alone: cancelling it could drop one it had taken.
            with contextlib.suppress(Exception):
                await self._nc.publish(self._subscription.subject, b"", headers={_INTERRUPT_HEADER: "1"})

    async def next_round(self, count: int, handle: Handle, *, pause_s: float) -> None:
        """One `pull` of a consumer's loop (the sender's, the notifier's): a NATS failure is logged,
        and after a pull that could not be made (NATS away, the pull refused or lost) it waits
        pause_s before returning, unless interrupted, so that the loop does not ask in a loop."""
        try:
            came = await self.pull(count, handle)
        except NATS_FAILURES as exc:
            log.warning("webhook_pull_failed", consumer=self._consumer, error=str(exc))
            came = None
        if came is None and not self._interrupted:
            await asyncio.sleep(pause_s)

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)

    async def close(self) -> None:
        await self._abandon()

    async def _abandon(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()


async def interrupted_within(task: asyncio.Task[None], pull: HeldPull, grace_s: float) -> None:
    """Ends a loop of pulls: interrupts the one held, gives the loop grace_s to end on its own,
    then cancels it; at once with NATS away (the interrupt cannot reach the inbox, and nothing the
    pull brought could be acked: a stop of `up` after its nats-server died waited out the grace)."""
    await pull.interrupt()
    if pull.connected:
        await asyncio.wait({task}, timeout=grace_s)
    await cancel_and_wait([task])
