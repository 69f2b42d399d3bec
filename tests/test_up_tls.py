"""Issue 17: `asyncinfer up --dev-tls` runs the whole stack on TLS with a local development CA made
beside the store (services/dev_ca.py) and reused by the next run; without TLS, `up` keeps the
gateway on loopback (tests/test_gateway_auth.py)."""

from __future__ import annotations

import asyncio
import datetime
import socket
import ssl
from pathlib import Path

import numpy as np
import pytest
import structlog.testing
from cryptography import x509

from asyncinfer.client import AsyncClient, UnavailableError
from asyncinfer.errors import ConfigError
from services.dev_ca import LOOPBACK_NAMES, RENEW_WITHIN_DAYS, SERVER_VALID_DAYS, DevTlsRenewal, ensure_dev_tls
from tests.test_up_grpcurl import close, start_up, stop, write_config


def sans(cert_file: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n) for n in names.get_values_for_type(x509.DNSName)} | {
        str(ip) for ip in names.get_values_for_type(x509.IPAddress)
    }


@pytest.mark.unit
def test_the_development_ca_is_made_once_and_reused(tmp_path: Path) -> None:
    tls = ensure_dev_tls(tmp_path / "tls", ["localhost", "127.0.0.1", "::1"])
    assert sans(tls.cert_file) == {"localhost", "127.0.0.1", "::1"}
    for key in (tls.key_file, tls.ca_key_file):
        assert key.stat().st_mode & 0o777 == 0o600
    # The CA loads as a trust anchor; the server certificate is its.
    ssl.create_default_context(cafile=str(tls.ca_file))
    issued = x509.load_pem_x509_certificate(tls.cert_file.read_bytes())
    issued.verify_directly_issued_by(x509.load_pem_x509_certificate(tls.ca_file.read_bytes()))
    ca, cert = tls.ca_file.read_bytes(), tls.cert_file.read_bytes()
    again = ensure_dev_tls(tmp_path / "tls", ["localhost", "127.0.0.1", "::1"])
    assert (again.ca_file.read_bytes(), again.cert_file.read_bytes()) == (ca, cert), "reused"
    # A new host, or a certificate near its end: a new server certificate from the same CA.
    wider = ensure_dev_tls(tmp_path / "tls", ["localhost", "127.0.0.1", "::1", "devbox.lan"])
    assert "devbox.lan" in sans(wider.cert_file)
    assert wider.ca_file.read_bytes() == ca
    before = wider.cert_file.read_bytes()
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=SERVER_VALID_DAYS - RENEW_WITHIN_DAYS + 1)
    renewed = ensure_dev_tls(tmp_path / "tls", ["localhost"], now=later)
    assert renewed.cert_file.read_bytes() != before
    assert renewed.ca_file.read_bytes() == ca


@pytest.mark.unit
@pytest.mark.parametrize("cut_short", ["cert", "key"])
def test_a_cut_short_development_certificate_is_made_again_and_a_cut_short_ca_is_named(
    tmp_path: Path, cut_short: str
) -> None:
    """A file of the development CA's folder empty (a crash, a full disk, as it was written): `up
    --dev-tls` ended in cryptography's ValueError traceback. The server's pair is made again by the
    same CA; the CA is not replaced (clients were given it): the error says which files to delete."""
    tls = ensure_dev_tls(tmp_path / "tls", ["localhost"])
    ca = tls.ca_file.read_bytes()
    (tls.cert_file if cut_short == "cert" else tls.key_file).write_bytes(b"")
    again = ensure_dev_tls(tmp_path / "tls", ["localhost"])
    issued = x509.load_pem_x509_certificate(again.cert_file.read_bytes())
    issued.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
    assert again.key_file.read_bytes() != b""

    (tls.ca_file if cut_short == "cert" else tls.ca_key_file).write_bytes(b"")
    with pytest.raises(ConfigError) as refused:
        ensure_dev_tls(tmp_path / "tls", ["localhost"])
    assert f"the development CA in {tmp_path / 'tls'} cannot be read" in refused.value.message
    assert f"delete {tls.ca_file} and {tls.ca_key_file}" in refused.value.message


