"""TLS material and secrets from files: gRPC server and channel credentials, the SSL context of the
NATS connection, and secrets given inline or as a path (a mounted Kubernetes Secret). Read at
start-up, where a bad file stops the service, and read again when the files change
(cert-manager, Vault and `up --dev-tls` renew them in place): a gRPC server's certificate, key and
client CA at its next TLS handshake (ServingCertificates), a client's at its next connection
(ClientCertificates); a renewal that cannot be used (a broken pair, a certificate expired or not yet
valid) keeps the last good one in use. A file that is
missing or unreadable is a ConfigError naming the key; a secret file (an API key, a password or
token, an NKey seed or credentials, a TLS private key) that others may read or change is warned
of (`secret_file_exposed`), as ssh does for a private key, and read."""

from __future__ import annotations

import contextlib
import os
import ssl
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Generic, Protocol, TypeVar, cast

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


@dataclass(frozen=True, slots=True)
class FileVersion:
    """What a stat of a file says of its content: a file replaced (renamed over, rewritten, or a
    Kubernetes Secret's `..data` symlink swapped: os.stat follows it) differs in one of these."""

    mtime_ns: int
    size: int
    inode: int


def file_versions(paths: Sequence[str]) -> tuple[FileVersion, ...]:
    """Each file's FileVersion (OSError when one cannot be stat'ed)."""
    return tuple(FileVersion(st.st_mtime_ns, st.st_size, st.st_ino) for st in map(os.stat, paths))


@dataclass(frozen=True, slots=True)
class StatFailed:
    """A file that could not be stat'ed (gone, unreadable directory), as a version of its own: it is
    warned of once, as a broken file is."""

    file: str
    reason: str


Versions = tuple[FileVersion, ...] | StatFailed


class ReloadFailed(Exception):
    """A changed file that cannot be served: which file, its setting, and why."""

    def __init__(self, file: str, setting: str, reason: str) -> None:
        super().__init__(f"{setting} {file!r}: {reason}")
        self.file, self.setting, self.reason = file, setting, reason


class NotYetValid(ReloadFailed):
    """A renewed certificate whose notBefore is still too far ahead: tried again at `retry_at`
    (Unix seconds), when it is within CLOCK_SKEW_S, without another change of its files."""

    def __init__(self, file: str, setting: str, reason: str, *, retry_at: float) -> None:
        super().__init__(file, setting, reason)
        self.retry_at = retry_at


# How far ahead of this host's clock a renewed certificate's notBefore may be and still be served.
# An issuer's clock and this host's differ by that much at worst where NTP runs, and issuers
# backdate a little for the same reason (step-ca 1 minute, Vault 30 s): a certificate issued and
# written moments ago by an issuer whose clock runs ahead is served at once rather than held
# back while the one it replaces may be about to expire. Five minutes, as Kerberos allows and as
# `up --dev-tls` and the tests backdate their certificates. One further ahead (staged early, or a
# clock badly off) would fail every peer's check: it is refused until then (docs/SECURITY.md).
CLOCK_SKEW_S = 300.0


