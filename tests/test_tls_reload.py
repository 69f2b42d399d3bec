"""Serving certificates renewed in place without a restart (asyncinfer.tls.ServingCertificates):
cert-manager, Vault and `up --dev-tls` replace the files, and each gRPC server serves the new
certificate to new connections, keeps the connections and streams already open, keeps the last
good certificate when a replacement cannot be served (and says so once), and sets its expiry
gauge to the certificate it serves; and clients (asyncinfer.tls.ClientCertificates) present a
renewed client certificate from their next connection: the batcher's work stream to a mutual-TLS
scheduler, a service's NATS connection at its reconnect. Real servers, a CA made in the test
(tests/certs.py), and the certificate a TLS handshake is answered with, read as a client reads it
(or, for the client side, as the server saw it)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import structlog.testing
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncinfer.client import AsyncClient
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.errors import ConfigError
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.connection import connection_changes
from asyncinfer.v1 import worker_service_pb2, worker_service_pb2_grpc
from services.batcher.app import BatcherApp
from services.gateway.app import GatewayApp
from tests import test_tls
from tests.certs import Pem, TestCA, channel_credentials
from tests.stack import StartStack
from tests.test_batcher_worker import FakeScheduler, batcher_under_test
from tests.test_tls import tls_config

tls_nats = test_tls.tls_nats  # the fixture: a nats-server requiring TLS, client certificates and a password

EXPIRY_GAUGE = "asyncinfer_tls_certificate_expiry_timestamp_seconds"


def serial(cert_file: str) -> int:
    return int(x509.load_pem_x509_certificate(Path(cert_file).read_bytes()).serial_number)


def not_after(cert_file: str) -> float:
    return x509.load_pem_x509_certificate(Path(cert_file).read_bytes()).not_valid_after_utc.timestamp()


def _handshake_serial(port: int, ca_file: str, client: Pem | None) -> int:
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["h2"])
    if client is not None:  # a server that requires client certificates (mutual TLS)
        context.load_cert_chain(client.cert_file, client.key_file)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock,
        context.wrap_socket(sock, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


async def served_serial(port: int, ca_file: str, client: Pem | None = None) -> int:
    """The serial of the certificate a new TLS connection to `port` is served (verified against
    `ca_file`). In a thread: the server answers on this event loop."""
    return await asyncio.to_thread(_handshake_serial, port, ca_file, client)


def expiry_gauge(registry: Any) -> dict[str, float]:
    return {
        sample.labels["certificate"]: sample.value
        for family in registry.collect()
        if family.name == EXPIRY_GAUGE
        for sample in family.samples
    }


def replace_file(source: str, target: Path) -> None:
    """As cert-manager's csi driver or a careful script does: written beside, renamed over."""
    beside = target.with_name(f".{target.name}.new")
    shutil.copyfile(source, beside)
    beside.chmod(0o600)
    os.replace(beside, target)


