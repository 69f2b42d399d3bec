"""What the gateway puts in an idempotency claim: the request's fingerprint and the claim's TTL
(the longest its job can live before it ends). The claim as stored, its codec and its reads and
writes are asyncinfer.idempotency_claims; who owns a key and what a repeat gets are the policy's
(idempotency.py).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from asyncinfer.config import Config, ModelConfig
from asyncinfer.idempotency_claims import KEY_TTL_SLACK_S, QUEUE_HORIZON_WITHOUT_DEADLINE_S
from services.gateway.submit_request import SubmitRequest


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
