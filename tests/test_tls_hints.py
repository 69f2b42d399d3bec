"""What each client says when a server that requires client certificates (mutual TLS: the
gateway's or the scheduler's tls_client_ca_file) closes a TLS connection that presented none.

A Python gRPC server cannot ask for a certificate without requiring one, and under TLS 1.3 the
client's side of the handshake is over before the server has checked the client's: the refusal
reaches the client as gRPC's "Socket closed", the same text as a plaintext client's to a TLS
server. Only the client knows it sent no certificate, so each names its own settings then, and
says nothing of certificates where it sent one or was not on TLS."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from asyncinfer.client import AsyncClient, AsyncInferClientError, RetryPolicy, UnavailableError
from asyncinfer.config import ConsoleConfig
from services.console.backend import Backend
from tests.certs import Pem, TestCA, tls_health_server

REPO = Path(__file__).resolve().parents[1]
SDK_HINT = (
    "if it requires client certificates (mutual TLS: its tls_client_ca_file), give tls_cert_file= and tls_key_file="
)
CLI_HINT = "give --tls-cert FILE and --tls-key FILE"
CONSOLE_HINT = "set console.tls_cert_file and console.tls_key_file"
ONE_TRY = RetryPolicy(max_attempts=1)


@pytest.fixture
def mutual_tls_port(ca: TestCA) -> Iterator[int]:
    """A gRPC server (health only) on 127.0.0.1 that requires a client certificate signed by `ca`."""
    with tls_health_server(ca, "server", require_client_auth=True) as port:
        yield port


async def test_the_sdk_names_the_client_certificate_settings(tmp_path: Path, ca: TestCA, mutual_tls_port: int) -> None:
    target = f"127.0.0.1:{mutual_tls_port}"
    async with AsyncClient(target, tls_ca_file=ca.ca_file, timeout_s=5, retry=ONE_TRY) as client:
        with pytest.raises(UnavailableError) as refused:
            await client.models()
    assert "Socket closed" in refused.value.message, str(refused.value)
    assert SDK_HINT in (refused.value.hint or ""), str(refused.value)
    # Not where a certificate was sent (here one the server's CA did not sign: refused the same
    # way), nor on plaintext (whose hint is the CA's), nor with credentials the SDK did not make.
    stranger = TestCA(tmp_path / "stranger").issue("stranger")
    their_own = grpc.ssl_channel_credentials(Path(ca.ca_file).read_bytes())  # noqa: ASYNC240
    plaintext = {"retry": ONE_TRY}
    for options in (
        {"tls_ca_file": ca.ca_file, "tls_cert_file": stranger.cert_file, "tls_key_file": stranger.key_file},
        {"credentials": their_own},
        plaintext,
    ):
        async with AsyncClient(target, timeout_s=5, **{"retry": ONE_TRY, **options}) as client:  # type: ignore[arg-type]
            with pytest.raises(UnavailableError) as refused:
                await client.models()
        assert "Socket closed" in refused.value.message, (options, str(refused.value))
        assert "client certificates" not in str(refused.value), (options, str(refused.value))
        if options is plaintext:
            assert "give tls_ca_file=" in (refused.value.hint or ""), str(refused.value)


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    # The refusal is UNAVAILABLE, which the CLI tries again until a wait would pass the call's
    # --timeout, then says what the last try met, and its hint: 2 s keep it to about a second of
    # tries, where 5 had each gateway command take all of its 5 s (a hang guard, no more).
    return subprocess.run(
        [sys.executable, "-m", "asyncinfer", *argv, "--timeout", "2"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cli_names_tls_cert_and_tls_key(tmp_path: Path, ca: TestCA, mutual_tls_port: int) -> None:
    address = f"127.0.0.1:{mutual_tls_port}"
    # With a certificate (its CA not the server's), or on plaintext: no word of certificates.
    stranger: Pem = TestCA(tmp_path / "stranger").issue("stranger")
    with_cert = ("--tls-ca", ca.ca_file, "--tls-cert", stranger.cert_file, "--tls-key", stranger.key_file)
    runs = {
        "gateway": ("models", "--gateway", address, "--tls-ca", ca.ca_file),
        "scheduler": ("dlq", "list", "--scheduler", address, "--tls-ca", ca.ca_file),
        "with a certificate": ("models", "--gateway", address, *with_cert),
        "plaintext": ("models", "--gateway", address),
    }
    # Each command a process of its own, all at once: they share nothing but the server.
    with ThreadPoolExecutor(len(runs)) as pool:
        ended = dict(zip(runs, pool.map(lambda argv: run_cli(*argv), runs.values()), strict=True))
    for name in ("gateway", "scheduler"):
        done = ended[name]
        assert done.returncode == 5, done.stderr
        lines = [line for line in done.stderr.splitlines() if not line.endswith("trying again for a few seconds")]
        assert "Socket closed" in lines[0], done.stderr
        assert lines[1].startswith("asyncinfer:   hint: the server closed the connection after the TLS handshake")
        assert CLI_HINT in lines[1], done.stderr
    for name in ("with a certificate", "plaintext"):
        done = ended[name]
        assert done.returncode == 5, done.stderr
        assert "Socket closed" in done.stderr, done.stderr
        assert "--tls-cert" not in done.stderr, done.stderr
    assert "give --tls-ca FILE" in ended["plaintext"].stderr, ended["plaintext"].stderr


async def test_the_console_names_its_client_certificate_settings(ca: TestCA, mutual_tls_port: int) -> None:
    address = f"127.0.0.1:{mutual_tls_port}"
    addresses = {"gateway_address": address, "scheduler_address": address}
    console = ca.issue("console")
    without = Backend(ConsoleConfig(tls_ca_file=ca.ca_file, **addresses))
    with_cert = Backend(
        ConsoleConfig(
            tls_ca_file=ca.ca_file, tls_cert_file=console.cert_file, tls_key_file=console.key_file, **addresses
        )
    )
    try:
        for read in (without.queues, without.models):
            with pytest.raises(UnavailableError) as refused:
                await read()
            assert "Socket closed" in refused.value.message, str(refused.value)
            assert CONSOLE_HINT in (refused.value.hint or ""), str(refused.value)
            assert f"hint: the {'scheduler' if read == without.queues else 'gateway'} closed" in str(refused.value)
        # Its certificate gets it past the handshake: the server (health only) then has no OpsService.
        with pytest.raises(AsyncInferClientError) as answered:
            await with_cert.queues()
        assert answered.value.code is grpc.StatusCode.UNIMPLEMENTED, str(answered.value)
    finally:
        await without.close()
        await with_cert.close()
