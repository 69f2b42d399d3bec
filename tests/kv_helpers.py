"""Listing a KV bucket's keys in tests, exactly; reading a job's record as the gateway does; watching
the jobs bucket's writes (JobWrites).

Not nats-py's `KeyValue.keys()`: it watches the bucket with an ordered consumer and can decide
"no keys" before the keys the server already pushed have been processed (a test saw [] for a bucket
holding two records, then both a moment later). The stream's own subject counts are exact."""

from __future__ import annotations

import asyncio
import time

from asyncinfer.codecs.record import decode_record
from asyncinfer.contract import JOBS_BUCKET, WORK_STREAM
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord, JobState
from asyncinfer.nats import Client, JetStreamContext
from asyncinfer.nats.kv import open_kv_bucket
from tests.waits import WAIT_S


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


class JobWrites:
    """Every write to the jobs bucket from `start` on, as a test sees them: per key, in order,
    (time.monotonic() when it arrived, the record). `start` returns once the watch is open (call
    it once the bucket exists: after the services start); `stop` ends it, started or not."""

    def __init__(self, nc: Client, bucket: str = JOBS_BUCKET) -> None:
        self.nc = nc
        self.bucket = bucket
        self.writes: dict[str, list[tuple[float, JobRecord]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        watching = asyncio.Event()
        self._task = asyncio.create_task(self._watch(watching))
        await asyncio.wait_for(watching.wait(), WAIT_S)

    async def _watch(self, watching: asyncio.Event) -> None:
        kv = await self.nc.jetstream().key_value(self.bucket)
        watcher = await kv.watchall()
        watching.set()
        async for entry in watcher:
            if entry is not None and entry.value:  # not the end of the history, not a delete
                self.writes.setdefault(entry.key, []).append((time.monotonic(), decode_record(entry.value)))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def latest(self, key: str) -> JobRecord | None:
        """The key's last record written, None before any."""
        records = self.writes.get(key)
        return records[-1][1] if records else None

    def keys_in(self, state: JobState) -> list[str]:
        """The keys whose last record written is in `state`."""
        return [key for key, records in self.writes.items() if records[-1][1].state == state]

    def ran_again(self, key: str, after: float) -> float | None:
        """When the key's first RUNNING record written after `after` (monotonic) arrived, if one did."""
        return next((t for t, record in self.writes[key] if t > after and record.state == JobState.RUNNING), None)

    def all_ran_again(self, keys: list[str], after: float) -> bool:
        return all(self.ran_again(key, after) is not None for key in keys)

    def slowest_again(self, keys: list[str], after: float) -> float:
        """How long after `after` the last of the keys ran again (all_ran_again first)."""
        return max((self.ran_again(key, after) or after) for key in keys) - after

    def all_terminal(self, keys: list[str]) -> bool:
        return all((record := self.latest(key)) is not None and record.state.is_terminal for key in keys)
