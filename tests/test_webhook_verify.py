"""`asyncinfer.client.verify_webhook`, the receiving side of Standard Webhooks: against real deliveries
from a running stack (one secret, and two during a rotation), and against the independent
`standardwebhooks` library both ways (what it signs verifies with ours; what our stack signs verifies with
it and with ours; both refuse the same tampered, stale and unsigned deliveries)."""

from __future__ import annotations

import asyncio
import email.message
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError as TheirError

from asyncinfer.client import AsyncInferClientError, WebhookVerificationError, verify_webhook
from asyncinfer.config import Config
from asyncinfer.embedded_nats import free_port
from asyncinfer.v1 import job_pb2
from asyncinfer.webhook_secrets import new_secret
from tests.stack import StartStack
from tests.test_webhooks import all_final, submit, until
from tests.waits import WAIT_S
from tests.webhook_receiver import SECRET, Receiver, receiver, webhook_config

__all__ = ["receiver"]  # the fixture, used by name

README = Path(__file__).resolve().parents[1] / "README.md"

BODY = b'{"type":"job.completed","timestamp":"2025-01-01T12:00:00Z","data":{"job_id":"j1","state":"SUCCEEDED"}}'


def theirs(secret: str, webhook_id: str, at: int, body: bytes) -> dict[str, str]:
    """Headers signed by the standardwebhooks library, not by our code."""
    signature = Webhook(secret).sign(webhook_id, datetime.fromtimestamp(at, UTC), body)
    return {"webhook-id": webhook_id, "webhook-timestamp": str(at), "webhook-signature": signature}


def refusal(headers: Any, body: bytes, secrets: str | list[str], **options: Any) -> WebhookVerificationError:
    with pytest.raises(WebhookVerificationError) as caught:
        verify_webhook(headers, body, secrets, **options)
    return caught.value


# --- real deliveries ---------------------------------------------------------------------------


async def test_a_real_delivery_verifies_and_a_tampered_replayed_or_foreign_one_does_not(
    config: Config, receiver: Receiver, start_stack: StartStack
) -> None:
    stack = await start_stack(webhook_config(config))
    job_id = await submit(stack, receiver.url("/hook"), job_pb2.CALLBACK_EVENT_COMPLETED)
    await until(stack, job_id, all_final(1))
    (delivery,) = await receiver.wait_for("/hook", 1)
    assert not isinstance(delivery.verified, Exception), delivery.verified  # standardwebhooks agrees

    payload = verify_webhook(delivery.headers, delivery.body, SECRET)
    assert payload == json.loads(delivery.body)
    assert payload["type"] == "job.completed"
    assert payload["data"]["job_id"] == job_id
    # Header names in any case, as frameworks hand them over.
    assert verify_webhook({k.title(): v for k, v in delivery.headers.items()}, delivery.body, SECRET) == payload

    tampered = delivery.body.replace(b"SUCCEEDED", b"FAILED\x00\x00\x00")
    assert refusal(delivery.headers, tampered, SECRET).reason == "BAD_SIGNATURE"
    foreign = refusal(delivery.headers, delivery.body, new_secret())
    assert foreign.reason == "BAD_SIGNATURE"
    assert "1 secret(s)" in str(foreign)

    # The same delivery replayed six minutes later: its signature is still valid, its age is not.
    sent_at = int(delivery.headers["webhook-timestamp"])
    replayed = refusal(delivery.headers, delivery.body, SECRET, now=sent_at + 360)
    assert replayed.reason == "TOO_OLD"
    assert "360 s old" in str(replayed)
    assert verify_webhook(delivery.headers, delivery.body, SECRET, now=sent_at + 299) == payload
    assert refusal(delivery.headers, delivery.body, SECRET, now=sent_at + 61, tolerance_s=60).reason == "TOO_OLD"
    assert refusal(delivery.headers, delivery.body, SECRET, now=sent_at - 301).reason == "TOO_NEW"

    unsigned = {k: v for k, v in delivery.headers.items() if k != "webhook-signature"}
    missing = refusal(unsigned, delivery.body, SECRET)
    assert missing.reason == "MISSING_HEADER"
    assert "webhook-signature" in str(missing)
    assert isinstance(missing, AsyncInferClientError)  # the SDK's one root


