"""The scheduler's side of the model registry (asyncinfer.model_registry): the versions its
connected batchers announce (hello, then each change), written to the models bucket, one entry per
(model, version, batcher), and deleted when the batcher stops serving the version or leaves.

Entries carry a per-message TTL (ENTRY_TTL_S) and are written again every REFRESH_S while the
batcher is connected, so a scheduler that dies leaves no entry behind for longer than the TTL.
One owned loop writes: a change marks the registry dirty and the loop writes the whole set of this
scheduler's entries (a handful), then deletes those it wrote before that are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from asyncinfer.contract import model_version_key
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.model_registry import FAILED, LOADING, READY, RegisteredVersion, batcher_token, encode_registered
from asyncinfer.nats.kv import KvBucket, kv_put_with_ttl
from asyncinfer.supervision import end_if_cancelled
from services.scheduler.batchers import BatcherRegistry, BatcherSession

log = structlog.get_logger("asyncinfer.scheduler.models")

ENTRY_TTL_S = 30
REFRESH_S = 10.0


class ModelRegistryWriter:
    def __init__(self, bucket: KvBucket, batchers: BatcherRegistry) -> None:
        self._bucket = bucket
        self._batchers = batchers
        self._dirty = asyncio.Event()
        self._written: set[str] = set()

    def changed(self, _session: BatcherSession | None = None) -> None:
        """A session started, changed what it serves, or ended."""
        self._dirty.set()

    def entries(self) -> dict[str, RegisteredVersion]:
        now = time.time()
        entries: dict[str, RegisteredVersion] = {}
        for session in self._batchers.sessions:
            if session.closed:
                continue
            for served in session.announced:
                key = model_version_key(served.model_name, served.model_version, batcher_token(session.batcher_id))
                entries[key] = RegisteredVersion(
                    model_name=served.model_name,
                    version=served.model_version,
                    batcher_id=session.batcher_id,
                    state=READY if served.ready else LOADING,
                    max_batch_size=served.max_batch_size,
                    signature=served.signature,
                    updated_at=now,
                )
            for failure in session.load_failures:
                key = model_version_key(failure.model_name, failure.model_version, batcher_token(session.batcher_id))
                entries.setdefault(
                    key,
                    RegisteredVersion(
                        model_name=failure.model_name,
                        version=failure.model_version,
                        batcher_id=session.batcher_id,
                        state=FAILED,
                        max_batch_size=0,
                        signature=None,
                        updated_at=now,
                        reason=failure.reason,
                    ),
                )
        return entries

    async def write(self) -> None:
        entries = self.entries()
        await asyncio.gather(
            *(kv_put_with_ttl(self._bucket, k, encode_registered(e), ttl_s=ENTRY_TTL_S) for k, e in entries.items())
        )
        await self._delete(self._written - set(entries))
        self._written = set(entries)

    async def run(self) -> None:
        """Writes on every change and every REFRESH_S, until cancelled."""
        while True:
            end_if_cancelled()  # a stop's cancellation that the last round's NATS request lost
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REFRESH_S):
                    await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.write()
            except NATS_FAILURES as exc:
                log.warning("model_registry_write_failed", error=str(exc))
                self._dirty.set()
                await asyncio.sleep(1.0)

    async def clear(self) -> None:
        """Deletes this scheduler's entries (a graceful stop)."""
        await self._delete(self._written)
        self._written = set()

    async def _delete(self, keys: set[str]) -> None:
        """Together, not one after another: with NATS gone each waits out its request timeout, and
        one key after another made a stop last a timeout per model (an entry not deleted expires
        with its TTL)."""

        async def delete(key: str) -> None:
            with contextlib.suppress(*NATS_FAILURES):
                await self._bucket.kv.delete(key)

        await asyncio.gather(*(delete(key) for key in keys))
