"""A local development CA for `asyncinfer up --dev-tls`: the whole stack on TLS on one machine, with a CA
made here, kept beside the JetStream store and reused by the next `up` (so a client trusts it once).

Files (`<store parent>/tls/`): ca.pem (give it to clients: `--tls-ca`, grpcurl's `-cacert`),
ca-key.pem, and server.pem / server-key.pem, one certificate for every server `up` runs (gateway,
scheduler, batcher, the embedded nats-server), valid for localhost, 127.0.0.1 and ::1 and the hosts
they are configured to bind. Keys are written 0600. The server certificate (90 days) is made again
when it is within 30 days of its end or does not name a configured host, at `up`'s start and, while
`up` runs, by a check every hour (DevTlsRenewal: the services serve the new files from their next
handshake, the embedded nats-server once told to reload); the CA lives ten years. Files are
replaced whole (written beside, renamed over), never seen half-written. A development CA on a
laptop is not a production PKI: its key is a file in the working directory.

`with_dev_tls` points every server, client and the embedded NATS at these files.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncinfer.config import Config
from asyncinfer.embedded_nats import conf_string
from asyncinfer.errors import ConfigError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey
    from cryptography.x509 import Certificate

CA_VALID_DAYS = 3650
SERVER_VALID_DAYS = 90
# Renewed at `up`'s start well before the services warn of an expiry (tls.expiry_warning_days, 14 by
# default: asyncinfer.cert_expiry), so a development stack restarted now and then never warns.
RENEW_WITHIN_DAYS = 30
# How often a running `up` looks whether its server certificate is due (a laptop asleep for days
# checks within the hour after it wakes: the due date is the wall clock's, not a timer's).
RENEWAL_CHECK_INTERVAL_S = 3600.0
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class DevTls:
    directory: Path

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def ca_key_file(self) -> Path:
        return self.directory / "ca-key.pem"

    @property
    def cert_file(self) -> Path:
        return self.directory / "server.pem"

    @property
    def key_file(self) -> Path:
        return self.directory / "server-key.pem"


def dev_tls_dir(config: Config) -> Path:
    return Path(config.embedded_nats.store_dir).parent / "tls"


UNSPECIFIED = ("0.0.0.0", "::", "[::]")


def bound_hosts(config: Config) -> list[str]:
    """The names the server certificate must carry: loopback, and every host a server binds. An
    unspecified address (0.0.0.0) names no host: clients dial this machine by its name or one of
    its addresses, so those are named (a certificate for loopback alone failed every remote
    client's hostname check)."""
    hosts = list(LOOPBACK_NAMES)
    for host in (config.gateway.host, config.scheduler.host, config.batcher.host, config.embedded_nats.host):
        if not host:
            continue
        names = this_machine() if host in UNSPECIFIED else [host]
        hosts += [name for name in names if name not in hosts]
    return hosts


def this_machine() -> list[str]:
    """This machine's host name, its fully qualified name, and the addresses they resolve to."""
    names = list(dict.fromkeys(name for name in (socket.gethostname(), socket.getfqdn()) if name))
    for name in list(names):
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError:
            continue
        for info in infos:
            address = str(info[4][0]).split("%", 1)[0]
            if address not in names:
                names.append(address)
    return names


def ensure_dev_tls(directory: Path, hosts: Iterable[str], *, now: datetime.datetime | None = None) -> DevTls:
    """The CA and server certificate in `directory`: reused while valid, made when missing."""
    from cryptography import x509  # the embedded extra's: only `up --dev-tls` needs it
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    now = now or datetime.datetime.now(datetime.UTC)
    tls = DevTls(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(hosts))
    ca_cert, ca_key = None, None
    if tls.ca_file.exists() and tls.ca_key_file.exists():
        try:
            ca_cert = x509.load_pem_x509_certificate(tls.ca_file.read_bytes())
            loaded = serialization.load_pem_private_key(tls.ca_key_file.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            # Not replaced silently: clients were given this CA (--tls-ca). It was a traceback.
            raise ConfigError(
                f"the development CA in {directory} cannot be read ({exc}): delete {tls.ca_file} and "
                f"{tls.ca_key_file} for `up --dev-tls` to make a new CA (then give clients the new {tls.ca_file})"
            ) from None
        ca_key = loaded if isinstance(loaded, ec.EllipticCurvePrivateKey) else None
        if ca_cert.not_valid_after_utc - now < datetime.timedelta(days=RENEW_WITHIN_DAYS):
            ca_cert, ca_key = None, None
    made_ca = ca_cert is None
    if ca_cert is None or ca_key is None:
        ca_cert, ca_key = _new_ca(now)
        _write_key(ca_key, tls.ca_key_file)
        _replace(tls.ca_file, ca_cert.public_bytes(serialization.Encoding.PEM))
    if made_ca or not _server_cert_fits(tls, ca_cert, names, now):
        cert, key = _new_server_cert(ca_cert, ca_key, names, now)
        # The key first, then at once its certificate: a server that reads the two between the
        # renames finds a pair that does not match and keeps the one it serves (asyncinfer.tls).
        _write_key(key, tls.key_file)
        _replace(tls.cert_file, cert.public_bytes(serialization.Encoding.PEM))
    return tls


@dataclass(frozen=True, slots=True)
class DevTlsRenewal:
    """What a running `up --dev-tls` keeps renewed: the files in `tls.directory`, for `hosts`."""

    tls: DevTls
    hosts: tuple[str, ...]

    def renew(self, now: datetime.datetime | None = None) -> bool:
        """Makes the server certificate (or the CA) again if it is due (ensure_dev_tls); whether
        the server certificate changed. Blocking (reads and writes files)."""
        before = _read_or_none(self.tls.cert_file)
        ensure_dev_tls(self.tls.directory, self.hosts, now=now)
        return self.tls.cert_file.read_bytes() != before

    def not_after(self) -> datetime.datetime:
        """The server certificate's end."""
        from cryptography import x509

        return x509.load_pem_x509_certificate(self.tls.cert_file.read_bytes()).not_valid_after_utc


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def with_dev_tls(config: Config, tls: DevTls) -> Config:
    """Every server of `up` on TLS with the dev certificate, and every client trusting the dev CA."""
    cert, key, ca = str(tls.cert_file), str(tls.key_file), str(tls.ca_file)
    server = {"tls_cert_file": cert, "tls_key_file": key}
    return config.replace(
        gateway=server,
        scheduler=server,
        batcher={**server, "scheduler_ca_file": ca},
        console={"tls_ca_file": ca},
        nats={"tls_ca_file": ca},
    )


def nats_server_tls_conf(tls: DevTls) -> str:
    """The embedded nats-server's configuration lines for TLS on its client port. In its file, not
    its flags: a reload (SIGHUP) reads the certificate again only from the file."""
    return f"tls {{\n  cert_file: {conf_string(str(tls.cert_file))}\n  key_file: {conf_string(str(tls.key_file))}\n}}\n"


def _server_cert_fits(tls: DevTls, ca_cert: Certificate, names: list[str], now: datetime.datetime) -> bool:
    from cryptography import x509

    if not (tls.cert_file.exists() and tls.key_file.exists()):
        return False
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(tls.cert_file.read_bytes())
        serialization.load_pem_private_key(tls.key_file.read_bytes(), password=None)
    except (ValueError, TypeError):  # cut short (a crash as it was written): made again, by the same CA
        return False
    if cert.issuer != ca_cert.subject or cert.not_valid_after_utc - now < datetime.timedelta(days=RENEW_WITHIN_DAYS):
        return False
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    have = {str(n) for n in sans.get_values_for_type(x509.DNSName)}
    have |= {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    return all(_canonical(name) in have for name in names)


def _canonical(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def _new_ca(now: datetime.datetime) -> tuple[Certificate, EllipticCurvePrivateKey]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asyncinfer up development CA")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _new_server_cert(
    ca_cert: Certificate, ca_key: EllipticCurvePrivateKey, names: list[str], now: datetime.datetime
) -> tuple[Certificate, EllipticCurvePrivateKey]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = []
    for name in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asyncinfer up")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVER_VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _write_key(key: EllipticCurvePrivateKey, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _replace(path, pem, mode=0o600)


def _replace(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """`path` holding `data`, replaced whole: written beside (with `mode` from its creation: a key
    is never readable by others, even for a moment) and renamed over it. The servers of a running
    `up` read these files at any moment."""
    beside = path.with_name(f".{path.name}.new")
    beside.unlink(missing_ok=True)
    descriptor = os.open(beside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
    os.chmod(beside, mode)  # whatever the umask took away
    os.replace(beside, path)
