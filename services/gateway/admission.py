"""Admission: whether a new job may join its model's queue and its tenant's quota.

- Per model (ModelConfig.max_queue_depth): against `QueueView.estimated_depth`, in memory: the
  scheduler's snapshot plus what this gateway queued since, so the hot path reads nothing; before a
  refusal, the count is read again from the work consumers (`QueueView.confirm_depth`), since the
  jobs queued since the snapshot may have run already.
- Per tenant (GatewayConfig.max_queued_per_tenant): the tenant's unfinished jobs, counted from
  the work stream's subjects (services.gateway.tenant_quota): nothing kept, so nothing drifts.

Past a limit: RESOURCE_EXHAUSTED with a RetryInfo delay estimated from the model's measured
throughput (how long until enough jobs have left the queue), never below MIN_RETRY_AFTER_S.
"""

from __future__ import annotations

from asyncinfer.config import ModelConfig
from asyncinfer.errors import ResourceExhausted, Unavailable
from asyncinfer.job_store import NATS_FAILURES
from services.gateway.queue_view import QueueView
from services.gateway.tenant_quota import TenantQuota, TenantSlot

MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 300.0
# When no throughput is measured (no batcher yet, or no scheduler), a delay that lets a
# scale-from-zero start rather than one computed from nothing.
UNKNOWN_RATE_RETRY_AFTER_S = 5.0


def retry_after_s(excess_jobs: int, completed_per_s: float) -> float:
    """How long until `excess_jobs` have left the queue at the measured rate, within bounds."""
    if completed_per_s <= 0:
        return UNKNOWN_RATE_RETRY_AFTER_S
    return min(max(excess_jobs / completed_per_s, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)


class Admission:
    def __init__(self, view: QueueView, tenants: TenantQuota | None, *, max_queued_per_tenant: int) -> None:
        self._view = view
        self._tenants = tenants if max_queued_per_tenant else None
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
                # A paused queue does not drain: "try again in 5 s" promised what it could not keep.
                when = (
                    "its queue is paused (nothing leaves it until ResumeQueue)"
                    if self._view.is_paused(model.name)
                    else f"try again in {delay:.0f} s"
                )
                raise ResourceExhausted(
                    f"model {model.name!r} has {depth} jobs queued, at its limit of {model.max_queue_depth} "
                    f"(max_queue_depth); {when}",
                    retry_after_s=delay,
                    reason="QUEUE_FULL",
                    metadata={"model": model.name, "queued": str(depth), "limit": str(model.max_queue_depth)},
                )
        return self._view.reserve(model.name)

    async def admit_to_model(self, model: ModelConfig) -> float:
        """`reserve_model_slot`, reading the model's queued count again before a refusal: the
        estimate counts every job queued since the last snapshot, dispatched or not."""
        try:
            return self.reserve_model_slot(model)
        except ResourceExhausted as refused:
            if refused.reason != "QUEUE_FULL":
                raise
        await self._view.confirm_depth(model.name)
        return self.reserve_model_slot(model)  # synchronous again: the check and the count together

    def release_model_slot(self, model: ModelConfig, token: float) -> None:
        self._view.release(model.name, token)

    @property
    def limits_tenants(self) -> bool:
        return self._tenants is not None

    async def reserve_tenant_slot(self, tenant: str, model: ModelConfig) -> TenantSlot | None:
        """Counts the job against its tenant's quota, or raises TENANT_QUOTA_EXCEEDED (Unavailable
        when NATS cannot be reached); the slot is ended with `end_tenant_slot` once the job is
        published or not. None without a limit."""
        if self._tenants is None:
            return None
        try:
            admitted = await self._tenants.admit(tenant)
        except NATS_FAILURES as exc:
            raise Unavailable(f"cannot read the tenant's queued count: {exc}") from exc
        if isinstance(admitted, TenantSlot):
            return admitted
        limit = self._max_per_tenant
        delay = retry_after_s(admitted - limit + 1, self._rate(model.name))
        raise ResourceExhausted(
            f"tenant {tenant!r} has {admitted} jobs queued, at its limit of {limit} "
            f"(max_queued_per_tenant); try again in {delay:.0f} s",
            retry_after_s=delay,
            reason="TENANT_QUOTA_EXCEEDED",
            metadata={"tenant": tenant, "queued": str(admitted), "limit": str(limit)},
        )

    def end_tenant_slot(self, slot: TenantSlot | None) -> None:
        if slot is not None and self._tenants is not None:
            self._tenants.end(slot)
