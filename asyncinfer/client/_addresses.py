"""The error of each address of a target that has several, where gRPC's names one only.

gRPC tries each address a name resolves to (localhost: ::1 and 127.0.0.1) and reports only the
last failure ("failed to connect to all addresses; last error: ... ipv6:%5B::1%5D:PORT:
Connection refused"). With a gateway on 127.0.0.1 alone and a wrong CA (or a plaintext client),
the error said nothing listened, and hid the TLS failure met on the address that did listen. So
where a call ends "Connection refused" on a target with several addresses, each of them is tried
alone, once, and a failure that says more (a TLS handshake failed, the server closed the
connection) is the one shown, with the refusal said after it."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from typing import Any

import grpc
from grpc import aio

from asyncinfer.client._targets import _HIS_TO_JUDGE, _SCHEME
from asyncinfer.client.errors import AsyncInferClientError, from_rpc_error

REFUSED = "Connection refused"
# The most the tries of the addresses take together, within what is left of the call's deadline.
PROBE_S = 3.0


def _address_target(host: str, port: str) -> str:
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


async def target_addresses(target: str) -> tuple[list[str], str | None]:
    """The one-address gRPC targets (ipv4:A:P, ipv6:[A]:P) of `target`, and the host name its TLS
    certificate is checked against (None: an address, gRPC's own default). Empty where `target`
    is of another form (unix:, an authority, another resolver) or its name does not resolve."""
    scheme = _SCHEME.fullmatch(target)
    rest = target  # HOST[:PORT], as _targets reads a first part that is not a scheme gRPC knows
    if scheme is not None:
        name, after = scheme.group(1).lower(), scheme.group(2)
        if name in ("ipv4", "ipv6"):
            return [f"{name}:{address}" for address in after.split(",")], None
        if name == "dns":
            rest = after[2:].partition("/")[2] if after.startswith("//") else after
        elif name in _HIS_TO_JUDGE or after.startswith("//"):
            return [], None
    if rest.startswith("["):
        host, _, after = rest[1:].partition("]")
        port = after[1:] or "443"
    elif rest.count(":") == 1:
        host, _, port = rest.partition(":")
    else:
        host, port = rest, "443"
    try:
        ipaddress.ip_address(host)
        return [_address_target(host, port)], None
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return [], None
    found = dict.fromkeys(_address_target(str(info[4][0]), port) for info in infos)
    return list(found), host


async def _one_address_error(
    address: str,
    host: str | None,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
    timeout_s: float,
) -> AsyncInferClientError | None:
    """What a call to `address` alone meets (None: it was answered, whatever the answer)."""
    if credentials is not None and host is not None:
        options = [("grpc.ssl_target_name_override", host), *options]
    channel = (
        aio.secure_channel(address, credentials, options) if credentials else aio.insecure_channel(address, options)
    )
    try:
        call = channel.unary_unary("/grpc.health.v1.Health/Check", lambda _: b"", lambda raw: raw)
        await call(b"", timeout=timeout_s)
    except grpc.RpcError as rpc_error:
        error = from_rpc_error(rpc_error)
        if error.code is grpc.StatusCode.UNAVAILABLE:
            return error
    finally:
        await channel.close(None)
    return None


async def most_telling(
    error: AsyncInferClientError,
    target: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
    timeout_s: float | None,
) -> AsyncInferClientError:
    """`error`, or where it is a refused connection and another address of `target` failed
    otherwise, that address's error, its message saying the refusal after it."""
    if error.code is not grpc.StatusCode.UNAVAILABLE or REFUSED not in error.message:
        return error
    addresses, host = await target_addresses(target)
    if len(addresses) < 2:
        return error
    budget_s = PROBE_S if timeout_s is None else min(PROBE_S, timeout_s)
    if budget_s <= 0:
        return error
    found = await asyncio.gather(
        *(_one_address_error(address, host, credentials, options, budget_s) for address in addresses)
    )
    for other in found:
        if other is not None and REFUSED not in other.message:
            refused = [a for a, e in zip(addresses, found, strict=True) if e is not None and REFUSED in e.message]
            if refused:
                # Not REFUSED's words: the hints read those as "nothing listens there".
                other.message += f" (and {', '.join(refused)} refused the connection)"
                other.args = (other.message,)
            return other
    return error
