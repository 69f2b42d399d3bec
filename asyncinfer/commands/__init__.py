"""The client commands of `asyncinfer`, for people and scripts: submit, get, watch, cancel, list,
bulk (JobService on the gateway), batch (BatchService on the gateway) and dlq, stats (OpsService on the scheduler).

Each module registers its subcommands on the `asyncinfer` parser and gives each a coroutine
handler `(args, options) -> exit code`; `run` runs the handler and turns errors into the exit codes
documented in `asyncinfer.commands.output`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys

from asyncinfer.client import AsyncInferClientError
from asyncinfer.commands import batches, bulk, jobs, ops
from asyncinfer.commands.hints import connection_hint, reused_key_hint
from asyncinfer.commands.inputs import header_argument, text_argument
from asyncinfer.commands.options import DEFAULT_CALL_TIMEOUT_S, DEFAULT_GATEWAY, DEFAULT_SCHEDULER, Handler, Options
from asyncinfer.commands.output import (
    EXIT_INTERRUPTED,
    EXIT_OTHER,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    UsageError,
    report_error,
)

EXIT_CODES_HELP = (
    "exit codes: 0 ok, 1 a job ended other than SUCCEEDED, 2 usage error, 3 not found, 4 invalid argument, "
    "5 unavailable / deadline exceeded / resource exhausted, 6 other error, 7 unauthenticated / permission "
    "denied, 130 interrupted, 141 the output's reader went away (| head)"
)


def _timeout_seconds(text: str) -> float:
    """--timeout: a finite number of seconds, 0 or more (the SDK refuses a negative one; 0 exceeds
    at once, sending nothing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"give 0 or more seconds, not {text!r}")
    return value


def add_client_options(parser: argparse.ArgumentParser, *, top_level: bool = False) -> None:
    """--gateway, --scheduler, --api-key, --ops-key, --tls-*, --timeout, --json and --config. They are accepted both
    before the command (`asyncinfer --json get ID`) and after it (`asyncinfer get ID --json`): on
    subcommands they default to SUPPRESS so that they do not overwrite what was given before."""
    default = None if top_level else argparse.SUPPRESS
    if not top_level:
        parser.epilog = EXIT_CODES_HELP
    group = parser.add_argument_group("client options (every command but the servers')")
    group.add_argument(
        "--gateway",
        metavar="ADDR",
        type=text_argument,
        default=default,
        help=f"the gateway's JobService (env ASYNCINFER_GATEWAY_ADDRESS; default {DEFAULT_GATEWAY})",
    )
    group.add_argument(
        "--scheduler",
        metavar="ADDR",
        type=text_argument,
        default=default,
        help=f"the scheduler's OpsService, for dlq, queue and stats (env ASYNCINFER_SCHEDULER_ADDRESS; "
        f"default {DEFAULT_SCHEDULER})",
    )
    group.add_argument(
        "--api-key",
        metavar="KEY",
        type=header_argument,
        default=default,
        help="API key of role tenant, sent to the gateway only (env ASYNCINFER_API_KEY)",
    )
    group.add_argument(
        "--ops-key",
        metavar="KEY",
        type=header_argument,
        default=default,
        help="API key of role ops, sent to the scheduler by dlq, queue and stats (env ASYNCINFER_OPS_KEY). "
        "They never send --api-key instead: the scheduler takes no tenant key, and a tenant's key is not "
        "handed to a service that only refuses it",
    )
    group.add_argument(
        "--tls-ca",
        metavar="FILE",
        default=default,
        help="TLS: PEM CA bundle that verifies the gateway and the scheduler (env ASYNCINFER_TLS_CA_FILE)",
    )
    group.add_argument(
        "--tls-cert",
        metavar="FILE",
        default=default,
        help="TLS: PEM client certificate, for mutual TLS (env ASYNCINFER_TLS_CERT_FILE; with --tls-key)",
    )
    group.add_argument(
        "--tls-key", metavar="FILE", default=default, help="TLS: its private key (env ASYNCINFER_TLS_KEY_FILE)"
    )
    group.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_timeout_seconds,
        default=default,
        help=f"seconds each call may take (default {DEFAULT_CALL_TIMEOUT_S:g}), and a wait (--wait, watch): "
        "unbounded unless given",
    )
    group.add_argument(
        "--json",
        action="store_true",
        default=False if top_level else argparse.SUPPRESS,
        help="machine-readable output: one JSON object, or JSON lines for streams",
    )


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the client commands to `asyncinfer`'s subcommands."""
    for module in (jobs, bulk, batches, ops):
        module.register(commands, add_client_options)


def is_client_command(args: argparse.Namespace) -> bool:
    return callable(getattr(args, "handler", None))


def run(args: argparse.Namespace) -> int:
    """Runs a client command's handler; its exit code."""
    options = Options.from_args(args)
    try:
        handler: Handler = args.handler
        return asyncio.run(handler(args, options))
    except UsageError as exc:
        print(f"asyncinfer: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except AsyncInferClientError as exc:
        code = report_error(exc)
        if (hint := connection_hint(exc, options) or reused_key_hint(exc)) is not None:
            print(f"asyncinfer:   hint: {hint}", file=sys.stderr)
        return code
    except BrokenPipeError:  # `asyncinfer batch download ID | head`: exit_quietly_on_broken_pipe's
        raise
    except TimeoutError:  # a wait bounded by --timeout (asyncio's; an OSError too, so first)
        print("asyncinfer: timed out (--timeout)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except OSError as exc:  # a file it reads or writes (--out on a full disk, a folder not there)
        print(f"asyncinfer: {exc}", file=sys.stderr)
        return EXIT_OTHER
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
