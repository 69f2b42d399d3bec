"""Admission: whether a new job may join its model's queue and its tenant's quota.

- Per model (ModelConfig.max_queue_depth): against `QueueView.estimated_depth`, in memory: the
  scheduler's snapshot plus what this gateway queued since, so the hot path reads no KV.
- Per tenant (GatewayConfig.max_queued_per_tenant): the `tenant.<tenant>` counter in the queues
  bucket (see asyncinfer.queues; a decimal count), raised by compare-and-set before the job is
  published and lowered again here if it is not; the scheduler lowers it when a job leaves the
  queue. This costs a KV read and write per submit, only while the limit is configured.

Past a limit: RESOURCE_EXHAUSTED with a RetryInfo delay estimated from the model's measured
throughput (how long until enough jobs have left the queue), never below MIN_RETRY_AFTER_S.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from asyncinfer.config import ModelConfig
from asyncinfer.errors import ResourceExhausted, Unavailable
from asyncinfer.job_store import NATS_FAILURES
from asyncinfer.nats import KeyDeletedError, KeyNotFoundError, KeyValue, KeyWrongLastSequenceError
from asyncinfer.queues import decode_count, encode_count, tenant_key
from services.gateway.queue_view import QueueView

log = structlog.get_logger("asyncinfer.gateway.admission")

MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 300.0
# When no throughput is measured (no batcher yet, or no scheduler), a delay that lets a
# scale-from-zero start rather than one computed from nothing.
UNKNOWN_RATE_RETRY_AFTER_S = 5.0
# Compare-and-set rounds before giving up on a counter that many gateways update at once.
MAX_COUNTER_ROUNDS = 50


def retry_after_s(excess_jobs: int, completed_per_s: float) -> float:
    """How long until `excess_jobs` have left the queue at the measured rate, within bounds."""
    if completed_per_s <= 0:
        return UNKNOWN_RATE_RETRY_AFTER_S
    return min(max(excess_jobs / completed_per_s, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)


class Admission:
    def __init__(self, view: QueueView, queues: KeyValue, *, max_queued_per_tenant: int) -> None:
        self._view = view
        self._queues = queues
        self._max_per_tenant = max_queued_per_tenant

    def _rate(self, model_name: str) -> float:
        snapshot = self._view.snapshot(model_name)
        return snapshot.completed_per_s if snapshot is not None else 0.0

    def reserve_model_slot(self, model: ModelConfig) -> float:
        """Counts the job against its model's queue, or raises QUEUE_FULL. Synchronous, so that
        concurrent submits to this gateway cannot all pass the same check."""
        if model.max_queue_depth:
            depth = self._view.estimated_depth(model.name)
            if depth >= model.max_queue_depth:
                excess = depth - model.max_queue_depth + 1
                delay = retry_after_s(excess, self._rate(model.name))
                raise ResourceExhausted(
                    f"model {model.name!r} has {depth} jobs queued, at its limit of {model.max_queue_depth} "
                    f"(max_queue_depth); try again in {delay:.0f} s",
                    retry_after_s=delay,
                    reason="QUEUE_FULL",
                    metadata={"model": model.name, "queued": str(depth), "limit": str(model.max_queue_depth)},
                )
        return self._view.reserve(model.name)

    def release_model_slot(self, model: ModelConfig, token: float) -> None:
        self._view.release(model.name, token)

    @property
    def limits_tenants(self) -> bool:
        return self._max_per_tenant > 0

    async def reserve_tenant_slot(self, tenant: str, model: ModelConfig) -> None:
        """Adds one to the tenant's queued count, or raises TENANT_QUOTA_EXCEEDED (Unavailable
        when NATS cannot be reached). A no-op without a limit."""
        if not self._max_per_tenant:
            return
        limit = self._max_per_tenant

        def over_quota(count: int) -> ResourceExhausted:
            delay = retry_after_s(count - limit + 1, self._rate(model.name))
            return ResourceExhausted(
                f"tenant {tenant!r} has {count} jobs queued, at its limit of {limit} "
                f"(max_queued_per_tenant); try again in {delay:.0f} s",
                retry_after_s=delay,
                reason="TENANT_QUOTA_EXCEEDED",
                metadata={"tenant": tenant, "queued": str(count), "limit": str(limit)},
            )

        await self._update_count(tenant, +1, refuse=lambda count: over_quota(count) if count >= limit else None)

    async def release_tenant_slot(self, tenant: str) -> None:
        """Takes back a reservation whose job was not queued. Best effort: a failure is logged
        (the count then stays one too high until the scheduler's next correction)."""
        if not self._max_per_tenant:
            return
        try:
            await self._update_count(tenant, -1, refuse=lambda count: None)
        except Unavailable as exc:
            log.error("tenant_count_not_released", tenant=tenant, error=exc.message)

    async def _update_count(
        self, tenant: str, delta: int, *, refuse: Callable[[int], ResourceExhausted | None]
    ) -> None:
        key = tenant_key(tenant)
        for _ in range(MAX_COUNTER_ROUNDS):
            try:
                try:
                    entry = await self._queues.get(key)
                    count, revision = decode_count(entry.value), entry.revision
                except (KeyNotFoundError, KeyDeletedError):
                    count, revision = 0, None
                error = refuse(count)
                if error is not None:
                    raise error
                value = encode_count(max(count + delta, 0))
                if revision is None:
                    await self._queues.create(key, value)
                else:
                    await self._queues.update(key, value, last=revision)
                return
            except KeyWrongLastSequenceError:
                await asyncio.sleep(0)  # another gateway or the scheduler wrote first: read again
            except NATS_FAILURES as exc:
                raise Unavailable(f"cannot update the tenant's queued count: {exc}") from exc
        raise Unavailable(f"the queued count of tenant {tenant!r} is too contended; try again")
