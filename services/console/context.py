"""What every page handler is given, and the few answers they share."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import grpc
from aiohttp import web

from asyncinfer.client import AsyncInferClientError
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
    # Why it is read-only, when it is (said where a button would be).
    read_only_because: str = ""
    # Signs the outcome an action redirects with (`outcome`), so that a link cannot make a page
    # show a notice of its own in the console's voice.
    message_key: bytes = b""
    # console.trace_url: where a trace ID links ("" shows it as text).
    trace_url: str = ""

    def outcome(self, path: str, said: str, **query: str) -> str:
        """The URL an action redirects to, its outcome `said` in the query, signed."""
        return ui.url(path, **query, message=said, sig=_signature(self.message_key, said))

    def check_form(self, form: dict[str, str]) -> web.Response | None:
        """None when an action may run; otherwise the page that says why not."""
        if not self.writable:
            body = ui.error_box(f"this console is read-only: {self.read_only_because}")
            return web.Response(text=ui.page("Not allowed", body), status=403, content_type="text/html")
        # As bytes: compare_digest refuses str with non-ASCII characters (a 500 for a hand-made form).
        if not hmac.compare_digest(form.get("csrf", "").encode(), self.csrf.encode()):
            body = ui.error_box("the form is stale or came from another site: reload the page and try again")
            return web.Response(text=ui.page("Not allowed", body), status=403, content_type="text/html")
        return None


# What a refused call says to the browser: the caller's mistake is theirs (4xx), only trouble
# reaching a service is a bad gateway (502), or a gateway timeout (504) when it did not answer in time.
_STATUS_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def status_of(error: AsyncInferClientError) -> int:
    """The HTTP status of a page that shows `error`."""
    return _STATUS_BY_CODE.get(error.code, 502)


def count_param(text: str, *, default: int, most: int) -> int | None:
    """A count from a query or form field: ASCII digits (str.isdigit takes '²', which int() refuses)
    up to `most`; `default` when empty; None when it is not one."""
    if not text:
        return default
    if not (text.isascii() and text.isdigit()) or len(text) > 18 or int(text) > most:
        return None
    return int(text)


MESSAGE_KEY = web.AppKey("message_key", bytes)


def _signature(key: bytes, message: str) -> str:
    return hmac.new(key, message.encode(), "sha256").hexdigest()[:32]


def message_of(request: web.Request) -> str:
    """The outcome of the action that redirected here (shown escaped, as text), when this console
    signed it: `?message=` alone showed any text in the notice box (a link could say "re-enter your
    ops key at ...")."""
    message, signature = request.query.get("message", ""), request.query.get("sig", "")
    key = request.app.get(MESSAGE_KEY)
    if not message or key is None or not hmac.compare_digest(signature.encode(), _signature(key, message).encode()):
        return ""
    return message[:300]


def fragment_or_page(
    request: web.Request, title: str, body: str, *, status: int = 200, final: bool = False
) -> web.Response:
    """The body alone for the page's refresh script, else the whole page."""
    if request.headers.get("X-Console-Fragment"):
        return _fragment(body, status=status, final=final)
    return web.Response(text=ui.page(title, body, message=message_of(request)), status=status, content_type="text/html")


def live_page(
    request: web.Request,
    title: str,
    body: str,
    *,
    element_id: str,
    refresh: str | None,
    every_ms: int = 1000,
    final: bool = False,
    above: str = "",
) -> web.Response:
    """A page whose element `element_id` holds `body`, refreshed by the page's script
    (services.console.html) from the URL `refresh` every `every_ms` milliseconds; None: it stays
    put. To the script's request, `body` alone, saying `final` (nothing on it changes any more)
    with X-Console-Final. `above`: what the whole page shows above the element."""
    if request.headers.get("X-Console-Fragment"):
        return _fragment(body, status=200, final=final)
    live = "" if refresh is None else f' data-refresh="{ui.h(refresh)}" data-every="{every_ms}"'
    return web.Response(
        text=ui.page(title, f'{above}<div id="{element_id}"{live}>{body}</div>', message=message_of(request)),
        content_type="text/html",
    )


def _fragment(body: str, *, status: int, final: bool) -> web.Response:
    response = web.Response(text=body, status=status, content_type="text/html")
    if final:
        response.headers["X-Console-Final"] = "1"
    return response
