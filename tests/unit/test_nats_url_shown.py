"""What errors show of `nats.url` (asyncinfer.nats.connection.url_without_credentials): every
server's address, none of the credentials nats-py logs in with from a URL."""

from __future__ import annotations

import pytest

from asyncinfer.nats.connection import url_without_credentials

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("nats://gateway:s3cret@nats:4222", "nats://***@nats:4222"),
        (
            "tls://a-token@nats-0:4222, nats://u:p@nats-1:4222,nats://nats-2:4222",
            "tls://***@nats-0:4222,nats://***@nats-1:4222,nats://nats-2:4222",
        ),
        ("u:p@ss@nats:4222", "***@nats:4222"),  # no scheme, an unescaped '@' in the password
        ("ws://u:p@nats:8080/path?at=@", "ws://***@nats:8080/path?at=@"),
        ("nats://[::1]:4222", "nats://[::1]:4222"),
    ],
)
def test_credentials_are_left_out_and_the_servers_kept(url: str, shown: str) -> None:
    assert url_without_credentials(url) == shown
