"""The fast path: requests, JetStream publishes and KV reads on nats-py's private plumbing, for
less CPU per call. The one file in the code base that touches nats-py's private names; everything
else reaches it through the adapter (`asyncinfer.nats.requests`, `asyncinfer.nats.kv`), which
uses nats-py's public API instead when `FASTPATH_ENABLED` is False.

Why. Every accepted job costs the gateway two JetStream publishes (its work message, its record)
and the scheduler several requests more; nats-py 2.16 wraps each in `asyncio.wait_for` (two extra
futures, a timer and callbacks in Python), a fresh NUID plus `secrets.token_hex`, and a `PubAck`
dataclass built from the answer. Here a request is one future in nats-py's own response map (the
same wildcard inbox subscription that `Client.request` uses) and one C-level timer
(`loop.call_later`) for its timeout. Measured on the 2-core machine, 128 concurrent publishers in
one process: 53 us of client CPU per publish instead of 95 us (17,600/s instead of 10,500/s).
The PUB/HPUB command itself is built here too (`publish_command`: the checks `Client.publish`
makes, header keys checked once per process, the header block encoded at once) and a group's
commands are queued as one write (`send_commands`); a request's token is a counter, not a NUID,
and a publish's answer is read for its sequence without a JSON parse: 55 -> 30 us per publish in
100-message groups (session 11).
A KV read (every dispatch and every GetJob reads a job record) is the same STREAM.MSG.GET request
that `KeyValue.get` sends, without its email.parser header parsing and dataclasses: the one
header that matters, KV-Operation, is found by a byte scan.

An object's chunk (`direct_get`, 8 to 32 reads per MB of a file batch's rows and results) is one
such request, its JSON written by hand, without `get_msg`'s `RawStreamMsg`: reading 48 ranges of
4 MiB of 128 KiB chunks cost the client 0.43-0.45 CPU-s against 0.45-0.48 (session 21, 2 cores);
most of a read's cost is nats-py's reading and parsing of the bytes, which this does not touch.

Ordered consumers (the services' KV watches, the gateway's job feed) answer JetStream's flow
control without nats-py's 0.25-s polling task while idle (`quiet_flow_control_checks`, below): an
idle `up`'s event loop slept and woke 15.3 / 11.9 times a second, 7.2 / 6.2 without it.

Same semantics as the public calls they replace: `nats.errors.TimeoutError` when no answer comes
in time, `NoRespondersError` when nothing serves the subject (a stream without a leader), the
JetStream API errors as nats-py raises them (`APIError.from_error`), `KeyWrongLastSequenceError`
for a failed compare-and-set, `InvalidKeyError` for a key KeyValue would refuse.

When. Written against nats-py 2.16.x. At import this module reads nats-py's version and checks,
with hasattr on a fresh Client and JetStreamContext, that every private name it uses exists; an
older nats-py, or a newer one that renamed any of them, turns the fast path off and the adapter
runs on nats-py's public API alone (`FASTPATH_REASON` says why). `make pytest-nats-fallback`
runs the NATS tests with it off, so the fallback is exercised as well.

Environment: `ASYNCINFER_NATS_FASTPATH=0` forces the public fallback (read once, at import), to
compare the two or to rule the fast path out when chasing a bug.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.metadata
import itertools
import json
import os
import re
import ssl
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import nats.aio.client
import nats.errors
import nats.js.errors
import nats.js.kv
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.transport import TcpTransport
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyWrongLastSequenceError

from asyncinfer.nats.protocol import (
    NO_RESPONDERS_STATUS,
    STATUS_HEADER,
    WRONG_LAST_SEQUENCE_CODES,
)

SWITCH_VARIABLE = "ASYNCINFER_NATS_FASTPATH"
WRITTEN_AGAINST = (2, 16)
# The private names used below, checked at import.
CLIENT_PRIVATE_NAMES = (
    "_resp_map",
    "_resp_sub_prefix",
    "_init_request_sub",
    # publish_command, send_commands: what Client.publish checks and where it queues a command
    "_send_command",
    "_pending",
    "_flush_pending",
    "_flush_queue",
    "_pending_data_size",
    "_max_pending_size",
    "_max_payload",
    "_skip_subject_validation",
    "stats",
    # abandoned_pongs_skipped: the PONGs' futures and what a PONG resets
    "_pongs",
    "_process_pong",
    "_pongs_received",
    "_pings_outstanding",
)
JETSTREAM_PRIVATE_NAMES = ("_nc", "_prefix", "_timeout")
KV_MODULE_PRIVATE_NAMES = ("_is_key_valid",)
# quiet_flow_control_checks: an ordered consumer's state and the two methods it replaces or wraps
JSI_PRIVATE_NAMES = (
    "_conn",
    "_psub",
    "_fcr",
    "_fcd",
    "_fciseq",
    "_fctask",
    "schedule_flow_control_response",
    "check_flow_control_response",
)
# nats.aio.client's read size, which its connect also gives asyncio's StreamReader as its limit.
CLIENT_MODULE_NAMES = ("DEFAULT_BUFFER_SIZE",)
# close_replaced_connections: the connection a TCP transport holds (and the one under TLS)
TCP_TRANSPORT_PRIVATE_NAMES = ("_io_writer", "_bare_io_writer")
# end_reconnection: the client's reconnect task and the transport it connects
RECONNECTION_PRIVATE_NAMES = ("_reconnection_task", "_transport")
KV_OP_HEADER = nats.js.kv.KV_OP.encode()
KV_REMOVALS = (nats.js.kv.KV_DEL, nats.js.kv.KV_PURGE)


def _nats_py_version() -> tuple[int, ...]:
    try:
        text = importlib.metadata.version("nats-py")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def _missing_private_names() -> list[str]:
    client = Client()
    missing = [f"Client.{name}" for name in CLIENT_PRIVATE_NAMES if not hasattr(client, name)]
    jetstream = client.jetstream()
    missing += [f"JetStreamContext.{name}" for name in JETSTREAM_PRIVATE_NAMES if not hasattr(jetstream, name)]
    missing += [f"nats.js.kv.{name}" for name in KV_MODULE_PRIVATE_NAMES if not hasattr(nats.js.kv, name)]
    missing += [f"nats.aio.client.{name}" for name in CLIENT_MODULE_NAMES if not hasattr(nats.aio.client, name)]
    transport = TcpTransport()  # type: ignore[no-untyped-call]
    missing += [f"TcpTransport.{name}" for name in TCP_TRANSPORT_PRIVATE_NAMES if not hasattr(transport, name)]
    missing += [f"Client.{name}" for name in RECONNECTION_PRIVATE_NAMES if not hasattr(client, name)]
    try:
        jsi: Any = JetStreamContext._JSI(jetstream, client, "", True, None, None, None)  # type: ignore[arg-type]
    except (AttributeError, TypeError):
        jsi = None
    missing += [f"JetStreamContext._JSI.{name}" for name in JSI_PRIVATE_NAMES if not hasattr(jsi, name)]
    return missing


def _decide() -> tuple[bool, str]:
    if os.environ.get(SWITCH_VARIABLE, "").strip() == "0":
        return False, f"{SWITCH_VARIABLE}=0"
    version = _nats_py_version()
    if version < WRITTEN_AGAINST:
        return False, f"nats-py {version or 'of unknown version'} is older than the 2.16 it was written against"
    missing = _missing_private_names()
    if missing:
        return False, f"nats-py {version} lacks {', '.join(missing)}"
    return True, f"nats-py {version}"


FASTPATH_ENABLED, FASTPATH_REASON = _decide()


# nats-py's response callback takes everything after the prefix as the token. Its own requests'
# tokens are a 22-character NUID and 4 hex digits; these are "-" and a counter, unique in the
# process (so on every connection) and never one of those: a NUID has no "-".
_TOKENS = itertools.count()


def _next_token() -> str:
    return f"-{next(_TOKENS)}"


def _expire(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(nats.errors.TimeoutError())


async def request(
    nc: Client, subject: str, payload: bytes | memoryview, *, timeout_s: float, headers: dict[str, str] | None = None
) -> Msg:
    """`nc.request(subject, payload, timeout=timeout_s, headers=headers)`, cheaper (see the module).
    A memoryview payload is copied once, into the command, when the call sends it: its bytes must
    not change until then."""
    client: Any = nc
    if not client._resp_sub_prefix:
        await client._init_request_sub()
    token = _next_token()
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Msg] = loop.create_future()
    responses: dict[str, asyncio.Future[Msg]] = client._resp_map
    responses[token] = future
    timer = loop.call_later(timeout_s, _expire, future)
    queued: bytes | None = None
    try:
        reply = client._resp_sub_prefix.decode() + token
        queued = await send_commands(client, [publish_command(client, subject, reply, payload, headers)], len(payload))
        msg = await future
    except BaseException:
        if queued is not None:
            withdraw_unsent(client, queued)
        raise
    finally:
        timer.cancel()
        responses.pop(token, None)
    if msg.headers and msg.headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS:
        raise nats.errors.NoRespondersError
    return msg


def jetstream_client(context: JetStreamContext) -> Client:
    """The connection a JetStream context was made on (nats-py keeps it private): for the requests
    the adapter makes itself, such as a message's delete without the secure erase."""
    client: Client = context._nc
    return client


