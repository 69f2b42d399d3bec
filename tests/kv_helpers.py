"""Listing a KV bucket's keys in tests, exactly; reading a job's record as the gateway does.

Not nats-py's `KeyValue.keys()`: it watches the bucket with an ordered consumer and can decide
"no keys" before the keys the server already pushed have been processed (a test saw [] for a bucket
holding two records, then both a moment later). The stream's own subject counts are exact."""

from __future__ import annotations

from asyncinfer.contract import JOBS_BUCKET, WORK_STREAM
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord
from asyncinfer.nats import JetStreamContext
from asyncinfer.nats.kv import open_kv_bucket


async def kv_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """Every key with a message in the bucket, sorted (the tests that use it never delete keys)."""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    return sorted(subject.removeprefix(prefix) for subject in (info.state.subjects or {}))


async def job_record(
    js: JetStreamContext, key: str, *, bucket: str = JOBS_BUCKET, work_stream: str = WORK_STREAM
) -> JobRecord | None:
    """A job's record as the gateway reads it: from the jobs bucket, or while the job is queued
    and nothing else has happened to it, its work message (at revision 0)."""
    return await JobStore(await open_kv_bucket(js, bucket), work_stream=work_stream).get(key)
