"""Who is calling: API keys (stored as SHA-256 digests in the configuration) map callers to tenants.

With no keys configured every caller is the default tenant, which is only safe while nothing beyond
this machine can connect: `asyncinfer.access.require_keys_beyond_loopback` refuses such a start before
anything binds.
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncinfer.access import AccessGuard, KeyRing
from asyncinfer.config import ApiKeyConfig

# Who takes tenant keys, as a refusal of another role names it (it said JobService to a BatchService call).
TENANT_SERVICES = "the gateway's JobService and BatchService"


# What anyone who reached a gateway with no key could do (asyncinfer.access.require_keys_beyond_loopback).
GATEWAY_EXPOSES = "submit, read and cancel every job"


def tenant_guard(api_keys: Iterable[ApiKeyConfig], services: Iterable[str]) -> AccessGuard:
    """The gateway's key check, on every method of every service it serves, before the method
    runs (as the scheduler's and batcher's): a method added later that forgets to ask for its
    caller's tenant is still closed to a caller without a tenant key. Health and reflection stay
    open (asyncinfer.grpc_server)."""
    names = tuple(services)
    return AccessGuard(KeyRing(api_keys), dict.fromkeys(names, "tenant"), names=dict.fromkeys(names, TENANT_SERVICES))


class Authenticator:
    """Maps the `authorization: Bearer <key>` metadata of a call to the caller's tenant: a key of
    role tenant (asyncinfer.access); a key of another role is PERMISSION_DENIED here. The
    tenant_guard has checked the key before a method runs; this check again is the method's own
    (one SHA-256 of the key and a lookup, ~1 us)."""

    def __init__(self, api_keys: Iterable[ApiKeyConfig], default_tenant: str) -> None:
        self._keys = KeyRing(api_keys)
        self._default_tenant = default_tenant

    @property
    def enabled(self) -> bool:
        return self._keys.enabled

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        if not self._keys.enabled:
            return self._default_tenant
        return self._keys.require(metadata, "tenant", TENANT_SERVICES).tenant
