"""NATS requests and JetStream publishes on the services' hot paths, with less per-call CPU than
nats-py 2.16's `Client.request` / `JetStreamContext.publish`.

Why. Every accepted job costs the gateway two JetStream publishes (its work message, its record)
and the scheduler several requests more; nats-py wraps each in `asyncio.wait_for` (two extra
futures, a timer and callbacks in Python), a fresh NUID plus `secrets.token_hex`, and a `PubAck`
dataclass built from the answer. Here a request is one future in nats-py's own response map (the
same wildcard inbox subscription that `Client.request` uses) and one C-level timer
(`loop.call_later`) for its timeout. Measured on the 2-core machine, 128 concurrent publishers in
one process: 53 us of client CPU per publish instead of 95 us (17,600/s instead of 10,500/s).

Same semantics as the calls they replace: `nats.errors.TimeoutError` when no answer comes in
time, `NoRespondersError` when nothing serves the subject (a stream without a leader), the
JetStream API errors as nats-py raises them (`APIError.from_error`), and `KeyWrongLastSequenceError`
for a failed compare-and-set. Uses nats-py's private request plumbing (`_resp_map`,
`_resp_sub_prefix`, `_init_request_sub`, `_nuid`) as `JobStore` uses the KV's: pinned with
nats-py's version in pyproject, and covered by tests against a real server.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.errors import APIError, KeyWrongLastSequenceError

STATUS_HEADER = "Status"
NO_RESPONDERS_STATUS = "503"
# JSStreamWrongLastSequenceErrF, JSStreamWrongLastSequenceConstantErr: a compare-and-set lost.
WRONG_LAST_SEQUENCE_CODES = (10071, 10164)


def _expire(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(nats.errors.TimeoutError())


async def request(
    nc: NatsClient, subject: str, payload: bytes, *, timeout_s: float, headers: dict[str, str] | None = None
) -> Msg:
    """`nc.request(subject, payload, timeout=timeout, headers=headers)`, cheaper (see the module)."""
    client: Any = nc
    if not client._resp_sub_prefix:
        await client._init_request_sub()
    # nats-py's response callback takes everything after the prefix as the token; a NUID is unique
    # per connection, so no random suffix is needed.
    token = client._nuid.next().decode()
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Msg] = loop.create_future()
    responses: dict[str, asyncio.Future[Msg]] = client._resp_map
    responses[token] = future
    timer = loop.call_later(timeout_s, _expire, future)
    try:
        await nc.publish(subject, payload, reply=client._resp_sub_prefix.decode() + token, headers=headers)
        msg = await future
    finally:
        timer.cancel()
        responses.pop(token, None)
    if msg.headers and msg.headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS:
        raise nats.errors.NoRespondersError
    return msg


async def js_publish(
    nc: NatsClient,
    subject: str,
    payload: bytes,
    *,
    timeout_s: float,
    headers: dict[str, str] | None = None,
) -> int:
    """A JetStream publish: the stream sequence it was stored at (or, for a duplicate within the
    stream's window, the sequence of the first). Raises as `JetStreamContext.publish` does, with
    `KeyWrongLastSequenceError` for a failed expected-last-subject-sequence check."""
    try:
        msg = await request(nc, subject, payload, timeout_s=timeout_s, headers=headers)
    except nats.errors.NoRespondersError as exc:
        raise nats.js.errors.NoStreamResponseError from exc
    answer = json.loads(msg.data)
    error = answer.get("error")
    if error is not None:
        if error.get("err_code") in WRONG_LAST_SEQUENCE_CODES:
            raise KeyWrongLastSequenceError(description=error.get("description"))
        APIError.from_error(error)  # raises
    return int(answer["seq"])
