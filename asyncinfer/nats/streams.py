"""Declaring streams and KV buckets, durable JetStream publishes, and retrying what a cluster
answers while it elects a leader. Declarations are idempotent, so every service can run them at
start-up in any order.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BucketNotFoundError, NoStreamResponseError, NotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from asyncinfer.backoff import retry
from asyncinfer.config import NatsConfig
from asyncinfer.contract import (
    EXPECTED_STREAM_HEADER,
    MSG_ID_HEADER,
    MSG_TTL_HEADER,
    consumer_info_subject,
    stream_info_subject,
    stream_msg_delete_subject,
    stream_msg_get_subject,
)
from asyncinfer.errors import Unavailable
from asyncinfer.nats import _fastpath
from asyncinfer.nats.protocol import NO_PLACEMENT_CODES, STORE_FULL_CODES
from asyncinfer.nats.requests import js_publish

log = structlog.get_logger("asyncinfer.nats")

T = TypeVar("T")

# What a JetStream request raises while a stream has no leader (an election after a node died, a
# cluster still forming) or while the client reconnects to another node: worth trying again.
TRANSIENT_JS_ERRORS: tuple[type[Exception], ...] = (
    asyncio.TimeoutError,  # nats.errors.TimeoutError is one
    NoStreamResponseError,
    nats.errors.NoRespondersError,
    ServiceUnavailableError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
)


class NoPlacementYetError(ServiceUnavailableError):
    """JetStream could not place a declaration's replicas: fewer servers with JetStream are up
    than `nats.replicas` asks for. A 400, yet transient while a cluster forms (its servers join
    its meta leader one by one) or a lost server comes back, so a declaration waits for it as for
    a leader election; a cluster smaller than the setting never gets there, and the declaration
    then says so."""

    def __init__(self, description: str, *, code: int | None = None, err_code: int | None = None) -> None:
        super().__init__(code=code, description=description, err_code=err_code)
        self.description: str = description


class StoreFullError(APIError):
    """JetStream refused a write for want of space (a stream at its limits with DiscardNew, or the
    server's or account's storage used up). Not transient: retrying at once only waits. Still a
    NATS error to code that catches those (NATS_FAILURES)."""

    def __init__(self, description: str, *, code: int | None = None, err_code: int | None = None) -> None:
        super().__init__(code=code, description=description, err_code=err_code)
        self.description: str = description


def store_full(exc: BaseException) -> StoreFullError | None:
    """The StoreFullError `exc` stands for, if it is one (nats-py raises these as a 503 or 400)."""
    if isinstance(exc, StoreFullError):
        return exc
    if isinstance(exc, APIError) and exc.err_code in STORE_FULL_CODES:
        return StoreFullError(exc.description or "insufficient resources", code=exc.code, err_code=exc.err_code)
    return None


async def store_has_room(
    js: JetStreamContext, stream: str, *, headroom_bytes: int, probe_subject: str | None = None
) -> bool:
    """Whether the stream, and the account's JetStream storage, have headroom_bytes to spare (what
    a health probe asks while writes fail for want of space; True where there is no limit).

    With `probe_subject` (a subject of `stream` no consumer takes; the stream must allow
    per-message TTLs), the answer is also a real write of that many bytes, gone in a second: the
    server's own limit (`max_file_store`, a full disk) is not one its API reports, and a store
    full there looks roomy by every figure above."""
    info = await js.stream_info(stream)
    config, state = info.config, info.state
    max_bytes = config.max_bytes or 0
    # A stream smaller than a few requests: a quarter of it is room enough.
    wanted = min(headroom_bytes, max_bytes // 4) if max_bytes > 0 else headroom_bytes
    if max_bytes > 0 and state.bytes + wanted > max_bytes:
        return False
    if config.max_msgs is not None and config.max_msgs > 0 and state.messages + 1 > config.max_msgs:
        return False
    account = await js.account_info()
    limit = account.limits.max_storage
    if limit is not None and limit > 0 and account.storage + headroom_bytes > limit:
        return False
    if probe_subject is None:
        return True
    headers = {EXPECTED_STREAM_HEADER: stream, MSG_TTL_HEADER: "1s"}
    try:
        await js_publish(js, probe_subject, bytes(wanted), timeout_s=ATTEMPT_TIMEOUT_S, headers=headers)
    except APIError as exc:
        if store_full(exc) is not None:
            return False
        raise
    return True


# One attempt of a retried JetStream request; leader elections take a few seconds, so several
# short attempts beat one long one.
ATTEMPT_TIMEOUT_S = 2.0


async def retry_transient(operation: Callable[[float], Awaitable[T]], *, retry_for_s: float, what: str) -> T:
    """operation(attempt_timeout_s), tried again on transient JetStream errors until retry_for_s
    has passed; the last error is raised. Only for idempotent operations (a publish with a
    Nats-Msg-Id, a read, a declaration)."""
    give_up_at = time.monotonic() + retry_for_s

    async def attempt() -> T:
        remaining = give_up_at - time.monotonic()
        try:
            return await operation(max(min(ATTEMPT_TIMEOUT_S, remaining), 0.1))
        except APIError as exc:
            full = store_full(exc)
            if full is not None:  # a 503 like an election's, but it will not pass in seconds
                raise full from exc
            if exc.err_code in NO_PLACEMENT_CODES:  # a 400, but it passes as the servers join
                raise NoPlacementYetError(
                    exc.description or "no suitable peers for placement", code=exc.code, err_code=exc.err_code
                ) from exc
            raise

    return await retry(attempt, on=TRANSIENT_JS_ERRORS, retry_for_s=retry_for_s, what=what)


async def publish_durably(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    stream: str,
    msg_id: str,
    retry_for_s: float,
    headers: dict[str, str] | None = None,
) -> int:
    """A JetStream publish that survives leader elections: retried with the same Nats-Msg-Id, so
    an attempt that was stored but whose ack was lost is dropped as a duplicate by the stream
    (within its duplicate window) and the retry still gets an ack. Returns the stream sequence."""

    all_headers = {**(headers or {}), MSG_ID_HEADER: msg_id, EXPECTED_STREAM_HEADER: stream}

    async def attempt(timeout_s: float) -> int:
        return await js_publish(js, subject, payload, timeout_s=timeout_s, headers=all_headers)

    return await retry_transient(attempt, retry_for_s=retry_for_s, what=f"publish {subject}")


async def last_stored(js: JetStreamContext, stream: str, subject: str) -> tuple[bytes, float | None] | None:
    """The payload of the stream's last message on `subject` (wildcards allowed) and the time the
    server stamped on it as it stored it (Unix seconds, the server's clock; None where unset), or
    None when it has none. Read from the stream's leader (STREAM.MSG.GET, not a direct get, which a
    replica may answer before it has the message), so a message whose publish was acknowledged is
    found."""
    try:
        message = await js.get_last_msg(stream, subject)
    except NotFoundError:
        return None
    stored = message.time.timestamp() if message.time is not None else None
    return message.data or b"", stored


async def stream_subjects(js: JetStreamContext, stream: str, subjects_filter: str) -> list[str]:
    """The subjects of the stream's messages that match `subjects_filter` (the server answers at
    most 100,000 of them in one stream info)."""
    info = await js.stream_info(stream, subjects_filter=subjects_filter)
    return list(info.state.subjects or {})


class _ApiAnswer(Protocol):
    error: dict[str, Any] | None


_Answer = TypeVar("_Answer", bound=_ApiAnswer)


async def _api_request(nc: Client, subject: str, request: bytes, answer: type[_Answer], *, timeout_s: float) -> _Answer:
    """A raw JetStream API request's answer, decoded as `answer` (only the fields it names), its
    error raised as nats-py raises it (APIError.from_error: NotFoundError for a missing stream or
    message, and so on)."""
    reply = await nc.request(subject, request, timeout=timeout_s)
    decoded = msgspec.json.decode(reply.data, type=answer)
    if decoded.error is not None:
        APIError.from_error(decoded.error)  # raises
    return decoded


class _SubjectsTotal(msgspec.Struct):
    total: int = 0
    error: dict[str, Any] | None = None


# Past every page: the server then answers the number of matching subjects and none of them.
_PAST_EVERY_PAGE = 1 << 31


async def count_subjects(nc: Client, stream: str, subjects_filter: str, *, timeout_s: float) -> int:
    """How many distinct subjects of the stream's messages match `subjects_filter`, without the
    list: a stream info asking for the subjects at an offset past the last one carries their
    total only (~1 KB whatever the count; the server's cost grows with the count: ~0.5 ms at
    100, ~1.2 ms at 1,000, ~7 ms at 10,000 on a 2-core machine)."""
    request = msgspec.json.encode({"subjects_filter": subjects_filter, "offset": _PAST_EVERY_PAGE})
    answer = await _api_request(nc, stream_info_subject(stream), request, _SubjectsTotal, timeout_s=timeout_s)
    return answer.total


class _SubjectsPage(msgspec.Struct):
    class State(msgspec.Struct):
        subjects: dict[str, int] | None = None

    state: State | None = None
    total: int = 0
    offset: int = 0
    error: dict[str, Any] | None = None


async def subject_pages(nc: Client, stream: str, subjects_filter: str, *, timeout_s: float) -> AsyncIterator[list[str]]:
    """The subjects of the stream's messages that match `subjects_filter`, one stream info answer
    at a time: the server lists at most 100,000 subjects in one (then sorted, the rest behind an
    offset), so `stream_subjects` alone misses the rest, whichever they sort as."""
    offset = 0
    while True:
        request = msgspec.json.encode({"subjects_filter": subjects_filter, "offset": offset})
        page = await _api_request(nc, stream_info_subject(stream), request, _SubjectsPage, timeout_s=timeout_s)
        subjects = list((page.state.subjects if page.state is not None else None) or {})
        if subjects:
            yield subjects
        offset += len(subjects)
        if not subjects or offset >= page.total:
            return


async def count_messages(nc: Client, stream: str, subjects_filter: str, *, timeout_s: float) -> int:
    """How many of the stream's messages have a subject matching `subjects_filter`: the sum of
    the per-subject counts a stream info lists, page by page (the server lists at most 100,000
    subjects in one answer), so exact whatever the number of subjects."""
    counted, offset = 0, 0
    while True:
        request = msgspec.json.encode({"subjects_filter": subjects_filter, "offset": offset})
        page = await _api_request(nc, stream_info_subject(stream), request, _SubjectsPage, timeout_s=timeout_s)
        subjects = (page.state.subjects if page.state is not None else None) or {}
        counted += sum(subjects.values())
        offset += len(subjects)
        if not subjects or offset >= page.total:
            return counted


def _server_time(ts: str | None) -> float | None:
    """A JetStream API answer's `ts` (the server's clock as it answered) in Unix seconds; None from a
    server older than 2.10, or Go's zero time (year 1) where a server leaves it unset."""
    if not ts:
        return None
    server_time = datetime.fromisoformat(ts).timestamp()
    return server_time if server_time > 0 else None