def write_half(source: str, target: Path) -> None:
    """A file rewritten in place (the same inode), caught half-way through."""
    data = Path(source).read_bytes()
    target.write_bytes(data[: len(data) // 2])


def reload_events(logs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [
        (entry["event"], entry["setting"], entry["file"])
        for entry in logs
        if entry["event"] in ("tls_certificate_reloaded", "tls_certificate_reload_failed")
    ]


@pytest.fixture
async def tls_batcher(tmp_path: Path, ca: TestCA) -> AsyncIterator[tuple[BatcherApp, Path, Path, Pem]]:
    """A batcher (its KServe API; no scheduler, no NATS) serving certificate `a` from files that the
    test replaces: the app, its certificate and key files, and `a`."""
    served = tmp_path / "served"
    served.mkdir()
    cert_file, key_file = served / "tls.crt", served / "tls.key"
    first = ca.issue("a")
    replace_file(first.cert_file, cert_file)
    replace_file(first.key_file, key_file)
    config = Config().replace(
        batcher={
            "port": 0,
            "metrics_port": 0,
            "scheduler_address": None,
            "tls_cert_file": str(cert_file),
            "tls_key_file": str(key_file),
        },
        logging={"level": "warning", "format": "console"},
    )
    app = BatcherApp(config)
    await app.start()
    try:
        yield app, cert_file, key_file, first
    finally:
        await app.stop(grace_s=1.0)


async def test_a_renewed_certificate_is_served_to_new_connections_and_a_broken_one_never(
    ca: TestCA, tls_batcher: tuple[BatcherApp, Path, Path, Pem]
) -> None:
    """The files were read once, at start: a renewal was served only after a restart, so an
    operator had to restart every pod before each expiry. Now: renewed files (renamed over the old
    ones) are served from the next handshake, the expiry gauge follows, and a channel opened
    before goes on working. A replacement that cannot be served (a key that is not the
    certificate's, a half-written certificate) is warned of once per version and the certificate
    served stays, its gauge too; once the files are right, they are served."""
    app, cert_file, key_file, first = tls_batcher
    port = app.port
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", channel_credentials(ca.ca_file)) as before:
        health = health_pb2_grpc.HealthStub(before)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
        assert await served_serial(port, ca.ca_file) == serial(first.cert_file)
        assert expiry_gauge(app.registry) == {"batcher.tls_cert_file": not_after(first.cert_file)}

        renewed, other = ca.issue("b", valid_days=3), ca.issue("c", valid_days=5)
        with structlog.testing.capture_logs() as logs:
            replace_file(renewed.cert_file, cert_file)
            replace_file(renewed.key_file, key_file)
            assert await served_serial(port, ca.ca_file) == serial(renewed.cert_file)
            assert await served_serial(port, ca.ca_file) == serial(renewed.cert_file)
        assert reload_events(logs) == [("tls_certificate_reloaded", "batcher.tls_cert_file", str(cert_file))]
        assert expiry_gauge(app.registry) == {"batcher.tls_cert_file": not_after(renewed.cert_file)}
        # The connection made with the first certificate still answers.
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING

        with structlog.testing.capture_logs() as logs:
            replace_file(other.cert_file, cert_file)  # its key not yet there: the pair does not match
            for _ in range(3):
                assert await served_serial(port, ca.ca_file) == serial(renewed.cert_file)
            write_half(other.cert_file, cert_file)
            for _ in range(2):
                assert await served_serial(port, ca.ca_file) == serial(renewed.cert_file)
        failed = [entry for entry in logs if entry["event"] == "tls_certificate_reload_failed"]
        assert [(f["setting"], f["file"], f["log_level"]) for f in failed] == [
            ("batcher.tls_key_file", str(key_file), "warning"),
            ("batcher.tls_cert_file", str(cert_file), "warning"),
        ], failed
        assert "not the private key" in failed[0]["reason"]
        assert "no PEM certificate" in failed[1]["reason"]
        assert expiry_gauge(app.registry) == {"batcher.tls_cert_file": not_after(renewed.cert_file)}

        with structlog.testing.capture_logs() as logs:
            replace_file(other.cert_file, cert_file)
            replace_file(other.key_file, key_file)
            assert await served_serial(port, ca.ca_file) == serial(other.cert_file)
        assert reload_events(logs) == [("tls_certificate_reloaded", "batcher.tls_cert_file", str(cert_file))]
        assert expiry_gauge(app.registry) == {"batcher.tls_cert_file": not_after(other.cert_file)}
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING


def utc_date(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")


async def test_an_expired_renewal_is_refused_and_the_certificate_served_stays(
    ca: TestCA, tls_batcher: tuple[BatcherApp, Path, Path, Pem]
) -> None:
    """A renewal that is a good pair but already past its notAfter (a stale Secret copied back, a
    renewal job that ran on a stopped clock) was served: every client's handshake then failed,
    where the certificate it replaced was still good. Now it is refused like a broken one: the
    served certificate and its gauge stay, and the warning says it expired and when; a good
    renewal after it is served."""
    app, cert_file, key_file, first = tls_batcher
    port = app.port
    expired = ca.issue("expired", valid_days=-1)
    with structlog.testing.capture_logs() as logs:
        replace_file(expired.cert_file, cert_file)
        replace_file(expired.key_file, key_file)
        for _ in range(2):
            assert await served_serial(port, ca.ca_file) == serial(first.cert_file)
    assert reload_events(logs) == [("tls_certificate_reload_failed", "batcher.tls_cert_file", str(cert_file))]
    (failed,) = [entry for entry in logs if entry["event"] == "tls_certificate_reload_failed"]
    assert failed["log_level"] == "warning"
    assert f"expired at {utc_date(not_after(expired.cert_file))}" in failed["reason"], failed
    # Written on gRPC's handshake thread, which the service's logging context does not reach.
    assert failed["service"] == "batcher", failed
    assert expiry_gauge(app.registry) == {"batcher.tls_cert_file": not_after(first.cert_file)}

    renewed = ca.issue("renewed", valid_days=2)
    with structlog.testing.capture_logs() as logs:
        replace_file(renewed.cert_file, cert_file)
        replace_file(renewed.key_file, key_file)
        assert await served_serial(port, ca.ca_file) == serial(renewed.cert_file)
    assert reload_events(logs) == [("tls_certificate_reloaded", "batcher.tls_cert_file", str(cert_file))]
    assert expiry_gauge(app.registry) == {"batcher.tls_cert_file": not_after(renewed.cert_file)}


@pytest.mark.unit
def test_a_renewal_not_yet_valid_is_served_within_five_minutes_of_skew_else_from_when_it_is(
    tmp_path: Path, ca: TestCA
) -> None:
    """Clock skew: a renewal whose notBefore is a little ahead of this host's clock (its issuer's
    clock runs ahead) is served at once; one further ahead than CLOCK_SKEW_S (staged early) would
    fail every peer's check, so it is refused like an expired one, warned of once, and served,
    without another change of its files, from the first handshake once its notBefore is within
    CLOCK_SKEW_S of the clock."""
    from asyncinfer.tls import CLOCK_SKEW_S, ServingCertificates

    first = ca.issue("a")
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    replace_file(first.cert_file, cert_file)
    replace_file(first.key_file, key_file)
    now = datetime.now(UTC)
    clock = [now.timestamp()]
    serving = ServingCertificates("scheduler", str(cert_file), str(key_file), None, clock=lambda: clock[0])
    told: list[tuple[str, str, float]] = []
    serving.on_reloaded(lambda *renewal: told.append(renewal))

    skewed = ca.issue("b", valid_from=now + timedelta(minutes=2))
    replace_file(skewed.cert_file, cert_file)
    replace_file(skewed.key_file, key_file)
    assert isinstance(serving.fetch(), grpc.ServerCertificateConfiguration)
    assert told == [("scheduler.tls_cert_file", str(cert_file), not_after(skewed.cert_file))]

    staged_from = now + timedelta(hours=1)
    staged = ca.issue("c", valid_from=staged_from, valid_days=2)
    with structlog.testing.capture_logs() as logs:
        replace_file(staged.cert_file, cert_file)
        replace_file(staged.key_file, key_file)
        assert [serving.fetch() for _ in range(3)] == [None, None, None]
        clock[0] = staged_from.timestamp() - CLOCK_SKEW_S - 1
        assert serving.fetch() is None
        assert len(told) == 1
        clock[0] += 2
        assert isinstance(serving.fetch(), grpc.ServerCertificateConfiguration)
        assert serving.fetch() is None
    assert [(entry["event"], entry["setting"]) for entry in logs] == [
        ("tls_certificate_reload_failed", "scheduler.tls_cert_file"),
        ("tls_certificate_reloaded", "scheduler.tls_cert_file"),
    ]
    assert f"not valid before {utc_date(staged_from.timestamp())}" in logs[0]["reason"], logs[0]
    assert [entry["service"] for entry in logs] == ["scheduler", "scheduler"]
    assert told[1:] == [("scheduler.tls_cert_file", str(cert_file), not_after(staged.cert_file))]


@pytest.mark.unit
def test_a_client_certificates_renewal_lines_name_the_service_whatever_thread_reads_them(
    tmp_path: Path, ca: TestCA
) -> None:
    """The service a log line names comes from the logging context (structlog's contextvars), which
    a thread does not inherit: a renewal read on one (gRPC's handshake threads) said its setting but
    not its service, and under `up` five services share the settings' names. ClientCertificates
    (the NATS connection's, made where the service's context is bound) keep the service named at
    construction."""
    from asyncinfer.logs import service_context
    from asyncinfer.tls import ClientCertificates, client_ssl_context

    first, renewed, expired = ca.issue("a"), ca.issue("b"), ca.issue("c", valid_days=-1)
    cert_file, key_file = tmp_path / "client.crt", tmp_path / "client.key"
    replace_file(first.cert_file, cert_file)
    replace_file(first.key_file, key_file)

    def build() -> ssl.SSLContext:
        return client_ssl_context("nats", ca_file=ca.ca_file, cert_file=str(cert_file), key_file=str(key_file))

    files = [("nats.tls_cert_file", str(cert_file)), ("nats.tls_key_file", str(key_file))]
    certificates = service_context("scheduler").run(
        ClientCertificates, build, files, certificate=("nats.tls_cert_file", str(cert_file))
    )
    with structlog.testing.capture_logs() as logs:
        for pem in (renewed, expired):
            replace_file(pem.cert_file, cert_file)
            replace_file(pem.key_file, key_file)
            reader = threading.Thread(target=certificates.current)
            reader.start()
            reader.join()
    assert [(entry["event"], entry.get("service")) for entry in logs] == [
        ("tls_certificate_reloaded", "scheduler"),
        ("tls_certificate_reload_failed", "scheduler"),
    ]


class SecretVolume:
    """A directory laid out as the kubelet mounts a Secret: each file a symlink through `..data`,
    itself a symlink to a timestamped directory; an update writes a new directory and swaps
    `..data` in one rename, then removes the old directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir()
        self._generation = 0

    def path(self, name: str) -> str:
        return str(self.directory / name)

    def write(self, files: dict[str, str]) -> None:
        self._generation += 1
        data = self.directory / f"..2026_12_07_{self._generation}"
        data.mkdir()
        for name, source in files.items():
            shutil.copyfile(source, data / name)
            (data / name).chmod(0o440)
        link, swap = self.directory / "..data", self.directory / "..data_tmp"
        old = link.resolve() if link.is_symlink() else None
        swap.symlink_to(data.name)
        os.replace(swap, link)
        for name in files:
            if not (self.directory / name).is_symlink():
                (self.directory / name).symlink_to(f"..data/{name}")
        if old is not None:
            shutil.rmtree(old)


async def test_every_server_serves_a_secret_renewed_by_a_symlink_swap_and_open_streams_go_on(
    tmp_path: Path,
    ca: TestCA,
    tls_nats: NatsServerProcess,
    start_stack: StartStack,
) -> None:
    """As Kubernetes updates a mounted Secret (cert-manager renewing it): `..data` swapped to a new
    directory. The gateway, the scheduler (mutual TLS: its client CA from the Secret too) and the
    batcher serve the renewed certificate to new connections and set their gauges; the batcher's
    work stream to the scheduler, opened before, is the same session after and runs a job."""
    volumes = {name: SecretVolume(tmp_path / f"{name}-tls") for name in ("gateway", "scheduler", "batcher")}
    first = {name: ca.issue(f"{name}-1") for name in volumes}
    for name, volume in volumes.items():
        volume.write({"tls.crt": first[name].cert_file, "tls.key": first[name].key_file, "ca.crt": ca.ca_file})

    def served_from(volume: SecretVolume, client_ca: bool = False) -> dict[str, str]:
        files = {"tls_cert_file": volume.path("tls.crt"), "tls_key_file": volume.path("tls.key")}
        return {**files, "tls_client_ca_file": volume.path("ca.crt")} if client_ca else files

    config = tls_config(tmp_path, ca, tls_nats)
    config = config.replace(
        gateway=served_from(volumes["gateway"]),
        scheduler=served_from(volumes["scheduler"], client_ca=True),
        batcher=served_from(volumes["batcher"]),
    )
    stack = await start_stack(config)
    assert stack.batcher is not None
    client_cert = ca.issue("client")
    ports = {"gateway": stack.gateway.port, "scheduler": stack.scheduler.port, "batcher": stack.batcher.port}
    registries = {
        "gateway": stack.gateway.registry,
        "scheduler": stack.scheduler.metrics.registry,
        "batcher": stack.batcher.registry,
    }
    for name, port in ports.items():
        assert await served_serial(port, ca.ca_file, client_cert) == serial(first[name].cert_file), name
    (session,) = stack.scheduler.batchers.sessions

    renewed = {name: ca.issue(f"{name}-2", valid_days=2) for name in volumes}
    with structlog.testing.capture_logs() as logs:
        for name, volume in volumes.items():
            volume.write({"tls.crt": renewed[name].cert_file, "tls.key": renewed[name].key_file, "ca.crt": ca.ca_file})
        for name, port in ports.items():
            assert await served_serial(port, ca.ca_file, client_cert) == serial(renewed[name].cert_file), name
    assert sorted(reload_events(logs)) == sorted(
        ("tls_certificate_reloaded", f"{name}.tls_cert_file", volume.path("tls.crt"))
        for name, volume in volumes.items()
    )
    for name, registry in registries.items():
        assert expiry_gauge(registry)[f"{name}.tls_cert_file"] == not_after(renewed[name].cert_file), name

    async with AsyncClient(stack.address, tls_ca_file=ca.ca_file) as client:
        job = await client.submit("demo", {"x": np.ones((2, 4), np.float32)})
        done = await client.wait(job, timeout_s=30)
    assert done.state.name == "SUCCEEDED", done
    assert stack.scheduler.batchers.sessions == (session,)  # the stream from before carried it


@pytest.mark.unit
def test_a_handshake_stats_the_files_and_reads_them_only_once_they_changed(tmp_path: Path, ca: TestCA) -> None:
    """gRPC asks at every TLS handshake: reading and parsing the files each time would cost every
    new connection, so a handshake stats them (mtime, size, inode) and reads only a new version.
    Proof: bytes changed in place with the same size and mtime are not read (no warning, nothing
    served anew); once the mtime moves they are, found broken, and warned of once however many
    handshakes follow; a file gone likewise; the good files back are served, listeners told."""
    from asyncinfer.tls import ServingCertificates

    first = ca.issue("a")
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    replace_file(first.cert_file, cert_file)
    replace_file(first.key_file, key_file)
    serving = ServingCertificates("gateway", str(cert_file), str(key_file), None)
    told: list[tuple[str, str, float]] = []
    serving.on_reloaded(lambda *renewal: told.append(renewal))
    with structlog.testing.capture_logs() as logs:
        assert [serving.fetch() for _ in range(3)] == [None, None, None]
        stat = os.stat(cert_file)
        good = cert_file.read_bytes()
        with open(cert_file, "r+b") as file:
            file.write(b"x" * len(good))
        os.utime(cert_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert serving.fetch() is None
        assert logs == []
        os.utime(cert_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        assert [serving.fetch() for _ in range(3)] == [None, None, None]
        cert_file.unlink()
        assert [serving.fetch() for _ in range(3)] == [None, None, None]
    assert [(entry["event"], entry["file"], entry["setting"]) for entry in logs] == [
        ("tls_certificate_reload_failed", str(cert_file), "gateway.tls_cert_file"),
        ("tls_certificate_reload_failed", str(cert_file), "gateway.tls_cert_file"),
    ]
    assert "No such file" in logs[1]["reason"]
    assert told == []
    renewed = ca.issue("b")
    replace_file(renewed.cert_file, cert_file)
    replace_file(renewed.key_file, key_file)
    assert isinstance(serving.fetch(), grpc.ServerCertificateConfiguration)
    assert serving.fetch() is None
    assert told == [("gateway.tls_cert_file", str(cert_file), not_after(renewed.cert_file))]


async def mutual_tls_server(
    ca: TestCA, name: str, add_servicer: Callable[[grpc.aio.Server], None]
) -> tuple[grpc.aio.Server, int]:
    """A started gRPC server on a free port, with a certificate `ca` issued to `name`, that requires
    a client certificate `ca` signed (as a scheduler with tls_client_ca_file does); and its port."""
    pem = ca.issue(name)
    credentials = grpc.ssl_server_credentials(
        [(Path(pem.key_file).read_bytes(), Path(pem.cert_file).read_bytes())],  # noqa: ASYNC240
        root_certificates=Path(ca.ca_file).read_bytes(),  # noqa: ASYNC240
        require_client_auth=True,
    )
    server = grpc.aio.server()
    add_servicer(server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, port


class PeerRecordingScheduler(FakeScheduler):
    """test_batcher_worker's fake scheduler, recording the common name of the client certificate
    each work stream was opened with (gRPC's auth context: the certificate the handshake saw)."""

    def __init__(self) -> None:
        super().__init__()
        self.client_names: list[str] = []

    async def Connect(
        self, request_iterator: AsyncIterator[worker_service_pb2.ConnectRequest], context: Any
    ) -> AsyncIterator[worker_service_pb2.ConnectResponse]:
        self.client_names.append(context.auth_context()["x509_common_name"][0].decode())
        async for response in super().Connect(request_iterator, context):
            yield response


async def test_the_batcher_presents_a_renewed_client_certificate_from_its_next_work_stream(
    tmp_path: Path, ca: TestCA
) -> None:
    """The batcher's client certificate to a mutual-TLS scheduler was read once, at start. Now each
    work stream it opens (a reconnect) presents the files' current certificate; a broken renewal
    keeps the last good one presented (warned of once), its gauge too."""
    fake = PeerRecordingScheduler()
    server, port = await mutual_tls_server(
        ca, "scheduler", lambda server: worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(fake, server)
    )
    cert_file, key_file = tmp_path / "client.crt", tmp_path / "client.key"
    first, renewed, other = (
        ca.issue("batcher-1"),
        ca.issue("batcher-2", valid_days=3),
        ca.issue("batcher-3", valid_days=5),
    )
    replace_file(first.cert_file, cert_file)
    replace_file(first.key_file, key_file)
    section = {
        **batcher_under_test(port),
        "scheduler_ca_file": ca.ca_file,
        "scheduler_cert_file": str(cert_file),
        "scheduler_key_file": str(key_file),
    }
    batcher = BatcherApp(Config().replace(batcher=section, models=[DEMO_MODEL]))
    try:
        with structlog.testing.capture_logs() as logs:
            await batcher.start()
            connection = await fake.next_connection(1)
            assert expiry_gauge(batcher.registry) == {"batcher.scheduler_cert_file": not_after(first.cert_file)}
            replace_file(renewed.cert_file, cert_file)
            replace_file(renewed.key_file, key_file)
            connection.abort()
            connection = await fake.next_connection(2)
            assert fake.client_names == ["batcher-1", "batcher-2"]
            assert expiry_gauge(batcher.registry) == {"batcher.scheduler_cert_file": not_after(renewed.cert_file)}
            replace_file(other.cert_file, cert_file)  # its key not yet there
            connection.abort()
            connection = await fake.next_connection(3)
            connection.abort()
            connection = await fake.next_connection(4)
            assert expiry_gauge(batcher.registry) == {"batcher.scheduler_cert_file": not_after(renewed.cert_file)}
            replace_file(other.key_file, key_file)
            connection.abort()
            await fake.next_connection(5)
            assert expiry_gauge(batcher.registry) == {"batcher.scheduler_cert_file": not_after(other.cert_file)}
    finally:
        await batcher.stop(grace_s=1.0)
        await server.stop(0)
    assert fake.client_names == ["batcher-1", "batcher-2", "batcher-2", "batcher-2", "batcher-3"]
    assert reload_events(logs) == [
        ("tls_certificate_reloaded", "batcher.scheduler_cert_file", str(cert_file)),
        ("tls_certificate_reload_failed", "batcher.scheduler_cert_file", str(cert_file)),
        ("tls_certificate_reloaded", "batcher.scheduler_cert_file", str(cert_file)),
    ]
    (failed,) = [entry for entry in logs if entry["event"] == "tls_certificate_reload_failed"]
    assert failed["log_level"] == "warning"
    assert "not a PEM certificate and its private key" in failed["reason"]


class PeerRecordingHealth(health_pb2_grpc.HealthServicer):
    """A health service (as the gateway's and the scheduler's) recording the common name of the
    client certificate each call came with; while `hold` is set, each Check waits for `release`."""

    def __init__(self) -> None:
        self.client_names: list[str] = []
        self.hold = False
        self.held = 0
        self.both_held = asyncio.Event()
        self.release = asyncio.Event()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        self.client_names.append(context.auth_context()["x509_common_name"][0].decode())
        if self.hold:
            self.held += 1
            if self.held == 2:
                self.both_held.set()
            await self.release.wait()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10.0) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def test_the_console_presents_a_renewed_client_certificate_from_its_next_page(tmp_path: Path, ca: TestCA) -> None:
    """The console made its two channels once, at start, and a gRPC channel reconnects with the
    credentials it was made with: a renewed console.tls_cert_file was presented only after a
    restart, and once the old one expired every page failed at the mutual-TLS scheduler. Now a
    page after the files changed goes out on channels made with them (here /readyz, which calls
    both services' health), the renewal is logged with its service, and a call made before it
    finishes on the old channels."""
    from asyncinfer.config import ConsoleConfig
    from services.console.app import ConsoleApp
    from services.console.backend import Backend

    health = PeerRecordingHealth()
    server, port = await mutual_tls_server(
        ca, "services", lambda server: health_pb2_grpc.add_HealthServicer_to_server(health, server)
    )
    cert_file, key_file = tmp_path / "console.crt", tmp_path / "console.key"
    first, renewed, again = ca.issue("console-1"), ca.issue("console-2", valid_days=3), ca.issue("console-3")
    replace_file(first.cert_file, cert_file)
    replace_file(first.key_file, key_file)
    section = {
        "gateway_address": f"localhost:{port}",
        "scheduler_address": f"localhost:{port}",
        "tls_ca_file": ca.ca_file,
        "tls_cert_file": str(cert_file),
        "tls_key_file": str(key_file),
    }
    # Read by asyncinfer.tls as the services' are: a bad file is a ConfigError naming its setting.
    with pytest.raises(ConfigError, match=r"console\.tls_cert_file and console\.tls_key_file go together"):
        Backend(ConsoleConfig(**{**section, "tls_key_file": None}))
    console = ConsoleApp(Config().replace(console={**section, "port": 0, "stats_interval_s": 3600.0}))
    backend = Backend(ConsoleConfig(**section))
    try:
        await console.start()
        ready = f"http://127.0.0.1:{console.port}/readyz"
        assert await asyncio.to_thread(http_get, ready) == (200, "ready\n")
        assert health.client_names == ["console-1", "console-1"]
        with structlog.testing.capture_logs() as logs:
            replace_file(renewed.cert_file, cert_file)
            replace_file(renewed.key_file, key_file)
            assert await asyncio.to_thread(http_get, ready) == (200, "ready\n")
        assert health.client_names[2:] == ["console-2", "console-2"]
        assert [(e["event"], e["setting"], e["service"]) for e in logs if e["event"].startswith("tls_")] == [
            ("tls_certificate_reloaded", "console.tls_cert_file", "console")
        ]

        # A call made before a renewal finishes on the channels it was made on.
        health.hold = True
        before = asyncio.create_task(backend.unreachable(timeout_s=30.0))
        await asyncio.wait_for(health.both_held.wait(), 30.0)
        replace_file(again.cert_file, cert_file)
        replace_file(again.key_file, key_file)
        await backend.renew_certificates()
        health.hold = False
        assert await backend.unreachable(timeout_s=30.0) == []
        health.release.set()
        assert await before == []
        assert health.client_names[4:] == ["console-1", "console-1", "console-3", "console-3"]

        # Closed with a call still on retired channels: not waited for (the console closes its
        # Backend once its pages have stopped); the call goes on to its end.
        health.hold, health.held = True, 0
        health.both_held.clear()
        health.release.clear()
        stuck = asyncio.create_task(backend.unreachable(timeout_s=30.0))
        await asyncio.wait_for(health.both_held.wait(), 30.0)
        replace_file(renewed.cert_file, cert_file)
        replace_file(renewed.key_file, key_file)
        await backend.renew_certificates()
        await asyncio.wait_for(backend.close(), 30.0)
        assert not stuck.done()
        health.release.set()
        assert await stuck == []
    finally:
        await backend.close()
        await console.stop()
        await server.stop(0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def nats_peer_names(monitor_port: int, name: str) -> list[str]:
    """The subjects of the client certificates of the server's connections named `name` (its
    monitoring endpoint's /connz)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz?auth=true&subs=false", timeout=5.0) as response:
        connections = json.load(response)["connections"] or []
    return [c["tls_peer_certs"][0]["subject"] for c in connections if c.get("name") == name]


def refuse_one_connection(port: int) -> None:
    """Stands in for the server while it is away: takes one connection on its port and closes it
    (a reconnect try that fails), returning once a try has come."""
    with socket.create_server(("127.0.0.1", port)) as listener:
        listener.settimeout(30.0)
        accepted, _ = listener.accept()
        accepted.close()


async def connection_state(nc: NatsClient, *, connected: bool) -> None:
    """Returns once the client's connection is up (or down), woken by each change of it."""
    changes = connection_changes(nc)
    while True:
        changed = changes.next()
        if nc.is_connected == connected:
            return
        await changed.wait()


async def test_a_service_presents_a_renewed_nats_client_certificate_from_its_next_reconnect(
    tmp_path: Path, ca: TestCA
) -> None:
    """The NATS connection's SSL context was made once, at start. Now a reconnect (here: the
    nats-server restarted) makes one from the files' current version: the gateway presents its
    renewed client certificate to the server that verifies it, and its gauge says so; also one
    renewed during the outage (as when the old one expired meanwhile and the server refuses it)."""
    server_pem = ca.issue("nats")
    nats = NatsServerProcess(
        store_dir=tmp_path / "nats",
        log_file=tmp_path / "nats.log",
        monitor_port=free_port(),
        extra_args=(
            "--tls", "--tlscert", server_pem.cert_file, "--tlskey", server_pem.key_file,
            "--tlscacert", ca.ca_file, "--tlsverify",
        ),
    )  # fmt: skip
    nats.start()
    try:
        cert_file, key_file = tmp_path / "nats-client.crt", tmp_path / "nats-client.key"
        first, renewed = ca.issue("gateway-nats-1"), ca.issue("gateway-nats-2", valid_days=3)
        again = ca.issue("gateway-nats-3", valid_days=5)
        replace_file(first.cert_file, cert_file)
        replace_file(first.key_file, key_file)
        config = Config().replace(
            nats={
                "url": nats.url.replace("nats://", "tls://"),
                "tls_ca_file": ca.ca_file,
                "tls_cert_file": str(cert_file),
                "tls_key_file": str(key_file),
            },
            gateway={"port": 0, "metrics_port": 0},
            logging={"level": "warning", "format": "console"},
        )
        gateway = GatewayApp(config)
        with structlog.testing.capture_logs() as logs:
            await gateway.start()
            try:
                assert await asyncio.to_thread(nats_peer_names, nats.monitor_port, "asyncinfer-gateway") == [
                    "CN=gateway-nats-1"
                ]
                replace_file(renewed.cert_file, cert_file)
                replace_file(renewed.key_file, key_file)
                nc = gateway.nats_connection
                await asyncio.to_thread(nats.stop)
                await asyncio.wait_for(connection_state(nc, connected=False), 30.0)
                await asyncio.to_thread(nats.start)
                await asyncio.wait_for(connection_state(nc, connected=True), 30.0)
                assert await asyncio.to_thread(nats_peer_names, nats.monitor_port, "asyncinfer-gateway") == [
                    "CN=gateway-nats-2"
                ]
                assert expiry_gauge(gateway.registry)["nats.tls_cert_file"] == not_after(renewed.cert_file)

                # Renewed while NATS is away, after a reconnect try (so after the disconnection was
                # handled): each failed try reads the files again, so the next one presents it.
                await asyncio.to_thread(nats.stop)
                await asyncio.wait_for(connection_state(nc, connected=False), 30.0)
                await asyncio.to_thread(refuse_one_connection, nats.port)
                replace_file(again.cert_file, cert_file)
                replace_file(again.key_file, key_file)
                await asyncio.to_thread(refuse_one_connection, nats.port)
                await asyncio.to_thread(nats.start)
                await asyncio.wait_for(connection_state(nc, connected=True), 30.0)
                assert await asyncio.to_thread(nats_peer_names, nats.monitor_port, "asyncinfer-gateway") == [
                    "CN=gateway-nats-3"
                ]
                assert expiry_gauge(gateway.registry)["nats.tls_cert_file"] == not_after(again.cert_file)
            finally:
                await gateway.stop(grace_s=1.0)
    finally:
        nats.stop()
    assert ("tls_certificate_reloaded", "nats.tls_cert_file", str(cert_file)) in reload_events(logs)
