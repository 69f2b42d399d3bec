"""One line of advice after a connection error the CLI cannot fix itself: nothing listening, a
host name that does not resolve, a TLS mismatch either way, or an address that serves another
service. gRPC's own text for these ("failed to connect to all addresses ... Socket closed",
"errors resolving ...: [field:hostname lookup error:...]", "Method not found!") names no cause."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from asyncinfer.client import AsyncInferClientError
from asyncinfer.client.errors import DEV_CA

if TYPE_CHECKING:
    from asyncinfer.commands.options import Options

# gRPC's text for a failed name lookup: its resolver's now ("errors resolving HOST:PORT: ..."), and
# before grpcio 1.60 or so ("DNS resolution failed for HOST:PORT: ...").
_NAME_LOOKUP_FAILED = ("errors resolving ", "DNS resolution failed")
# ... where DNS answered that no such name exists: c-ares's (gRPC's default resolver), getaddrinfo's
# (GRPC_DNS_RESOLVER=native) on Linux and on macOS. Not a DNS server that did not answer, which
# another try may get past ("Temporary failure in name resolution", "Timeout while contacting").
_NO_SUCH_NAME = (
    "Domain name not found",
    "Name or service not known",
    "No address associated with hostname",
    "nodename nor servname provided",
)


def name_lookup_failed(error: AsyncInferClientError) -> bool:
    return error.code is grpc.StatusCode.UNAVAILABLE and any(text in error.message for text in _NAME_LOOKUP_FAILED)


def no_such_host(error: AsyncInferClientError) -> bool:
    """DNS said the address's host name does not exist: no try of the same address can connect."""
    return name_lookup_failed(error) and any(text in error.message for text in _NO_SUCH_NAME)


def connection_hint(error: AsyncInferClientError, options: Options) -> str | None:
    addresses = f"--gateway is {options.gateway}, --scheduler {options.scheduler}"
    if error.code is grpc.StatusCode.UNIMPLEMENTED and "Method not found" in error.message:
        return (
            "that address serves another service: --gateway takes the gateway's JobService, --scheduler the "
            f"scheduler's OpsService (dlq, queue, stats); {addresses}"
        )
    if error.code is not grpc.StatusCode.UNAVAILABLE:
        return None
    text = error.message
    if "Connection refused" in text:
        return f"nothing listens there: is the stack up (`asyncinfer up`)? {addresses}"
    if no_such_host(error):
        return f"no host has that name: is it spelled right? {addresses}"
    if name_lookup_failed(error):
        return f"the host name could not be looked up (is DNS reachable from here?): {addresses}"
    if "handshake failed" in text.lower() and options.tls_ca_file:
        return (
            f"the TLS handshake failed: is the server on TLS (`asyncinfer up --dev-tls`), and is --tls-ca "
            f"({options.tls_ca_file}) the CA that signed its certificate?"
        )
    if "before receiving SETTINGS frame" in text:
        return (
            f"something accepts connections there but does not answer as a gRPC server in time: is it the "
            f"gateway (or the scheduler), and is it running (not stopped or overloaded)? {addresses}"
        )
    if "Socket closed" in text and not options.tls_ca_file:
        return f"the server closed the connection: if it is on TLS, give --tls-ca FILE (`up --dev-tls`'s: {DEV_CA})"
    return None