@pytest.mark.unit
def test_a_gateway_bound_to_every_address_gets_a_certificate_for_this_machines_names(tmp_path: Path) -> None:
    """0.0.0.0 names no host: remote clients dial the machine by name or address, which a certificate
    for loopback alone failed (Hostname Verification Check failed)."""
    import socket

    from asyncinfer.config import Config
    from services.dev_ca import bound_hosts

    hosts = bound_hosts(Config().replace(gateway={"host": "0.0.0.0"}))
    assert socket.gethostname() in hosts
    assert {"localhost", "127.0.0.1", "::1"} <= set(hosts)
    assert "0.0.0.0" not in hosts
    assert socket.gethostname() in sans(ensure_dev_tls(tmp_path / "tls", hosts).cert_file)
    assert bound_hosts(Config()) == ["localhost", "127.0.0.1", "::1"], "loopback alone: loopback names alone"


def due_since_a_while() -> datetime.datetime:
    """A moment from which the development certificate made then is due for renewal now."""
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=SERVER_VALID_DAYS - RENEW_WITHIN_DAYS + 1)


@pytest.mark.unit
def test_a_development_certificate_due_is_renewed_whole_by_the_same_ca(tmp_path: Path) -> None:
    """What a running `up --dev-tls` does every hour: nothing while the certificate is good; once
    it is within RENEW_WITHIN_DAYS of its end, a new one from the same CA, each file replaced
    whole (renamed over: a server reading it meanwhile sees the old file or the new, never half
    of one), the key never readable by others."""
    tls = ensure_dev_tls(tmp_path / "tls", LOOPBACK_NAMES, now=due_since_a_while())
    ca, before = tls.ca_file.read_bytes(), tls.cert_file.read_bytes()
    inode = tls.key_file.stat().st_ino
    renewal = DevTlsRenewal(tls, LOOPBACK_NAMES)
    assert renewal.renew() is True
    assert tls.cert_file.read_bytes() != before
    assert tls.ca_file.read_bytes() == ca
    assert tls.key_file.stat().st_ino != inode, "the key replaced, not rewritten in place"
    assert tls.key_file.stat().st_mode & 0o777 == 0o600
    assert sorted(path.name for path in tls.directory.iterdir()) == [
        "ca-key.pem",
        "ca.pem",
        "server-key.pem",
        "server.pem",
    ]
    assert renewal.not_after() - datetime.datetime.now(datetime.UTC) > datetime.timedelta(days=SERVER_VALID_DAYS - 1)
    assert renewal.renew() is False
    # The renewed pair is a pair, and its certificate the CA's.
    ssl.create_default_context().load_cert_chain(tls.cert_file, tls.key_file)
    issued = x509.load_pem_x509_certificate(tls.cert_file.read_bytes())
    issued.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))


