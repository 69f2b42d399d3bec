"""The registry of model versions (the KV bucket `models`, NatsConfig.models_bucket): one entry per
(model, version, batcher) at `model_version_key`, written by the scheduler a batcher is connected
to from what the batcher announces (its hello, then each change: a version loading, ready, gone),
and deleted when the batcher leaves or stops serving the version. Gateways watch it: a version
with an entry is accepted by SubmitJob even when the gateway's own file does not declare it, with
the signature the batcher announced, and ListModels shows each version's state and batchers.

The value is versioned JSON (`v`: 1): model, version, batcher (its ID), state (READY, LOADING, or
FAILED with a `reason`: it could not load the version), max_batch_size, inputs and outputs ([name,
datatype, shape] each; null for FAILED), updated_at (Unix seconds).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from asyncinfer.config import NatsConfig
from asyncinfer.nats import JetStreamContext, KeyValue
from asyncinfer.nats.streams import ensure_kv_bucket
from asyncinfer.tensors import ModelSignature, TensorSpec

REGISTRY_VERSION = 1
READY = "READY"
LOADING = "LOADING"
UNAVAILABLE = "UNAVAILABLE"
# A version the batcher was told to serve and could not load (`reason` says why): no work goes to
# it; a gateway shows it in ListModels. A release before this one skips the entry (an unknown state).
FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class RegisteredVersion:
    model_name: str
    version: str
    batcher_id: str
    state: str  # READY, LOADING or FAILED
    max_batch_size: int
    signature: ModelSignature | None
    updated_at: float = 0.0
    reason: str = ""  # FAILED: why


def batcher_token(batcher_id: str) -> str:
    """A batcher ID as one KV key token (IDs may hold dots or other characters keys refuse)."""
    return base64.urlsafe_b64encode(batcher_id.encode()).decode().rstrip("=") or "_"


def _specs(specs: tuple[TensorSpec, ...]) -> list[list[object]]:
    return [[t.name, t.datatype, list(t.shape)] for t in specs]


def encode_registered(entry: RegisteredVersion) -> bytes:
    signature = entry.signature
    return json.dumps(
        {
            "v": REGISTRY_VERSION,
            "model": entry.model_name,
            "version": entry.version,
            "batcher": entry.batcher_id,
            "state": entry.state,
            "max_batch_size": entry.max_batch_size,
            "inputs": _specs(signature.inputs) if signature is not None else None,
            "outputs": _specs(signature.outputs) if signature is not None else None,
            "updated_at": entry.updated_at,
            **({"reason": entry.reason} if entry.reason else {}),
        },
        separators=(",", ":"),
    ).encode()


def decode_registered(data: bytes) -> RegisteredVersion:
    """Raises ValueError (or KeyError, TypeError) for an entry it cannot read."""
    raw = json.loads(data)
    if raw.get("v") != REGISTRY_VERSION:
        raise ValueError(f"unknown registry entry version {raw.get('v')!r}")

    def specs(items: list[list[Any]]) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(name=str(n), datatype=str(d), shape=tuple(int(x) for x in shape)) for n, d, shape in items
        )

    signature = None
    if raw.get("inputs") is not None:
        signature = ModelSignature(inputs=specs(raw["inputs"]), outputs=specs(raw["outputs"]))
    return RegisteredVersion(
        model_name=str(raw["model"]),
        version=str(raw["version"]),
        batcher_id=str(raw["batcher"]),
        state=str(raw["state"]),
        max_batch_size=int(raw["max_batch_size"]),
        signature=signature,
        updated_at=float(raw.get("updated_at", 0.0)),
        reason=str(raw.get("reason", "")),
    )


# How long the server keeps the delete marker an expired entry leaves (a watcher hears it at once).
MARKER_TTL_S = 60.0


async def ensure_models_bucket(js: JetStreamContext, config: NatsConfig) -> KeyValue:
    return await ensure_kv_bucket(
        js,
        config,
        bucket=config.models_bucket,
        description="asyncinfer registry of model versions and the batchers serving them",
        # Entries expire by their TTL when the scheduler that wrote them is gone; without a marker
        # the gateways' watches heard nothing, and a dead batcher's versions stayed READY for good.
        limit_marker_ttl_s=MARKER_TTL_S,
    )
