"""Reading many of a stream's messages (headers only) in batches of a bounded size, so that the
reader's event loop is never held longer than one batch takes to parse.

Why. An ordered push consumer (what nats-py's `KeyValue.keys` and `subscribe(ordered_consumer=
True)` use) sends as fast as the server can: the socket fills, and nats-py parses every message a
read holds (up to asyncinfer.nats._fastpath.READ_BYTES, ~900 headers-only KV messages) and then
runs the callbacks of all it queued, back to back, before anything else on the loop runs. A
tenant's first ListJobs over 20,000 keys held the gateway's loop 75-112 ms at a time (3-5 stalls
over 20 ms a call). Here an ephemeral pull consumer hands out `batch` messages per pull request:
the socket never holds more than one batch, the loop runs other work between batches, and a
batch costs one round trip to the server (local: ~0.2 ms).

The consumer acknowledges nothing (AckNone), lives in memory, and the server deletes it
`inactive_threshold_s` after the last pull (we delete it at once when done; if that fails, the
threshold does it). The end: the last message of a batch says nothing is pending, or the server
answers a pull with a status (404/408: nothing left). The pulls are asyncinfer.nats.pull_inbox's,
as the scheduler's. Messages written during the scan that match
its filter are read too (a consumer's pending count includes them), as with the push consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NotFoundError

from asyncinfer.nats.pull_inbox import PullInbox

log = structlog.get_logger("asyncinfer.nats")

DELETE_TIMEOUT_S = 2.0


class ScanRefusedError(APIError):
    """The server answered a pull with a status other than 'nothing left' (409: the consumer was
    deleted, too many pulls waiting, ...)."""


class ScanTimeoutError(NatsTimeoutError):
    """The scan did not end in time: a pull went unanswered (NATS away, or a user that may create
    the consumer but not pull from it: the server refuses the pull, the client hears nothing)."""

    def __init__(self, stream: str, timeout_s: float) -> None:
        super().__init__()
        self.stream = stream
        self.timeout_s = timeout_s

    def __str__(self) -> str:
        return (
            f"nats: a scan of stream {self.stream} did not end (a pull went unanswered, or {self.timeout_s:g} s "
            f"passed): is NATS there, and may this user pull from {self.stream}?"
        )


async def scan_headers(
    nc: Client,
    *,
    stream: str,
    filter_subject: str,
    deliver_policy: api.DeliverPolicy,
    start_seq: int | None,
    on_batch: Callable[[list[Msg]], None],
    batch: int,
    inactive_threshold_s: float,
    timeout_s: float,
) -> int:
    """Every message of `stream` on `filter_subject` that `deliver_policy` (from `start_seq` with
    BY_START_SEQUENCE) delivers, headers only, handed to `on_batch` a batch of at most `batch` at a
    time, in stream order. Returns the highest stream sequence delivered (0 for none). Raises
    nats-py's errors, ScanTimeoutError (a nats-py TimeoutError) when the scan takes longer than
    `timeout_s` in all, and ScanRefusedError."""
    config = api.ConsumerConfig(
        deliver_policy=deliver_policy,
        opt_start_seq=start_seq,
        filter_subject=filter_subject,
        ack_policy=api.AckPolicy.NONE,
        headers_only=True,
        inactive_threshold=inactive_threshold_s,
        mem_storage=True,
        num_replicas=1,
    )
    js = nc.jetstream(timeout=timeout_s)
    info = await js.add_consumer(stream, config=config)
    if not info.num_pending:
        await _delete(js, stream, info.name)
        return 0
    inbox = PullInbox(nc)  # no-wait pulls of `batch`, each answered whole before the next
    highest = 0
    try:
        async with _bounded(stream, timeout_s):  # the whole scan, as one push consumer's was bounded
            while True:
                got = await inbox.pull(stream, info.name, batch)
                if inbox.ended == "refused":
                    raise ScanRefusedError(description=f"a pull from {stream} was refused")
                if inbox.ended == "lost":  # unanswered: the bound's error says what to check
                    raise TimeoutError
                if got:
                    on_batch(got)
                    metadata = got[-1].metadata
                    highest = metadata.sequence.stream
                    if metadata.num_pending == 0:
                        break
                if inbox.ended == "empty":
                    break
    finally:
        await inbox.close()
        await _delete(js, stream, info.name)
    return highest


@contextlib.asynccontextmanager
async def _bounded(stream: str, timeout_s: float) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError as exc:
        raise ScanTimeoutError(stream, timeout_s) from exc


async def _delete(js: JetStreamContext, stream: str, consumer: str) -> None:
    try:
        async with asyncio.timeout(DELETE_TIMEOUT_S):  # not a scan's whole bound when NATS is away
            await js.delete_consumer(stream, consumer)
    except NotFoundError:  # gone already: inactive past its threshold
        pass
    except (NatsError, TimeoutError) as exc:  # the server deletes it once inactive anyway
        log.warning("scan_consumer_delete_failed", stream=stream, consumer=consumer, error=str(exc))
