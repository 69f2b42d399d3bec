"""The console as a service app (asyncinfer.runner's App): an aiohttp server of server-rendered
pages, the Backend's two gRPC channels, and one background loop sampling the queues.

Who may act: replay, purge, pause, resume, a job's cancel and retry and a batch's cancel are
offered when the console holds an ops key, or when the stack has no API keys at all and the console
binds loopback (`asyncinfer up` without keys, where every local caller may use the OpsService
anyway); never with `console.read_only`."""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Awaitable, Callable, Iterable
from functools import partial

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware
from yarl import URL

from asyncinfer.access import is_loopback
from asyncinfer.api_keys import hash_key
from asyncinfer.config import Config
from asyncinfer.errors import ConfigError
from asyncinfer.supervision import Supervisor
from asyncinfer.tls import read_secret
from services.console import html as ui
from services.console.backend import Backend, ModelQueues
from services.console.context import MESSAGE_KEY, Context
from services.console.history import QueueHistory
from services.console.pages_batches import batch_cancel, batch_file, batch_page, batches_page
from services.console.pages_jobs import job_cancel, job_page, job_retry, jobs_page, models_page
from services.console.pages_ops import (
    dead_letter_action,
    dead_letter_page,
    dead_letters_page,
    queue_action,
    queues_page,
)
from services.console.pages_tls import tls_page

