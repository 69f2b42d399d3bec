"""Who is calling: API keys (stored as SHA-256 digests in the configuration) map callers to tenants.

With no keys configured every caller is the default tenant, which is only safe while nothing beyond
this machine can connect: `require_auth_beyond_loopback` refuses such a start before anything binds.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

from asyncinfer.api_keys import hash_key
from asyncinfer.config import ApiKeyConfig
from asyncinfer.errors import ConfigError, Unauthenticated

BEARER = "bearer "


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
    """Maps the `authorization: Bearer <key>` metadata of a call to the caller's tenant."""

    def __init__(self, api_keys: Iterable[ApiKeyConfig], default_tenant: str) -> None:
        self._keys = tuple((key.sha256.encode(), key.tenant) for key in api_keys)
        self._default_tenant = default_tenant

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        if not self._keys:
            return self._default_tenant
        values = [value for name, value in metadata if name.lower() == "authorization"]
        if not values:
            raise Unauthenticated("missing API key: send metadata 'authorization: Bearer <key>'")
        value = values[0]
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if not text[: len(BEARER)].lower() == BEARER or not text[len(BEARER) :].strip():
            raise Unauthenticated("the authorization metadata must be 'Bearer <key>'")
        digest = hash_key(text[len(BEARER) :].strip()).encode()
        tenant: str | None = None
        # Every configured digest is compared, in constant time each, so timing says nothing of which matched.
        for known, owner in self._keys:
            if hmac.compare_digest(digest, known):
                tenant = owner
        if tenant is None:
            raise Unauthenticated("invalid API key")
        return tenant