async def js_publish(
    js: JetStreamContext,
    subject: str,
    payload: bytes | memoryview,
    *,
    timeout_s: float,
    headers: dict[str, str] | None = None,
) -> int:
    """`js.publish(...).seq`, cheaper (see the module); `KeyWrongLastSequenceError` for a failed
    expected-last-subject-sequence check."""
    context: Any = js
    try:
        msg = await request(context._nc, subject, payload, timeout_s=timeout_s, headers=headers)
    except nats.errors.NoRespondersError as exc:
        raise nats.js.errors.NoStreamResponseError from exc
    return _stream_sequence(msg)


# The sequence in a publish's answer without a JSON parse: a JSON string cannot hold `"seq":`
# unescaped (its quotes would be \"), so the first match is the key's.
_ACK_SEQUENCE = re.compile(rb'"seq":\s*(\d+)')


def _stream_sequence(msg: Msg) -> int:
    """The sequence a JetStream publish's answer reports, or the error it stands for (raised)."""
    data = msg.data
    if b'"error"' not in data:
        found = _ACK_SEQUENCE.search(data)
        if found is not None:
            return int(found.group(1))
    answer = json.loads(data)
    error = answer.get("error")
    if error is not None:
        if error.get("err_code") in WRONG_LAST_SEQUENCE_CODES:
            raise KeyWrongLastSequenceError(description=error.get("description"))
        APIError.from_error(error)  # raises
    return int(answer["seq"])


