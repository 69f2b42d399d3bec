"""Idempotency claims as stored: what a claim holds (the first job's ID, the request's fingerprint,
when it was claimed), its codec, and the compare-and-set reads and writes on the idempotency
bucket. Shared by the gateway, which claims keys (services/gateway/idempotency.py decides who owns
a key, when a claim is stale and what a repeat gets), and by both services' job stores, which fit a
claim's lifetime to its job's record as the job ends (asyncinfer.claim_lifetimes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from asyncinfer.config import NatsConfig
from asyncinfer.contract import EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER, MSG_TTL_HEADER, kv_stream, kv_subject_prefix
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats import (
    KV_DEL,
    KV_OP,
    APIError,
    Client,
    JetStreamContext,
    KeyNotFoundError,
    KeyValue,
    KeyWrongLastSequenceError,
)
from asyncinfer.nats.kv import DEFAULT_TIMEOUT_S
from asyncinfer.nats.streams import ensure_kv_bucket, stored_age_s

# A job with no queue deadline may wait this long, as far as its claim's first TTL counts (once it
# has ended, its claim's TTL is cut to its record's: asyncinfer.claim_lifetimes).
QUEUE_HORIZON_WITHOUT_DEADLINE_S = 7 * 86400.0
# A claim outlives its job's record by this much.
KEY_TTL_SLACK_S = 3600.0
# A removed claim's delete marker lives this long, then the key has no trace left.
REMOVED_MARKER_TTL_S = 60
# JSStreamWrongLastSequenceErr and its constant form, as nats-py's KeyValue maps them.
WRONG_LAST_SEQUENCE_CODES = (10071, 10164)


@dataclass(frozen=True, slots=True)
class Claim:
    job_id: str
    fingerprint: str
    claim_time: float
    revision: int = 0

    def encode(self) -> bytes:
        return _claim_encoder.encode(
            ClaimWire(
                v=CLAIM_CODEC_VERSION, job_id=self.job_id, fingerprint=self.fingerprint, claim_time=self.claim_time
            )
        )

    @classmethod
    def decode(cls, data: bytes, revision: int) -> Claim:
        w = _claim_decoder.decode(data)
        return cls(w.job_id, w.fingerprint, w.claim_time, revision)


@dataclass(frozen=True, slots=True)
class ClaimWritten:
    """What a keyed job's record keeps of the claim its submit wrote (asyncinfer.claim_lifetimes)."""

    revision: int
    fingerprint: str


# The claim's codec: version 1 is version 0's fields with `v` first.
CLAIM_CODEC_VERSION = 1


class ClaimWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 0  # missing: version 0
    job_id: str
    fingerprint: str
    claim_time: float


_claim_encoder = msgspec.json.Encoder()
_claim_decoder = msgspec.json.Decoder(ClaimWire)


async def ensure_idempotency_bucket(js: JetStreamContext, config: NatsConfig) -> KeyValue:
    """The KV bucket of claims (direct gets off: a loser must read the claim the winner just wrote)."""
    return await ensure_kv_bucket(
        js,
        config,
        bucket=config.idempotency_bucket,
        description="asyncinfer idempotency keys, keyed <tenant>.<sha256(key)>: the first job",
    )


class ClaimStore:
    """The claims in the idempotency bucket, each written only by a compare-and-set on its key's
    last revision, so that of any number of racing writers exactly one wins."""

    def __init__(self, claims: KeyValue, js: JetStreamContext, *, bucket: str) -> None:
        self._kv = claims
        self._js = js
        self._subject_prefix = kv_subject_prefix(bucket)
        self._stream = kv_stream(bucket)

    async def write(self, key: str, value: bytes, *, last_revision: int, ttl_s: int | None, op: str = "") -> int:
        """A compare-and-set on the key's last revision (0: it has none), as KeyValue's create and
        delete do, but in one request: nats-py's create re-reads the key after every conflict (in
        case it was deleted), which a loser here does anyway, and its delete takes no TTL. The new
        revision; KeyWrongLastSequenceError when another write came first. The owner calls it
        directly with the encoded claim (one call per keyed submit, no layer above it)."""
        headers: dict[str, Any] = {EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER: str(last_revision)}
        if op:
            headers[KV_OP] = op
        try:
            ack = await self._js.publish(f"{self._subject_prefix}{key}", value, headers=headers, msg_ttl=ttl_s)
        except APIError as exc:
            if exc.err_code in WRONG_LAST_SEQUENCE_CODES:
                raise KeyWrongLastSequenceError(description=exc.description) from exc
            raise
        return ack.seq

    async def write_unanswered(self, nc: Client, key: str, value: bytes, *, last_revision: int, ttl_s: int) -> None:
        """`write`, published without asking for an answer: one message and no reply to wait for,
        a fraction of a request's cost on both sides. Whether it landed is not told: the server
        drops it when the key's last revision is not `last_revision`."""
        headers = {EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER: str(last_revision), MSG_TTL_HEADER: str(ttl_s)}
        await nc.publish(f"{self._subject_prefix}{key}", value, headers=headers)

    async def remove(self, key: str, revision: int) -> int:
        """Deletes the claim at `revision` (KeyWrongLastSequenceError if it changed since); the
        delete marker's revision. The marker has a TTL, so the markers of refused requests and
        released keys do not pile up in the bucket."""
        return await self.write(key, b"", last_revision=revision, ttl_s=REMOVED_MARKER_TTL_S, op=KV_DEL)

    async def stored_age_s(self, nc: Client, claim: Claim) -> float | None:
        """How long ago the server stored `claim`, by its own clock (claim_time is the writer's wall
        clock, read against the reader's: a step of either fools it); None when the claim is not
        in the bucket any more (replaced or removed since it was read)."""
        try:
            return await stored_age_s(self._js, nc, self._stream, claim.revision, timeout_s=DEFAULT_TIMEOUT_S)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the idempotency key's age: {exc}", reason="NATS_UNAVAILABLE") from exc

    async def read(self, key: str) -> tuple[Claim | None, int]:
        """The claim on the key, or None and the revision of its delete marker (0: none)."""
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError as exc:  # never written, expired (0), or released (a marker)
            marker = getattr(exc.entry, "revision", None)
            return None, marker or 0
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the idempotency key: {exc}", reason="NATS_UNAVAILABLE") from exc
        if not entry.value or entry.revision is None:
            return None, entry.revision or 0
        return Claim.decode(entry.value, entry.revision), entry.revision