async def test_during_a_rotation_either_secret_verifies_a_real_delivery(
    config: Config, start_stack: StartStack
) -> None:
    old, new = new_secret(), new_secret()
    rotating = webhook_config(
        config, secrets=[{"tenant": "default", "secret": new}, {"tenant": "default", "secret": old}]
    )
    server = Receiver(old)
    await server.start()
    try:
        stack = await start_stack(rotating)
        job_id = await submit(stack, server.url("/rotating"), job_pb2.CALLBACK_EVENT_COMPLETED)
        (delivery,) = await server.wait_for("/rotating", 1)
    finally:
        await server.stop()
    assert len(delivery.headers["webhook-signature"].split(" ")) == 2
    for secrets in (old, new, [old, new], [new_secret(), new]):
        assert verify_webhook(delivery.headers, delivery.body, secrets)["data"]["job_id"] == job_id
    assert refusal(delivery.headers, delivery.body, [new_secret(), new_secret()]).reason == "BAD_SIGNATURE"


# --- interoperability with standardwebhooks ----------------------------------------------------


def test_what_standardwebhooks_signs_verifies_with_ours() -> None:
    secret = new_secret()
    at = int(time.time())
    headers = theirs(secret, "msg_2a", at, BODY)
    assert verify_webhook(headers, BODY, secret) == json.loads(BODY)
    assert verify_webhook(headers, BODY.decode(), secret) == json.loads(BODY)  # a str body is its UTF-8
    # Its secrets without the prefix or the padding are the same key to both.
    assert verify_webhook(headers, BODY, secret.removeprefix("whsec_").rstrip("=")) == json.loads(BODY)
    # A rotation as it writes one: two of its signatures, space-separated; a v1a (asymmetric) one is ignored.
    other = new_secret()
    both = dict(
        headers,
        **{
            "webhook-signature": f"v1a,AAAA {theirs(other, 'msg_2a', at, BODY)['webhook-signature']} "
            f"{headers['webhook-signature']}"
        },
    )
    assert verify_webhook(both, BODY, other) == verify_webhook(both, BODY, secret) == json.loads(BODY)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("valid", None),
        ("tampered body", "BAD_SIGNATURE"),
        ("wrong secret", "BAD_SIGNATURE"),
        ("other webhook-id", "BAD_SIGNATURE"),
        ("timestamp moved", "BAD_SIGNATURE"),
        ("only v1a", "BAD_SIGNATURE"),
        ("last character changed", "BAD_SIGNATURE"),
        ("ten minutes old", "TOO_OLD"),
        ("ten minutes ahead", "TOO_NEW"),
        ("no webhook-id", "MISSING_HEADER"),
        ("no timestamp", "MISSING_HEADER"),
        ("timestamp not a number", "INVALID_HEADER"),
    ],
)
def test_ours_and_standardwebhooks_accept_and_refuse_the_same_deliveries(case: str, reason: str | None) -> None:
    secret = new_secret()
    at = int(time.time())
    body = BODY
    key = secret
    headers = theirs(secret, "msg_3b", at, BODY)
    if case == "tampered body":
        body = BODY.replace(b"j1", b"j2")
    elif case == "wrong secret":
        key = new_secret()
    elif case == "other webhook-id":
        headers["webhook-id"] = "msg_3c"
    elif case == "timestamp moved":
        headers["webhook-timestamp"] = str(at - 1)
    elif case == "only v1a":
        headers["webhook-signature"] = "v1a," + headers["webhook-signature"].removeprefix("v1,")
    elif case == "last character changed":
        signature = headers["webhook-signature"]
        headers["webhook-signature"] = signature[:-3] + ("B" if signature[-3] == "A" else "A") + signature[-2:]
    elif case == "ten minutes old":
        headers = theirs(secret, "msg_3b", at - 600, BODY)
    elif case == "ten minutes ahead":
        headers = theirs(secret, "msg_3b", at + 600, BODY)
    elif case == "no webhook-id":
        del headers["webhook-id"]
    elif case == "no timestamp":
        del headers["webhook-timestamp"]
    elif case == "timestamp not a number":
        headers["webhook-timestamp"] = "yesterday"

    if reason is None:
        assert verify_webhook(headers, body, key) == Webhook(key).verify(body, headers) == json.loads(body)
    else:
        assert refusal(headers, body, key).reason == reason
        with pytest.raises(TheirError):
            Webhook(key).verify(body, headers)