async def publish_all(nc: Client, messages: Sequence[tuple[str, bytes]]) -> None:
    """Core NATS publishes (no reply, no headers), every one in the same write: `nc.publish` for
    each, as one command. What comes before a message nats-py would refuse is still sent."""
    commands: list[bytes] = []
    payload_bytes = 0
    refused: Exception | None = None
    for subject, payload in messages:
        try:
            commands.append(publish_command(nc, subject, "", payload, None))
        except Exception as exc:
            refused = exc
            break
        payload_bytes += len(payload)
    if commands:
        await send_commands(nc, commands, payload_bytes)
    if refused is not None:
        raise refused


# One publish of a pipelined group: (subject, payload, headers).
Publish = tuple[str, bytes, "dict[str, str] | None"]


def _expire_all(futures: list[asyncio.Future[Msg]]) -> None:
    for future in futures:
        _expire(future)


def _fail_all(futures: list[asyncio.Future[Msg]], error: Exception) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error)


# As nats-py checks a header key and a subject (Client._send_publish, _validate_subject).
_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_SUBJECT_INVALID = re.compile(r"[ \t\r\n]")
_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
# Each header key as checked ("Key: "): the keys are the code's own few names.
_HEADER_PREFIXES: dict[str, str] = {}
_HEADER_PREFIXES_MAX = 256


