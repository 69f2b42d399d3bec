"""TLS material and secrets from files, read once at start-up: gRPC server and channel credentials,
the SSL context of the NATS connection, and secrets given inline or as a path (a mounted
Kubernetes Secret). A file that is missing or unreadable is a ConfigError naming the key; a secret
file (an API key, a password or token, an NKey seed or credentials, a TLS private key) that others
may read or change is warned of (`secret_file_exposed`), as ssh does for a private key, and read."""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path
from typing import Protocol

import grpc
import structlog

from asyncinfer.errors import ConfigError

log = structlog.get_logger("asyncinfer.tls")

# Mode bits of a secret file that are warned of: any access by others (world), or a group write.
# A group read is not: Kubernetes mounts a Secret with the pod's fsGroup as its group and, in
# deploy/k8s, defaultMode 0440, so that the service's non-root user reads it through its group; a
# warning on every pod's start would teach operators to ignore the one that matters. Kubernetes'
# own default, 0644, is warned of (docs/SECURITY.md).
EXPOSING_MODE_BITS = stat.S_IRWXO | stat.S_IWGRP


def warn_if_exposed(path: str, key: str) -> None:
    """Logs `secret_file_exposed` (the file, the setting and its mode) when others may read the
    secret file or change it. Never refuses: the service starts all the same."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)  # a mounted Secret is a symlink: its target's mode
    except OSError:
        return  # the read that follows names the problem
    if mode & EXPOSING_MODE_BITS:
        log.warning(
            "secret_file_exposed",
            file=path,
            setting=key,
            mode=f"{mode:04o}",
            hint="others may read or change it: chmod 600 (or 640/440, a group read is accepted); "
            "in Kubernetes, the Secret volume's defaultMode 0440 with the pod's fsGroup",
        )


def read_private(path: str, key: str) -> bytes:
    """A secret file's bytes, warned of when others may read or change it (warn_if_exposed)."""
    warn_if_exposed(path, key)
    return read_bytes(path, key)


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
        text = read_private(path, f"{key}_file").decode(errors="strict").strip()
        if not text:
            raise ConfigError(f"{key}_file: {path!r} is empty")
        return text
    return inline or None


def read_ca(path: str, key: str) -> bytes:
    """A PEM CA bundle's bytes, checked to hold a certificate: gRPC takes any bytes here and fails
    later, a server at its bind ("Failed to bind to address", a traceback and exit 1, as if the port
    were taken), a client at each handshake ("Failed to create security handshaker"), never naming
    the file."""
    data = read_bytes(path, key)
    try:
        ssl.create_default_context(cadata=data.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError):
        raise ConfigError(f"{key} {path!r} is not a PEM CA bundle: it holds no certificate") from None
    return data


def _pair(cert_file: str | None, key_file: str | None, cert_key: str, key_key: str) -> tuple[bytes, bytes] | None:
    if bool(cert_file) != bool(key_file):
        raise ConfigError(f"{cert_key} and {key_key} go together: set both or neither")
    if not cert_file or not key_file:
        return None
    cert, key = read_bytes(cert_file, cert_key), read_private(key_file, key_key)
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
    client_ca = read_ca(client_ca_file, f"{section}.tls_client_ca_file") if client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca, require_client_auth=bool(client_ca))


def channel_credentials(
    *, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None, key: str = "tls"
) -> grpc.ChannelCredentials:
    """TLS credentials of a gRPC channel: the CA that verifies the server (None: the system's CAs),
    and a client certificate for servers that require mutual TLS. `key` prefixes the settings'
    names in errors: "batcher.scheduler" names batcher.scheduler_ca_file, _cert_file, _key_file."""
    pair = _pair(cert_file, key_file, f"{key}_cert_file", f"{key}_key_file")
    ca = read_ca(ca_file, f"{key}_ca_file") if ca_file else None
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