async def stored_age_s(js: JetStreamContext, nc: Client, stream: str, seq: int, *, timeout_s: float) -> float | None:
    """How long ago the stream stored its message `seq`, on the server's clock alone: the time the
    server stamped on the message against its time now (a plain stream info's `ts`), so a step of
    a client's wall clock plays no part. None when the stream no longer holds the message; inf when
    the server does not say its time (older than 2.10). Two requests (a message get, a stream
    info)."""
    try:
        stored = await js.get_msg(stream, seq=seq)
    except NotFoundError:
        return None
    server_time = (await stream_position(nc, stream, timeout_s=timeout_s)).server_time
    if server_time is None or stored.time is None:
        return math.inf
    return server_time - stored.time.timestamp()


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """A plain stream info's last sequence, with the server's time as it answered."""

    last_seq: int  # 0: the stream has stored nothing
    server_time: float | None  # Unix seconds on the server's clock; None from a server older than 2.10


class _StreamPosition(msgspec.Struct):
    class State(msgspec.Struct):
        last_seq: int = 0

    state: State | None = None
    ts: str | None = None
    error: dict[str, Any] | None = None


async def stream_position(nc: Client, stream: str, *, timeout_s: float) -> StreamPosition:
    """The stream's last sequence and the server's time, from one stream info (a raw request:
    nats-py's StreamInfo drops `ts`). Raises as JetStreamContext.stream_info does."""
    info = await _api_request(nc, stream_info_subject(stream), b"", _StreamPosition, timeout_s=timeout_s)
    return StreamPosition(
        last_seq=info.state.last_seq if info.state is not None else 0, server_time=_server_time(info.ts)
    )


