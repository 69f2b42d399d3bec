"""The TLS page: how many days are left on the certificates the gateway and the scheduler serve
(services/console/served_certificates.py), flagged under the shipped alert's 14 days."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from aiohttp import web

from services.console import html as ui
from services.console.context import Context
from services.console.served_certificates import ServedCertificate

DAY_S = 86400.0
# The shipped alert's threshold (deploy/k8s's AsyncinferTlsCertificateExpiresSoon).
SOON_DAYS = 14.0


def days_left(not_after: float, now: float) -> str:
    """'41.5 days left', 'expires within 14 days: 3.2 days left', or 'expired 2.0 days ago'."""
    days = (not_after - now) / DAY_S
    if days < 0:
        return f"expired {-days:.1f} days ago"
    said = f"{days:.1f} days left"
    return f"expires within {SOON_DAYS:g} days: {said}" if days < SOON_DAYS else said


def _row(served: ServedCertificate, now: float) -> list[str]:
    if served.not_after is None:
        return [ui.h(served.name), ui.h(served.address), "-", ui.h(served.problem)]
    expires = datetime.fromtimestamp(served.not_after, UTC)
    return [ui.h(served.name), ui.h(served.address), ui.when(expires), ui.h(days_left(served.not_after, now))]


async def tls_page(ctx: Context, request: web.Request) -> web.Response:
    served = await ctx.backend.served_certificates()
    now = time.time()
    body = ui.table(
        ("service", "address", "certificate expires", "days left"),
        (_row(s, now) for s in served),
        id_="served-certificates",
        empty="the console reaches the gateway and the scheduler in plaintext (no console.tls_ca_file)",
    )
    return web.Response(text=ui.page("TLS", body), content_type="text/html")
