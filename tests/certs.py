"""A certificate authority made in the test (the `cryptography` package), and the server and
client certificates it signs, written as PEM files: what a cluster's cert-manager or a team's CA
would hand the services."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2_grpc


@dataclass(frozen=True, slots=True)
class Pem:
    cert_file: str
    key_file: str


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


class TestCA:
    """A CA whose certificate is `ca_file`; `issue` signs a leaf for 127.0.0.1 and localhost."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, directory: Path, name: str = "asyncinfer test CA") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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
            .sign(self._key, hashes.SHA256())
        )
        self.ca_file = str(directory / "ca.pem")
        Path(self.ca_file).write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, valid_days: float = 1.0, valid_from: datetime.datetime | None = None) -> Pem:
        """A certificate for both server and client use, valid for 127.0.0.1 and localhost, for
        `valid_days` from now (negative: expired that long ago), from `valid_from` (its notBefore;
        default five minutes before now, or before its end)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        if valid_from is None:
            valid_from = min(now, now + datetime.timedelta(days=valid_days)) - datetime.timedelta(minutes=5)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(valid_from)
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        cert_file, key_file = self.directory / f"{name}.pem", self.directory / f"{name}-key.pem"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_file)
        return Pem(cert_file=str(cert_file), key_file=str(key_file))


def channel_credentials(ca_file: str, client: Pem | None = None) -> grpc.ChannelCredentials:
    """A channel that trusts `ca_file`, presenting `client`'s certificate when given."""
    ca = Path(ca_file).read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=Path(client.key_file).read_bytes(),
        certificate_chain=Path(client.cert_file).read_bytes(),
    )


@contextmanager
def tls_health_server(ca: TestCA, name: str, *, require_client_auth: bool = False) -> Iterator[int]:
    """A TLS gRPC server (health only) on 127.0.0.1 alone, its certificate `name` signed by `ca`;
    with `require_client_auth`, it requires a client certificate that `ca` signed (mutual TLS).
    Yields its port; stopped at the end."""
    pem = ca.issue(name)
    credentials = grpc.ssl_server_credentials(
        [(Path(pem.key_file).read_bytes(), Path(pem.cert_file).read_bytes())],
        root_certificates=Path(ca.ca_file).read_bytes() if require_client_auth else None,
        require_client_auth=require_client_auth,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield port
    finally:
        server.stop(None)
