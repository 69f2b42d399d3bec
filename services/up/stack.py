"""The whole stack in one process: the embedded nats-server first (stopped last), then the
gateway, the scheduler, a batcher and the console, each in a logging context of its own."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import structlog

from asyncinfer.config import Config
from asyncinfer.embedded_nats import conf_string
from asyncinfer.errors import ConfigError
from asyncinfer.gc_tuning import collect_before_serving, tune_for_serving
from asyncinfer.logs import service_context
from asyncinfer.runner import EXIT_UNAVAILABLE, App, StopSignal, run_until_stopped
from asyncinfer.supervision import Supervisor
from services.apps import SERVICES, import_app_module
from services.dev_ca import RENEWAL_CHECK_INTERVAL_S, DevTlsRenewal, nats_server_tls_conf
from services.up.banner import banner
from services.up.defaults import with_up_defaults
from services.up.ports import check_up_exposure, raise_if_busy, up_ports
from services.up.store_lock import StoreLock, pid_file, unusable_store

SHUTDOWN_GRACE_S = 10.0
# How long the banner waits for the batcher's first work stream to the scheduler (both in this process).
BATCHER_CONNECT_WAIT_S = 10.0

log = structlog.get_logger("asyncinfer.up")


class InContext:
    """A service app whose start and stop run in a logging context of their own (the service's
    name on each line); what they start inherits it."""

    def __init__(self, app: App, context: contextvars.Context) -> None:
        self.app = app
        self.supervisor = app.supervisor
        self.port = 0
        self.metrics_port = 0
        self._context = context

    async def start(self) -> None:
        await asyncio.create_task(self.app.start(), context=self._context)
        self.port = self.app.port
        self.metrics_port = int(getattr(self.app, "metrics_port", 0))

    async def stop(self, grace_s: float = 5.0) -> None:
        await asyncio.create_task(self.app.stop(grace_s), context=self._context)


EMBEDDED_MAX_PAYLOAD = "8MB"
# How long a renewal waits for the nats-server's log to say it reloaded, and how often it looks.
RELOAD_WAIT_S = 10.0
RELOAD_POLL_S = 0.05
RELOADED = "Reloaded server configuration"
RELOAD_FAILED = "Failed to reload server configuration"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _reload_outcome(log_file: Path, offset: int) -> str | None:
    """What the nats-server's log says of a reload since `offset`: "reloaded", "not reloaded:
    <its reason>", or None while it says nothing yet."""
    try:
        with log_file.open("rb") as file:
            file.seek(offset)
            lines = file.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if RELOADED in line:
            return "reloaded"
        if RELOAD_FAILED in line:
            return "not reloaded: " + line.split(RELOAD_FAILED, 1)[1].lstrip(": ")
    return None