def _header_block(headers: dict[str, str]) -> bytes:
    """The NATS/1.0 header block nats-py builds for `headers` (keys checked, values trimmed and
    CR/LF turned to spaces), each key checked once per process and the block encoded at once."""
    lines = ["NATS/1.0"]
    for name, value in headers.items():
        prefix = _HEADER_PREFIXES.get(name)
        if prefix is None:
            key = name.strip()
            if not key:
                continue  # skipped, as nats-py does
            if not _HEADER_KEY.fullmatch(key):
                raise nats.errors.BadHeaderError(key)
            prefix = key + ": "
            if len(_HEADER_PREFIXES) < _HEADER_PREFIXES_MAX:
                _HEADER_PREFIXES[name] = prefix
        value = value.strip()
        if "\r" in value or "\n" in value:
            value = value.translate(_VALUE_NEWLINES)
        lines.append(prefix + value)
    lines += ("", "")
    return "\r\n".join(lines).encode()


def publish_command(
    client: Any, subject: str, reply: str, payload: bytes | memoryview, headers: dict[str, str] | None
) -> bytes:
    """The PUB or HPUB protocol command that `Client.publish(subject, payload, reply=reply,
    headers=headers)` would queue, after the same checks (raising what it raises)."""
    if not client._skip_subject_validation and (
        not subject or _SUBJECT_INVALID.search(subject) or (reply and _SUBJECT_INVALID.search(reply))
    ):
        raise nats.errors.BadSubjectError
    if len(payload) > client._max_payload:
        raise nats.errors.MaxPayloadError
    if headers is None:
        if not reply:
            return b"PUB %s %d\r\n%s\r\n" % (subject.encode(), len(payload), payload)
        return b"PUB %s %s %d\r\n%s\r\n" % (subject.encode(), reply.encode(), len(payload), payload)
    block = _header_block(headers)
    return b"HPUB %s %s%d %d\r\n%s%s\r\n" % (
        subject.encode(),
        reply.encode() + b" " if reply else b"",
        len(block),
        len(block) + len(payload),
        block,
        payload,
    )


async def send_commands(client: Any, commands: list[bytes], payload_bytes: int) -> bytes:
    """Queues publish commands built by `publish_command` as one write: what `Client.publish`
    does per message (its connection checks, stats and flush), once for all of them. Returns the
    bytes queued, which `withdraw_unsent` takes back while they are not yet sent."""
    if client.is_closed:
        raise nats.errors.ConnectionClosedError
    if client.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    data = b"".join(commands)
    if not client.is_connected and (
        client._max_pending_size <= 0 or len(data) + client._pending_data_size > client._max_pending_size
    ):
        raise nats.errors.OutboundBufferLimitError
    client.stats["out_msgs"] += len(commands)
    client.stats["out_bytes"] += payload_bytes
    await client._send_command(data)
    if client._flush_queue is not None and client._flush_queue.empty():
        await client._flush_pending()
    return data


def withdraw_unsent(client: Any, queued: bytes) -> bool:
    """Takes commands queued by `send_commands` (the very bytes it returned) out of nats-py's
    pending buffer if they are still there, unsent; True if they were. Called when their caller
    stops waiting for the answer (a timeout, a cancel). Why: while the connection is down nats-py
    keeps what is published in that buffer (up to its pending_size, 2 MiB) and sends it once
    reconnected, long after the request timed out. A work message left there was stored then and
    its job ran, although its submit had been answered UNAVAILABLE (and a client that submitted
    again had two jobs). Taken back, a request that timed out was either never sent or sent
    before its answer was lost: the second is the ambiguity of any lost acknowledgement, the first
    is now certain. Bytes gone from the buffer were written to the socket (nats-py's flusher takes
    the whole list at once) and are not replayed after a reconnect."""
    pending: list[bytes] = client._pending
    for index, command in enumerate(pending):
        if command is queued:
            del pending[index]
            client._pending_data_size = max(0, client._pending_data_size - len(queued))
            return True
    return False