# --- what a receiver hands it ------------------------------------------------------------------


def test_http_server_headers_and_pairs_are_accepted() -> None:
    """`http.server` gives an `email.message.Message`; WSGI/ASGI code often has (name, value) pairs."""
    secret = new_secret()
    signed = theirs(secret, "msg_4d", int(time.time()), BODY)
    message = email.message.Message()
    for name, value in signed.items():
        message[name.title()] = value
    message["Content-Type"] = "application/json"
    assert verify_webhook(message, BODY, secret) == json.loads(BODY)
    assert verify_webhook(list(signed.items()), BODY, secret) == json.loads(BODY)


def test_a_body_that_is_not_json_and_a_secret_that_is_not_one_say_so() -> None:
    secret = new_secret()
    body = b"not json"
    refused = refusal(theirs(secret, "msg_5e", int(time.time()), body), body, secret)
    assert refused.reason == "INVALID_BODY"
    with pytest.raises(ValueError, match="whsec_"):
        verify_webhook(theirs(secret, "msg_5e", int(time.time()), BODY), BODY, "whsec_not base64!")
    with pytest.raises(ValueError, match="no webhook secret"):
        verify_webhook(theirs(secret, "msg_5e", int(time.time()), BODY), BODY, [])


# --- the README's receiver ---------------------------------------------------------------------


def readme_receiver() -> str:
    """The README's ```python block that starts `# receiver.py`, verbatim."""
    (code,) = re.findall(r"```python\n(# receiver\.py.*?)```", README.read_text(), re.S)
    return str(code)


def post(url: str, headers: dict[str, str], body: bytes) -> int:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code


async def test_the_readmes_receiver_prints_a_real_delivery_and_refuses_forged_and_replayed_ones(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    code = readme_receiver()
    assert "verify_webhook(self.headers, body, SECRET)" in code
    port = free_port()
    (tmp_path / "receiver.py").write_text(code.replace("8099", str(port)))
    (tmp_path / ".asyncinfer").mkdir()
    (tmp_path / ".asyncinfer" / "webhook-secret").write_text(SECRET + "\n")  # where `up` keeps it
    process = await asyncio.create_subprocess_exec(
        sys.executable, "receiver.py", cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        give_up_at = time.monotonic() + 15
        while True:  # until it listens
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                assert process.returncode is None, await process.communicate()
                assert time.monotonic() < give_up_at, "the README's receiver never listened"
                await asyncio.sleep(0.05)
        stack = await start_stack(webhook_config(config))
        url = f"http://127.0.0.1:{port}/hook"
        job_id = await submit(stack, url, job_pb2.CALLBACK_EVENT_COMPLETED)
        job = await until(stack, job_id, all_final(1))
        (delivery,) = job.callback_deliveries
        assert delivery.last_status_code == 204, delivery  # verified, so answered 2xx

        now = int(time.time())
        forged = theirs(new_secret(), "msg_forged", now, BODY)
        replayed = theirs(SECRET, "msg_replayed", now - 600, BODY)
        assert await asyncio.to_thread(post, url, forged, BODY) == 400
        assert await asyncio.to_thread(post, url, replayed, BODY) == 400
    finally:
        process.terminate()
        out, err = await asyncio.wait_for(process.communicate(), WAIT_S)
    printed = out.decode().splitlines()
    assert len(printed) == 3, (out, err)
    assert f"'job_id': '{job_id}'" in printed[0], printed
    assert "'type': 'job.completed'" in printed[0], printed
    assert printed[1].startswith("refused: BAD_SIGNATURE"), printed
    assert printed[2].startswith("refused: TOO_OLD"), printed
