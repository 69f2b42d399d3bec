"""When the certificates the gateway and the scheduler serve expire, as the console meets them: a
TLS handshake of its own with each (its CA, and its client certificate where it has one: a
scheduler on mutual TLS asks for it), the leaf certificate's notAfter read with `cryptography`.

The services export the same date (asyncinfer_tls_certificate_expiry_timestamp_seconds, and the
shipped alert under 14 days), which an operator sees where Prometheus is; the console's TLS page
shows it, in days left, to whoever looks at the console. What it shows is what a client is served
now, a renewal included once the service serves it."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass

from asyncinfer.config import ConsoleConfig

# A handshake that has not ended by then: the page says so rather than wait (its peers answer in ms).
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ServedCertificate:
    """What one service (`name`, at `address`) served: its certificate's notAfter (Unix seconds),
    or why there is none to show (`problem`)."""

    name: str
    address: str
    not_after: float | None = None
    problem: str = ""


def _client_context(config: ConsoleConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=config.tls_ca_file)
    if config.tls_cert_file and config.tls_key_file:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    context.set_alpn_protocols(["h2"])  # what a gRPC client offers
    return context


def _host_port(address: str) -> tuple[str, int] | None:
    """host:port (a [v6]:port too); None for another form (a resolver's target, several addresses)."""
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or not host or "/" in host or "," in address:
        return None
    return host.strip("[]"), int(port)


async def served_certificate(name: str, address: str, context: ssl.SSLContext) -> ServedCertificate:
    from cryptography import x509  # the server extra's, as asyncinfer.cert_expiry's

    where = _host_port(address)
    if where is None:
        return ServedCertificate(name, address, problem="not a host:port address: see its metrics")
    host, port = where
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            _, writer = await asyncio.open_connection(host, port, ssl=context, server_hostname=host)
    except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
        return ServedCertificate(name, address, problem=f"no TLS handshake: {exc or type(exc).__name__}")
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    certificate = x509.load_der_x509_certificate(der)
    return ServedCertificate(name, address, not_after=certificate.not_valid_after_utc.timestamp())


async def served_certificates(config: ConsoleConfig) -> list[ServedCertificate]:
    """The gateway's and the scheduler's; none when the console reaches them in plaintext."""
    if not config.tls_ca_file:
        return []
    context = await asyncio.to_thread(_client_context, config)  # reads the files: renewed ones too
    return list(
        await asyncio.gather(
            served_certificate("gateway", config.gateway_address, context),
            served_certificate("scheduler", config.scheduler_address, context),
        )
    )