async def js_publish_many(
    js: JetStreamContext, publishes: Sequence[Publish], *, timeout_s: float
) -> list[int | Exception]:
    """`js_publish` for each of `publishes`, pipelined: every message is written to the
    connection before any answer is awaited (nats-py's flusher then sends them in one write), and
    the answers are awaited together, under one timer. Each result is the publish's sequence or
    its error (as `js_publish` raises it), in order."""
    context: Any = js
    client: Any = context._nc
    if not client._resp_sub_prefix:
        await client._init_request_sub()
    loop = asyncio.get_running_loop()
    prefix = client._resp_sub_prefix.decode()
    responses: dict[str, asyncio.Future[Msg]] = client._resp_map
    futures: list[asyncio.Future[Msg]] = []
    tokens: list[str] = []
    timer = loop.call_later(timeout_s, _expire_all, futures)
    unsent: Exception | None = None
    commands: list[bytes] = []
    payload_bytes = 0
    queued: bytes | None = None
    answered = False
    try:
        for subject, payload, headers in publishes:
            token = _next_token()
            try:
                commands.append(publish_command(client, subject, prefix + token, payload, headers))
                payload_bytes += len(payload)
            except Exception as exc:  # refused as Client.publish would: this and the rest are not sent
                unsent = exc
                break
            future: asyncio.Future[Msg] = loop.create_future()
            responses[token] = future
            tokens.append(token)
            futures.append(future)
        if commands:
            try:
                queued = await send_commands(client, commands, payload_bytes)
            except Exception as exc:  # the connection closed or is draining: none was sent
                _fail_all(futures, exc)
        answers = await asyncio.gather(*futures, return_exceptions=True)
        answered = all(isinstance(answer, Msg) for answer in answers)
    finally:
        if queued is not None and not answered:  # (answered: they were sent)
            withdraw_unsent(client, queued)
        timer.cancel()
        for token in tokens:
            responses.pop(token, None)
    results: list[int | Exception] = []
    for answer in answers:
        results.append(_sequence_or_error(answer))
    if unsent is not None:
        results += [unsent] * (len(publishes) - len(results))
    return results


def _sequence_or_error(answer: Msg | BaseException) -> int | Exception:
    if isinstance(answer, BaseException):
        if not isinstance(answer, Exception):
            raise answer
        return answer
    if answer.headers and answer.headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS:
        return nats.js.errors.NoStreamResponseError()
    try:
        return _stream_sequence(answer)
    except Exception as exc:
        return exc


# A stored message's subject and sequence in a direct get's answer (nats-py's Header names).
SUBJECT_HEADER = "Nats-Subject"
SEQUENCE_HEADER = "Nats-Sequence"
NOT_FOUND_STATUS = "404"


async def direct_get(
    js: JetStreamContext, stream: str, *, seq: int, next_by_subject: str = "", timeout_s: float
) -> tuple[str, int, bytes]:
    """The (subject, sequence, data) of `js.get_msg(stream, seq=seq, subject=next_by_subject,
    next=bool(next_by_subject), direct=True)`, cheaper (see the module): one request on the fast
    path, its JSON built by hand and nothing lifted into a RawStreamMsg. An object's chunks are
    read this way, 8 to 32 per MB. `nats.js.errors.NotFoundError` where there is no such message,
    the JetStream API error nats-py raises for any other status."""
    context: Any = js
    if next_by_subject:
        payload = json.dumps({"seq": seq, "next_by_subj": next_by_subject}).encode()
    else:
        payload = b'{"seq":%d}' % seq
    msg = await request(context._nc, f"{context._prefix}.DIRECT.GET.{stream}", payload, timeout_s=timeout_s)
    headers = msg.headers or {}
    if not msg.data:
        status = headers.get(STATUS_HEADER)
        if status == NOT_FOUND_STATUS:
            raise nats.js.errors.NotFoundError
        if status:
            raise APIError.from_msg(msg)
    return headers.get(SUBJECT_HEADER, ""), int(headers.get(SEQUENCE_HEADER) or seq), msg.data or b""