@dataclass(frozen=True, slots=True)
class ConsumerCounts:
    """What a consumer info says of a consumer's queue, with the server's time as it answered."""

    num_pending: int  # messages matching the consumer's filter and not yet delivered
    delivered_stream_seq: int  # the stream sequence of the last message delivered (0: none yet)
    server_time: float | None  # Unix seconds on the server's clock; None from a server older than 2.10
    # Deliveries not yet acknowledged: in flight on some scheduler, or nak'ed and not yet delivered again.
    num_ack_pending: int = 0


class _ConsumerInfo(msgspec.Struct):
    class Delivered(msgspec.Struct):
        stream_seq: int = 0

    num_pending: int = 0
    num_ack_pending: int = 0
    delivered: Delivered | None = None
    ts: str | None = None
    error: dict[str, Any] | None = None


async def consumer_counts(nc: Client, stream: str, consumer: str, *, timeout_s: float) -> ConsumerCounts:
    """A consumer info as a raw request, for the server's time (`ts`), which nats-py's ConsumerInfo
    drops: ages measured against it are on the server's clock alone. Raises as
    JetStreamContext.consumer_info does (NotFoundError for a missing consumer or stream)."""
    info = await _api_request(nc, consumer_info_subject(stream, consumer), b"", _ConsumerInfo, timeout_s=timeout_s)
    return ConsumerCounts(
        num_pending=info.num_pending,
        delivered_stream_seq=info.delivered.stream_seq if info.delivered is not None else 0,
        server_time=_server_time(info.ts),
        num_ack_pending=info.num_ack_pending,
    )


