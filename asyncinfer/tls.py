"""TLS material and secrets from files, read once at start-up: gRPC server and channel credentials,
the SSL context of the NATS connection, and secrets given inline or as a path (a mounted
Kubernetes Secret). A file that is missing or unreadable is a ConfigError naming the key."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Protocol

import grpc

from asyncinfer.errors import ConfigError


def read_bytes(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path!r}: {exc.strerror or exc}") from None


def read_secret(inline: str | None, path: str | None, key: str) -> str | None:
    """The secret given inline, or read from the file beside it (surrounding whitespace dropped:
    a Secret mounted from `kubectl create secret --from-file` often ends with a newline)."""
    if inline and path:
        raise ConfigError(f"{key} and {key}_file are both set: give one")
    if path:
        text = read_bytes(path, f"{key}_file").decode(errors="strict").strip()
        if not text:
            raise ConfigError(f"{key}_file: {path!r} is empty")
        return text
    return inline or None


def _pair(cert_file: str | None, key_file: str | None, cert_key: str, key_key: str) -> tuple[bytes, bytes] | None:
    if bool(cert_file) != bool(key_file):
        raise ConfigError(f"{cert_key} and {key_key} go together: set both or neither")
    if not cert_file or not key_file:
        return None
    cert, key = read_bytes(cert_file, cert_key), read_bytes(key_file, key_key)
    # Checked here, where the files can be named: gRPC takes any bytes and fails later, a server
    # with "Failed to bind to address" (as if the port were taken), a client at its handshake.
    try:
        ssl.create_default_context().load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{cert_key} {cert_file!r} and {key_key} {key_file!r} are not a PEM certificate and its private key "
            f"({exc.reason or exc})"
        ) from None
    return cert, key


class ServerTlsSection(Protocol):
    """A config section of a gRPC server ([gateway], [scheduler], [batcher])."""

    @property
    def tls_cert_file(self) -> str | None: ...
    @property
    def tls_key_file(self) -> str | None: ...
    @property
    def tls_client_ca_file(self) -> str | None: ...


def server_credentials(section: str, settings: ServerTlsSection) -> grpc.ServerCredentials | None:
    """TLS credentials of a gRPC server (None: plaintext); with a client CA, mutual TLS: a client
    without a certificate that CA signed fails the handshake."""
    cert_file, key_file, client_ca_file = settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file
    pair = _pair(cert_file, key_file, f"{section}.tls_cert_file", f"{section}.tls_key_file")
    if pair is None:
        if client_ca_file:
            raise ConfigError(f"{section}.tls_client_ca_file needs {section}.tls_cert_file and tls_key_file")
        return None
    cert, key = pair
    client_ca = read_bytes(client_ca_file, f"{section}.tls_client_ca_file") if client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca, require_client_auth=bool(client_ca))


def channel_credentials(
    *, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None, key: str = "tls"
) -> grpc.ChannelCredentials:
    """TLS credentials of a gRPC channel: the CA that verifies the server (None: the system's CAs),
    and a client certificate for servers that require mutual TLS."""
    pair = _pair(cert_file, key_file, f"{key} certificate", f"{key} key")
    ca = read_bytes(ca_file, f"{key} CA") if ca_file else None
    if pair is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    cert, private_key = pair
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=private_key, certificate_chain=cert)


def client_ssl_context(
    section: str, *, ca_file: str | None, cert_file: str | None, key_file: str | None
) -> ssl.SSLContext:
    """A verifying client context: the given CA (else the system's), and a client certificate."""
    _pair(cert_file, key_file, f"{section}.tls_cert_file", f"{section}.tls_key_file")
    try:
        context = ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{section}.tls_ca_file: cannot load {ca_file!r}: {exc}") from None
    if cert_file and key_file:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{section}.tls_cert_file / tls_key_file: cannot load them: {exc}") from None
    return context
