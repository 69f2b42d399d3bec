"""The whole stack in one process: the embedded nats-server first (stopped last), then the
gateway, the scheduler, a batcher and the console, each in a logging context of its own."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import structlog

from asyncinfer.config import Config
from asyncinfer.gc_tuning import collect_before_serving, tune_for_serving
from asyncinfer.logs import service_context
from asyncinfer.runner import EXIT_UNAVAILABLE, App, StopSignal, run_until_stopped
from asyncinfer.supervision import Supervisor
from services.apps import SERVICES, import_app_module
from services.up.banner import banner
from services.up.defaults import with_up_defaults
from services.up.ports import check_up_exposure, raise_if_busy, up_ports
from services.up.store_lock import StoreLock, pid_file, unusable_store

SHUTDOWN_GRACE_S = 10.0


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


class EmbeddedNats:
    """The embedded nats-server as the first app `up` starts, so it is stopped last, after the
    services that use it. If it exits on its own (killed, its store's disk full) `up` stops, with
    EXIT_UNAVAILABLE: the services would only retry a server that is gone."""

    def __init__(self, config: Config, stop: StopSignal, *, extra_args: tuple[str, ...] = ()) -> None:
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
            extra_args=("-c", str(self._conf), "-P", str(pid_file(store)), *extra_args),
        )
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
            self._conf.write_text(f"max_payload: {EMBEDDED_MAX_PAYLOAD}\n")
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
    nats_args: tuple[str, ...] = ()
    ca_file: str | None = None
    if tls:
        from services.dev_ca import bound_hosts, dev_tls_dir, ensure_dev_tls, nats_server_args, with_dev_tls

        dev = await asyncio.to_thread(ensure_dev_tls, dev_tls_dir(config), bound_hosts(config))
        config, nats_args, ca_file = with_dev_tls(config, dev), nats_server_args(dev), str(dev.ca_file)
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
        return await _run_up(config, given_tls=(nats_args, ca_file), on_stopping=on_stopping, on_serving=on_serving)
    finally:
        lock.release()


async def _run_up(
    config: Config,
    *,
    given_tls: tuple[tuple[str, ...], str | None],
    on_stopping: Callable[[], None] | None,
    on_serving: Callable[[], None] | None = None,
) -> int:
    nats_args, ca_file = given_tls
    given = config
    config = with_up_defaults(config)
    # SIGHUP too: the terminal that ran it closed (it died by it, leaving its nats-server running).
    stop = StopSignal(hangup=True, on_force=lambda: nats.terminate(), on_stopping=on_stopping)
    nats = EmbeddedNats(config, stop, extra_args=nats_args)
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
