"""Requests, JetStream publishes and core-NATS notices (`publish_all`), as the services' hot paths
make them: on the fast path
(`asyncinfer.nats._fastpath`, about half the client CPU per call) when it is enabled, on nats-py's
public `Client.request` / `JetStreamContext.publish` otherwise. Both raise the same errors:
`nats.errors.TimeoutError`, `NoRespondersError` (a request) or `NoStreamResponseError` (a
publish) when nothing answers, the JetStream API errors as nats-py raises them, and
`KeyWrongLastSequenceError` for a failed expected-last-subject-sequence check.

The choice is made once, at import; `FASTPATH_ENABLED` and `FASTPATH_REASON` say which it was.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyWrongLastSequenceError

from asyncinfer.nats import _fastpath
from asyncinfer.nats.protocol import WRONG_LAST_SEQUENCE_CODES

FASTPATH_ENABLED = _fastpath.FASTPATH_ENABLED
FASTPATH_REASON = _fastpath.FASTPATH_REASON


async def public_request(
    nc: Client, subject: str, payload: bytes, *, timeout_s: float, headers: dict[str, str] | None = None
) -> Msg:
    return await nc.request(subject, payload, timeout=timeout_s, headers=headers)


async def public_js_publish(
    js: JetStreamContext,
    subject: str,
    payload: bytes | memoryview,
    *,
    timeout_s: float,
    headers: dict[str, str] | None = None,
) -> int:
    try:
        ack = await js.publish(subject, bytes(payload), timeout=timeout_s, headers=headers)
    except APIError as exc:
        # KeyValue.update maps these the same way; JetStreamContext.publish leaves them a BadRequest.
        if exc.err_code in WRONG_LAST_SEQUENCE_CODES:
            raise KeyWrongLastSequenceError(description=exc.description) from exc
        raise
    return ack.seq


async def public_js_publish_many(
    js: JetStreamContext, publishes: Sequence[_fastpath.Publish], *, timeout_s: float
) -> list[int | Exception]:
    # Each publish a task of its own; they all run in the same turn of the loop, so their
    # messages still leave in one flush before any answer is awaited.
    answers = await asyncio.gather(
        *(
            public_js_publish(js, subject, payload, timeout_s=timeout_s, headers=headers)
            for subject, payload, headers in publishes
        ),
        return_exceptions=True,
    )
    results: list[int | Exception] = []
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, Exception):
            raise answer
        results.append(answer)
    return results


async def public_direct_get(
    js: JetStreamContext, stream: str, *, seq: int, next_by_subject: str = "", timeout_s: float
) -> tuple[str, int, bytes]:
    # The context's own timeout bounds it (nats-py's get_msg takes none).
    if next_by_subject:
        raw = await js.get_msg(stream, seq=seq, subject=next_by_subject, next=True, direct=True)
    else:
        raw = await js.get_msg(stream, seq=seq, direct=True)
    return raw.subject or "", raw.seq or seq, raw.data or b""


async def public_publish_all(nc: Client, messages: Sequence[tuple[str, bytes]]) -> None:
    for subject, payload in messages:
        await nc.publish(subject, payload)


# Bound once, so a call costs no more than the implementation it reaches. `request`: the answer
# to a request on core NATS. `js_publish`: the stream sequence a JetStream publish was stored at
# (for a duplicate within the stream's duplicate window, the sequence of the first).
request = _fastpath.request if FASTPATH_ENABLED else public_request
js_publish = _fastpath.js_publish if FASTPATH_ENABLED else public_js_publish
# `js_publish_many`: `js_publish` for a group of publishes, pipelined (all written before any answer
# is awaited); each publish's sequence or error, in order.
js_publish_many = _fastpath.js_publish_many if FASTPATH_ENABLED else public_js_publish_many
# `direct_get`: (subject, sequence, data) of the stream's message at `seq`, or of the first at or
# after it on `next_by_subject`, by a direct get; NotFoundError when there is none.
direct_get = _fastpath.direct_get if FASTPATH_ENABLED else public_direct_get
# `publish_all`: core NATS publishes (no reply, no headers) in one write; raises what `nc.publish`
# raises for the first it refuses, after sending those before it.
publish_all = _fastpath.publish_all if FASTPATH_ENABLED else public_publish_all


def pending_request_count(nc: Client) -> int:
    """Response futures the client holds for requests in flight (for tests: none may leak)."""
    return _fastpath.pending_request_count(nc)
