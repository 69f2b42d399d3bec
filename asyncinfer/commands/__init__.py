"""The client commands of `asyncinfer`, for people and scripts: submit, get, watch, cancel, list,
bulk (JobService on the gateway) and dlq, stats (OpsService on the scheduler).

Each module registers its subcommands on the `asyncinfer` parser and gives each a coroutine
handler `(args, options) -> exit code`; `run` runs the handler and turns errors into the exit codes
documented in `asyncinfer.commands.output`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncinfer.client import AsyncClient, AsyncInferClientError
from asyncinfer.commands.output import EXIT_INTERRUPTED, EXIT_USAGE, UsageError, report_error

DEFAULT_GATEWAY = "127.0.0.1:50051"
DEFAULT_SCHEDULER = "127.0.0.1:50052"
DEFAULT_CALL_TIMEOUT_S = 30.0
EXIT_CODES_HELP = (
    "exit codes: 0 ok, 1 a job ended other than SUCCEEDED, 2 usage error, 3 not found, 4 invalid argument, "
    "5 unavailable / deadline exceeded / resource exhausted, 6 other error, 7 unauthenticated / permission "
    "denied, 130 interrupted"
)


@dataclass(frozen=True, slots=True)
class Options:
    """The options every client command shares."""

    gateway: str
    scheduler: str
    api_key: str | None
    timeout_s: float | None  # None: unary calls take DEFAULT_CALL_TIMEOUT_S, waits are unbounded
    json: bool
    config: Path | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        return cls(
            gateway=getattr(args, "gateway", None) or os.environ.get("ASYNCINFER_GATEWAY_ADDRESS") or DEFAULT_GATEWAY,
            scheduler=getattr(args, "scheduler", None)
            or os.environ.get("ASYNCINFER_SCHEDULER_ADDRESS")
            or DEFAULT_SCHEDULER,
            api_key=getattr(args, "api_key", None) or os.environ.get("ASYNCINFER_API_KEY") or None,
            timeout_s=getattr(args, "timeout", None),
            json=bool(getattr(args, "json", False)),
            config=getattr(args, "config", None),
        )

    @property
    def call_timeout_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else DEFAULT_CALL_TIMEOUT_S

    def client(self) -> AsyncClient:
        """A client of the gateway; make it inside the running event loop, and close it."""
        return AsyncClient(self.gateway, api_key=self.api_key, timeout_s=self.call_timeout_s)


Handler = Callable[[argparse.Namespace, Options], Coroutine[Any, Any, int]]


def add_client_options(parser: argparse.ArgumentParser, *, top_level: bool = False) -> None:
    """--gateway, --scheduler, --api-key, --timeout, --json and --config. They are accepted both
    before the command (`asyncinfer --json get ID`) and after it (`asyncinfer get ID --json`): on
    subcommands they default to SUPPRESS so that they do not overwrite what was given before."""
    default = None if top_level else argparse.SUPPRESS
    if not top_level:
        parser.epilog = EXIT_CODES_HELP
    group = parser.add_argument_group("client options (submit, get, watch, cancel, list, bulk, dlq, stats)")
    group.add_argument(
        "--gateway",
        metavar="ADDR",
        default=default,
        help=f"the gateway's JobService (env ASYNCINFER_GATEWAY_ADDRESS; default {DEFAULT_GATEWAY})",
    )
    group.add_argument(
        "--scheduler",
        metavar="ADDR",
        default=default,
        help=f"the scheduler's OpsService, for dlq and stats (env ASYNCINFER_SCHEDULER_ADDRESS; "
        f"default {DEFAULT_SCHEDULER})",
    )
    group.add_argument("--api-key", metavar="KEY", default=default, help="API key (env ASYNCINFER_API_KEY)")
    group.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=default,
        help=f"deadline of each call (default {DEFAULT_CALL_TIMEOUT_S:g}); also bounds waits (default: none)",
    )
    group.add_argument(
        "--json",
        action="store_true",
        default=False if top_level else argparse.SUPPRESS,
        help="machine-readable output: one JSON object, or JSON lines for streams",
    )


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the client commands to `asyncinfer`'s subcommands."""
    from asyncinfer.commands import bulk, jobs, ops

    for module in (jobs, bulk, ops):
        module.register(commands, add_client_options)


def is_client_command(args: argparse.Namespace) -> bool:
    return callable(getattr(args, "handler", None))


def run(args: argparse.Namespace) -> int:
    """Runs a client command's handler; its exit code."""
    try:
        options = Options.from_args(args)
        handler: Handler = args.handler
        return asyncio.run(handler(args, options))
    except UsageError as exc:
        print(f"asyncinfer: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except AsyncInferClientError as exc:
        return report_error(exc)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