def test_the_embedded_nats_servers_configuration_file_names_any_path(tmp_path: Path) -> None:
    r"""The nats-server's configuration file names the development certificate's files (and the
    server's name) as quoted strings. They were written as JSON strings, but nats-server's format
    takes only the escapes \xXX, \t, \n, \r, \" and \\: a path with a character beyond ASCII (a
    home directory named José) was written \u00e9, and `up --dev-tls` did not start ("Invalid escape
    character 'u'"). The file is read here as the server reads it at start and at a reload."""
    import subprocess

    from asyncinfer.config import Config
    from asyncinfer.embedded_nats import find_nats_server, free_port
    from asyncinfer.runner import StopSignal
    from services.up.stack import EmbeddedNats

    data = tmp_path / 'José\'s "data" \\ $HOME #1\t\x01日本'
    tls = ensure_dev_tls(data / "tls", LOOPBACK_NAMES)
    config = Config().replace(embedded_nats={"store_dir": str(data / "store"), "port": 0, "monitor_port": free_port()})
    nats = EmbeddedNats(config, StopSignal(), dev_tls=DevTlsRenewal(tls, LOOPBACK_NAMES))
    nats._prepare_store()
    checked = subprocess.run(
        [find_nats_server(), "-t", "-c", str(data / "nats-server.conf")], capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stderr or checked.stdout


def _served_subject_serial(port: int, ca_file: Path) -> int:
    """The serial of the certificate a new TLS connection to the nats-server on `port` is served
    (NATS sends its INFO in plaintext first, then the client starts TLS)."""
    context = ssl.create_default_context(cafile=str(ca_file))
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        sock.recv(4096)
        with context.wrap_socket(sock, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


async def test_the_embedded_nats_server_serves_a_renewed_development_certificate_without_a_restart(
    tmp_path: Path,
) -> None:
    """`up --dev-tls` made its certificate at start only, and a long `up` outlived it (90 days): the
    gRPC servers would serve a renewal (asyncinfer.tls), but nothing renewed it, and the embedded
    nats-server read its files once. Now a running `up` renews it when due and tells the
    nats-server, which serves it to new connections (its TLS files are in its configuration file,
    which a reload reads again; its flags are not); the line says so."""
    from asyncinfer.config import Config
    from asyncinfer.embedded_nats import free_port
    from asyncinfer.runner import StopSignal
    from services.up.stack import EmbeddedNats

    data = tmp_path / "data"
    tls = ensure_dev_tls(data / "tls", LOOPBACK_NAMES, now=due_since_a_while())
    first = int(x509.load_pem_x509_certificate(tls.cert_file.read_bytes()).serial_number)
    config = Config().replace(embedded_nats={"store_dir": str(data / "store"), "port": 0, "monitor_port": free_port()})
    nats = EmbeddedNats(config, StopSignal(), dev_tls=DevTlsRenewal(tls, LOOPBACK_NAMES))
    await nats.start()
    try:
        assert await asyncio.to_thread(_served_subject_serial, nats.port, tls.ca_file) == first
        with structlog.testing.capture_logs() as logs:
            assert await nats.renew_dev_tls() is True
            assert await nats.renew_dev_tls() is False  # renewed: not due any more
        renewed = int(x509.load_pem_x509_certificate(tls.cert_file.read_bytes()).serial_number)
        assert renewed != first
        assert await asyncio.to_thread(_served_subject_serial, nats.port, tls.ca_file) == renewed
        assert [(e["event"], e["nats_server"], e["cert_file"]) for e in logs] == [
            ("dev_tls_renewed", "reloaded", str(tls.cert_file))
        ]
        assert nats.supervisor.loop_names == ["dev-tls-renewal"]
    finally:
        await nats.stop()
    assert nats.supervisor.loop_names == []


@pytest.mark.timeout(180)
async def test_up_with_tls_serves_everything_over_tls(tmp_path: Path) -> None:
    config_path, ports = write_config(tmp_path)
    up = start_up(config_path, ports, tmp_path, args=("--dev-tls",))
    try:
        ca_file = tmp_path / "data" / "tls" / "ca.pem"
        assert f"-cacert {ca_file}" in up.banner
        assert "-plaintext" not in up.banner
        assert "NATS JetStream                 tls://127.0.0.1:" in up.banner
        assert "flaky" in up.banner  # the sample models, as without TLS: the file declares none
        async with AsyncClient(up.gateway, tls_ca_file=str(ca_file)) as client:
            job = await client.submit("demo", {"x": np.ones((2, 4), np.float32)})
            done = await client.wait(job, timeout_s=60)  # the batcher reached the scheduler over TLS
        assert done.state.name == "SUCCEEDED", done
        async with AsyncClient(up.gateway, timeout_s=3) as plaintext:
            with pytest.raises(UnavailableError):
                await plaintext.models()
        assert stop(up) == 0
    finally:
        close(up)
    # The embedded NATS spoke TLS too: its log says so.
    assert "TLS required for client connections" in (tmp_path / "data" / "nats-server.log").read_text()
