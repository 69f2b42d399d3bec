"""Dead letters: jobs that failed for good, kept in their own stream for operators to inspect,
replay or purge.

The stream (NatsConfig.dead_letter_stream) holds one message per dead job on
`asyncinfer.dead.<model>`: JSON (versioned: the codec below) with the reason (MAX_ATTEMPTS, ...),
the attempts spent (those that counted against max_attempts) of those it could spend, and apart
those given back, the last error and the original work message (base64), so a replay can publish
it again unchanged. The publish carries `Nats-Msg-Id: <job_id>.dead.<attempt>` (the record's
`attempt`, the fencing token, as the release before wrote it): a scheduler that dies between
writing the dead letter and failing the record writes the same letter again on redelivery, and the
stream drops the duplicate.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import msgspec

from asyncinfer.codecs.envelope import decode_envelope
from asyncinfer.codecs.parts import ErrorWire, error_from_wire, error_to_wire
from asyncinfer.config import NatsConfig

# Named in asyncinfer.contract; re-exported for their callers here.
from asyncinfer.contract import DEAD_SUBJECT_PREFIX as DEAD_SUBJECT_PREFIX
from asyncinfer.contract import DEAD_SUBJECTS, MSG_TTL_HEADER, dead_letter_msg_id, stream_purge_subject
from asyncinfer.contract import dead_subject as dead_subject
from asyncinfer.jobs import JobError, WorkEnvelope
from asyncinfer.nats import APIError, JetStreamContext, NotFoundError, api
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.streams import delete_message, ensure_stream, publish_durably, stored_sequences

# JetStream's answer to a delete of a message that is not there (10057: "no message found").
NO_MESSAGE_FOUND = 10057

PUBLISH_RETRY_FOR_S = 10.0
# A delete's request waits this long for the stream's answer (nats-py's delete_msg waited 5 s too).
DELETE_TIMEOUT_S = 5.0
# Letters read, deleted or replayed at once by a purge or replay by sequence (each one request, or a
# few, to nats-server): one at a time, each waited out its round trip before the next was sent.
LETTERS_AT_ONCE = 32
# A purge by sequence learns which letters are there from the stream's list of deleted sequences
# (DeadLetterStore.missing) while it holds at most this many (~8 bytes each: 400 KB); past that it
# reads each letter.
MOST_DELETED_LISTED = 50_000
# A stream info's request waits this long for the answer.
INFO_TIMEOUT_S = 5.0
# A dead letter outlives its job's record by this much (the record's own retention counts from the
# job's end; the letter is written just after).
DEAD_LETTER_SLACK_S = 3600.0


T = TypeVar("T")
R = TypeVar("R")


async def each_at_most(
    items: Sequence[T], work: Callable[[T], Awaitable[R]], *, at_once: int = LETTERS_AT_ONCE
) -> list[R | Exception]:
    """work(item) for every item, at most `at_once` at a time, every one awaited to its end (a
    failure stops none of the others): each one's result, or the exception it raised, in the items'
    order."""
    slots = asyncio.Semaphore(at_once)

    async def one(item: T) -> R:
        async with slots:
            return await work(item)

    outcomes = await asyncio.gather(*(one(item) for item in items), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome  # a cancel, an exit: not one item's outcome
    return outcomes  # type: ignore[return-value]  # BaseExceptions that are not Exceptions raised above


@dataclass(frozen=True, slots=True)
class DeadLetter:
    job_id: str
    tenant: str
    model_name: str
    reason: str
    # The attempts that counted against max_attempts over the job's life (JobRecord.spent_attempts):
    # the job's attempt number in a letter written by the release before, given back ones included.
    attempts: int
    dead_time: float
    # The original work message, byte for byte.
    original: bytes
    last_error: JobError | None = None
    # Its sequence in the dead-letter stream (0 until stored).
    sequence: int = 0
    # The attempts given back (shed, put back: not counted); 0 in a letter from the release before.
    given_back_attempts: int = 0
    # The job's attempt number when it gave up (its fencing token, in the letter's Nats-Msg-Id);
    # 0 in a letter from the release before.
    last_attempt: int = 0
    # The attempts it could spend when it gave up: the record's max_attempts less those given back
    # (each raised it by one), the "of 2" in "2 of 2 (4 given back)". 0: not known (a letter
    # written before it was kept).
    allowed_attempts: int = 0

    @property
    def envelope(self) -> WorkEnvelope:
        return decode_envelope(self.original)


# --- codec: version 1 is version 0's fields with `v` first and defaults left out; version 2's
# `attempts` counts only the attempts that counted, and it adds given_back_attempts and last_attempt
# (defaults: the release before skips them, and reads `attempts` as its count) --------------------

CODEC_VERSION = 2


class DeadLetterWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 0  # missing: version 0
    job_id: str
    tenant: str
    model_name: str
    reason: str
    # The attempts that counted against max_attempts over the job's life (JobRecord.spent_attempts):
    # the job's attempt number in a letter written by the release before, given back ones included.
    attempts: int
    dead_time: float
    last_error: ErrorWire | None = None
    original: bytes  # base64 in JSON
    given_back_attempts: int = 0  # added in version 2
    last_attempt: int = 0  # added in version 2
    allowed_attempts: int = 0  # added later in version 2 (a default: older readers skip it)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(DeadLetterWire)


def encode_dead_letter(letter: DeadLetter) -> bytes:
    return _encoder.encode(
        DeadLetterWire(
            v=CODEC_VERSION,
            job_id=letter.job_id,
            tenant=letter.tenant,
            model_name=letter.model_name,
            reason=letter.reason,
            attempts=letter.attempts,
            dead_time=letter.dead_time,
            last_error=error_to_wire(letter.last_error),
            original=letter.original,
            given_back_attempts=letter.given_back_attempts,
            last_attempt=letter.last_attempt,
            allowed_attempts=letter.allowed_attempts,
        )
    )


def decode_dead_letter(data: bytes, sequence: int = 0) -> DeadLetter:
    w = _decoder.decode(data)
    return DeadLetter(
        job_id=w.job_id,
        tenant=w.tenant,
        model_name=w.model_name,
        reason=w.reason,
        attempts=w.attempts,
        dead_time=w.dead_time,
        original=w.original,
        last_error=error_from_wire(w.last_error),
        sequence=sequence,
        given_back_attempts=w.given_back_attempts,
        last_attempt=w.last_attempt,
        allowed_attempts=w.allowed_attempts,
    )


async def ensure_dead_letter_stream(js: JetStreamContext, config: NatsConfig) -> None:
    stream = api.StreamConfig(
        name=config.dead_letter_stream,
        description="asyncinfer jobs that failed for good, one subject per model",
        subjects=[DEAD_SUBJECTS],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        num_replicas=config.replicas,
        duplicate_window=config.duplicate_window_s,
        allow_msg_ttl=True,  # each letter lives as long as its job's record (DeadLetterStore.add)
    )
    await ensure_stream(js, stream, retry_for_s=config.connect_timeout_s)


class DeadLetterStore:
    def __init__(self, nc: NatsClient, js: JetStreamContext, config: NatsConfig) -> None:
        self._nc = nc
        self._js = js
        self._stream = config.dead_letter_stream

    async def add(self, letter: DeadLetter, *, retention_s: float = 0.0) -> DeadLetter:
        """Stores the letter for as long as its job's record is kept (`retention_s`, the record's
        result retention, plus DEAD_LETTER_SLACK_S; 0: for ever): past that a replay is refused
        (the record is gone), and the letter, which holds the job's inputs, was kept for ever."""
        headers = {MSG_TTL_HEADER: str(math.ceil(retention_s + DEAD_LETTER_SLACK_S))} if retention_s > 0 else None
        sequence = await publish_durably(
            self._js,
            dead_subject(letter.model_name),
            encode_dead_letter(letter),
            stream=self._stream,
            msg_id=dead_letter_msg_id(letter.job_id, letter.last_attempt or letter.attempts),
            retry_for_s=PUBLISH_RETRY_FOR_S,
            headers=headers,
        )
        return replace(letter, sequence=sequence)

    async def get(self, sequence: int) -> DeadLetter | None:
        try:
            raw = await self._js.get_msg(self._stream, seq=sequence)
        except NotFoundError:
            return None
        if raw.data is None:
            return None
        return decode_dead_letter(raw.data, raw.seq or sequence)

    async def get_many(self, sequences: Sequence[int]) -> list[DeadLetter | None]:
        """`get` of each, LETTERS_AT_ONCE in flight; a failure is raised once every read has ended."""
        letters: list[DeadLetter | None] = []
        for outcome in await each_at_most(sequences, self.get):
            if isinstance(outcome, Exception):
                raise outcome
            letters.append(outcome)
        return letters

    async def missing(self, sequences: Sequence[int]) -> list[int]:
        """Those of `sequences` with no letter, in their order, found without reading a letter: the
        stream's first and last sequence and those deleted between (`stored_sequences`, one or two
        stream infos). A purge by sequence read each whole letter to know it was there (1,000
        letters of 64 KiB inputs: 87 MB). Past MOST_DELETED_LISTED deleted, each letter is read."""
        stored = await stored_sequences(
            self._nc, self._stream, most_deleted=MOST_DELETED_LISTED, timeout_s=INFO_TIMEOUT_S
        )
        if stored is not None:
            return [sequence for sequence in sequences if not stored.holds(sequence)]
        found = await self.get_many([sequence for sequence in dict.fromkeys(sequences) if sequence > 0])
        present = {letter.sequence for letter in found if letter is not None}
        return [sequence for sequence in sequences if sequence not in present]

    async def page(self, *, model_name: str = "", after: int = 0, limit: int = 50) -> list[DeadLetter]:
        """Up to `limit` letters with sequences above `after`, oldest first."""
        subject = dead_subject(model_name) if model_name else DEAD_SUBJECTS
        letters: list[DeadLetter] = []
        cursor = after + 1
        while len(letters) < limit:
            try:
                raw = await self._js.get_msg(self._stream, seq=cursor, subject=subject, next=True)
            except NotFoundError:
                break
            if raw.seq is None:
                break
            if raw.data is not None:
                letters.append(decode_dead_letter(raw.data, raw.seq))
            cursor = raw.seq + 1
        return letters

    async def all(self, *, model_name: str = "") -> list[DeadLetter]:
        letters: list[DeadLetter] = []
        while page := await self.page(model_name=model_name, after=letters[-1].sequence if letters else 0, limit=256):
            letters += page
        return letters

    async def count(self, *, model_name: str = "") -> int:
        """How many dead letters there are (of the model)."""
        if not model_name:
            info = await self._js.stream_info(self._stream)
            return int(info.state.messages)
        subject = dead_subject(model_name)
        info = await self._js.stream_info(self._stream, subjects_filter=subject)
        return int((info.state.subjects or {}).get(subject, 0))

    async def delete(self, sequence: int) -> bool:
        """Deletes the letter: whether it was there. Without the secure erase nats-py's delete_msg
        asks for (the message overwritten in its file): a purge of 1,000 letters by sequence (each
        read, then deleted) took 6.4 s with it and 1.0 s without, and 22.7 s against 2.7 s with
        64 KiB inputs, 4.9 CPU-s of nats-server against 0.8 (bench/results/dead_letter_purge_cost.txt).
        Nothing promises erasure (docs/SECURITY.md, "Deleted, not erased"): `purge` (one STREAM.PURGE)
        never erased, and a letter's inputs are those of a job acked off WORK, not erased either."""
        try:
            return await delete_message(self._nc, self._stream, sequence, timeout_s=DELETE_TIMEOUT_S)
        except NotFoundError:
            return False
        except APIError as exc:
            if exc.err_code == NO_MESSAGE_FOUND:  # deleted meanwhile (another purge): gone all the same
                return False
            raise

    async def delete_many(self, sequences: Sequence[int]) -> list[bool | Exception]:
        """`delete` of each, LETTERS_AT_ONCE in flight: whether each was there, or why it failed."""
        return await each_at_most(sequences, self.delete)

    async def purge(self, *, model_name: str = "") -> int:
        """Deletes every letter (of the model); how many were deleted."""
        request: dict[str, Any] = {"filter": dead_subject(model_name)} if model_name else {}
        reply = await self._nc.request(stream_purge_subject(self._stream), json.dumps(request).encode(), timeout=5.0)
        answer = json.loads(reply.data)
        if "error" in answer:
            raise RuntimeError(f"purge failed: {answer['error']}")
        return int(answer.get("purged", 0))