log = structlog.get_logger("asyncinfer.console")
Page = Callable[[Context, web.Request], Awaitable[web.StreamResponse]]
# Inline styles and the one inline script (by its hash); nothing from elsewhere, no framing.
CSP = (
    f"default-src 'none'; script-src '{ui.SCRIPT_HASH}'; style-src 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)


SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


async def _security_headers(_request: web.Request, response: web.StreamResponse) -> None:
    """On every answer as its headers go out (aiohttp's on_response_prepare): a page's, and aiohttp's
    own 404, 405 and 500, which a middleware never sees returned (they are raised past it). A header
    the answer set itself stays (a download's stricter CSP)."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip().removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def known_hosts_only(bound_to_loopback: bool, allowed_hosts: Iterable[str]) -> Middleware:
    """A request must name a host the console is known by. A page a browser fetched from another
    site, its name re-pointed at the console's address (DNS rebinding), names that site, and could
    otherwise read the form token and act with the console's keys. On a loopback bind: loopback
    names only. Beyond it: localhost, IP addresses (a rebinding needs a name) and
    `console.allowed_hosts`. A POST whose Origin names another host is refused too (a form token
    that leaked is not enough)."""
    allowed = {h.strip().lower() for h in allowed_hosts if h.strip()}

    def known(host: str) -> bool:
        if bound_to_loopback:
            return is_loopback(host)
        return is_loopback(host) or is_ip_address(host) or host.lower() in allowed

    @web.middleware
    async def check(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        host = request.url.host or ""
        if not known(host):
            names = (
                "localhost, 127.0.0.1 or [::1]"
                if bound_to_loopback
                else "localhost, an IP address or console.allowed_hosts"
            )
            body = ui.error_box(f"this console answers only to {names}, not {host[:100]!r}")
            return web.Response(text=ui.page("Not allowed", body), status=421, content_type="text/html")
        origin = request.headers.get("Origin")
        if request.method == "POST" and origin not in (None, "null") and URL(origin).host != host:
            body = ui.error_box("the form came from another site")
            return web.Response(text=ui.page("Not allowed", body), status=403, content_type="text/html")
        return await handler(request)

    return check


def renewing_certificates(backend: Backend) -> Middleware:
    """Before each request, the Backend's channels made again if the console's TLS files were
    renewed (Backend.renew_certificates): a renewed client certificate is presented from the next
    page on, without a restart."""

    @web.middleware
    async def renew(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        await backend.renew_certificates()
        return await handler(request)

    return renew


@web.middleware
async def framed_router_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own 404 (no route) and 405 (a method the route does not take) as console pages:
    the bar of links and what was wrong, where they were a bare '404: Not Found', a dead end for an
    operator who mistyped an address or followed an old link. A page's own 404 (no such job) is
    its own answer and passes through."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as refused:
        takes = ", ".join(sorted(refused.allowed_methods))
        body = ui.error_box(f"{request.path[:200]} is not sent with {request.method[:20]}: it takes {takes}")
        return web.Response(
            text=ui.page("Not allowed", body), status=405, headers={"Allow": takes}, content_type="text/html"
        )
    except web.HTTPNotFound:
        body = ui.error_box(f"no page at {request.path[:200]}") + (
            "<p>The console's pages are in the bar above; a job's page is /jobs/&lt;job ID&gt;, "
            "a batch's /batches/&lt;batch ID&gt;.</p>"
        )
        return web.Response(text=ui.page("Not found", body), status=404, content_type="text/html")


async def _health(_request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


# A readiness probe's own timeout is 1 s by default: each service's answer is awaited for less.
READY_CHECK_TIMEOUT_S = 0.8


async def _ready(backend: Backend, _request: web.Request) -> web.Response:
    """Readiness: 200 while the console reaches its gateway and its scheduler (their health
    answers SERVING), 503 naming what it cannot reach. /healthz stays liveness: a console whose
    gateway is away is not helped by a restart."""
    unreachable = await backend.unreachable(READY_CHECK_TIMEOUT_S)
    if unreachable:
        return web.Response(text="not ready: cannot reach " + "; ".join(unreachable) + "\n", status=503)
    return web.Response(text="ready\n")


async def _home(home: str, _request: web.Request) -> web.Response:
    raise web.HTTPFound(home)


class ConsoleApp:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.supervisor = Supervisor("console")
        self.port = 0
        self.writable = False
        self._backend: Backend | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = self.config.console.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{shown}:{self.port}/"

    def _holds_a_key(self) -> bool:
        console = self.config.console
        return bool(console.tenant_key or console.tenant_key_file or console.ops_key or console.ops_key_file)

    def _keyless_stack(self) -> bool:
        """The stack has no API keys: this configuration lists none, and the console holds none (run
        apart, its file may leave the stack's keys out while it holds one of them)."""
        return not self.config.gateway.api_keys and not self._holds_a_key()

    def _tenant(self) -> str:
        """The tenant the console's key reaches, when this configuration lists the keys ('' when
        it cannot tell: the page then says "the jobs the console's key reaches")."""
        gateway, console = self.config.gateway, self.config.console
        if self._keyless_stack():
            return gateway.default_tenant
        if not gateway.api_keys:
            return ""
        key = read_secret(console.tenant_key, console.tenant_key_file, "console.tenant_key")
        digest = hash_key(key) if key else ""
        return next((k.tenant for k in gateway.api_keys if k.sha256 == digest and k.role == "tenant"), "")

    async def start(self) -> None:
        console = self.config.console
        if not is_loopback(console.host) and not (
            console.tenant_key or console.tenant_key_file or console.ops_key or console.ops_key_file
        ):
            # The services refuse to bind beyond loopback without keys (asyncinfer.access); a console
            # holding none reads a stack that has none, and would hand it to whoever reaches it.
            raise ConfigError(
                f"the console would bind {console.host!r}, beyond loopback, without keys: anyone who can reach it "
                "could read every job and dead letter and act on the queues. Give it console.tenant_key / ops_key "
                "(the stack's API keys) or set console.host to 127.0.0.1."
            )
        backend = self._backend = Backend(console)
        try:
            self.writable = not console.read_only and (
                backend.has_ops_key or (self._keyless_stack() and is_loopback(console.host))
            )
            history = QueueHistory(console.history_s)
            ctx = Context(
                backend=backend,
                history=history,
                csrf=secrets.token_urlsafe(24),
                message_key=secrets.token_bytes(16),
                writable=self.writable,
                read_only_because=(
                    "console.read_only is set"
                    if console.read_only
                    else "its actions (replay, purge, pause, resume, cancel, retry) need it to hold an ops key (console.ops_key)"
                ),
                tenant=self._tenant(),
                stats_interval_s=console.stats_interval_s,
                trace_url=console.trace_url,
            )
            app = web.Application(
                middlewares=[
                    known_hosts_only(is_loopback(console.host), console.allowed_hosts),
                    renewing_certificates(backend),
                    framed_router_errors,
                ],
                client_max_size=64 * 1024,
            )
            app.on_response_prepare.append(_security_headers)
            app[MESSAGE_KEY] = ctx.message_key
            pages: list[tuple[str, str, Page]] = [
                ("GET", "/models", models_page),
                ("GET", "/jobs", jobs_page),
                ("GET", "/jobs/{job_id}", job_page),
                ("POST", "/jobs/{job_id}/cancel", job_cancel),
                ("POST", "/jobs/{job_id}/retry", job_retry),
                ("GET", "/batches", batches_page),
                ("GET", "/batches/{batch_id}", batch_page),
                ("POST", "/batches/{batch_id}/cancel", batch_cancel),
                ("GET", "/batches/{batch_id}/files/{file:output|errors|npz}", batch_file),
                ("GET", "/queues", queues_page),
                ("POST", "/queues/{action:pause|resume}", queue_action),
                ("GET", "/dead-letters", dead_letters_page),
                ("GET", "/dead-letters/{sequence}", dead_letter_page),
                ("POST", "/dead-letters/{action:replay|purge}", dead_letter_action),
                ("GET", "/tls", tls_page),
            ]
            for method, path, handler in pages:
                app.router.add_route(method, path, partial(handler, ctx))
            # The queues need the ops role where keys are on: a console holding a tenant key alone
            # opens on that tenant's jobs (it opened on a page that said UNAUTHENTICATED).
            reaches_ops = backend.has_ops_key or self._keyless_stack()
            app.router.add_get("/", partial(_home, "/queues" if reaches_ops else "/jobs"))
            app.router.add_get("/healthz", _health)
            app.router.add_get("/readyz", partial(_ready, backend))
            self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, console.host, console.port)
            await site.start()
            self.port = int(self._runner.addresses[0][1])

            async def sample() -> list[ModelQueues]:
                await backend.renew_certificates()
                return await backend.queues()

            self.supervisor.start("console-sampler", history.sample_forever(sample, console.stats_interval_s))
        except BaseException:
            await self.stop(0)
            raise
        log.info("console_started", url=self.url, writable=self.writable)

    async def stop(self, grace_s: float = 5.0) -> None:
        self.supervisor.begin_stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.supervisor.stop()  # the sampler
        if self._backend is not None:
            await self._backend.close()
            self._backend = None
            log.info("console_stopped")
