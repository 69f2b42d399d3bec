"""Pulling work messages one at a time, only when there is a credit for them.

nats-py's `fetch` cannot ask for one message without waiting, so `pull_one` speaks the JetStream
pull API directly: a no-wait request for a batch of one answers at once with either the message or
a status (404 No Messages, 408 Request Timeout).

The request goes out on a fresh inbox subscription rather than `nc.request`: JetStream delivers
the message to the inbox under the message's own subject, so nats-py's shared request inbox,
which routes replies by subject, cannot match it to the request. A subscription routes by its ID.
"""

from __future__ import annotations

import contextlib
import json

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError

from asyncinfer.jetstream import work_consumer_name
from asyncinfer.jobs import PRIORITIES_BY_RANK
from services.scheduler.priority import PrioritySelector, TenantRoundRobin

log = structlog.get_logger("asyncinfer.scheduler.queue")

_NO_WAIT_ONE = json.dumps({"batch": 1, "no_wait": True}).encode()
_EMPTY_STATUSES = frozenset({"404", "408"})


async def pull_one(nc: NatsClient, stream: str, consumer: str, *, timeout_s: float = 2.0) -> Msg | None:
    """The next message of a durable pull consumer, or None at once when it has none.

    The returned Msg carries the client, so `ack`, `nak(delay=)`, `in_progress` and `term` work, and
    its reply subject gives `metadata` (num_delivered, sequence, timestamp)."""
    msgs = await pull_up_to(nc, stream, consumer, 1, timeout_s=timeout_s)
    return msgs[0] if msgs else None


async def pull_up_to(nc: NatsClient, stream: str, consumer: str, count: int, *, timeout_s: float = 2.0) -> list[Msg]:
    """Up to `count` messages that are available now, without waiting for more.

    A no-wait pull answers with the available messages, then (when fewer than asked) a 404/408
    status that ends the batch."""
    if count <= 0:
        return []
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    msgs: list[Msg] = []
    try:
        request = json.dumps({"batch": count, "no_wait": True}).encode()
        await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}", request, reply=inbox)
        while len(msgs) < count:
            reply = await subscription.next_msg(timeout=timeout_s)
            status = (reply.headers or {}).get("Status")
            if status is not None:
                if status not in _EMPTY_STATUSES:
                    description = (reply.headers or {}).get("Description", "")
                    log.warning(
                        "pull_refused", stream=stream, consumer=consumer, status=status, description=description
                    )
                break
            if not reply.reply:
                log.warning("pull_reply_without_ack_subject", stream=stream, consumer=consumer)
                continue
            msgs.append(reply)
    except NatsTimeoutError:
        # A message answered after this returns to the queue when its AckWait passes.
        log.warning("pull_timed_out", stream=stream, consumer=consumer, received=len(msgs))
    finally:
        with contextlib.suppress(Exception):
            await subscription.unsubscribe()
    return msgs


def _tenant_of(msg: Msg) -> str:
    try:
        return str(json.loads(msg.data).get("tenant", ""))
    except (ValueError, AttributeError):
        return ""


class ModelQueues:
    """A model's queues, one durable consumer per priority, and the choice between them (see
    services.scheduler.priority)."""

    def __init__(self, nc: NatsClient, stream: str, model_name: str, selector: PrioritySelector) -> None:
        self._nc = nc
        self._stream = stream
        self.model_name = model_name
        self.consumers = {p: work_consumer_name(model_name, p) for p in PRIORITIES_BY_RANK}
        self.selector = selector
        self._tenants = {p: TenantRoundRobin() for p in PRIORITIES_BY_RANK}

    async def pull_next(self, count: int = 1) -> list[Msg]:
        """The next `count` jobs to run (fewer when fewer wait), chosen now."""
        chosen: list[Msg] = []
        eligible = set(PRIORITIES_BY_RANK)
        while len(chosen) < count and eligible:
            plan = self.selector.plan(count - len(chosen), eligible)
            for priority, slots in plan.items():
                if slots == 0:
                    continue
                tenants = self._tenants[priority]
                msgs = await pull_up_to(self._nc, self._stream, self.consumers[priority], tenants.window(slots))
                picked, rest = tenants.choose([(_tenant_of(m), m) for m in msgs], slots)
                for msg in rest:
                    with contextlib.suppress(Exception):
                        await msg.nak()
                self.selector.charge(priority, len(picked))
                if len(picked) < slots:
                    self.selector.mark_empty(priority)
                    eligible.discard(priority)
                chosen += picked
        return chosen