async def kv_latest(
    js: JetStreamContext, *, stream: str, subject_prefix: str, key: str, timeout_s: float
) -> tuple[bytes, int] | None:
    """(value, revision) of the key's latest write, as `KeyValue.get` finds it (the same
    STREAM.MSG.GET, not a direct get), cheaper (see the module); None when it has none; an empty
    value when that write is a delete or purge, or a server-placed delete marker (empty body)."""
    if not nats.js.kv._is_key_valid(key):
        raise nats.js.errors.InvalidKeyError(key)
    context: Any = js
    subject = subject_prefix + key
    reply = await request(
        context._nc,
        f"{context._prefix}.STREAM.MSG.GET.{stream}",
        json.dumps({"last_by_subj": subject}).encode(),
        timeout_s=timeout_s,
    )
    answer = json.loads(reply.data)
    error = answer.get("error")
    if error is not None:
        if error.get("code") == 404:  # no message for the key
            return None
        APIError.from_error(error)  # raises
    message = answer["message"]
    if message.get("subject") != subject:
        return None
    revision = int(message["seq"])
    stored_headers = message.get("hdrs")
    if stored_headers and _kv_operation(base64.b64decode(stored_headers)) in KV_REMOVALS:
        return b"", revision
    data = message.get("data")
    if not data:
        return b"", revision
    return base64.b64decode(data), revision


def _kv_operation(headers: bytes) -> str | None:
    """The KV-Operation header (DEL, PURGE) of a raw NATS header block, if any."""
    for line in headers.split(b"\r\n")[1:]:  # the first line is the NATS/1.0 status line
        name, _, value = line.partition(b":")
        if name.strip() == KV_OP_HEADER:
            return value.strip().decode("ascii", "replace")
    return None


def closed_transport_errors(nc: Client) -> None:
    """Makes a publish that meets a connection lost a moment ago raise a NATS error, as one made
    while nats-py knows it is disconnected does not raise at all. nats-py's flusher task ends when
    its write to the socket raises (uvloop's RuntimeError on a transport that has just closed), and
    until its reader notices the loss every publish, request and flush writes inline and raises
    that RuntimeError: past callers that handle NATS errors, into a task that dies of it (session
    18 saw the scheduler's pull log an error as `up`'s nats-server was killed). Here it is nats-py's
    UnexpectedEOF, which they handle; nats-py reconnects as always."""
    client: Any = nc
    flush_pending = client._flush_pending

    async def flush_pending_or_eof(force_flush: bool = False) -> Any:
        try:
            return await flush_pending(force_flush)
        except RuntimeError as exc:  # the write to a closed transport (or a closed loop): not sent
            raise nats.errors.UnexpectedEOF from exc

    client._flush_pending = flush_pending_or_eof


def abandoned_pongs_skipped(nc: Client) -> None:
    """Makes a PONG whose flush gave up pass by, rather than end the connection's reader. nats-py's
    flush(timeout) cancels its PONG's future when the timeout passes and leaves it queued; the PONG
    that comes late (the server stalled: a VM or GC pause, SIGSTOP, a partition healed) met it in
    `_process_pong`, whose `set_result` raised InvalidStateError, and nats-py's read loop logged
    "nats: encountered error" with a traceback and ended. The connection then stayed up but deaf
    (no message, no answer read) until its unanswered pings took it for stale, ~10 s on. The
    scheduler's pulls flush with a 1 s timeout once one times out (pull_inbox.caught_up): the
    chaos soak (bench/soak.py --nats-chaos) found it. A PONG is still counted, as nats-py does."""
    client: Any = nc
    process_pong = client._process_pong

    async def process_pong_skipping_abandoned() -> None:
        pongs = client._pongs
        if pongs and pongs[0].done():  # a flush that timed out: nobody waits for this PONG
            pongs.pop(0)
            client._pongs_received += 1
            client._pings_outstanding = 0
            return
        await process_pong()

    client._process_pong = process_pong_skipping_abandoned


# What a connection reads from its socket at once: nats-py's 32 KiB made a 4 MiB chunk of a file
# batch 128 reads, each a pass of asyncio's StreamReader and of nats-py's parser, and its reader
# (whose limit is the same size) paused and resumed the socket every 64 KiB.
READ_BYTES = 256 * 1024


