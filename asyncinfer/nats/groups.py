"""Durable JetStream publishes in pipelined groups: a group's messages all written to the
connection before any acknowledgement is awaited (nats-py's flusher then sends them in one write),
the acknowledgements awaited together, each message still answered on its own. What a SubmitJobs
message of many jobs publishes (services.gateway.submit_group).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from nats.js import JetStreamContext

from asyncinfer.contract import EXPECTED_STREAM_HEADER, MSG_ID_HEADER
from asyncinfer.nats.requests import js_publish_many
from asyncinfer.nats.streams import ATTEMPT_TIMEOUT_S, TRANSIENT_JS_ERRORS, publish_durably, store_full


@dataclass(frozen=True, slots=True)
class DurableMessage:
    """One message of a pipelined durable publish (`publish_durably_many`)."""

    subject: str
    payload: bytes
    msg_id: str
    headers: dict[str, str] = field(default_factory=dict)


async def publish_durably_many(
    js: JetStreamContext, messages: Sequence[DurableMessage], *, stream: str, retry_for_s: float
) -> list[int | Exception]:
    """`publish_durably` for each message, as one pipelined group: every message is written to
    the connection before any acknowledgement is awaited (one flush, not one per message), then
    the acknowledgements are awaited together. Each result is the message's stream sequence or
    its error, in order (a StoreFullError where the store refused it for want of space).

    A message whose first attempt met a transient error (an election, a reconnect, a timeout) is
    retried on its own by `publish_durably` for what is left of retry_for_s, under the same
    Nats-Msg-Id: one stored before its acknowledgement was lost is then dropped as a duplicate."""
    give_up_at = time.monotonic() + retry_for_s
    publishes = [
        (m.subject, m.payload, {**m.headers, MSG_ID_HEADER: m.msg_id, EXPECTED_STREAM_HEADER: stream}) for m in messages
    ]
    first = await js_publish_many(js, publishes, timeout_s=max(min(ATTEMPT_TIMEOUT_S, retry_for_s), 0.1))
    results: list[int | Exception] = []
    again: list[int] = []
    for index, result in enumerate(first):
        if isinstance(result, Exception):
            full = store_full(result)
            if full is not None:
                result = full
            elif isinstance(result, TRANSIENT_JS_ERRORS):
                again.append(index)
        results.append(result)
    remaining_s = give_up_at - time.monotonic()
    if again and remaining_s > 0:
        retried = await asyncio.gather(
            *(
                publish_durably(
                    js,
                    messages[i].subject,
                    messages[i].payload,
                    stream=stream,
                    msg_id=messages[i].msg_id,
                    retry_for_s=remaining_s,
                    headers=messages[i].headers,
                )
                for i in again
            ),
            return_exceptions=True,
        )
        for i, outcome in zip(again, retried, strict=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome
            results[i] = outcome
    return results
