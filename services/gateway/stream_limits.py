"""Caps on the long-lived streams a gateway holds for its callers, and giving their memory back.

Each open WatchJob or WatchJobs stream holds what it is sending (gRPC keeps a message until the
client reads it: a job's outputs, up to inline_result_max_bytes, per stream), and each open
UploadInput holds its chunks in flight; so both are counted, per tenant and, for watches, per
client connection (the peer address gRPC reports), and refused past the limits with
RESOURCE_EXHAUSTED (TOO_MANY_WATCHES, TOO_MANY_UPLOADS) rather than letting one caller hold the
process's memory. Idle uploads end on their own (services.gateway.blobs).

Memory a burst of streams freed is not given back to the OS by the allocator on its own (glibc
keeps freed heap for reuse: 2,000 stalled watches of 200 KB outputs left ~90 MiB of 270 MiB behind
after they ended). After RELEASE_AFTER_ENDED streams ended, or when the last one ends (after a few), the gateway
asks glibc to return it (malloc_trim), a moment later so that gRPC has freed its buffers first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
from collections import Counter
from collections.abc import Callable, Iterator

import structlog

from asyncinfer.errors import ResourceExhausted

log = structlog.get_logger("asyncinfer.gateway.streams")

RELEASE_AFTER_ENDED = 500
RELEASE_AFTER_LAST = 16  # streams ended since the last release, when the last one ends
RELEASE_DELAY_S = 1.0


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
        return trim
    except (OSError, AttributeError):  # not glibc: nothing to ask
        return None


_malloc_trim = _load_malloc_trim()


def release_freed_memory() -> None:
    """Returns the allocator's free memory to the OS, where the allocator can (glibc)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class StreamCounts:
    """Open streams of one kind, per tenant and per connection."""

    def __init__(self, kind: str, *, reason: str, per_tenant: int, per_connection: int = 0) -> None:
        self._kind = kind
        self._reason = reason
        self._per_tenant = per_tenant
        self._per_connection = per_connection
        self._tenants: Counter[str] = Counter()
        self._connections: Counter[str] = Counter()
        self._ended = 0
        self._release: asyncio.TimerHandle | None = None

    @property
    def open(self) -> int:
        return self._tenants.total()

    @contextlib.contextmanager
    def hold(self, tenant: str, connection: str) -> Iterator[None]:
        """One stream open for its whole body; RESOURCE_EXHAUSTED when a limit is reached."""
        self._check(tenant, connection)
        self._tenants[tenant] += 1
        if self._per_connection:
            self._connections[connection] += 1
        try:
            yield
        finally:
            self._end(tenant, connection)

    def _check(self, tenant: str, connection: str) -> None:
        reason = self._reason
        if self._per_tenant and self._tenants[tenant] >= self._per_tenant:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {self._tenants[tenant]} {self._kind} streams open on this gateway, its limit; "
                f"end some first",
                reason=reason,
                metadata={"tenant": tenant, "open": str(self._tenants[tenant]), "limit": str(self._per_tenant)},
            )
        if self._per_connection and self._connections[connection] >= self._per_connection:
            raise ResourceExhausted(
                f"this connection has {self._connections[connection]} {self._kind} streams open, its limit; "
                f"end some first or watch many jobs on one WatchJobs stream",
                reason=reason,
                metadata={"open": str(self._connections[connection]), "limit": str(self._per_connection)},
            )

    def _end(self, tenant: str, connection: str) -> None:
        self._tenants[tenant] -= 1
        if self._tenants[tenant] <= 0:
            del self._tenants[tenant]
        if self._per_connection:
            self._connections[connection] -= 1
            if self._connections[connection] <= 0:
                del self._connections[connection]
        self._ended += 1
        many_ended = self._ended >= (RELEASE_AFTER_ENDED if self._tenants else RELEASE_AFTER_LAST)
        if many_ended and self._release is None:
            self._ended = 0
            with contextlib.suppress(RuntimeError):  # no loop: nothing to schedule on
                self._release = asyncio.get_running_loop().call_later(RELEASE_DELAY_S, self._release_now)

    def _release_now(self) -> None:
        self._release = None
        release_freed_memory()
