"""TLS end to end, with a CA made in the test (tests/certs.py): the SDK to the gateway over TLS, every
service to a nats-server that requires TLS with client certificates and a password (read from a
file), the batcher to the scheduler over mutual TLS; clients without the CA, or without a client
certificate where one is required, are refused; a gateway pointed at a TLS NATS it cannot verify
fails at once with a clear error, and a start-up that hangs still honours SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import structlog
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncinfer.client import AsyncClient, UnavailableError
from asyncinfer.config import Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.errors import ConfigError, Unavailable
from asyncinfer.nats.connection import connect
from services.gateway.app import GatewayApp
from tests.certs import TestCA, channel_credentials
from tests.stack import StartStack
from tests.tls_helpers import tls_nats_server

ROOT = Path(__file__).resolve().parent.parent
NATS_USER, NATS_PASSWORD = "asyncinfer", "nats-password-from-a-file"
# A connect that cannot verify the server's certificate gives up at that first TLS error (~0.05 s).
# With each attempt's timeout at 60 s, this is a hang guard: waiting the first connect's attempts
# out (what it guards against) would take 241.5 s.
GIVEN_UP_WITHIN_S = 30.0


@pytest.fixture
def tls_nats(tmp_path: Path, ca: TestCA) -> Iterator[NatsServerProcess]:
    """A nats-server that requires TLS, verifies client certificates against the CA, and a password."""
    with tls_nats_server(
        tmp_path, ca, "--user", NATS_USER, "--pass", NATS_PASSWORD, log_file=tmp_path / "nats.log"
    ) as server:
        yield server


def tls_config(tmp_path: Path, ca: TestCA, nats: NatsServerProcess) -> Config:
    """Every service on TLS (the scheduler requiring client certificates), against the TLS NATS."""
    password_file = tmp_path / "nats-password"
    password_file.write_text(NATS_PASSWORD + "\n")
    client = ca.issue("services")
    gateway, scheduler, batcher = ca.issue("gateway"), ca.issue("scheduler"), ca.issue("batcher")
    return Config().replace(
        nats={
            "url": nats.url.replace("nats://", "tls://"),
            "tls_ca_file": ca.ca_file,
            "tls_cert_file": client.cert_file,
            "tls_key_file": client.key_file,
            "user": NATS_USER,
            "password_file": str(password_file),
        },
        gateway={"port": 0, "metrics_port": 0, "tls_cert_file": gateway.cert_file, "tls_key_file": gateway.key_file},
        scheduler={
            "port": 0,
            "metrics_port": 0,
            "poll_interval_ms": 50.0,
            "tls_cert_file": scheduler.cert_file,
            "tls_key_file": scheduler.key_file,
            "tls_client_ca_file": ca.ca_file,
        },
        batcher={
            "port": 0,
            "metrics_port": 0,
            "scheduler_address": None,
            "scheduler_ca_file": ca.ca_file,
            "scheduler_cert_file": batcher.cert_file,
            "scheduler_key_file": batcher.key_file,
        },
        logging={"level": "warning", "format": "console"},
    )


async def test_tls_end_to_end(tmp_path: Path, ca: TestCA, tls_nats: NatsServerProcess, start_stack: StartStack) -> None:
    config = tls_config(tmp_path, ca, tls_nats)
    stack = await start_stack(config)
    assert stack.batcher is not None
    async with AsyncClient(stack.address, tls_ca_file=ca.ca_file) as client:
        job = await client.submit("demo", {"x": np.ones((2, 4), np.float32)})
        done = await client.wait(job, timeout_s=30)
    assert done.state.name == "SUCCEEDED", done
    assert done.outputs["y"].shape == (2, 4)
    # The job ran on the batcher, which reached the scheduler over mutual TLS.
    assert stack.scheduler.batchers.sessions


async def test_clients_without_the_ca_or_a_client_certificate_are_refused(
    tmp_path: Path, ca: TestCA, tls_nats: NatsServerProcess, start_stack: StartStack
) -> None:
    config = tls_config(tmp_path, ca, tls_nats)
    stack = await start_stack(config, batcher=False)
    # Plaintext to a TLS gateway, and TLS that trusts only the system's CAs: both refused, each with
    # a hint on what to check (gRPC's own text, "Socket closed" or "Handshake failed", names no cause).
    hints = {"plaintext": "if the server is on TLS, give tls_ca_file=", "tls": "did tls_ca_file's CA sign"}
    for kind, options in (("plaintext", {}), ("tls", {"credentials": grpc.ssl_channel_credentials()})):
        async with AsyncClient(stack.address, timeout_s=3, **options) as client:
            with pytest.raises(UnavailableError) as refused:
                await client.models()
        assert refused.value.hint is not None, (kind, str(refused.value))
        assert hints[kind] in refused.value.hint, (kind, str(refused.value))
        assert str(refused.value).endswith(f"\n  hint: {refused.value.hint}")
        assert "hint" not in refused.value.message  # the CLI prints the message and a hint of its own
    # The scheduler requires a client certificate: the CA alone is not enough.
    health = health_pb2.HealthCheckRequest()
    without_cert = channel_credentials(ca.ca_file)
    async with grpc.aio.secure_channel(stack.ops_address, without_cert) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health_pb2_grpc.HealthStub(channel).Check(health, timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate from another CA is refused too; one from ours gets in.
    stranger = TestCA(tmp_path / "stranger").issue("stranger")
    for pem, allowed in ((stranger, False), (ca.issue("operator"), True)):
        credentials = channel_credentials(ca.ca_file, pem)
        async with grpc.aio.secure_channel(stack.ops_address, credentials) as channel:
            call = health_pb2_grpc.HealthStub(channel).Check(health, timeout=3)
            if allowed:
                assert (await call).status == health_pb2.HealthCheckResponse.SERVING
            else:
                with pytest.raises(grpc.aio.AioRpcError):
                    await call


async def test_nats_over_tls_needs_the_ca_and_credentials(
    tmp_path: Path, ca: TestCA, tls_nats: NatsServerProcess
) -> None:
    config = tls_config(tmp_path, ca, tls_nats)
    nc = await connect(config.nats, name="test")
    await nc.close()
    # Without the CA: a clear error at its first attempt's TLS error, not once the first connect's
    # attempts are waited out (3 x 60.5 s and 60 s).
    unverified = config.nats.model_copy(
        update={"tls_ca_file": None, "connect_timeout_s": 60.0, "first_connect_wait_s": 0.0}
    )
    # Nor with a first connect that waits for an unreachable server (nats.first_connect_wait_s).
    for settings in (unverified, unverified.model_copy(update={"first_connect_wait_s": 120.0})):
        with pytest.raises(ConfigError, match=r"cannot be verified.*nats\.tls_ca_file"):  # not a retry's matter
            async with asyncio.timeout(GIVEN_UP_WITHIN_S):
                await connect(settings, name="test")
    # A wrong password, and a missing password file, are refused too: configuration errors (exit 2),
    # not an outage (exit 69, which an orchestrator answers by restarting it in a loop).
    wrong = tmp_path / "wrong"
    wrong.write_text("not-it")
    with pytest.raises(ConfigError, match="refused this connection's credentials"):
        await connect(config.nats.model_copy(update={"password_file": str(wrong), "connect_timeout_s": 1.0}), name="t")
    with pytest.raises(ConfigError, match=r"nats\.password_file"):
        await connect(config.nats.model_copy(update={"password_file": str(tmp_path / "none")}), name="t")


async def test_a_nats_that_verifies_clients_names_the_client_certificate_settings(
    tmp_path: Path, ca: TestCA, tls_nats: NatsServerProcess
) -> None:
    """The test's nats-server verifies client certificates (--tlsverify). Without one, or with one
    of another CA, a connect said "TLS failed ([SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert
    certificate required (_ssl.c:2580)); check nats.tls_ca_file, tls_cert_file and tls_key_file"
    (or TLSV1_ALERT_UNKNOWN_CA), and now and then, the alert unread, "[Errno 32] Broken pipe", exit
    69: an outage to wait out. Either way the answer now names what to set."""
    # Attempts whose broken pipe comes at the handshake's end can wait out their timeout: the
    # first connect's deadline, 3 x (2 + 0.5) + 2 s, stays well within the hang guard.
    # first_connect_wait_s 0: these are about what the answer says (an attempt whose alert goes unread,
    # a broken pipe, was an outage to wait for: tests/test_nats_tls_refused_certificate.py has the wait).
    config = tls_config(tmp_path, ca, tls_nats).nats.model_copy(
        update={"connect_timeout_s": 2.0, "first_connect_wait_s": 0.0}
    )
    stranger = TestCA(tmp_path / "other-pki", name="another CA").issue("services")
    cases = {
        "none": (
            {"tls_cert_file": None, "tls_key_file": None},
            r"the server requires a client certificate \(nats-server tls \{ verify: true \}\): set nats\.tls_cert_file"
            r"|if the server requires client certificates .*set nats\.tls_cert_file and tls_key_file",
        ),
        "another CA's": (
            {"tls_cert_file": stranger.cert_file, "tls_key_file": stranger.key_file},
            r"the server does not trust this client's certificate \(nats\.tls_cert_file\)"
            r"|nats\.tls_cert_file must be signed by the CA it verifies them with"
            r"|closed the connection right after the TLS handshake, twice.*nats\.tls_cert_file",
        ),
    }
    for case, (update, expected) in cases.items():
        with pytest.raises((ConfigError, Unavailable), match=expected) as refused:
            async with asyncio.timeout(GIVEN_UP_WITHIN_S):
                await connect(config.model_copy(update=update), name="test")
        assert "_ssl.c" not in refused.value.message, case


async def test_a_gateway_with_an_unverifiable_tls_nats_fails_fast(
    tmp_path: Path, ca: TestCA, tls_nats: NatsServerProcess
) -> None:
    config = tls_config(tmp_path, ca, tls_nats)
    app = GatewayApp(config.replace(nats={"tls_ca_file": None, "connect_timeout_s": 60.0}))
    with pytest.raises(ConfigError, match="TLS certificate cannot be verified"):
        async with asyncio.timeout(GIVEN_UP_WITHIN_S):
            await app.start()


def _run_gateway(tmp_path: Path, config_text: str) -> subprocess.Popen[str]:
    path = tmp_path / "gateway.toml"
    path.write_text(config_text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "gateway", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )


def test_the_gateway_process_exits_clearly_on_an_unverifiable_tls_nats(
    tmp_path: Path, tls_nats: NatsServerProcess
) -> None:
    gateway = _run_gateway(
        tmp_path,
        f'[nats]\nurl = "{tls_nats.url.replace("nats://", "tls://")}"\nconnect_timeout_s = 60.0\n'
        "[gateway]\nport = 0\nmetrics_port = 0\n",
    )
    try:
        # Well within its connect timeout (60 s): the refused certificate ends it, not a timeout. (It
        # was 5 s for both: a loaded CI machine took longer than that to start Python.)
        _, stderr = gateway.communicate(timeout=30.0)
    finally:
        gateway.kill()
        gateway.communicate()  # closes its pipes, which a later test's collection would report
    assert gateway.returncode == 2
    assert "TLS certificate cannot be verified" in stderr
    assert "nats.tls_ca_file" in stderr


def test_a_gateway_on_tls_nats_stops_without_asyncios_ssl_warning(
    tmp_path: Path, ca: TestCA, tls_nats: NatsServerProcess
) -> None:
    """nats-py upgrades its connection with loop.start_tls, which never tells the stream protocol
    that it now runs over TLS; when the server closed the connection, asyncio logged "returning
    true from eof_received() has no effect when using ssl" at warning: every service on TLS NATS
    wrote it at each stop (and after each refused start), a warning an operator can do nothing about."""
    settings = tls_config(tmp_path, ca, tls_nats).nats
    gateway = _run_gateway(
        tmp_path,
        f'[nats]\nurl = "{settings.url}"\ntls_ca_file = "{settings.tls_ca_file}"\n'
        f'tls_cert_file = "{settings.tls_cert_file}"\ntls_key_file = "{settings.tls_key_file}"\n'
        f'user = "{settings.user}"\npassword_file = "{settings.password_file}"\n'
        '[gateway]\nport = 0\nmetrics_port = 0\n[logging]\nlevel = "info"\nformat = "json"\n',
    )
    try:
        assert gateway.stdout is not None
        for line in gateway.stdout:  # ends at its exit, if it never serves
            if "serving on" in line:
                break
        gateway.send_signal(signal.SIGTERM)
        _, stderr = gateway.communicate(timeout=60.0)  # a hang guard
    finally:
        gateway.kill()
        gateway.communicate()
    assert gateway.returncode == 0, stderr
    assert '"gateway_stopped"' in stderr
    assert "eof_received" not in stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_hanging_start_up_honours_a_stop_signal(tmp_path: Path, sig: signal.Signals) -> None:
    # A "NATS" that accepts connections and never says a word: each connect attempt waits out its
    # timeout, so the gateway's start-up would take minutes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        gateway = _run_gateway(
            tmp_path,
            f'[nats]\nurl = "nats://127.0.0.1:{port}"\nconnect_timeout_s = 60.0\n'
            '[gateway]\nport = 0\nmetrics_port = 0\n[logging]\nlevel = "info"\nformat = "json"\n',
        )
        try:
            # Its first attempt is hung up on; the next waits for an INFO that never comes (the case
            # where a cancelled connect used to wait forever). The signal handlers are installed by then.
            _wait_for_connection(silent).close()
            gateway.send_signal(sig)
            # A hang guard: ignoring the signal, it would go on connecting for connect_timeout_s (60 s).
            gateway.communicate(timeout=30.0)
        finally:
            gateway.kill()
    assert gateway.returncode == 0


def _wait_for_connection(listener: socket.socket, timeout_s: float = 30.0) -> socket.socket:
    listener.settimeout(timeout_s)
    conn, _ = listener.accept()  # the gateway is connecting: its start-up is under way
    return conn


@pytest.mark.unit
def test_tls_files_are_checked_at_start_up(tmp_path: Path) -> None:
    from asyncinfer.tls import serving_certificates

    gateway = Config().gateway
    with pytest.raises(ConfigError, match="go together"):
        serving_certificates("gateway", gateway.model_copy(update={"tls_cert_file": "cert.pem"}))
    with pytest.raises(ConfigError, match=r"gateway\.tls_cert_file: cannot read"):
        serving_certificates(
            "gateway", gateway.model_copy(update={"tls_cert_file": str(tmp_path / "x"), "tls_key_file": "y"})
        )
    assert serving_certificates("gateway", gateway) is None


def test_a_key_that_is_not_the_certificates_is_named_at_start_up(ca: TestCA) -> None:
    """A mismatched pair (or a file that is no PEM) failed later, as "Failed to bind to address"."""
    from asyncinfer.tls import serving_certificates

    one, other = ca.issue("one"), ca.issue("other")
    gateway = Config().gateway
    with pytest.raises(ConfigError, match="are not a PEM certificate and its private key"):
        serving_certificates(
            "gateway", gateway.model_copy(update={"tls_cert_file": one.cert_file, "tls_key_file": other.key_file})
        )
    with pytest.raises(ConfigError, match=r"gateway\.tls_cert_file"):
        serving_certificates(
            "gateway", gateway.model_copy(update={"tls_cert_file": ca.ca_file + ".x", "tls_key_file": one.key_file})
        )
    not_pem = gateway.model_copy(update={"tls_cert_file": one.key_file, "tls_key_file": one.key_file})
    with pytest.raises(ConfigError, match="not a PEM certificate"):
        serving_certificates("gateway", not_pem)
    assert serving_certificates(
        "gateway", gateway.model_copy(update={"tls_cert_file": one.cert_file, "tls_key_file": one.key_file})
    )


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        pytest.param("tls_client_ca_file", r"batcher\.tls_client_ca_file", id="server-client-ca"),
        pytest.param("scheduler_ca_file", r"batcher\.scheduler_ca_file", id="work-stream-ca"),
    ],
)
@pytest.mark.parametrize("content", ["key", "text"])
async def test_a_ca_file_without_a_certificate_is_named_at_start_up(
    tmp_path: Path, ca: TestCA, setting: str, named: str, content: str
) -> None:
    """A CA file that holds no certificate (a private key given by mistake, a cut-short copy) stopped
    nothing at the check: as the server's client CA, gRPC failed the bind ("Failed to bind to
    address", a traceback and exit 1, as if the port were taken); as the CA verifying the
    scheduler, the batcher started and each connect failed "Failed to create security handshaker"."""
    from services.batcher.app import BatcherApp

    server, client = ca.issue("batcher"), ca.issue("batcher-client")
    wrong = tmp_path / "ca.pem"
    if content == "key":
        shutil.copyfile(server.key_file, wrong)
    else:
        wrong.write_text("ca.pem\n")
    batcher = {
        "port": 0,
        "metrics_port": 0,
        "tls_cert_file": server.cert_file,
        "tls_key_file": server.key_file,
        "scheduler_address": "localhost:1",
        "scheduler_cert_file": client.cert_file,
        "scheduler_key_file": client.key_file,
        setting: str(wrong),
    }
    app = BatcherApp(Config().replace(batcher=batcher, logging={"level": "warning", "format": "console"}))
    try:
        with pytest.raises(ConfigError, match=rf"{named} '{wrong}' is not a PEM CA bundle"):
            await app.start()
    finally:
        await app.stop(grace_s=0)


async def test_the_console_reaches_a_mutual_tls_scheduler_with_its_client_certificate(
    tmp_path: Path, ca: TestCA, tls_nats: NatsServerProcess, start_stack: StartStack
) -> None:
    from asyncinfer.client import AsyncInferClientError
    from asyncinfer.config import ConsoleConfig
    from services.console.backend import Backend

    stack = await start_stack(tls_config(tmp_path, ca, tls_nats), batcher=False)
    console = ca.issue("console")
    addresses = {"gateway_address": f"localhost:{stack.gateway.port}", "scheduler_address": stack.ops_address}
    with_cert = Backend(
        ConsoleConfig(
            tls_ca_file=ca.ca_file, tls_cert_file=console.cert_file, tls_key_file=console.key_file, **addresses
        )
    )
    without = Backend(ConsoleConfig(tls_ca_file=ca.ca_file, **addresses))
    try:
        assert [q.model_name for q in await with_cert.queues()] == ["demo"]
        assert await without.models()  # the gateway does not require a client certificate
        with pytest.raises(AsyncInferClientError):
            await without.queues()  # the scheduler does
    finally:
        await with_cert.close()
        await without.close()


def exposure_warnings(logs: list[dict[str, object]]) -> list[tuple[object, object, object]]:
    return [(e["file"], e["setting"], e["mode"]) for e in logs if e["event"] == "secret_file_exposed"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("mode", "warned"),
    [
        pytest.param(0o600, False, id="0600"),
        pytest.param(0o400, False, id="0400"),
        pytest.param(
            0o640, False, id="0640"
        ),  # a group read is accepted: Kubernetes mounts Secrets 0440 with the pod's fsGroup
        pytest.param(0o440, False, id="0440"),
        pytest.param(0o644, True, id="0644"),  # Kubernetes' default defaultMode
        pytest.param(0o604, True, id="0604"),
        pytest.param(0o660, True, id="0660"),  # the group may replace it
        pytest.param(0o666, True, id="0666"),
    ],
)
def test_a_secret_file_others_may_read_is_warned_of_and_read(tmp_path: Path, mode: int, warned: bool) -> None:
    from asyncinfer.tls import read_secret

    path = tmp_path / "api-key"
    path.write_text("s3cret\n")
    path.chmod(mode)
    with structlog.testing.capture_logs() as logs:
        assert read_secret(None, str(path), "batcher.api_key") == "s3cret"  # never refused
    expected = [(str(path), "batcher.api_key_file", f"{mode:04o}")] if warned else []
    assert exposure_warnings(logs) == expected


@pytest.mark.unit
def test_a_world_readable_tls_key_or_nkey_seed_is_warned_of(ca: TestCA, tmp_path: Path) -> None:
    from asyncinfer.nats.connection import security_options
    from asyncinfer.tls import serving_certificates

    pem = ca.issue("gateway")
    Path(pem.cert_file).chmod(0o644)  # a certificate is public: not warned of
    Path(pem.key_file).chmod(0o644)
    seed = tmp_path / "gateway.nk"
    seed.write_text("SUAEXAMPLE\n")
    seed.chmod(0o604)
    gateway = Config().gateway.model_copy(update={"tls_cert_file": pem.cert_file, "tls_key_file": pem.key_file})
    with structlog.testing.capture_logs() as logs:
        assert serving_certificates("gateway", gateway) is not None
        assert security_options(Config().nats.model_copy(update={"nkey_seed_file": str(seed)}))["nkeys_seed"]
    assert exposure_warnings(logs) == [
        (pem.key_file, "gateway.tls_key_file", "0644"),
        (str(seed), "nats.nkey_seed_file", "0604"),
    ]


def _not_after(cert_file: str) -> float:
    from cryptography import x509

    return x509.load_pem_x509_certificate(Path(cert_file).read_bytes()).not_valid_after_utc.timestamp()


def _expiry_samples(registry: Any) -> dict[str, float]:
    """asyncinfer_tls_certificate_expiry_timestamp_seconds' samples in a service's registry, by label."""
    samples: dict[str, float] = {}
    for family in registry.collect():
        if family.name == "asyncinfer_tls_certificate_expiry_timestamp_seconds":
            samples.update({sample.labels["certificate"]: sample.value for sample in family.samples})
    return samples


async def test_each_service_exposes_its_certificates_expiry_and_warns_of_one_expiring_soon(
    tmp_path: Path, ca: TestCA, tls_nats: NatsServerProcess, start_stack: StartStack
) -> None:
    """Operators had no warning before a serving certificate or a client one (mutual TLS to NATS,
    the batcher's to the scheduler) expired: the handshakes failed the day it did. Now each
    service's metrics say when each certificate it loaded expires, and a service logs a warning at
    start for one that expires within tls.expiry_warning_days (here half a day: the tests' other
    certificates are valid for one)."""
    config = tls_config(tmp_path, ca, tls_nats)
    soon = ca.issue("gateway-soon", valid_days=0.25)
    config = config.replace(
        gateway={"tls_cert_file": soon.cert_file, "tls_key_file": soon.key_file}, tls={"expiry_warning_days": 0.5}
    )
    with structlog.testing.capture_logs() as logs:
        stack = await start_stack(config)
    assert stack.batcher is not None
    nats_client = config.nats.tls_cert_file
    assert nats_client is not None
    assert config.scheduler.tls_cert_file is not None
    assert config.batcher.scheduler_cert_file is not None
    assert _expiry_samples(stack.gateway.registry) == {
        "gateway.tls_cert_file": _not_after(soon.cert_file),
        "nats.tls_cert_file": _not_after(nats_client),
    }
    assert _expiry_samples(stack.scheduler.metrics.registry) == {
        "scheduler.tls_cert_file": _not_after(config.scheduler.tls_cert_file),
        "nats.tls_cert_file": _not_after(nats_client),
    }
    # The batcher serves plaintext here and moves no claim checks (no NATS): its client certificate alone.
    assert _expiry_samples(stack.batcher.registry) == {
        "batcher.scheduler_cert_file": _not_after(config.batcher.scheduler_cert_file)
    }
    warned = [entry for entry in logs if entry["event"] in ("tls_certificate_expires_soon", "tls_certificate_expired")]
    assert [(w["event"], w["certificate"], w["file"]) for w in warned] == [
        ("tls_certificate_expires_soon", "gateway.tls_cert_file", soon.cert_file)
    ], warned
    assert warned[0]["log_level"] == "warning"
    assert 0 < warned[0]["days_left"] <= 0.25


@pytest.mark.unit
def test_an_expiring_certificate_is_warned_of_each_day_it_is_checked_and_the_gauge_says_the_one_loaded(
    tmp_path: Path,
) -> None:
    """The daily check against a clock: nothing while the certificate is outside the window, a
    warning once inside, an error once past; 0 days never logs. The check reads no file: one renewed
    on disk changes nothing until it is in use (a server's at its next handshake, a client's at its
    next connection, which tell the gauge: tests/test_tls_reload.py): the gauge says the one in use."""
    from prometheus_client import CollectorRegistry

    from asyncinfer.cert_expiry import DAY_S, CertificateExpiry

    ca = TestCA(tmp_path / "pki")
    pem = ca.issue("served", valid_days=20)
    expires = _not_after(pem.cert_file)
    now = [expires - 20 * DAY_S]
    registry = CollectorRegistry()
    expiry = CertificateExpiry(
        [("gateway.tls_cert_file", pem.cert_file)], registry=registry, warning_days=14, clock=lambda: now[0]
    )
    assert _expiry_samples(registry) == {"gateway.tls_cert_file": expires}
    renewed = ca.issue("renewed", valid_days=90)
    shutil.copy(renewed.cert_file, pem.cert_file)  # cert-manager rewrote the Secret: not yet served
    events = []
    for day in (0, 7, 19, 21):
        now[0] = expires - 20 * DAY_S + day * DAY_S
        with structlog.testing.capture_logs() as logs:
            expiry.check()
        events.append([(entry["event"], entry["log_level"]) for entry in logs])
    assert events == [
        [],  # 20 days left
        [("tls_certificate_expires_soon", "warning")],  # 13
        [("tls_certificate_expires_soon", "warning")],  # 1
        [("tls_certificate_expired", "error")],
    ]
    assert _expiry_samples(registry) == {"gateway.tls_cert_file": expires}
    quiet = CertificateExpiry([("nats.tls_cert_file", pem.cert_file)], registry=CollectorRegistry(), warning_days=0)
    with structlog.testing.capture_logs() as logs:
        assert quiet.check() == []
    assert logs == []


@pytest.mark.unit
def test_a_certificate_file_without_a_certificate_is_named() -> None:
    from asyncinfer.cert_expiry import not_after

    with pytest.raises(ConfigError, match=r"gateway\.tls_cert_file '/nonexistent\.pem': cannot read"):
        not_after("/nonexistent.pem", "gateway.tls_cert_file")


async def test_the_console_shows_the_days_left_on_the_certificates_the_gateway_and_the_scheduler_serve(
    tmp_path: Path, ca: TestCA, tls_nats: NatsServerProcess, start_stack: StartStack
) -> None:
    """The services' gauge and the shipped alert reach an operator where Prometheus is; the console
    said nothing of a certificate about to expire. Its TLS page shows, for the gateway and the
    scheduler, when the certificate each serves expires (a handshake of its own: what a client is
    served) and the days left, flagged under the alert's 14 days."""
    import aiohttp

    from services.console.app import ConsoleApp

    config = tls_config(tmp_path, ca, tls_nats)
    lasting = ca.issue("gateway-lasting", valid_days=40)
    config = config.replace(gateway={"tls_cert_file": lasting.cert_file, "tls_key_file": lasting.key_file})
    stack = await start_stack(config, batcher=False)
    client = ca.issue("console")
    console = ConsoleApp(
        stack.config.replace(
            console={
                "port": 0,
                "gateway_address": f"127.0.0.1:{stack.gateway.port}",
                "scheduler_address": stack.ops_address,
                "tls_ca_file": ca.ca_file,
                "tls_cert_file": client.cert_file,  # the scheduler requires one
                "tls_key_file": client.key_file,
            }
        )
    )
    await console.start()
    try:
        async with aiohttp.ClientSession() as session, session.get(console.url + "tls") as answer:
            assert answer.status == 200
            page = await answer.text()
    finally:
        await console.stop()
    rows = re.findall(r"<tr><td>(\w+)</td><td>[^<]*</td><td><time datetime=\"([^\"]+)\".*?</td><td>([^<]*)</td>", page)
    assert config.scheduler.tls_cert_file is not None
    expected = {
        "gateway": _not_after(lasting.cert_file),
        "scheduler": _not_after(config.scheduler.tls_cert_file),
    }
    assert [name for name, _, _ in rows] == ["gateway", "scheduler"], page
    shown = {name: datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp() for name, at, _ in rows}
    assert shown == pytest.approx(expected, abs=1)  # the page's times are to the millisecond
    said = {name: days for name, _, days in rows}
    assert re.fullmatch(r"(39\.\d|40\.0) days left", said["gateway"]), said
    assert re.fullmatch(r"expires within 14 days: [01]\.\d days left", said["scheduler"]), said


@pytest.mark.unit
def test_the_console_says_days_left_and_flags_a_certificate_under_the_alerts_14_days() -> None:
    from services.console.pages_tls import DAY_S, days_left

    assert days_left(40 * DAY_S, 0.0) == "40.0 days left"
    assert days_left(13.5 * DAY_S, 0.0) == "expires within 14 days: 13.5 days left"
    assert days_left(0.0, 2 * DAY_S) == "expired 2.0 days ago"