class EmbeddedNats:
    """The embedded nats-server as the first app `up` starts, so it is stopped last, after the
    services that use it. If it exits on its own (killed, its store's disk full) `up` stops, with
    EXIT_UNAVAILABLE: the services would only retry a server that is gone."""

    def __init__(self, config: Config, stop: StopSignal, *, dev_tls: DevTlsRenewal | None = None) -> None:
        """`dev_tls`: TLS on the client port with `up --dev-tls`'s certificate, kept renewed while
        it runs (the services read the renewed files themselves; the nats-server is told to)."""
        from asyncinfer.embedded_nats import NatsServerProcess

        embedded = config.embedded_nats
        store = Path(embedded.store_dir)
        # As the cluster's nats.conf (deploy/k8s): room for a work message of a 4-MiB request
        # (gateway.max_request_bytes; its tensors grow by a third as base64). NATS's own default,
        # 1 MB, refused requests of 1-4 MiB the gateway accepts.
        self._conf = store.parent / "nats-server.conf"
        self.server = NatsServerProcess(
            store_dir=store,
            host=embedded.host,
            port=embedded.port,
            monitor_port=embedded.monitor_port,
            log_file=store.parent / "nats-server.log",
            # Its pid file tells the next `up` which server a dead one left (store_lock.py).
            extra_args=("-c", str(self._conf), "-P", str(pid_file(store))),
        )
        self._dev_tls = dev_tls
        self.supervisor = Supervisor("nats")
        self.port = 0
        self._stop_signal = stop
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None
        self._context = service_context("nats")
        self._log = structlog.get_logger("asyncinfer.embedded_nats")

    def _prepare_store(self) -> None:
        try:
            self.server.store_dir.mkdir(parents=True, exist_ok=True)
            # The server's name is in the file as in its flags: a reload (SIGHUP) refuses a file
            # without it ("config reload not supported for ServerName").
            conf = f"max_payload: {EMBEDDED_MAX_PAYLOAD}\nserver_name: {conf_string(self.server.server_name)}\n"
            if self._dev_tls is not None:
                conf += nats_server_tls_conf(self._dev_tls.tls)
            self._conf.write_text(conf)
        except OSError as exc:
            raise unusable_store(self.server.store_dir, exc) from None

    async def start(self) -> None:
        await asyncio.to_thread(self._prepare_store)
        await asyncio.to_thread(self.server.start)
        self.port = self.server.port
        assert self.server.process is not None
        self._context.run(
            self._log.info,
            "nats_server_started",
            url=self.server.url,
            pid=self.server.process.pid,
            store=str(self.server.store_dir),
            log_file=str(self.server.log_file),
        )
        self._watch = asyncio.create_task(self._watch_exit(), name="nats-server-watch", context=self._context)
        if self._dev_tls is not None:
            self._context.run(self.supervisor.start, "dev-tls-renewal", self._keep_dev_tls_renewed())

    async def _keep_dev_tls_renewed(self) -> None:
        """`up --dev-tls`'s certificate made again when it is due (within RENEW_WITHIN_DAYS of its
        end), looked at every hour while `up` runs: one that `up`'s start found 31 days from its
        end was otherwise served until it expired, and warned of from 14 days before."""
        while True:
            await asyncio.sleep(RENEWAL_CHECK_INTERVAL_S)
            await self.renew_dev_tls()

    async def renew_dev_tls(self, now: datetime.datetime | None = None) -> bool:
        """The development certificate renewed if it is due (at `now`, default the clock's), and
        the nats-server told to read it again; whether it was. A failure (a full disk) is logged
        and tried again at the next check: the certificate in use stays."""
        assert self._dev_tls is not None
        try:
            renewed = await asyncio.to_thread(self._dev_tls.renew, now)
            if not renewed:
                return False
            not_after = await asyncio.to_thread(self._dev_tls.not_after)
        except (OSError, ValueError, ConfigError) as exc:
            self._log.warning("dev_tls_renewal_failed", error=str(exc), directory=str(self._dev_tls.tls.directory))
            return False
        reloaded = await self._reload()
        self._log.info(
            "dev_tls_renewed",
            cert_file=str(self._dev_tls.tls.cert_file),
            not_after=not_after.isoformat(timespec="seconds"),
            nats_server=reloaded,
        )
        return True

    async def _reload(self) -> str:
        """Tells the nats-server to read its configuration (its TLS files) again (SIGHUP) and
        waits, within RELOAD_WAIT_S, for its log to say how that went: "reloaded", else what it
        said ("not reloaded: ..."), or "reload not confirmed"."""
        log_file = self.server.log_file
        assert log_file is not None
        offset = await asyncio.to_thread(_size, log_file)
        if not self.server.reload():
            return "not running"
        deadline = asyncio.get_running_loop().time() + RELOAD_WAIT_S
        while asyncio.get_running_loop().time() < deadline:
            said = await asyncio.to_thread(_reload_outcome, log_file, offset)
            if said is not None:
                if said != "reloaded":
                    self._log.warning("nats_server_reload_failed", reason=said, log_file=str(log_file))
                return said
            await asyncio.sleep(RELOAD_POLL_S)
        return "reload not confirmed"

    async def _watch_exit(self) -> None:
        code = await self.server.wait_exited()
        if not self._stopping:
            self._stop_signal.abort(
                f"the embedded nats-server exited (exit code {code}; its log: {self.server.log_file})",
                exit_code=EXIT_UNAVAILABLE,
            )

    def terminate(self) -> None:
        """SIGTERM to the nats-server, not waited for (a forced stop of `up`: it flushes and exits)."""
        self._stopping = True
        if self.server.process is not None and self.server.process.poll() is None:
            self.server.process.terminate()

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        await self.supervisor.stop()  # the renewal check
        await self.server.astop()
        if self._watch is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        self._context.run(self._log.info, "nats_server_stopped")


