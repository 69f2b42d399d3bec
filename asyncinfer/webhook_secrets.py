"""Webhook signing secrets in the Standard Webhooks format: `whsec_` + base64 of 32 random bytes
(`asyncinfer webhook-secret` prints one; the scheduler signs with it, receivers verify with it)."""

from __future__ import annotations

import base64
import secrets

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32


def new_secret() -> str:
    """A fresh signing secret."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def secret_key(secret: str) -> bytes:
    """The HMAC key a secret stands for: its base64-decoded part."""
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))
