"""Each tenant's stored uploads against `gateway.max_stored_upload_bytes_per_tenant`: counted from
the object store's own stream, never kept.

An upload's chunks are published on `$O.<bucket>.C.in.<tenant>.<nuid>` (asyncinfer.blob_meta
`chunks_name`), so the tenant's stored bytes are the number of its chunk messages in the stream
(one subject filter, `count_messages`) times the chunk size: what the store holds, in whole
128 KiB chunks (an object's last chunk counts whole, so a 1-byte upload counts 128 KiB). Nothing
is incremented or decremented: a deleted, expired-and-swept or refused upload's chunks are purged
and stop counting at the next read, and no crash can make the count drift.

Two checks, so that the limit holds across concurrent uploads and several gateways:
- at the start, the stored chunks plus the declared size (when given) must fit, and while the
  upload streams, the stored chunks at the start plus what it has sent so far (refused at once,
  so that a full tenant's upload is not stored first);
- before the upload is made visible (its meta written), a read issued after its last chunk was
  acknowledged must fit. Every upload's chunks are stored before its own last read, so of two
  uploads that both become visible the later read counted both: the tenant never holds more than
  the limit in visible uploads. (Uploads that race near the limit may all be refused, each
  counting the others' chunks in flight; each caller is told how much is stored, and one at a
  time they take the room that is left.)

Uploads stored before chunk names carried the tenant are not counted (they expire within their
retention).

With an objects' directory (nats.objects_directory), uploads' bytes are files named as their chunk
subjects would be (`in.<tenant>.<nuid>`, asyncinfer.blob_files): the tenant's stored bytes are its
chunk messages plus its files, each file counted in whole chunks as a chunk subject is (one
directory scan a read). A file is written before its meta as chunks are, so both checks hold as
above; a file goes with its meta's delete or the sweep, so nothing drifts either. A gateway without
the directory counts chunks alone: every service must name the same directory.
"""

from __future__ import annotations

import asyncio

from asyncinfer.blob_files import ObjectFiles
from asyncinfer.blob_meta import CHUNK_BYTES, input_chunks_filter
from asyncinfer.errors import ResourceExhausted
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.streams import count_messages, retry_transient

READ_RETRY_S = 5.0
RETRY_AFTER_S = 60.0  # room comes back when uploads are deleted or expire: not in a second


def chunks_for(size_bytes: int) -> int:
    return -(-size_bytes // CHUNK_BYTES)


class UploadStorage:
    """Reads a tenant's stored upload bytes and refuses what would pass its limit (0: no limit)."""

    def __init__(self, nc: NatsClient, *, bucket: str, limit_bytes: int, directory: str | None = None) -> None:
        self._nc = nc
        self._files = ObjectFiles(directory, bucket) if directory else None
        self._bucket = bucket
        self._stream = f"OBJ_{bucket}"
        self.limit_bytes = limit_bytes

    @property
    def enabled(self) -> bool:
        return self.limit_bytes > 0

    async def stored_bytes(self, tenant: str) -> int:
        """The tenant's uploads as the store holds them (whole chunks; files counted the same)."""

        async def read(timeout_s: float) -> int:
            return await count_messages(
                self._nc, self._stream, input_chunks_filter(self._bucket, tenant), timeout_s=timeout_s
            )

        chunks = await retry_transient(read, retry_for_s=READ_RETRY_S, what="count the tenant's stored uploads")
        files = 0 if self._files is None else await asyncio.to_thread(self._files.tenant_upload_bytes, tenant)
        return chunks * CHUNK_BYTES + files

    def check(self, tenant: str, stored_bytes: int, adding_bytes: int) -> None:
        """Raises ResourceExhausted TENANT_STORAGE_EXCEEDED when stored + adding passes the limit
        (`adding_bytes` is counted in whole chunks, as it will be stored)."""
        if not self.enabled:
            return
        adding = chunks_for(adding_bytes) * CHUNK_BYTES
        if stored_bytes + adding <= self.limit_bytes:
            return
        raise ResourceExhausted(
            f"tenant {tenant!r} stores {stored_bytes} bytes of uploads; {adding} more would pass its limit of "
            f"{self.limit_bytes} bytes (gateway.max_stored_upload_bytes_per_tenant, counted in whole "
            f"{CHUNK_BYTES}-byte chunks): delete uploads it no longer needs (DeleteInput) or let them expire; "
            "nothing of this upload was kept",
            retry_after_s=RETRY_AFTER_S,
            reason="TENANT_STORAGE_EXCEEDED",
            metadata={
                "tenant": tenant,
                "stored_bytes": str(stored_bytes),
                "upload_bytes": str(adding),
                "limit_bytes": str(self.limit_bytes),
            },
        )

    async def check_committed(self, tenant: str) -> None:
        """The check before an upload becomes visible: its own chunks are in the stream already,
        so the tenant's whole stored total must fit."""
        if self.enabled:
            self.check(tenant, await self.stored_bytes(tenant), 0)