class _StreamSpan(msgspec.Struct):
    class State(msgspec.Struct):
        first_seq: int = 0
        last_seq: int = 0
        num_deleted: int = 0
        deleted: list[int] | None = None

    state: State | None = None
    error: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class StoredSequences:
    """Which sequences a stream holds: those from `first` to `last` but the `deleted` between."""

    first: int
    last: int
    deleted: frozenset[int]

    def holds(self, sequence: int) -> bool:
        return self.first <= sequence <= self.last and sequence not in self.deleted


async def stored_sequences(nc: Client, stream: str, *, most_deleted: int, timeout_s: float) -> StoredSequences | None:
    """Which sequences the stream holds, read without a message: a plain stream info (its first
    and last sequence and how many between were deleted), then, when some were and no more than
    `most_deleted`, a second with `deleted_details` (each deleted sequence, ~8 bytes apiece: the
    server has no cap on the list). None when more were deleted: the list would cost more than it
    saves. Exact as of the server's answer, as a read of each message is."""
    span = await _api_request(nc, stream_info_subject(stream), b"", _StreamSpan, timeout_s=timeout_s)
    if span.state is not None and span.state.num_deleted > 0:
        if span.state.num_deleted > most_deleted:
            return None
        request = msgspec.json.encode({"deleted_details": True})
        span = await _api_request(nc, stream_info_subject(stream), request, _StreamSpan, timeout_s=timeout_s)
    state = span.state or _StreamSpan.State()
    return StoredSequences(first=state.first_seq, last=state.last_seq, deleted=frozenset(state.deleted or ()))


class _StreamSize(msgspec.Struct):
    class State(msgspec.Struct):
        num_subjects: int = 0

    state: State | None = None
    error: dict[str, Any] | None = None


async def subject_counts(
    nc: Client, stream: str, subjects_filter: str, *, most: int, timeout_s: float
) -> dict[str, int] | None:
    """The number of the stream's messages on each subject matching `subjects_filter`, or None
    when the stream holds more than `most` subjects (the list would cost more than it saves).
    First a plain stream info: its number of subjects, all of the stream's (at least those
    matching), which the server keeps as it stores, where counting the matching ones walks them
    (`count_subjects`: ~7 ms at 10,000); only when there are some, and no more than `most`, a
    second that lists those matching. An empty stream is one request."""
    size = await _api_request(nc, stream_info_subject(stream), b"", _StreamSize, timeout_s=timeout_s)
    total = size.state.num_subjects if size.state is not None else 0
    if total == 0:
        return {}
    if total > most:
        return None
    request = msgspec.json.encode({"subjects_filter": subjects_filter})
    page = await _api_request(nc, stream_info_subject(stream), request, _SubjectsPage, timeout_s=timeout_s)
    subjects = (page.state.subjects if page.state is not None else None) or {}
    if page.total > len(subjects):  # more than one page (subjects came since the count): unknown
        return None
    return subjects


