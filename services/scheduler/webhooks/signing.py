"""Standard Webhooks signatures (https://www.standardwebhooks.com): `webhook-signature` is
`v1,<base64 HMAC-SHA256>` over `{webhook-id}.{webhook-timestamp}.{raw body}`, keyed with the
base64-decoded part of the tenant's `whsec_` secret."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Sequence

from asyncinfer.webhook_secrets import secret_key


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value for one attempt."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def signed_headers(secret: str | Sequence[str], webhook_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The headers of one attempt; with several secrets (a rotation), one signature per secret,
    space-separated, as Standard Webhooks specifies: a receiver accepts any that it can verify."""
    secrets = [secret] if isinstance(secret, str) else list(secret)
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(s, webhook_id, timestamp, body) for s in secrets),
    }
