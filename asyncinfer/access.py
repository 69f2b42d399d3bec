"""Who may call what: API keys (stored as SHA-256 digests, `gateway.api_keys`, one list for the
whole stack) carry a role, and each service takes one role:

- tenant: the gateway's JobService, that tenant's jobs only;
- ops: the scheduler's OpsService, and the batcher's KServe v2 API;
- batcher: the scheduler's WorkerService.

With no key configured nothing is checked, so a service then binds only to loopback
(`require_keys_beyond_loopback`, at every service's start). With any key configured, every method of a guarded service needs a key of its role:
UNAUTHENTICATED without a valid key, PERMISSION_DENIED with a key of another role. Health
checking and reflection are served outside the guard (probes and grpcurl's schema lookups carry no
key). `AccessGuard` wraps each method handler once, at registration (as asyncinfer.grpc_errors
does), so the check costs one hash and one lookup a call, whatever the number of keys.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import grpc

from asyncinfer.api_keys import hash_key
from asyncinfer.errors import ConfigError, PermissionDenied, Unauthenticated
from asyncinfer.grpc_handlers import rewrap

if TYPE_CHECKING:  # the client commands import this module (bearer_metadata): not the configuration's classes
    from asyncinfer.config import ApiKeyConfig

Role = Literal["tenant", "ops", "batcher"]
BEARER = "bearer "
Metadata = Iterable[tuple[str, str | bytes]]


def is_loopback(host: str) -> bool:
    """True when an address binds only this machine (127.0.0.0/8, ::1, localhost)."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


def require_keys_beyond_loopback(
    section: str, host: str, api_keys: Iterable[ApiKeyConfig], exposes: str, *, tls: bool
) -> None:
    """Refuses (ConfigError, before anything binds) a service bound beyond loopback with no API
    key configured: `exposes` says what anyone who reaches it could then do. With keys but no TLS
    of its own, a warning: the keys cross the network in cleartext unless TLS ends in front of it
    (a load balancer, a service mesh), which the service cannot see."""
    if is_loopback(host):
        return
    if not tuple(api_keys):
        raise ConfigError(
            f"the {section} would bind {host!r}, beyond loopback, without API keys: anyone who can reach it "
            f"could {exposes}. Add [[gateway.api_keys]] entries (the keys of the whole stack, each with its "
            f"role; `asyncinfer hash-key KEY`) or set {section}.host to 127.0.0.1."
        )
    if not tls:
        import structlog  # here: the client commands import this module, and structlog brings rich

        structlog.get_logger("asyncinfer.access").warning(
            "api_keys_in_cleartext",
            host=host,
            hint=f"callers' API keys reach this {section} unencrypted unless TLS ends in front of it; "
            f"set {section}.tls_cert_file and tls_key_file otherwise",
        )


def bearer_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries an API key (none without one)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


class KeyRing:
    """The configured keys, compared by digest in constant time each."""

    def __init__(self, api_keys: Iterable[ApiKeyConfig]) -> None:
        # By digest: a call looks up one entry, whatever the number of keys (a comparison with each
        # key cost 69 us a call with 1,000 tenants' keys, 0.7 ms with 10,000, on every RPC).
        self._keys = {key.sha256.encode(): key for key in api_keys}

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def identify(self, metadata: Metadata) -> ApiKeyConfig:
        """The configured key the call carries; Unauthenticated without one."""
        values = [value for name, value in metadata if name.lower() == "authorization"]
        if not values:
            raise Unauthenticated("missing API key: send metadata 'authorization: Bearer <key>'")
        value = values[0]
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if not text[: len(BEARER)].lower() == BEARER or not text[len(BEARER) :].strip():
            raise Unauthenticated("the authorization metadata must be 'Bearer <key>'")
        digest = hash_key(text[len(BEARER) :].strip()).encode()
        # The lookup's timing depends on the digest of what the caller sent, never on a key: a
        # caller who learnt that the SHA-256 of a guess shares a hash bucket or a prefix with a
        # stored digest is no closer to a key (it would need a preimage). The match itself is
        # still compared in constant time.
        found = self._keys.get(digest)
        if found is None or not hmac.compare_digest(digest, found.sha256.encode()):
            raise Unauthenticated("invalid API key")
        return found

    def require(self, metadata: Metadata, role: Role, service: str) -> ApiKeyConfig:
        """The caller's key, which must have `role`; PermissionDenied for a key of another role."""
        key = self.identify(metadata)
        if key.role != role:
            raise PermissionDenied(
                f"{service}: keys of role {role} only; this key's role is {key.role}",
                reason="WRONG_KEY_ROLE",
                metadata={"required_role": role, "key_role": key.role},
            )
        return key


class UnguardedService(Exception):
    """A service registered on a guarded server without a role: a mistake in the code, found at start."""


class AccessGuard:
    """Checks the caller's key before each method of the guarded services runs.

    `roles` maps a full service name to the role it takes; a service registered without one is
    refused at registration (UnguardedService), so a service added later cannot be served open by
    mistake. `open_methods` lists full method names (`/package.Service/Method`) served without a
    key (e.g. KServe's ServerLive, a liveness probe); `names` says how a refusal names a service
    (its full name otherwise)."""

    def __init__(
        self,
        keys: KeyRing,
        roles: Mapping[str, Role],
        open_methods: Iterable[str] = (),
        names: Mapping[str, str] | None = None,
    ) -> None:
        self._keys = keys
        self._roles = dict(roles)
        self._open = frozenset(open_methods)
        self._names = dict(names or {})

    @property
    def enabled(self) -> bool:
        return self._keys.enabled

    def wrap(self, service: str, method: str, handler: Any) -> Any:
        """The handler of `/service/method`, checking the key first (unchanged when open)."""
        if handler is None:
            return None
        role = self._roles.get(service)
        if role is None:  # checked with keys or without, so that a test without keys finds it
            raise UnguardedService(f"{service} has no API key role: add it to its server's AccessGuard roles")
        if not self._keys.enabled or f"/{service}/{method}" in self._open:
            return handler
        keys = self._keys
        name = self._names.get(service, service)

        def check(context: grpc.aio.ServicerContext[Any, Any]) -> None:
            keys.require(context.invocation_metadata() or (), role, name)

        return _guarded(handler, check)

    def wrap_generic(self, handler: grpc.GenericRpcHandler[Any, Any]) -> grpc.GenericRpcHandler[Any, Any]:
        return _GuardedGenericHandler(handler, self)


def _guarded(handler: Any, check: Callable[[Any], None]) -> Any:
    def unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: Any) -> Any:
            check(context)
            return await behavior(request, context)

        return call

    def streaming(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: Any) -> AsyncIterator[Any]:
            check(context)
            async for response in behavior(request, context):
                yield response

        return call

    return rewrap(handler, lambda behavior, _requests, responses: (streaming if responses else unary)(behavior))


class _GuardedGenericHandler(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    def __init__(self, inner: grpc.GenericRpcHandler[Any, Any], guard: AccessGuard) -> None:
        self._inner = inner
        self._guard = guard

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = self._inner.service(handler_call_details)
        service, _, method = handler_call_details.method.removeprefix("/").partition("/")
        return self._guard.wrap(service, method, handler)
