"""The gateway's per-tenant counts (services.gateway.tenant_quota) past MAX_TENANTS: the tenants kept
are looked over at most every FORGET_SCAN_EVERY_S. When none could be forgotten (all active), each
new tenant walked all of them again: 10,000 steps a submit (the scale pass's note)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from services.gateway import tenant_quota
from services.gateway.tenant_quota import MAX_TENANTS, TenantQuota, _TenantCount

pytestmark = pytest.mark.unit


class CountingDict(dict[str, _TenantCount]):
    walks = 0

    def items(self) -> Any:
        CountingDict.walks += 1
        return super().items()


def test_a_full_set_of_active_tenants_is_walked_once_a_second_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [time.monotonic()]
    monkeypatch.setattr(tenant_quota.time, "monotonic", lambda: now[0])
    quota = TenantQuota(None, work_stream="WORK", limit=100, read_retry_s=1.0)  # type: ignore[arg-type]
    active = CountingDict({f"t{i}": _TenantCount(read_at=now[0]) for i in range(MAX_TENANTS)})
    quota._tenants = active
    for _ in range(1_000):  # new tenants within the second: none of the kept could go
        quota._forget_idle()
    assert CountingDict.walks == 1
    assert len(active) == MAX_TENANTS
    now[0] += tenant_quota.FORGET_AFTER_S + 1  # a minute on, all idle: the next look forgets them
    quota._forget_idle()
    assert CountingDict.walks == 2
    assert len(active) == 0
