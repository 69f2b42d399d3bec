"""Who is calling: API keys (stored as SHA-256 digests in the configuration) map callers to tenants.

With no keys configured every caller is the default tenant, which is only safe while nothing beyond
this machine can connect: `require_auth_beyond_loopback` refuses such a start before anything binds.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from asyncinfer.access import KeyRing
from asyncinfer.config import ApiKeyConfig
from asyncinfer.errors import ConfigError

SERVICE_NAME = "asyncinfer.v1.JobService"


def is_loopback(host: str) -> bool:
    """True when an address binds only this machine (127.0.0.0/8, ::1, localhost)."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


def require_auth_beyond_loopback(what: str, host: str, api_keys: Iterable[ApiKeyConfig]) -> None:
    if not is_loopback(host) and not tuple(api_keys):
        raise ConfigError(
            f"{what} would bind {host!r}, beyond loopback, without API keys: anyone who can reach it could "
            "submit, read and cancel every job. Add [[gateway.api_keys]] entries (`asyncinfer hash-key KEY`) "
            "or bind 127.0.0.1."
        )


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
        return self._keys.require(metadata, "tenant", SERVICE_NAME).tenant
