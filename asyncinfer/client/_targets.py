"""The gRPC target a client is given, checked before its channel is made. gRPC takes any string,
and one it can never reach ("127.0.0.1:5005l", ":", "host:99999") fails each call UNAVAILABLE,
which the client's retry policy retried for ~7 s though no try could succeed; a port past 65535
gRPC wraps (127.0.0.1:99999 dialled port 34463) and port 0 it dials.

The forms are gRPC's (grpc/doc/naming.md): HOST[:PORT] or dns:[//AUTHORITY/]HOST[:PORT], HOST a
name, an IPv4 address or an IPv6 one in brackets ("[::1]:50051"; without brackets, no port), no
port or an empty one gRPC's default, 443; ipv4:/ipv6: addresses with their ports; unix:PATH and
other schemes are gRPC's to judge. A string whose first part is not a scheme gRPC knows
("localhost:50051") is HOST:PORT, as gRPC reads it."""

from __future__ import annotations

import re

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)", re.DOTALL)
# The port names gRPC's resolvers know; any other name fails as "Failed to parse port".
_PORT_NAMES = frozenset({"http", "https"})
_HIS_TO_JUDGE = frozenset({"unix", "unix-abstract", "vsock"})
FORMS = "HOST:PORT, e.g. 127.0.0.1:50051, [::1]:50051, dns:///gateway:50051 or unix:/path"


def target_problem(target: str) -> str | None:
    """Why gRPC can never reach `target` (None: it may)."""
    scheme = _SCHEME.fullmatch(target)
    if scheme is not None:
        name, rest = scheme.group(1).lower(), scheme.group(2)
        if name == "dns":
            if rest.startswith("//"):  # dns://AUTHORITY/HOST[:PORT]: the host follows the authority
                rest = rest[2:].partition("/")[2]
            return _host_port_problem(rest, port_required=False)
        if name in ("ipv4", "ipv6"):
            problems = (_host_port_problem(address, port_required=True) for address in rest.split(","))
            return next((problem for problem in problems if problem is not None), None)
        if name in _HIS_TO_JUDGE or rest.startswith("//"):  # a path, or another resolver's URI (xds:///...)
            return None
    return _host_port_problem(target, port_required=False)


def _host_port_problem(text: str, *, port_required: bool) -> str | None:
    port: str | None
    if text.startswith("["):
        host, closed, after = text[1:].partition("]")
        if not closed:
            return "its '[' is not closed"
        if after and not after.startswith(":"):
            return "after ']' comes ':PORT' or nothing"
        port = after[1:] if after else None
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:  # a name, or an IPv6 address without brackets (which cannot have a port)
        host, port = text, None
    if not host:
        return "it names no host"
    if not port:
        return "an ipv4: or ipv6: address needs its port" if port_required else None
    number = port.strip()
    if port in _PORT_NAMES or (number.isascii() and number.isdigit() and 1 <= int(number) <= 65535):
        return None
    return f"its port {port!r} is not a number from 1 to 65535"


def check_target(target: str) -> str:
    """`target`, or ValueError saying why gRPC can never reach it."""
    problem = target_problem(target)
    if problem is not None:
        raise ValueError(f"not a gRPC target: {target!r}: {problem} (give {FORMS})")
    return target