def larger_reads() -> None:
    """Connections made from now on read up to READ_BYTES at once (nats-py's module setting: every
    client of the process). A small message is read as soon as it arrives, as before."""
    nats.aio.client.DEFAULT_BUFFER_SIZE = max(nats.aio.client.DEFAULT_BUFFER_SIZE, READ_BYTES)


# The ordered consumers' flow-control answer (every KV watch of the services, the gateway's job feed
# and queue views, object reads). nats-py 2.16 runs a task per ordered consumer that wakes every
# 0.25 s to see whether a flow-control request the server sent has become answerable (it is
# answered once the messages delivered before it have been handled): 4 timers a second per
# watch, forever, to answer requests that come only while the server pushes a backlog, and that
# nats-py answers itself as it reads them for a subscription with a callback (all our KV watches)
# or read with next_msg; only one read through `messages` (an iterator) waits on this task.
# Measured on an idle `up` (strace of its loop's thread): woken 15.3 / 11.9 -> 7.2 / 6.2 times a
# second, 11.1 / 7.9 -> 3.2 / 2.8 of them by a timer (the watches' timers, set together, often
# fired on one wake-up). Here that task sleeps until a
# request is scheduled (nats-py's schedule_flow_control_response, patched to wake it), polls at
# nats-py's 0.25 s only while one waits for earlier messages to be handled, and otherwise wakes
# every FLOW_CONTROL_IDLE_CHECK_S to end itself once the connection is closed (as nats-py's own
# heartbeat check does, every two heartbeats). What the other checks guard is untouched: a missed
# heartbeat remakes the consumer (nats-py's activity_check), and a gap in the consumer's
# sequence remakes it from the last stream sequence seen (nats-py's _process_msg, and
# check_for_sequence_mismatch on each heartbeat).
FLOW_CONTROL_RECHECK_S = 0.25  # nats-py's, while an answer waits for earlier messages
FLOW_CONTROL_IDLE_CHECK_S = 10.0
_FLOW_CONTROL_SCHEDULED = "_asyncinfer_flow_control_scheduled"
# nats-py's own (None where this nats-py has no such method: FASTPATH_ENABLED is then False).
_original_schedule: Any = getattr(getattr(JetStreamContext, "_JSI", None), "schedule_flow_control_response", None)


def _schedule_and_wake(jsi: Any, reply: str) -> None:
    _original_schedule(jsi, reply)
    scheduled: asyncio.Event | None = getattr(jsi, _FLOW_CONTROL_SCHEDULED, None)
    if scheduled is not None:
        scheduled.set()


async def _answer_flow_control(jsi: Any) -> None:
    """nats-py's check_flow_control_response, woken by a scheduled answer instead of every 0.25 s."""
    scheduled = asyncio.Event()
    setattr(jsi, _FLOW_CONTROL_SCHEDULED, scheduled)
    while not jsi._conn.is_closed:
        if jsi._fcr is None:  # nothing to answer (one scheduled before this task ran is seen here)
            scheduled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(scheduled.wait(), FLOW_CONTROL_IDLE_CHECK_S)
            continue
        if jsi._fciseq - jsi._psub._pending_queue.qsize() >= jsi._fcd:
            reply, jsi._fcr, jsi._fcd = jsi._fcr, None, 0
            # As nats-py: an answer lost is asked for again (a stalled consumer's heartbeat names it).
            with contextlib.suppress(Exception):
                await jsi._conn.publish(reply)
        else:
            await asyncio.sleep(FLOW_CONTROL_RECHECK_S)


def quiet_flow_control_checks() -> None:
    """Ordered consumers subscribed from now on (every client of the process) answer flow control
    without a timer while idle (above). Idempotent."""
    jsi_class: Any = JetStreamContext._JSI
    jsi_class.schedule_flow_control_response = _schedule_and_wake
    jsi_class.check_flow_control_response = _answer_flow_control


