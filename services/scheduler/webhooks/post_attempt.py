"""One HTTP attempt of a delivery: the tenant's secret, the URL vetted again against the addresses
it resolves to now, the signed POST to those addresses in resolver order until one answers (within
webhooks.request_timeout_s), and the answer read as (status code, error, Retry-After). What the
answer means for the delivery (done, retried, failed, disabled) is the sender's (sender.py), so
this module holds the network and nothing of the state.
"""

from __future__ import annotations

import email.utils
import ipaddress
import time
from collections.abc import Callable

import structlog
from prometheus_client import Counter

from asyncinfer.config import WebhooksConfig
from asyncinfer.webhook_urls import RefusedUrl, Unresolved, parse_callback_url, parse_networks, vetted_addresses
from services.scheduler.webhooks.deliveries import Delivery
from services.scheduler.webhooks.http_post import HttpFailure, HttpResponse, WebhookHttp
from services.scheduler.webhooks.signing import signed_headers

# The link-local address where clouds serve instance metadata (and credentials).
CLOUD_METADATA = "169.254.169.254"

log = structlog.get_logger("asyncinfer.scheduler.webhooks")


def retry_after_s(value: str | None, *, now: float) -> float | None:
    """Retry-After in seconds: delta-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    if value.strip().isdigit():
        return float(value.strip())
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - now, 0.0)


class DeliveryPoster:
    """Makes delivery attempts, counting each by outcome in `attempts` (2XX, 3XX, 4XX, 5XX, 410,
    ERROR, REFUSED)."""

    def __init__(self, settings: WebhooksConfig, attempts: Counter, *, clock: Callable[[], float]) -> None:
        self._settings = settings
        self._allowed = parse_networks(settings.allowed_networks)
        metadata = ipaddress.ip_address(CLOUD_METADATA)
        if any(metadata in network for network in self._allowed):
            # Allowed on purpose perhaps, but worth one line: a tenant's callback URL could then
            # read the cloud's instance metadata (credentials) through this scheduler.
            log.warning(
                "webhooks_may_reach_cloud_metadata",
                allowed_networks=list(settings.allowed_networks),
                hint=f"webhooks.allowed_networks includes {CLOUD_METADATA}; allow narrower networks",
            )
        self._attempts = attempts
        self._clock = clock
        self._http = WebhookHttp()

    async def close(self) -> None:
        await self._http.close()

    async def post(self, delivery: Delivery) -> tuple[int, str, float | None]:
        """(status code, error, Retry-After s); the code is 0 when no answer came, -1 when the
        attempt was refused before any request."""
        secrets = self._settings.secrets_for(delivery.tenant)
        if not secrets:
            self._attempts.labels(outcome="REFUSED").inc()
            return -1, "the tenant has no webhook secret configured any more (webhooks.secrets)", None
        try:
            url = parse_callback_url(delivery.url)
            addresses = await vetted_addresses(url, self._allowed)
        except Unresolved as exc:
            # It resolved when the job was submitted: a resolver that fails or times out now is
            # retried, as a connection that fails is (not the end of the delivery).
            self._attempts.labels(outcome="ERROR").inc()
            return 0, str(exc), None
        except RefusedUrl as exc:
            self._attempts.labels(outcome="REFUSED").inc()
            return -1, f"refused: {exc}", None
        body = delivery.body.encode()
        timestamp = int(self._clock())
        headers = signed_headers(secrets, delivery.webhook_id, timestamp, body)
        errors: list[str] = []
        response: HttpResponse | None = None
        deadline = time.monotonic() + self._settings.request_timeout_s
        for address in addresses:  # vetted addresses in resolver order, until one answers
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                response = await self._http.post(url, address, headers=headers, body=body, timeout_s=remaining)
                break
            except HttpFailure as exc:
                errors.append(f"{address}: {exc}")
        if response is None:
            self._attempts.labels(outcome="ERROR").inc()
            return 0, "; ".join(errors) or "no answer", None
        code = response.status
        self._attempts.labels(outcome="410" if code == 410 else f"{code // 100}XX").inc()
        if 200 <= code < 300:
            return code, "", None
        if 300 <= code < 400:
            where = response.headers.get("location", "")[:200]
            error = f"HTTP {code}: redirects are not followed (Location: {where})"
        else:
            error = f"HTTP {code}"
        return code, error, retry_after_s(response.headers.get("retry-after"), now=self._clock())
