"""A target with several addresses (localhost: ::1 and 127.0.0.1 where /etc/hosts has both) whose
server listens on one of them: gRPC reports the last address's failure alone, and where that was
a refused connection the SDK and the CLI said "nothing listens there" and hid the TLS failure met
on the address that listens (a wrong CA, or plaintext to a TLS gateway). An `ipv4:` list stands
for such a name here: gRPC tries its addresses in order as it tries a name's, and this machine's
localhost has 127.0.0.1 alone."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from asyncinfer.client import AsyncClient, AsyncInferClientError, RetryPolicy, UnavailableError
from asyncinfer.client._addresses import target_addresses
from asyncinfer.embedded_nats import free_port
from tests.certs import TestCA, tls_health_server

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tls_port(ca: TestCA) -> Iterator[int]:
    """A TLS gRPC server (health only) on 127.0.0.1 alone, its certificate signed by `ca`."""
    with tls_health_server(ca, "gateway") as port:
        yield port


def two_addresses(port: int) -> str:
    """127.0.0.1 (which listens) then 127.0.0.2 (which refuses: nothing listens there on `port`)."""
    return f"ipv4:127.0.0.1:{port},127.0.0.2:{port}"


async def test_the_sdk_shows_the_tls_failure_over_another_addresss_refusal(
    tmp_path: Path, ca: TestCA, tls_port: int
) -> None:
    wrong_ca = TestCA(tmp_path / "other", "another CA").ca_file
    refused_too = f"(and ipv4:127.0.0.2:{tls_port} refused the connection)"
    for options, said, hint in (
        ({"tls_ca_file": wrong_ca}, "Tls handshake failed", "did tls_ca_file's CA sign"),
        ({}, "Socket closed", "if the server is on TLS, give tls_ca_file="),
    ):
        async with AsyncClient(
            two_addresses(tls_port), timeout_s=10, retry=RetryPolicy(max_attempts=1), **options
        ) as client:
            with pytest.raises(UnavailableError) as raised:
                await client.models()
        assert said in raised.value.message, str(raised.value)
        # Said after it where gRPC's own text was the refusal (the other order is gRPC's too: the
        # address that refuses may fail first when the machine is slow).
        assert "Connection refused" not in raised.value.message, str(raised.value)
        assert refused_too in raised.value.message or "refused" not in raised.value.message, str(raised.value)
        assert hint in (raised.value.hint or ""), str(raised.value)
    # The right CA: answered (the server has no JobService), no refusal in sight. (gRPC checks an
    # ipv4: list's certificate against the whole list: a name stands in, as a real one's would.)
    named = [("grpc.ssl_target_name_override", "localhost")]
    async with AsyncClient(
        two_addresses(tls_port), tls_ca_file=ca.ca_file, timeout_s=10, channel_options=named
    ) as client:
        with pytest.raises(AsyncInferClientError) as answered:
            await client.models()
    assert answered.value.code is grpc.StatusCode.UNIMPLEMENTED, str(answered.value)


def test_the_cli_shows_the_tls_failure_and_its_hint(tmp_path: Path, tls_port: int) -> None:
    """Of the gateway (the SDK's) and of the scheduler (dlq, queue and stats: a channel of its own)."""
    wrong_ca = TestCA(tmp_path / "other", "another CA").ca_file
    for argv in (("models", "--gateway"), ("dlq", "list", "--scheduler")):
        done = subprocess.run(
            [sys.executable, "-m", "asyncinfer", *argv, two_addresses(tls_port), "--tls-ca", wrong_ca],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 5, done.stderr
        lines = [line for line in done.stderr.splitlines() if not line.endswith("trying again for a few seconds")]
        assert "Tls handshake failed" in lines[0], done.stderr
        assert "Connection refused" not in lines[0], done.stderr  # (its retries may see the TLS failure last)
        assert lines[1].startswith("asyncinfer:   hint: the TLS handshake failed"), done.stderr


async def test_a_target_where_every_address_refuses_keeps_its_refusal() -> None:
    port = free_port()
    async with AsyncClient(two_addresses(port), timeout_s=10, retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(UnavailableError) as raised:
            await client.models()
    assert "Connection refused" in raised.value.message, str(raised.value)
    assert "refused the connection)" not in raised.value.message, str(raised.value)


@pytest.mark.unit
async def test_the_addresses_of_a_target() -> None:
    assert await target_addresses("ipv4:10.0.0.1:5,10.0.0.2:5") == (["ipv4:10.0.0.1:5", "ipv4:10.0.0.2:5"], None)
    assert await target_addresses("ipv6:[::1]:7") == (["ipv6:[::1]:7"], None)
    assert await target_addresses("127.0.0.1:50051") == (["ipv4:127.0.0.1:50051"], None)
    assert await target_addresses("[::1]:50051") == (["ipv6:[::1]:50051"], None)
    assert await target_addresses("unix:/tmp/socket") == ([], None)
    for name in ("localhost:50051", "dns:localhost:50051", "dns://8.8.8.8/localhost:50051"):
        addresses, host = await target_addresses(name)
        assert host == "localhost", name
        assert "ipv4:127.0.0.1:50051" in addresses, (name, addresses)