class _StoredHeaders(msgspec.Struct):
    class Message(msgspec.Struct):
        seq: int = 0
        hdrs: str | None = None  # base64 of the NATS/1.0 header block; the payload (`data`) is skipped

    message: Message | None = None
    error: dict[str, Any] | None = None


def _parse_header_block(block: bytes) -> dict[str, str]:
    """`NATS/1.0\r\nName: value\r\n...` as a dict (the last value of a repeated name)."""
    headers: dict[str, str] = {}
    for line in block.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().decode()] = value.strip().decode()
    return headers


async def next_headers(
    nc: Client, stream: str, subjects_filter: str, *, from_seq: int, timeout_s: float
) -> tuple[int, dict[str, str]] | None:
    """The sequence and headers of the stream's first message at or after `from_seq` on
    `subjects_filter` (a STREAM.MSG.GET next by subject, from the leader), or None when there is
    none. The payload crosses the wire (no read of a WorkQueue stream leaves it out: a headers-only
    consumer beside its work consumers is refused, error 10100) but is skipped, not decoded."""
    request = msgspec.json.encode({"seq": max(from_seq, 1), "next_by_subj": subjects_filter})
    try:
        answer = await _api_request(nc, stream_msg_get_subject(stream), request, _StoredHeaders, timeout_s=timeout_s)
    except NotFoundError:
        return None
    if answer.message is None:
        return None
    block = base64.b64decode(answer.message.hdrs) if answer.message.hdrs else b""
    return answer.message.seq, _parse_header_block(block)


class _Deleted(msgspec.Struct):
    success: bool = False
    error: dict[str, Any] | None = None


async def delete_message(nc: Client, stream: str, seq: int, *, timeout_s: float) -> bool:
    """Deletes the stream's message `seq`: whether it was there. Without the secure erase that
    nats-py's delete_msg asks for (it overwrites the message in its file: 2.25 ms a message on a
    2-core machine, 0.44 ms without; ~2 ms of nats-server CPU each under load): a message acked off
    a WorkQueue stream is not erased either, so a deleted job's inputs are no more exposed than
    any finished job's."""
    request = msgspec.json.encode({"seq": seq, "no_erase": True})
    try:
        answer = await _api_request(nc, stream_msg_delete_subject(stream), request, _Deleted, timeout_s=timeout_s)
    except NotFoundError:
        return False
    return answer.success


async def nak_delivery(nc: Client, ack_subject: str) -> None:
    """Naks a delivered message by its ack subject, whoever received it: JetStream redelivers it
    at once (if that delivery is still the one pending; otherwise the nak is ignored)."""
    await nc.publish(ack_subject, b"-NAK")


async def delete_messages_on(js: JetStreamContext, stream: str, subject: str, *, timeout_s: float) -> int:
    """Deletes, each by its sequence, the stream's messages on `subject` (found next by subject);
    how many. Not a purge by subject: nats-server (2.15.1) handles a purge narrower than a
    consumer's filter by raising the consumer's delivered ack floor to the purged delivery's, past
    older deliveries still pending, which were then dropped from pending and never delivered again
    (bench/nats_purge_strands.py). A delete lets go of its own delivery alone, as a term does."""
    nc = _fastpath.jetstream_client(js)
    deleted, seq = 0, 1
    while (found := await next_headers(nc, stream, subject, from_seq=seq, timeout_s=timeout_s)) is not None:
        seq = found[0]
        deleted += await delete_message(nc, stream, seq, timeout_s=timeout_s)
        seq += 1
    return deleted


async def messages_between(
    js: JetStreamContext, stream: str, subjects_filter: str, *, first_seq: int, last_seq: int
) -> list[tuple[int, str]]:
    """(sequence, subject) of the stream's messages from first_seq to last_seq that match
    `subjects_filter`, one STREAM.MSG.GET each (next by subject, from the leader). The payloads
    come along; this is for the few messages a consumer has delivered and not had acked."""
    found: list[tuple[int, str]] = []
    seq = max(first_seq, 1)
    while seq <= last_seq:
        try:
            message = await js.get_msg(stream, seq=seq, subject=subjects_filter, next=True)
        except NotFoundError:
            break
        if message.seq is None or message.seq > last_seq or message.subject is None:
            break
        found.append((message.seq, message.subject))
        seq = message.seq + 1
    return found