# nats-py's TCP transport is one object per client, and each connect (a reconnect's every attempt)
# replaces the connection it holds without closing it. A reconnect attempt that connects and then
# fails (the server, or a proxy in front of it, closes before its INFO: "empty response from server
# when expecting INFO message") is followed by the next attempt's connect, and its connection was
# left open, half-closed, to the garbage collector: after the event loop had ended, "loop is
# closed", an unclosed transport and an unclosed socket, which failed whichever test ran then
# (CI's "multiple unraisable exception warnings (3 sub-exceptions)"). The client's own close and
# its reconnect's start close only the connection held at that moment.
_original_tcp_connect: Any = TcpTransport.connect


async def _connect_closing_the_last(transport: Any, *args: Any, **kwargs: Any) -> Any:
    for writer in {id(w): w for w in (transport._io_writer, transport._bare_io_writer) if w is not None}.values():
        writer.close()  # a no-op for one already closed (the reconnect closes the lost one first)
    return await _original_tcp_connect(transport, *args, **kwargs)


def close_replaced_connections() -> None:
    """TCP transports connected from now on (every client of the process) close the connection they
    held before they connect again (above). Idempotent."""
    TcpTransport.connect = _connect_closing_the_last  # type: ignore[method-assign,assignment]


async def end_reconnection(client: Client, timeout_s: float) -> None:
    """After the client's close: a reconnect task that is still running is cancelled until it ends
    (within timeout_s), and the connection it may have made is closed.

    nats-py's close cancels the reconnect task and waits for it, but the cancellation can be lost
    while an attempt connects (asyncio.wait_for in Python 3.11 returns an inner connect that
    completed as it was cancelled), and the task's loop never asks whether the client was closed:
    it went on connecting every reconnect_time_wait, and the last connection it made was left to
    the garbage collector ("loop is closed", an unclosed transport and socket: an error in
    whichever test ran then, CI session 34; a batcher whose NATS went through a proxy that was cut)."""
    task = getattr(client, "_reconnection_task", None)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while task is not None and not task.done() and loop.time() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    if not client.is_closed:  # the task connected again after the close: closed again, all of it
        with contextlib.suppress(Exception):
            async with asyncio.timeout(max(deadline - loop.time(), 0.1)):
                await client.close()
    transport = getattr(client, "_transport", None)
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()


def use_tls_context(client: Client, context: ssl.SSLContext) -> None:
    """The SSL context the client's next connect (a reconnect) presents. nats-py reads
    options["tls"] at each connect and has no setter for it: a client certificate renewed on disk
    is given this way (asyncinfer.nats.connection), a context of its own each time."""
    client.options["tls"] = context


# nats-py's handling of a server's INFO (its greeting at each connect, and the cluster's updates later).
_PROCESS_INFO = "_process_info"


def vet_greetings(client: Client, vet: Callable[[Mapping[str, Any]], None], *, wants_tls: bool) -> bool:
    """Has `vet` read the INFO that each connect of the client (its first, and every reconnect) is
    greeted with, before nats-py upgrades the connection to TLS and sends its CONNECT (the
    credentials). What `vet` raises (a nats.errors.Error) fails that attempt as nats-py's own errors
    do: to the error callback, then the next attempt. nats-py itself takes the server's word on TLS:
    a client configured for it connected to a server without TLS in plaintext, password and all.

    With `wants_tls`, a server that offers TLS without requiring it (nats-server's allow_non_tls:
    INFO says tls_available) is answered over TLS: nats-py upgrades only where INFO says
    tls_required. Applied whatever FASTPATH_ENABLED says (a check, not a fast path); False where
    this nats-py has no such step, and its connects go on unvetted."""
    process_info = getattr(client, _PROCESS_INFO, None)
    if process_info is None:
        return False

    async def vetted(info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection:  # a connect's greeting (later INFOs tell of the cluster's servers)
            vet(info)
            if wants_tls and info.get("tls_available"):
                info["tls_required"] = True  # nats-py's _server_info: it reads it next, to upgrade
        await process_info(info, initial_connection=initial_connection)

    setattr(client, _PROCESS_INFO, vetted)
    return True


def pending_request_count(nc: Client) -> int:
    """Response futures the client holds for requests in flight, fast or public (nats-py's
    `Client.request` keeps them in the same private map): what the tests check is left empty.
    0 when this nats-py has no such map."""
    return len(getattr(nc, "_resp_map", None) or {})
