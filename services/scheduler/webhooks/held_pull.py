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
The pulls themselves (their inbox, the server's answers, a stop's interrupt) are the dispatcher's
too: asyncinfer.nats.pull_inbox.

The sender's pulls (`as_they_come`) are all held, each for as many deliveries as it has free slots,
and each delivery is started as it comes: the notifier stores them one at a time, and the sender
kept up, so each cost two requests (its held pull of one, the no-wait pull that found nothing after
it; 1,999 for a burst of 1,000 to one receiver). One pull now brings up to the free slots, whether
they are there (at once) or stored meanwhile (as they come); idle, it is still one request every
HOLD_S. A pull's slots stay its own until it ends (full, or its hold over): a host that hangs may
be handed that many deliveries, back after AckWait, as for the held pull of one.

A pull outlives a reconnect to another node of a cluster (the inbox is subscribed again, and the
consumer's leader still holds the pull). One that a restart of the one server loses ends at its
timeout (the hold and 2 s), and a delivery due meanwhile waits that long, once (a restart in a
test lost none: the next delivery went 1.1 s after it). Unlike the dispatcher's held
pulls (checked every second), no timer watches for it: webhooks are retried and at-least-once,
and a check would wake an idle scheduler again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg
from asyncinfer.nats.pull_inbox import PullInbox
from asyncinfer.supervision import cancel_and_wait

log = structlog.get_logger("asyncinfer.scheduler.webhooks")

# How long a pull is held open: a request per consumer this often while idle.
HOLD_S = 10.0

Handle = Callable[[Msg], Awaitable[None]]


class HeldPull:
    """Pulls of one durable consumer's messages, one pull at a time, on an inbox of their own."""

    def __init__(
        self, nc: NatsClient, stream: str, consumer: str, *, hold_s: float = HOLD_S, as_they_come: bool = False
    ) -> None:
        self._nc = nc
        self._stream = stream
        self._consumer = consumer
        self._hold_s = hold_s
        self._as_they_come = as_they_come
        self._inbox = PullInbox(nc)
        self._busy = False  # the last pull brought messages: the next asks for what is there

    async def pull(self, count: int, handle: Handle) -> int | None:
        """Up to `count` messages, then `handle` awaited with each: those there now after a pull
        that brought some, else one, waited for up to the hold. How many came; None
        when no pull could be made (NATS away, the pull refused or lost): the caller waits before
        the next, or it would ask in a loop."""
        if self._as_they_come:
            # Every pull held, for all `count`: what is there comes at once, the rest as it is
            # stored, each handled as it comes (the slots it asked for are free meanwhile).
            msgs = await self._inbox.pull(self._stream, self._consumer, count, wait_s=self._hold_s, handle=handle)
            failed = self._inbox.ended in ("refused", "lost")
            return None if failed and not msgs else len(msgs)
        if self._busy:
            msgs = await self._inbox.pull(self._stream, self._consumer, count)
        else:
            msgs = await self._inbox.pull(self._stream, self._consumer, min(count, 1), wait_s=self._hold_s)
        # Handled once the pull's answer is complete, as fetch did (a no-wait pull's comes at once,
        # a held pull brings one): their acks then leave together, in a few socket writes.
        for msg in msgs:
            await handle(msg)
        failed = self._inbox.ended in ("refused", "lost")
        self._busy = bool(msgs) and not failed
        return None if failed and not msgs else len(msgs)

    async def interrupt(self) -> None:
        """Ends the pull held now, and every later one (a stop)."""
        await self._inbox.interrupt()

    async def next_round(self, count: int, handle: Handle, *, pause_s: float) -> None:
        """One `pull` of a consumer's loop (the sender's, the notifier's): a NATS failure is logged,
        and after a pull that could not be made (NATS away, the pull refused or lost) it waits
        pause_s before returning, unless interrupted, so that the loop does not ask in a loop."""
        try:
            came = await self.pull(count, handle)
        except NATS_FAILURES as exc:
            log.warning("webhook_pull_failed", consumer=self._consumer, error=str(exc))
            came = None
        if came is None and not self._inbox.interrupted:
            await asyncio.sleep(pause_s)

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)

    async def close(self) -> None:
        await self._inbox.close()


async def interrupted_within(task: asyncio.Task[None], pull: HeldPull, grace_s: float) -> None:
    """Ends a loop of pulls: interrupts the one held, gives the loop grace_s to end on its own,
    then cancels it; at once with NATS away (the interrupt cannot reach the inbox, and nothing the
    pull brought could be acked: a stop of `up` after its nats-server died waited out the grace)."""
    await pull.interrupt()
    if pull.connected:
        await asyncio.wait({task}, timeout=grace_s)
    await cancel_and_wait([task])
