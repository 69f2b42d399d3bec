"""The tenants' queued counts for `gateway.max_queued_per_tenant`: derived from the work stream,
never kept.

A tenant's count is the number of its work messages in the stream, one subject per unfinished job
(`tenant_work_subjects`: asyncinfer.work.<model>.<priority>.<tenant>.<job_id>; the message leaves
when the job is terminal, or when a scheduler pulls a job canceled or expired while queued). It is
read from nats-server's subject index (`count_subjects`). Nothing is incremented or decremented
anywhere, so no crash, lost update or contention can make it drift: the next read is exact.

A read costs ~0.5 ms with 100 queued jobs and ~1.2 ms with 1,000 (a 2-core machine), too much for
every submit, so each gateway keeps per tenant the last read plus what it admitted since:

    estimate = subjects counted + this gateway's publishes in flight when the read was issued
               + what it admitted after the read was issued

which is never below the truth (a publish in flight is counted whether or not the read saw it).
A submit is admitted on the estimate while the last read is fresh (issued under FRESH_FOR_S ago)
and the estimate stays out of the last quarter of the limit; otherwise it waits for a read issued
after it arrived (one read in flight per tenant answers every submit waiting) and is admitted or
refused on that, in arrival order. So one gateway never admits past the limit and refuses only on
a read newer than the submit; contention only queues submits behind a read, never fails them.

Several gateways: each sees the others' jobs at its reads only, so a tenant may pass its limit by
what the other gateways admit meanwhile: within a read's round trip in the last quarter of the
limit, within FRESH_FOR_S below it. The count itself stays exact.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from asyncinfer.contract import tenant_work_subjects
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.streams import count_subjects, retry_transient

# How long a read is trusted for submits far from the limit.
FRESH_FOR_S = 0.25
# Tenants without a submit in flight or a read this recent are forgotten (past MAX_TENANTS kept).
FORGET_AFTER_S = 60.0
MAX_TENANTS = 10_000
# Past MAX_TENANTS, how often the tenants kept are looked over: a look walks them all, and when none
# could be forgotten (every one active within FORGET_AFTER_S) each new tenant walked them again.
FORGET_SCAN_EVERY_S = 1.0


@dataclass(slots=True)
class _TenantCount:
    counted: int = 0  # the last read's subjects plus the publishes in flight when it was issued
    counted_admitted: int = 0  # `admitted` when the last read was issued
    admitted: int = 0  # every submit this gateway admitted for the tenant
    in_flight: int = 0  # admitted and not yet published (or failed)
    read_at: float = float("-inf")  # monotonic time the last applied read was issued
    issued: int = 0  # reads issued
    applied: int = 0  # the last read applied (its number)
    reading: asyncio.Task[None] | None = field(default=None)

    def estimate(self) -> int:
        return self.counted + self.admitted - self.counted_admitted


@dataclass(frozen=True, slots=True)
class TenantSlot:
    """An admitted submit: ended (published or not) with `TenantQuota.end`."""

    tenant: str


class TenantQuota:
    def __init__(self, nc: NatsClient, *, work_stream: str, limit: int, read_retry_s: float) -> None:
        self._nc = nc
        self._work_stream = work_stream
        self._limit = limit
        self._near = limit // 4
        self._read_retry_s = read_retry_s
        self._tenants: dict[str, _TenantCount] = {}
        self._scanned_at = float("-inf")

    async def admit(self, tenant: str) -> TenantSlot | int:
        """The submit's slot, or the tenant's count (at or past the limit) when it is refused.
        Raises what NATS raises when the count cannot be read."""
        count = self._tenants.get(tenant)
        if count is None:
            self._forget_idle()
            count = self._tenants[tenant] = _TenantCount()
        fresh = time.monotonic() - count.read_at < FRESH_FOR_S
        if not (fresh and count.estimate() < self._limit - self._near):
            await self._read_after(tenant, count, count.issued + 1)
            if count.estimate() >= self._limit:
                return count.estimate()
        count.admitted += 1
        count.in_flight += 1
        return TenantSlot(tenant)

    def end(self, slot: TenantSlot) -> None:
        """The slot's publish is over: the job is in the stream (counted by the next read) or it
        was not queued (the estimate stays one high until then)."""
        count = self._tenants.get(slot.tenant)
        if count is not None:
            count.in_flight -= 1

    async def queued(self, tenant: str) -> int:
        """The tenant's unfinished jobs, read now (for tests and operators)."""
        return await count_subjects(self._nc, self._work_stream, tenant_work_subjects(tenant), timeout_s=2.0)

    async def _read_after(self, tenant: str, count: _TenantCount, wanted: int) -> None:
        """Returns once read number `wanted` (or a later one) is applied: one issued after the
        caller arrived, since the read in flight then (number count.issued) may predate it."""
        while count.applied < wanted:
            if count.reading is None:
                count.issued += 1
                count.reading = asyncio.create_task(self._read(tenant, count, count.issued))
                count.reading.add_done_callback(_retrieve)
            await asyncio.shield(count.reading)

    async def _read(self, tenant: str, count: _TenantCount, number: int) -> None:
        in_flight, admitted, issued_at = count.in_flight, count.admitted, time.monotonic()
        try:
            subjects = await retry_transient(
                lambda timeout_s: count_subjects(
                    self._nc, self._work_stream, tenant_work_subjects(tenant), timeout_s=timeout_s
                ),
                retry_for_s=self._read_retry_s,
                what=f"count the queued jobs of tenant {tenant!r}",
            )
        finally:
            count.reading = None
        count.counted = subjects + in_flight
        count.counted_admitted = admitted
        count.read_at = issued_at
        count.applied = number

    def _forget_idle(self) -> None:
        """Bounds the tenants kept, should there be many (tenants are API keys' or callers')."""
        if len(self._tenants) < MAX_TENANTS:
            return
        now = time.monotonic()
        if now - self._scanned_at < FORGET_SCAN_EVERY_S:
            return
        self._scanned_at = now
        for tenant, count in list(self._tenants.items()):
            if not count.in_flight and count.reading is None and now - count.read_at > FORGET_AFTER_S:
                del self._tenants[tenant]


def _retrieve(task: asyncio.Task[None]) -> None:
    """A failed read is every waiter's error; with none left it is still retrieved here."""
    if not task.cancelled():
        task.exception()
