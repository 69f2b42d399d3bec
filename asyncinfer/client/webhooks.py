"""Verifying a webhook delivery on the receiving side, per Standard Webhooks
(https://www.standardwebhooks.com), with the standard library alone.

    payload = verify_webhook(request.headers, raw_body, "whsec_...")

The scheduler signs `{webhook-id}.{webhook-timestamp}.{raw body}` with HMAC-SHA256 keyed by the
base64-decoded part of the tenant's `whsec_` secret, and sends `webhook-signature: v1,<base64>`, one
signature per secret (space-separated) while a secret rotates. A receiver must verify the body exactly
as received, before parsing it, and refuse a timestamp outside its tolerance: a captured delivery
replayed later carries a valid signature, and only its age gives it away.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from asyncinfer.client.errors import AsyncInferClientError

__all__ = ["DEFAULT_TOLERANCE_S", "WebhookVerificationError", "verify_webhook"]

DEFAULT_TOLERANCE_S = 300  # Standard Webhooks' recommendation: five minutes either way
SECRET_PREFIX = "whsec_"
HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")


class WebhookVerificationError(AsyncInferClientError):
    """A delivery failed verification; `reason` says why: MISSING_HEADER, INVALID_HEADER,
    BAD_SIGNATURE, TOO_OLD, TOO_NEW or INVALID_BODY. Answer it with a 4xx and do not act on it."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message, reason=reason)

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def _key(secret: str) -> bytes:
    """The HMAC key of a `whsec_` secret (the prefix is optional, padding too, as the standard's
    libraries allow); a secret that is not base64 is a configuration error, not a bad delivery."""
    text = secret.strip().removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a webhook secret is 'whsec_' followed by base64 (`asyncinfer webhook-secret`)") from None
    if not key:
        raise ValueError("the webhook secret is empty")
    return key


def _header_items(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    """Header names lower-cased: a dict, an `http.server`/`email.message.Message`, a Starlette or
    aiohttp multidict, or (name, value) pairs."""
    items = headers.items() if hasattr(headers, "items") else headers
    return {str(name).lower(): str(value) for name, value in items}


def verify_webhook(
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
    body: bytes | str,
    secret_or_secrets: str | Sequence[str],
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> Any:
    """The delivery's JSON payload, once its signature verifies with one of the secrets and its
    timestamp is within `tolerance_s` of `now` (Unix seconds; the clock by default).

    `body` is the raw request body, byte for byte (a str is taken as its UTF-8). Several secrets
    (old and new, during a rotation) accept a signature made with any of them. Raises
    `WebhookVerificationError` saying why a delivery is refused, and ValueError for a secret
    that is not a `whsec_` one.
    """
    secrets = [secret_or_secrets] if isinstance(secret_or_secrets, str) else list(secret_or_secrets)
    if not secrets:
        raise ValueError("no webhook secret to verify with")
    keys = [_key(s) for s in secrets]
    raw = body.encode() if isinstance(body, str) else bytes(body)
    found = _header_items(headers)
    missing = [name for name in HEADERS if not found.get(name)]
    if missing:
        raise WebhookVerificationError(f"missing header {', '.join(missing)}", reason="MISSING_HEADER")
    webhook_id, timestamp_text, signatures = (found[name] for name in HEADERS)
    if not timestamp_text.strip().isdigit():
        raise WebhookVerificationError(
            f"webhook-timestamp {timestamp_text[:40]!r} is not Unix seconds", reason="INVALID_HEADER"
        )
    timestamp = int(timestamp_text)

    signed = f"{webhook_id}.{timestamp}.".encode() + raw
    expected = [base64.b64encode(hmac.new(k, signed, hashlib.sha256).digest()) for k in keys]
    offered = [
        value.encode()
        for version, _, value in (part.partition(",") for part in signatures.split())
        if version == "v1"  # other schemes (v1a: asymmetric) are not ours to check
    ]
    # Every pair is compared, each in constant time: no early exit on the first match.
    matched = False
    for mine in expected:
        for theirs in offered:
            matched |= hmac.compare_digest(mine, theirs)
    if not matched:
        what = "no v1 signature" if not offered else f"no signature matches the {len(keys)} secret(s) given"
        raise WebhookVerificationError(
            f"{what} (webhook-id {webhook_id[:80]!r}): a wrong secret, or a body changed since it was signed "
            "(verify the raw bytes received, before parsing them)",
            reason="BAD_SIGNATURE",
        )

    clock = time.time() if now is None else now
    age_s = clock - timestamp
    if age_s > tolerance_s:
        raise WebhookVerificationError(
            f"webhook-timestamp is {age_s:.0f} s old, past the tolerance of {tolerance_s:g} s "
            "(a replayed delivery, or this clock is ahead)",
            reason="TOO_OLD",
        )
    if -age_s > tolerance_s:
        raise WebhookVerificationError(
            f"webhook-timestamp is {-age_s:.0f} s in the future, past the tolerance of {tolerance_s:g} s "
            "(the sender's clock is ahead, or this one behind)",
            reason="TOO_NEW",
        )
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise WebhookVerificationError(f"the body is not JSON: {exc}", reason="INVALID_BODY") from None
