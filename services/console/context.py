"""What every page handler is given, and the few answers they share."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from aiohttp import web

from services.console import html as ui
from services.console.backend import Backend
from services.console.history import QueueHistory


@dataclass(frozen=True, slots=True)
class Context:
    backend: Backend
    history: QueueHistory
    # Sent back with every form: a cross-site page cannot read it, so it cannot post an action.
    csrf: str
    # Replay, purge, pause and resume are offered (asyncinfer.config.ConsoleConfig.read_only).
    writable: bool
    tenant: str
    stats_interval_s: float

    def check_form(self, form: dict[str, str]) -> web.Response | None:
        """None when an action may run; otherwise the page that says why not."""
        if not self.writable:
            body = ui.error_box("this console is read-only: it holds no ops key, or console.read_only is set")
            return web.Response(text=ui.page("Not allowed", body), status=403, content_type="text/html")
        if not hmac.compare_digest(form.get("csrf", ""), self.csrf):
            body = ui.error_box("the form is stale or came from another site: reload the page and try again")
            return web.Response(text=ui.page("Not allowed", body), status=403, content_type="text/html")
        return None


def message_of(request: web.Request) -> str:
    """The outcome of the action that redirected here (shown escaped, as text)."""
    return request.query.get("message", "")[:300]


def fragment_or_page(
    request: web.Request, title: str, body: str, *, status: int = 200, final: bool = False
) -> web.Response:
    """The body alone for the page's refresh script, else the whole page."""
    if request.headers.get("X-Console-Fragment"):
        response = web.Response(text=body, status=status, content_type="text/html")
        if final:
            response.headers["X-Console-Final"] = "1"
        return response
    return web.Response(text=ui.page(title, body, message=message_of(request)), status=status, content_type="text/html")
