"""Listing a KV bucket's keys in tests, exactly.

Not nats-py's `KeyValue.keys()`: it watches the bucket with an ordered consumer and can decide
"no keys" before the keys the server already pushed have been processed (a test saw [] for a bucket
holding two records, then both a moment later). The stream's own subject counts are exact."""

from __future__ import annotations

from asyncinfer.nats import JetStreamContext


async def kv_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """Every key with a message in the bucket, sorted (the tests that use it never delete keys)."""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    return sorted(subject.removeprefix(prefix) for subject in (info.state.subjects or {}))