def utc_text(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")


def certificate_not_after(cert: bytes, key: bytes, cert_file: str, key_file: str, section: str) -> float:
    """The leaf's notAfter (Unix seconds) of a PEM chain and its private key, checked to be a pair;
    ReloadFailed otherwise. With bytes, not paths (as ssl's load_cert_chain takes): the bytes
    checked are the bytes then served, whatever the files hold by then."""
    from cryptography import x509  # the server extra's, as asyncinfer.cert_expiry's
    from cryptography.hazmat.primitives import serialization

    try:
        leaf = x509.load_pem_x509_certificates(cert)[0]
    except ValueError as exc:
        raise ReloadFailed(cert_file, f"{section}.tls_cert_file", f"no PEM certificate ({exc})") from None
    try:
        private_key = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:  # TypeError: a key that needs a password
        raise ReloadFailed(key_file, f"{section}.tls_key_file", f"no PEM private key ({exc})") from None
    public = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if private_key.public_key().public_bytes(*public) != leaf.public_key().public_bytes(*public):
        raise ReloadFailed(key_file, f"{section}.tls_key_file", f"not the private key of {cert_file!r}'s certificate")
    return leaf.not_valid_after_utc.timestamp()


def check_ca_bundle(data: bytes, ca_file: str, setting: str) -> None:
    from cryptography import x509

    try:
        x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ReloadFailed(ca_file, setting, f"no PEM CA certificate ({exc})") from None


# Told of each renewal served: the setting of the certificate file, its path, its notAfter.
ReloadListener = Callable[[str, str, float], None]


class Renewing(Protocol):
    """TLS files read again when they change (ServingCertificates, ClientCertificates)."""

    def on_reloaded(self, listener: ReloadListener) -> None: ...


class ServingCertificates:
    """A gRPC server's TLS credentials that serve its files' current certificate, key and client
    CA to each new connection, without a restart.

    gRPC calls `fetch` at every TLS handshake, on one of its own threads: RenewingFiles stats the
    files (a handshake's few microseconds more) and reads them only when a FileVersion changed; a
    good set (the key the certificate's, the client CA a PEM bundle, the certificate valid now) is
    served from that handshake on and logged (`tls_certificate_reloaded`, listeners told: the
    expiry gauge); one that cannot be served (the key not the certificate's, a half-written or
    unparsable file, a file gone, a certificate expired or not yet valid) is logged once per
    version (`tls_certificate_reload_failed`) and the last good set is kept. Connections already
    open keep the certificate they were made with. Whether client certificates are required is
    fixed at start. Its lines name the service `section` is (gateway, scheduler, batcher): gRPC's
    threads are outside the service's logging context."""

    def __init__(
        self,
        section: str,
        cert_file: str,
        key_file: str,
        client_ca_file: str | None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.section = section
        self._cert_file, self._key_file, self._client_ca_file = cert_file, key_file, client_ca_file
        files = [(f"{section}.tls_cert_file", cert_file), (f"{section}.tls_key_file", key_file)]
        if client_ca_file:
            files.append((f"{section}.tls_client_ca_file", client_ca_file))
        self._files = RenewingFiles(
            self._configuration,
            files,
            certificate=files[0],
            first=self._first_configuration,
            service=section,
            clock=clock,
        )
        self._lock = threading.Lock()  # gRPC may handshake on several threads at once
        self._served = self._files.current()
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._served,
            # None: gRPC keeps the configuration it serves (its documented contract; the stub omits it).
            cast(Callable[[], grpc.ServerCertificateConfiguration], self.fetch),
            require_client_authentication=bool(client_ca_file),
        )

    def on_reloaded(self, listener: ReloadListener) -> None:
        self._files.on_reloaded(listener)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate_configuration_fetcher: the new configuration, or None to keep the
        one served."""
        configuration = self._files.current()
        with self._lock:
            if configuration is self._served:
                return None
            self._served = configuration
            return configuration

    def _first_configuration(self) -> grpc.ServerCertificateConfiguration:
        """At start: a bad file is a ConfigError that names it (the service does not start)."""
        section = self.section
        pair = _pair(self._cert_file, self._key_file, f"{section}.tls_cert_file", f"{section}.tls_key_file")
        assert pair is not None  # both files are given (serving_certificates)
        cert, key = pair
        ca_file = self._client_ca_file
        client_ca = read_ca(ca_file, f"{section}.tls_client_ca_file") if ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        """A renewal: checked from the bytes then served (ReloadFailed names what cannot be)."""
        cert, key = self._read(self._cert_file, "tls_cert_file"), self._read(self._key_file, "tls_key_file")
        client_ca = self._read(self._client_ca_file, "tls_client_ca_file") if self._client_ca_file else None
        certificate_not_after(cert, key, self._cert_file, self._key_file, self.section)
        if client_ca is not None and self._client_ca_file:
            check_ca_bundle(client_ca, self._client_ca_file, f"{self.section}.tls_client_ca_file")
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca)

    def _read(self, path: str, key: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ReloadFailed(path, f"{self.section}.{key}", exc.strerror or str(exc)) from None


def serving_certificates(section: str, settings: ServerTlsSection) -> ServingCertificates | None:
    """TLS of a gRPC server (None: plaintext), its files checked now (ConfigError names a bad one)
    and read again when they change; with a client CA, mutual TLS: a client without a certificate
    that CA signed fails the handshake."""
    cert_file, key_file, client_ca_file = settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file
    if not cert_file and not key_file and client_ca_file:
        raise ConfigError(f"{section}.tls_client_ca_file needs {section}.tls_cert_file and tls_key_file")
    if not cert_file or not key_file:
        _pair(cert_file, key_file, f"{section}.tls_cert_file", f"{section}.tls_key_file")  # one alone: named
        return None
    return ServingCertificates(section, cert_file, key_file, client_ca_file)


Material = TypeVar("Material")


class RenewingFiles(Generic[Material]):
    """TLS material (a gRPC server's certificate configuration, channel credentials, an SSL
    context) made by `build` from its files at start, and made again once they changed: a renewed
    certificate (or key, or CA) is used from then on, what was made before keeps its own.

    `current()` stats the files (FileVersion) and builds only when a version changed. A build that
    fails (a key that is not the certificate's, a half-written file: `build`'s ReloadFailed or
    ConfigError, or a file gone), or whose certificate has expired (its notAfter past) or is not
    yet valid (its notBefore more than CLOCK_SKEW_S ahead), keeps the last good material and is
    logged once per version (`tls_certificate_reload_failed`, the reason saying which and when);
    one not yet valid is tried again once its notBefore is within CLOCK_SKEW_S. A build whose
    files changed while it read them is made again at the next call, not warned of; a good one is
    logged (`tls_certificate_reloaded`) and the listeners told of the certificate's expiry. At
    start the certificate is used whatever its dates: there is no other (the service's expiry
    check says so at error, asyncinfer.cert_expiry). Thread-safe; blocking (reads files): off the
    event loop (gRPC calls a server's on threads of its own)."""

    def __init__(
        self,
        build: Callable[[], Material],
        files: Sequence[tuple[str, str]],
        *,
        certificate: tuple[str, str] | None,
        first: Callable[[], Material] | None = None,
        service: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`files`: each (setting, path) `build` reads; `certificate`: the (setting, path) of the
        certificate among them, whose dates are checked and whose expiry listeners are told (None:
        a CA alone); `first`: the build at start, where a bad file is a ConfigError that stops the
        service (default `build`); `service`: the service its log lines name (default: the one the
        logging context names now, at construction: `current()` may run on a thread that context
        does not reach, as gRPC's are); `clock`: now, in Unix seconds."""
        bound = service or structlog.contextvars.get_contextvars().get("service")
        self._fields: dict[str, str] = {"service": str(bound)} if bound else {}
        self._clock = clock
        # A renewal not yet valid: when to read it again although its files have not changed.
        self._retry_at: float | None = None
        self._build = build
        self._settings = {path: setting for setting, path in files}
        self._paths = list(self._settings)
        self._certificate = certificate
        # What a failure that names no file is logged against: the certificate, else the first file.
        self._named = certificate or (files[0] if files else ("", ""))
        self._lock = threading.Lock()
        self._listeners: list[ReloadListener] = []
        # Stat'ed before the files are read: a renewal between the two is then seen as one.
        # None: the files are read at the next call.
        self._seen: Versions | None = None
        with contextlib.suppress(OSError):  # `build` names the file
            self._seen = file_versions(self._paths)
        self._current = (first or build)()

    def on_reloaded(self, listener: ReloadListener) -> None:
        self._listeners.append(listener)

    def current(self) -> Material:
        """The material built from the files' current version, or the last good one."""
        try:
            versions: Versions = file_versions(self._paths)
        except OSError as exc:
            versions = StatFailed(str(exc.filename), exc.strerror or str(exc))
        with self._lock:
            if versions == self._seen and (self._retry_at is None or self._clock() < self._retry_at):
                return self._current
            self._seen, self._retry_at = versions, None
            setting, file = self._named
            try:
                if isinstance(versions, StatFailed):
                    raise ReloadFailed(versions.file, self._settings.get(versions.file, setting), versions.reason)
                built = self._build()
                not_after = self._valid_until()
            except Exception as exc:  # never out: a reconnect, a handshake goes on with the last good one
                if not isinstance(versions, StatFailed) and self._rewritten(versions):
                    self._seen = None  # read while it was rewritten: built again at the next call
                elif isinstance(exc, ReloadFailed):
                    if isinstance(exc, NotYetValid):
                        self._retry_at = exc.retry_at
                    log.warning(
                        "tls_certificate_reload_failed",
                        file=exc.file,
                        setting=exc.setting,
                        reason=exc.reason,
                        **self._fields,
                    )
                else:  # ConfigError names the file
                    log.warning(
                        "tls_certificate_reload_failed",
                        file=file,
                        setting=setting,
                        reason=str(exc) or repr(exc),
                        **self._fields,
                    )
                return self._current
            if self._rewritten(versions):
                self._seen = None  # rewritten while read: built again at the next call
                return self._current
            self._current = built
            log.info("tls_certificate_reloaded", file=file, setting=setting, not_after=not_after, **self._fields)
            if self._certificate is not None and not_after is not None:
                for listener in self._listeners:
                    listener(self._certificate[0], self._certificate[1], not_after)
            return built

    def _rewritten(self, versions: tuple[FileVersion, ...]) -> bool:
        try:
            return file_versions(self._paths) != versions
        except OSError:
            return True

    def _valid_until(self) -> float | None:
        """The certificate's notAfter, once it is checked to be valid now (ReloadFailed: expired;
        NotYetValid: its notBefore more than CLOCK_SKEW_S ahead); None without a certificate."""
        if self._certificate is None:
            return None
        from cryptography import x509

        setting, path = self._certificate
        try:
            leaf = x509.load_pem_x509_certificates(Path(path).read_bytes())[0]
        except (OSError, ValueError) as exc:
            raise ReloadFailed(path, setting, str(exc)) from None
        now = self._clock()
        not_before, not_after = leaf.not_valid_before_utc.timestamp(), leaf.not_valid_after_utc.timestamp()
        if not_after <= now:
            raise ReloadFailed(
                path,
                setting,
                f"the certificate expired at {utc_text(not_after)} (its notAfter), before it was used: the one in "
                "use stays until the file holds one valid now",
            )
        if not_before > now + CLOCK_SKEW_S:
            raise NotYetValid(
                path,
                setting,
                f"the certificate is not valid before {utc_text(not_before)} (its notBefore), more than "
                f"{CLOCK_SKEW_S / 60:g} minutes ahead of this host's clock: the one in use stays, and this one is "
                "used once that is no longer so",
                retry_at=not_before - CLOCK_SKEW_S,
            )
        return not_after


class ClientCertificates(RenewingFiles[Material]):
    """A client's TLS material (gRPC channel credentials, an SSL context), made again for a
    connection opened after its files changed (RenewingFiles): a renewed client certificate (or
    CA) is used from the next connection, the connections open keep theirs."""


def renewing_channel_credentials(
    *,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    key: str = "tls",
    service: str | None = None,
) -> ClientCertificates[grpc.ChannelCredentials]:
    """channel_credentials, made again for a channel opened after its files changed; `service`
    names the service in the renewals' log lines (RenewingFiles)."""
    files = [
        (f"{key}_{name}_file", path) for name, path in (("ca", ca_file), ("cert", cert_file), ("key", key_file)) if path
    ]
    return ClientCertificates(
        lambda: channel_credentials(ca_file=ca_file, cert_file=cert_file, key_file=key_file, key=key),
        files,
        certificate=(f"{key}_cert_file", cert_file) if cert_file else None,
        service=service,
    )


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