async def ensure_stream(js: JetStreamContext, stream: api.StreamConfig, *, retry_for_s: float) -> None:
    """A stream of ours, created with `stream` unless it exists. An existing one is left as it is,
    but for per-message TTLs, turned on where `stream` asks for them (a release before made the
    stream without)."""
    name = stream.name
    assert name is not None

    async def declare(_: float) -> None:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            await js.add_stream(stream)
            log.info("stream_created", stream=name)
            return
        if stream.allow_msg_ttl and not info.config.allow_msg_ttl:
            info.config.allow_msg_ttl = True
            await js.update_stream(info.config)
            log.info("stream_message_ttls_allowed", stream=name)

    await declaration(declare, retry_for_s=retry_for_s, what=f"declare the {name} stream")


# A declaration at a service's start waits out a leader election this long at the least: a node
# lost just as a service started (a pod restarted during a failover) outlasted the 5 s it had, and
# the service died with a traceback, then again on each restart.
DECLARE_RETRY_S = 30.0


async def declaration(operation: Callable[[float], Awaitable[T]], *, what: str, retry_for_s: float = 0.0) -> T:
    """retry_transient for what a service sets up as it starts (a stream, a bucket, a consumer, a
    watch), for DECLARE_RETRY_S at the least; then Unavailable (one line, exit 69), not the NATS
    client's exception."""
    try:
        return await retry_transient(operation, retry_for_s=max(retry_for_s, DECLARE_RETRY_S), what=what)
    except NoPlacementYetError as exc:
        raise Unavailable(
            f"cannot {what}: JetStream could not place its replicas for {max(retry_for_s, DECLARE_RETRY_S):g} s "
            f"({exc.description}); are as many servers with JetStream up as nats.replicas asks for?"
        ) from exc
    except TRANSIENT_JS_ERRORS as exc:
        raise Unavailable(
            f"cannot {what}: JetStream did not answer for {max(retry_for_s, DECLARE_RETRY_S):g} s ({exc!r}); "
            "is JetStream on (nats-server -js), and has the cluster a leader?"
        ) from exc


async def _set_marker_ttl(js: JetStreamContext, stream: str, marker_ttl_s: float) -> None:
    """The bucket's delete markers live `marker_ttl_s`: set on a bucket created without them (a
    release before asked for none: the server leaves one when an entry's TTL removes it, which is
    how watchers hear of it), or made another length (the setting changed: it was ignored on a
    bucket that existed, silently)."""
    info = await js.stream_info(stream)
    was = info.config.subject_delete_marker_ttl
    if was and abs(was - marker_ttl_s) < 1.0:
        return
    info.config.subject_delete_marker_ttl = marker_ttl_s
    await js.update_stream(info.config)
    log.info("bucket_delete_marker_ttl_set", stream=stream, marker_ttl_s=marker_ttl_s, was_s=was)


async def ensure_kv_bucket(
    js: JetStreamContext,
    config: NatsConfig,
    *,
    bucket: str,
    description: str,
    limit_marker_ttl_s: float | None = None,
) -> KeyValue:
    """A KV bucket of ours, created on first use (history 1, file storage, the configured
    replicas). Direct gets are off for all of them: a read right after a write must see the write
    (followers may lag), and compare-and-set needs the latest revision. nats-py allows per-message
    TTLs on every bucket it creates."""

    async def declare(_: float) -> KeyValue:
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            created = await js.create_key_value(
                bucket=bucket,
                description=description,
                history=1,
                storage=api.StorageType.FILE,
                replicas=config.replicas,
                direct=False,
                limit_marker_ttl=limit_marker_ttl_s,
            )
            log.info("bucket_created", bucket=bucket)
            return created
        if limit_marker_ttl_s:
            await _set_marker_ttl(js, f"KV_{bucket}", limit_marker_ttl_s)
        return kv

    # A cluster that is still electing its meta leader answers 503 or not at all for a moment.
    return await declaration(declare, retry_for_s=config.connect_timeout_s, what=f"declare the {bucket} bucket")
