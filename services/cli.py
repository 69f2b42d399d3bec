"""The `asyncinfer` command.

    asyncinfer up [--config FILE] [--dev-tls] everything on one machine: embedded nats-server, gateway,
                                           scheduler, a batcher with the configured models, the console
                                           (--dev-tls: all on TLS, a local development CA)
    asyncinfer config                      the complete commented configuration, every key with its default
    asyncinfer hash-key KEY|-              the SHA-256 to put in gateway.api_keys for an API key (- : stdin)
    asyncinfer webhook-secret [--tenant T] a fresh whsec_ webhook signing secret and its configuration line
    asyncinfer completion bash|zsh|fish    a tab-completion script for the shell
    asyncinfer gateway|scheduler|batcher [--config FILE]
                                           one service in this process (gateway and scheduler against an external NATS, a batcher against its scheduler)
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
import faulthandler
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncinfer.grpc_logging  # noqa: F401  (before grpc is imported: see the module)
from asyncinfer import cli as client_cli
from asyncinfer import commands as client_commands
from asyncinfer.commands.output import EXIT_INTERRUPTED
from asyncinfer.errors import AsyncInferError, Unavailable
from services.apps import SERVICES
from services.server_extras import missing_for

# What only the server commands use is imported when one runs: the configuration's classes
# (pydantic) and structlog (which brings rich and pygments) were half of a client command's start.
if TYPE_CHECKING:
    from asyncinfer.config import Config
    from asyncinfer.runner import App


def _starter(name: str, make: Callable[[], App]) -> Callable[[], Awaitable[App]]:
    async def start() -> App:
        from asyncinfer.gc_tuning import collect_before_serving
        from services.apps import import_app_module

        await import_app_module(name)
        app = make()
        collect_before_serving()  # nothing served yet: the whole heap's walk stalls no call
        await app.start()
        return app

    return start


async def run_service(name: str, config: Config, config_path: Path | None = None) -> int:
    from asyncinfer.gc_tuning import tune_for_serving
    from asyncinfer.runner import run_until_stopped
    from services.apps import make_batcher
    from services.up.ports import raise_if_busy, service_host, service_ports
    from services.up.stack import SHUTDOWN_GRACE_S

    raise_if_busy(service_ports(config, name), hint="Is this service running already?")

    def make() -> App:
        return make_batcher(config, config_path) if name == "batcher" else SERVICES[name](config)

    def started(apps: Sequence[App]) -> None:
        tune_for_serving()
        print(f"asyncinfer {name} serving on {service_host(config, name)}:{apps[0].port}", flush=True)

    # A batcher alone is given its own grace (in-flight batches may outlast the other services' 10 s).
    grace_s = config.batcher.shutdown_grace_s if name == "batcher" else SHUTDOWN_GRACE_S
    return await run_until_stopped([_starter(name, make)], grace_s=grace_s, on_started=started)


def _run(main: Coroutine[Any, Any, int]) -> int:
    """asyncio.run on uvloop: per-call gRPC aio work is most of a service's CPU, and uvloop's loop
    takes 10-15% off it (measured on the batcher benchmark). malloc keeps large buffers for reuse
    (asyncinfer.malloc_tuning: page faults were a third of the scheduler's CPU on a file batch)."""
    import uvloop  # the server extra's: the base install runs the client commands without it

    from asyncinfer.malloc_tuning import keep_large_buffers

    keep_large_buffers()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(main)
    return exit_past_stuck_threads(code)


# How long a stopped service waits for its other threads to end before it exits without them.
THREADS_END_WAIT_S = 2.0


def exit_past_stuck_threads(code: int) -> int:
    """`code`, once the process's other threads have ended; if one has not within THREADS_END_WAIT_S,
    the process exits at once with `code`. A model call that never returns (a hung model) keeps its
    compute thread, which the batcher's stop abandons, but Python's exit joins every executor's
    threads: a batcher stopped by SIGTERM, or `up` by Ctrl-C, logged that it had stopped and then
    never exited."""
    deadline = time.monotonic() + THREADS_END_WAIT_S
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [
        t.name for t in threading.enumerate() if t.is_alive() and t is not threading.main_thread() and not t.daemon
    ]
    if not stuck:
        return code
    import structlog

    structlog.get_logger("asyncinfer.cli").warning(
        "exiting_without_threads", threads=stuck, why="a model call that never returned (its batch was abandoned)"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Each server command's --help: what it runs and what it needs, then one example.
DESCRIPTIONS = {
    "up": (
        "Runs everything on this machine until Ctrl-C: an embedded nats-server (its JetStream store in "
        ".asyncinfer/nats), the gateway (127.0.0.1:50051), the scheduler (:50052), a batcher serving the "
        "configured models (without [[models]]: minilm-l6, minilm-l6-doc, minilm-l6-doc-pipeline and the samples demo and flaky) and the "
        "web console (http://127.0.0.1:8070), and prints a banner with their addresses. It needs the server extra "
        "(pip install 'asyncinfer[all]') and its ports free (a taken one is refused, naming the variable that "
        "moves it); without API keys it generates the default tenant's webhook secret (.asyncinfer/webhook-secret).",
        "asyncinfer up --config asyncinfer.toml",
    ),
    "gateway": (
        "Runs the gateway alone: the public JobService and BatchService (gRPC on gateway.port, 50051), which "
        "admit jobs into NATS JetStream and answer reads and watches from it. It needs a NATS server with "
        "JetStream at nats.url (nats://127.0.0.1:4222) and the same configuration as the scheduler (models, API "
        "keys).",
        "ASYNCINFER_NATS__URL=nats://nats:4222 asyncinfer gateway --config asyncinfer.toml",
    ),
    "scheduler": (
        "Runs the scheduler alone: it dispatches queued jobs from NATS JetStream to the batchers that connect to "
        "it (WorkerService on scheduler.port, 50052, which serves the OpsService too: queues, dead letters), "
        "records their results and sends the webhooks. It needs a NATS server with JetStream at nats.url "
        "(nats://127.0.0.1:4222) and the same configuration as the gateway.",
        "ASYNCINFER_NATS__URL=nats://nats:4222 asyncinfer scheduler --config asyncinfer.toml",
    ),
    "batcher": (
        "Runs a batcher alone: it loads the configuration's [[models]], takes their jobs from its scheduler "
        "(batcher.scheduler_address, 127.0.0.1:50052), runs them in dynamic batches and serves KServe v2 "
        "inference on batcher.port (50053). It needs the scheduler reachable and what its models need (torch "
        "for PyTorch models, a Triton server for a triton backend); NATS (nats.url) only with "
        "batcher.claim_check_io.",
        "ASYNCINFER_BATCHER__SCHEDULER_ADDRESS=scheduler:50052 asyncinfer batcher --config asyncinfer.toml",
    ),
    "console": (
        "Runs the web console alone (HTTP on console.port, 8070): models, a tenant's jobs and batches, queues and "
        "dead letters, read from a gateway (console.gateway_address, 127.0.0.1:50051) and a scheduler "
        "(console.scheduler_address, 127.0.0.1:50052). It needs both reachable and, where they require API "
        "keys, console.tenant_key_file and console.ops_key_file.",
        "asyncinfer console --config asyncinfer.toml   # then open http://127.0.0.1:8070",
    ),
}


def described(name: str) -> dict[str, Any]:
    """add_parser's arguments for a server command's --help: its paragraph wrapped, its example
    on a line of its own (argparse's own wrapping split the command across lines)."""
    paragraph, example = DESCRIPTIONS[name]
    return {
        "description": textwrap.fill(paragraph, 79) + f"\n\nexample:\n  {example}",
        "epilog": CONFIG_FROM_ENVIRONMENT,
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }


# A server command's help named no variable: that every key has one was in docs/CONFIGURATION.md alone.
CONFIG_FROM_ENVIRONMENT = textwrap.fill(
    "environment: every configuration key is also ASYNCINFER_<SECTION>__<KEY> (ASYNCINFER_GATEWAY__PORT=50061), "
    "or a file <section>__<key> in the folder $ASYNCINFER_SECRETS_DIR names; the environment's value wins over "
    "the secrets folder's, which wins over the file's. `asyncinfer config` lists every key.",
    79,
)


def build_parser() -> argparse.ArgumentParser:
    parser, commands = client_cli.new_parser()
    up = commands.add_parser("up", help="run everything on this machine (embedded nats-server)", **described("up"))
    up.add_argument("--config", type=Path, help="configuration file (TOML); see `asyncinfer config`")
    up.add_argument(
        "--dev-tls",
        action="store_true",
        help="every server and NATS on TLS, with a local development CA kept beside the store (clients: --tls-ca)",
    )
    client_cli.add_tool_commands(commands)
    for name in SERVICES:
        against = {"console": "the gateway and the scheduler", "batcher": "its scheduler"}.get(name, "an external NATS")
        sub = commands.add_parser(name, help=f"run the {name} alone against {against}", **described(name))
        sub.add_argument("--config", type=Path, help="configuration file (TOML)")
    client_commands.register(commands)
    return parser


@contextlib.contextmanager
def _ctrl_c_ends_while_loading() -> Iterator[None]:
    """While a server command imports its modules, a Ctrl-C ends the process with 130, as while
    services.entry imports this module (which imported them until session 39): pydantic wraps a
    KeyboardInterrupt raised as it builds the configuration's classes in a RuntimeError."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) != (
        signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, lambda _signum, _frame: os._exit(EXIT_INTERRUPTED))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
    # A model that crashes the process (a segfault in a native extension) leaves every thread's
    # stack on stderr, naming the model's frame; it left nothing.
    faulthandler.enable()
    with _ctrl_c_ends_while_loading():
        import structlog

        from asyncinfer.config import load_config
        from asyncinfer.logs import QuietStop, configure_logging
        from asyncinfer.runner import EXIT_UNAVAILABLE
        from services.up.stack import run_up

    logging = False
    try:
        config = load_config(args.config)
        # `up` on a terminal: its banner is the first thing shown, not ~16 info lines of each
        # service's start above it, and Ctrl-C shows `stopping` and `asyncinfer stopped`, not each
        # service's stop. Warnings and errors show throughout; JSON lines and logging.level debug keep all.
        quiet_stop = QuietStop(until_serving=True)
        configure_logging(
            config.logging,
            service="up" if args.command == "up" else args.command,
            quiet_stop=quiet_stop if args.command == "up" else None,
        )
        logging = True
        if args.command == "up":
            if quiet_stop.applied:  # a line to show it started: loading the models may take a while
                print(
                    "asyncinfer is starting: NATS, the gateway, the scheduler, a batcher and the console ...",
                    flush=True,
                )
            return _run(run_up(config, tls=args.dev_tls, on_stopping=quiet_stop.begin, on_serving=quiet_stop.serving))
        return _run(run_service(args.command, config, args.config))
    except AsyncInferError as exc:
        unavailable = isinstance(exc, Unavailable)
        if logging and unavailable:
            # After the service's own start lines, the cause as an event too, for a log pipeline
            # that reads only the JSON lines (a configuration mistake stays one line).
            structlog.get_logger("asyncinfer.cli").error("start_failed", reason=exc.reason, error=exc.message)
        print(f"asyncinfer: {exc.message}", file=sys.stderr)
        # NATS (or another service) not there yet is not a configuration mistake: an orchestrator
        # restarts on 69 (sysexits' EX_UNAVAILABLE, as `up` exits when its nats-server goes away).
        return EXIT_UNAVAILABLE if unavailable else 2
    except KeyboardInterrupt:  # a signal before the handlers were installed
        return 130


if __name__ == "__main__":
    sys.exit(main())