async def run_up(
    config: Config,
    *,
    tls: bool = False,
    on_stopping: Callable[[], None] | None = None,
    on_serving: Callable[[], None] | None = None,
) -> int:
    """The whole stack in one process, on the embedded nats-server; the exit code. NATS starts
    first and stops last; each service's log lines name it. With `tls`, every server and the
    embedded NATS speak TLS with a local development CA (services/dev_ca.py). `on_stopping` is
    called once as the stop begins (StopSignal's), `on_serving` once everything serves, just
    after the banner (a terminal's info lines show from there: logs.QuietStop)."""
    renewal: DevTlsRenewal | None = None
    ca_file: str | None = None
    if tls:
        from services.dev_ca import bound_hosts, dev_tls_dir, ensure_dev_tls, with_dev_tls

        hosts = bound_hosts(config)
        dev = await asyncio.to_thread(ensure_dev_tls, dev_tls_dir(config), hosts)
        config, renewal, ca_file = with_dev_tls(config, dev), DevTlsRenewal(dev, tuple(hosts)), str(dev.ca_file)
    check_up_exposure(config)
    lock = StoreLock(Path(config.embedded_nats.store_dir))
    try:
        try:
            await asyncio.to_thread(lock.acquire_if_used)
            raise_if_busy(
                up_ports(config), hint="Is another `asyncinfer up` (on another store) or another program using them?"
            )
            await asyncio.to_thread(lock.acquire)
        except OSError as exc:
            raise unusable_store(Path(config.embedded_nats.store_dir), exc) from None
        return await _run_up(config, given_tls=(renewal, ca_file), on_stopping=on_stopping, on_serving=on_serving)
    finally:
        lock.release()


async def _batcher_connected(app: App) -> None:
    """The banner says the stack is ready, so a job submitted then should be computed at once: the
    batcher's first work stream to the scheduler (opened in the background, a few ms here) is waited
    for, up to BATCHER_CONNECT_WAIT_S. Its scheduler_connected line came after the banner, and a job
    submitted on the banner's word waited in the queue until then."""
    from services.batcher.app import BatcherApp  # imported already (import_app_module)

    if isinstance(app, BatcherApp) and not await app.scheduler_connected(BATCHER_CONNECT_WAIT_S):
        log.warning("batcher_not_connected_yet", waited_s=BATCHER_CONNECT_WAIT_S)


async def _run_up(
    config: Config,
    *,
    given_tls: tuple[DevTlsRenewal | None, str | None],
    on_stopping: Callable[[], None] | None,
    on_serving: Callable[[], None] | None = None,
) -> int:
    renewal, ca_file = given_tls
    given = config
    config = with_up_defaults(config)
    # SIGHUP too: the terminal that ran it closed (it died by it, leaving its nats-server running).
    stop = StopSignal(hangup=True, on_force=lambda: nats.terminate(), on_stopping=on_stopping)
    nats = EmbeddedNats(config, stop, dev_tls=renewal)
    state: dict[str, App] = {}

    async def start_nats() -> App:
        await nats.start()
        return nats

    def make(name: str) -> Callable[[], Awaitable[App]]:
        async def start() -> App:
            cfg = config.replace(nats={"url": nats.server.url})
            if name == "batcher" and "scheduler" in state:
                sched = state["scheduler"]
                cfg = cfg.replace(batcher={"scheduler_address": f"{config.scheduler.host}:{sched.port}"})
            if name == "console":  # the stack's own gateway and scheduler, on the ports they bound
                gateway, sched = state["gateway"], state["scheduler"]
                cfg = cfg.replace(
                    console={
                        "gateway_address": f"{config.gateway.host}:{gateway.port}",
                        "scheduler_address": f"{config.scheduler.host}:{sched.port}",
                    }
                )
            await import_app_module(name)
            app = InContext(SERVICES[name](cfg), service_context(name))
            if not state:  # the first service: nothing listens yet (the later ones' garbage is young or frozen)
                collect_before_serving()
            await app.start()
            state[name] = app
            if name == "batcher":
                await _batcher_connected(app.app)
            return app

        return start

    def started(_apps: Sequence[App]) -> None:
        tune_for_serving()
        print(
            banner(config, state, nats.server.url, dev_secret=config.webhooks != given.webhooks, ca_file=ca_file),
            flush=True,
        )
        if on_serving is not None:
            on_serving()

    try:
        return await run_until_stopped(
            [start_nats, make("gateway"), make("scheduler"), make("batcher"), make("console")],
            grace_s=SHUTDOWN_GRACE_S,
            on_started=started,
            stop=stop,
        )
    finally:
        await nats.server.astop()  # stopped already, unless a start failed before NATS was an app
        took = "" if stop.began_at is None else f" in {time.monotonic() - stop.began_at:.1f} s"
        print(f"asyncinfer stopped{took}", flush=True)
