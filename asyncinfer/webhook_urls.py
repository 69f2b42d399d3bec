"""Which webhook URLs asyncinfer will call: the gateway checks a callback URL when a job is
submitted, and the scheduler checks it again against the addresses it actually connects to.

The rules:
- http or https only; an absolute URL with a host; no user:password@ part (credentials would be
  logged and shown on the job); at most MAX_URL_LENGTH characters, printable ASCII only (no spaces,
  no control characters that could split the request line; IDNs must be given in punycode).
- Every address the host resolves to must be public: private, loopback, link-local, multicast,
  reserved, unspecified, shared (100.64/10), documentation and site-local addresses are refused, and
  so are IPv6 addresses embedding such an IPv4 address (IPv4-mapped, IPv4-compatible, 6to4, NAT64),
  unless the address lies inside one of `webhooks.allowed_networks`.
- At submit a host with ANY refused address is refused (a name pointing inside is a mistake or an
  attack). At send time the host is resolved again (DNS may have changed: rebinding) and only the
  vetted addresses are connected to; none vetted means the attempt is refused.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_URL_LENGTH = 2048
RESOLVE_TIMEOUT_S = 5.0
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


class RefusedUrl(ValueError):
    """The URL may not be called; the message says why, in words for the caller."""


class Unresolved(RefusedUrl):
    """The host does not resolve now: refused at submit (a typo is the caller's to fix), but only
    a failed attempt at send time (a resolver down or timing out, a record being changed)."""


class ResolverFailed(Unresolved):
    """The resolver gave no answer (a temporary failure, a timeout), which says nothing of the
    host: at submit, UNAVAILABLE (try again), not a refusal of the URL."""


@dataclass(frozen=True, slots=True)
class CallbackUrl:
    """A checked URL, split into what an HTTP request needs."""

    scheme: str  # http | https
    host: str  # the host name or address literal, without brackets
    port: int
    target: str  # path and query, as sent on the request line
    host_header: str  # the Host header: host[:port], IPv6 literals in brackets

    @property
    def tls(self) -> bool:
        return self.scheme == "https"


def parse_callback_url(url: str) -> CallbackUrl:
    """Splits and checks the URL's form; raises RefusedUrl. Addresses are not looked at here."""
    if not url:
        raise RefusedUrl("give the URL to call")
    if len(url) > MAX_URL_LENGTH:
        raise RefusedUrl(f"URLs are at most {MAX_URL_LENGTH} characters, this one has {len(url)}")
    if not url.isascii() or not url.isprintable() or " " in url:
        raise RefusedUrl("URLs are printable ASCII without spaces (percent-encode the rest, punycode for IDNs)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RefusedUrl(f"not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise RefusedUrl(f"only http and https URLs can be called, not {parts.scheme or 'a relative URL'!r}")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise RefusedUrl("URLs may not carry credentials (user:password@); authenticate with the signature")
    host = parts.hostname
    if not host:
        raise RefusedUrl("the URL has no host")
    if port == 0:
        raise RefusedUrl("port 0 cannot be called")
    default_port = 443 if scheme == "https" else 80
    actual_port = port if port is not None else default_port
    literal = _address_literal(host)
    shown_host = f"[{host}]" if isinstance(literal, ipaddress.IPv6Address) else host
    host_header = shown_host if actual_port == default_port else f"{shown_host}:{actual_port}"
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return CallbackUrl(scheme=scheme, host=host, port=actual_port, target=target, host_header=host_header)


def _address_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or (address in _IPV4_COMPATIBLE and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _is_public(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            return _is_public(embedded)
        if address.is_site_local:
            return False
    return address.is_global and not (
        address.is_multicast or address.is_reserved or address.is_unspecified or address.is_link_local
    )


def parse_networks(cidrs: Iterable[str]) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def is_allowed_address(address: IPAddress, allowed: Sequence[IPNetwork]) -> bool:
    """Public, or inside an allowed network (an IPv6 address embedding IPv4 is judged as that IPv4)."""
    candidates: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address) and (embedded := _embedded_ipv4(address)) is not None:
        candidates.append(embedded)
    if any(candidate in network for candidate in candidates for network in allowed):
        return True
    return _is_public(address)


async def _getaddrinfo(host: str, port: int) -> list[Any]:
    """The event loop's resolver (a seam: tests make it fail as a resolver can)."""
    return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)


async def resolve(host: str, port: int, *, timeout_s: float = RESOLVE_TIMEOUT_S) -> list[IPAddress]:
    """The addresses `host` resolves to now, in the resolver's order; an address literal is itself.
    Raises RefusedUrl when it does not resolve."""
    literal = _address_literal(host)
    if literal is not None:
        return [literal]
    try:
        async with asyncio.timeout(timeout_s):
            infos = await _getaddrinfo(host, port)
    except TimeoutError:
        raise ResolverFailed(f"the resolver did not answer for the host {host!r} within {timeout_s:g} s") from None
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:  # "Temporary failure in name resolution"
            raise ResolverFailed(f"the host {host!r} could not be resolved now ({exc})") from None
        raise Unresolved(f"the host {host!r} does not resolve ({exc})") from None
    except OSError as exc:
        raise Unresolved(f"the host {host!r} does not resolve ({exc})") from None
    addresses: list[IPAddress] = []
    for _family, _type, _proto, _canonical, sockaddr in infos:
        # IPv6 sockaddrs may carry a zone ("fe80::1%eth0"); the zone never makes an address public.
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise Unresolved(f"the host {host!r} does not resolve")
    return addresses


def refused_message(host: str, address: IPAddress) -> str:
    shown = host if host == str(address) else f"{host!r} ({address})"
    return (
        f"the host {shown} is a private, loopback, link-local or otherwise non-public address; webhooks are "
        "sent only to public addresses unless webhooks.allowed_networks allows it"
    )


async def check_callback_url(url: str, allowed: Sequence[IPNetwork]) -> CallbackUrl:
    """Submit-time check: the URL's form, and every address its host resolves to now. Raises RefusedUrl."""
    parsed = parse_callback_url(url)
    for address in await resolve(parsed.host, parsed.port):
        if not is_allowed_address(address, allowed):
            raise RefusedUrl(refused_message(parsed.host, address))
    return parsed


async def vetted_addresses(parsed: CallbackUrl, allowed: Sequence[IPNetwork]) -> list[IPAddress]:
    """Send-time check: the addresses to connect to (those allowed, in resolver order). Raises
    RefusedUrl when there is none."""
    addresses = await resolve(parsed.host, parsed.port)
    vetted = [a for a in addresses if is_allowed_address(a, allowed)]
    if not vetted:
        raise RefusedUrl(refused_message(parsed.host, addresses[0]))
    return vetted
