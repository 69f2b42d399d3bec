"""A nats-server on TLS for tests, its certificate signed by the test's CA (tests/certs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncinfer.embedded_nats import NatsServerProcess
from tests.certs import TestCA


@contextmanager
def tls_nats_server(
    folder: Path, ca: TestCA, *extra_args: str, log_file: Path | None = None, port: int = 0
) -> Iterator[NatsServerProcess]:
    """A nats-server that requires TLS (a certificate `ca` issues for 127.0.0.1) and verifies
    client certificates against `ca`, its store under `folder`; `extra_args` add to its command
    line (a user and password); `port` 0 picks a free one. Stopped on the way out."""
    cert = ca.issue("nats")
    server = NatsServerProcess(
        store_dir=folder / "nats",
        port=port,
        log_file=log_file,
        extra_args=(
            "--tls", "--tlscert", cert.cert_file, "--tlskey", cert.key_file, "--tlscacert", ca.ca_file, "--tlsverify",
            *extra_args,
        ),
    )  # fmt: skip
    server.start()
    try:
        yield server
    finally:
        server.stop()
