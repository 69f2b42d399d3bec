"""Who is calling: API keys (stored as SHA-256 digests in the configuration) map callers to tenants.

With no keys configured every caller is the default tenant, which is only safe while nothing beyond
this machine can connect: `asyncinfer.access.require_keys_beyond_loopback` refuses such a start before
anything binds.
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncinfer.access import KeyRing
from asyncinfer.config import ApiKeyConfig

# Who takes tenant keys, as a refusal of another role names it (it said JobService to a BatchService call).
TENANT_SERVICES = "the gateway's JobService and BatchService"


# What anyone who reached a gateway with no key could do (asyncinfer.access.require_keys_beyond_loopback).
GATEWAY_EXPOSES = "submit, read and cancel every job"


class Authenticator:
    """Maps the `authorization: Bearer <key>` metadata of a call to the caller's tenant: a key of
    role tenant (asyncinfer.access); a key of another role is PERMISSION_DENIED here."""

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
