"""One line of advice after a connection error the CLI cannot fix itself: nothing listening, a
host name that does not resolve, a TLS mismatch either way, no client certificate for a server
that may require one, or an address that serves another service. gRPC's own text for these
("failed to connect to all addresses ... Socket closed", "errors resolving ...: [field:hostname
lookup error:...]", "Method not found!") names no cause. And after an idempotency key refused as
used with another request, the commands that follow the key's job or batch, or make a new one."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from asyncinfer.client import AsyncInferClientError
from asyncinfer.client.errors import (
    DEV_CA,
    NAME_LOOKUP_HINT,
    NO_SUCH_HOST_HINT,
    SOCKET_CLOSED,
    name_lookup_failed,
    no_such_host,
)

if TYPE_CHECKING:
    from asyncinfer.commands.options import Options


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
        return f"{NO_SUCH_HOST_HINT} {addresses}"
    if name_lookup_failed(error):
        return f"{NAME_LOOKUP_HINT} {addresses}"
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
    if SOCKET_CLOSED in text and not options.tls:
        return f"the server closed the connection: if it is on TLS, give --tls-ca FILE (`up --dev-tls`'s: {DEV_CA})"
    if SOCKET_CLOSED in text and not options.tls_cert_file:
        # What a server that requires client certificates answers a TLS client without one: only
        # the client knows it sent none (asyncinfer.client.errors.SOCKET_CLOSED).
        return (
            "the server closed the connection after the TLS handshake: if it requires client certificates "
            "(mutual TLS: the gateway's or the scheduler's tls_client_ca_file), give --tls-cert FILE and "
            "--tls-key FILE (env ASYNCINFER_TLS_CERT_FILE, ASYNCINFER_TLS_KEY_FILE), a certificate its CA signed"
        )
    return None


def reused_key_hint(error: AsyncInferClientError) -> str | None:
    """For an idempotency key already used with another request (IDEMPOTENCY_KEY_REUSED): the
    commands that take the user on, as the gateway's message names the RPCs (GetJob, GetBatch)."""
    if error.code is not grpc.StatusCode.ALREADY_EXISTS or error.reason != "IDEMPOTENCY_KEY_REUSED":
        return None
    if job_id := error.metadata.get("job_id"):
        return f"that job: asyncinfer get {job_id}; a new job: run this again with another --idempotency-key"
    if batch_id := error.metadata.get("batch_id"):
        return (
            f"that batch: asyncinfer batch get {batch_id}; a new batch: run this again with another --idempotency-key"
        )
    return None
