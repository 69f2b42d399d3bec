"""Idempotency claims as stored: what a claim holds (the first job's ID, the request's fingerprint,
when it was claimed), its codec, its TTL, and the compare-and-set reads and writes on the
idempotency bucket. Who owns a key, when a claim is stale and what a repeat gets are the policy's
(idempotency.py), which this module knows nothing of: it can be read, and its wire form changed,
without the races around it.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncinfer.config import Config, ModelConfig, NatsConfig
from asyncinfer.contract import EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER, kv_subject_prefix
from asyncinfer.errors import Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats import (
    KV_DEL,
    KV_OP,
    APIError,
    JetStreamContext,
    KeyNotFoundError,
    KeyValue,
    KeyWrongLastSequenceError,
)
from asyncinfer.nats.streams import ensure_kv_bucket
from services.gateway.submit_request import SubmitRequest

QUEUE_HORIZON_WITHOUT_DEADLINE_S = 7 * 86400.0
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


# The claim's codec: version 1 is version 0's fields with `v` first.
CLAIM_CODEC_VERSION = 1


class ClaimWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 0  # missing: version 0
    job_id: str
    fingerprint: str
    claim_time: float


_claim_encoder = msgspec.json.Encoder()
_claim_decoder = msgspec.json.Decoder(ClaimWire)


def _canonical(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bytes):
        return hashlib.sha256(value).hexdigest()
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_canonical(v) for v in value]
    return value


def request_fingerprint(request: SubmitRequest) -> str:
    """SHA-256 over every domain field of the request but the key itself (so fields added later
    count too). A deadline derived from a queue TTL differs on every retry: the TTL counts instead."""
    fields = _canonical(request)
    del fields["idempotency_key"], fields["traceparent"]  # a retry is a new trace of the same request
    if request.queue_ttl_s is not None:
        del fields["deadline"]
    encoded = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(encoded.encode()).hexdigest()


def claim_ttl_s(request: SubmitRequest, model: ModelConfig, config: Config, *, now: float) -> int:
    """Whole seconds (NATS's unit, at least 1): the longest the job can live, generously."""
    queue_s = request.deadline - now if request.deadline is not None else QUEUE_HORIZON_WITHOUT_DEADLINE_S
    attempts = request.max_attempts or model.max_attempts
    run_s = attempts * ((request.execution_timeout_s or model.default_execution_timeout_s) + model.retry_backoff_max_s)
    retention_s = request.result_retention_s or config.gateway.default_result_retention_s
    return max(1, math.ceil(max(queue_s, 0.0) + run_s + retention_s + KEY_TTL_SLACK_S))


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

    async def remove(self, key: str, revision: int) -> int:
        """Deletes the claim at `revision` (KeyWrongLastSequenceError if it changed since); the
        delete marker's revision. The marker has a TTL, so the markers of refused requests and
        released keys do not pile up in the bucket."""
        return await self.write(key, b"", last_revision=revision, ttl_s=REMOVED_MARKER_TTL_S, op=KV_DEL)

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
