"""The client side of the `asyncinfer` command: the commands that need no service code.

    asyncinfer config                      the complete commented configuration, every key with its default
    asyncinfer hash-key KEY|-              the SHA-256 to put in gateway.api_keys for an API key (- : stdin)
    asyncinfer webhook-secret [--tenant T] a fresh whsec_ webhook signing secret and its configuration line
    asyncinfer nats-users DIR [--batcher]  one NKey seed per service in DIR, and the nats-server users block
    asyncinfer completion bash|zsh|fish    a tab-completion script for the shell (asyncinfer.completion)
    asyncinfer submit|get|watch|cancel|list|bulk|dlq|stats ...
                                           the client commands (asyncinfer.commands; exit codes in
                                           asyncinfer/commands/output.py)

`python -m asyncinfer` runs this. The installed `asyncinfer` command is services.cli, which adds the
commands that start servers (up, gateway, scheduler, batcher) to this parser: shared code never
imports the services.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from asyncinfer import commands as client_commands
from asyncinfer import completion
from asyncinfer.api_keys import hash_key
from asyncinfer.commands.output import EXIT_INTERRUPTED
from asyncinfer.webhook_secrets import new_secret

PROG = "asyncinfer"
DESCRIPTION = (
    "Asynchronous ML inference: `asyncinfer up` runs the whole stack on this machine; the other commands are "
    "its client (submit, watch, bulk, batch ...), its operator's tools (dlq, queue, stats) and its services "
    "run apart. `asyncinfer COMMAND --help` says more of each."
)
CLIENT_ONLY_EPILOG = (
    "This is the client CLI (`python -m asyncinfer`): the commands that start servers (up, gateway, scheduler, "
    "batcher) are in the installed `asyncinfer` command."
)

SubParsers = argparse._SubParsersAction  # argparse has no public name for it


class SuggestingParser(argparse.ArgumentParser):
    """argparse's parser, whose errors suggest the command or option meant (Python 3.11's has no
    suggest_on_error): `asyncinfer submitt` and `--priorty` were refused with no hint. Its
    subcommands' parsers are of this class too (add_subparsers makes them of their parent's)."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """argparse's, but words it does not know are refused by the command given, which suggests
        its own options: the top-level parser refused them, suggesting from every command's
        (`asyncinfer submit demo --bogus`: "did you mean '--out'?", an option of bulk's)."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            _chosen_parser(self, parsed).error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed

    def error(self, message: str) -> NoReturn:
        commands = _missing_command(self, message)
        if commands:
            # `asyncinfer`, `asyncinfer batch`, `asyncinfer dlq` alone: the usage block, then
            # "required: COMMAND" (or argparse's own names, `dlq_action`), naming no command.
            self.exit(
                2,
                f"{self.prog}: error: give a command: {', '.join(commands)} (`{self.prog} --help` says what each does)\n",
            )
        if usage := _missing_positionals(self, message):
            # `asyncinfer watch` with no job ID: argparse's usage block (six lines of the client
            # options) before the one line that says what is missing.
            self.exit(2, f"{self.prog}: error: give {usage} (`{self.prog} --help` says more)\n")
        suggestion = _suggestion(self, message)
        if suggestion or "invalid choice: " in message:
            # One line: a typo's answer is the command or option meant (or, for a command, the list
            # of them). argparse's usage block before it (five lines for `asyncinfer sumbit`) was
            # what a newcomer read first, and the top-level usage names no subcommand's options.
            if suggestion:
                message = re.sub(r" \(choose from .*\)$", "", message)  # the 21 commands: --help lists them
            self.exit(2, f"{self.prog}: error: {message}{suggestion}\n")
        # The rest in one line too (a value of the wrong type, `--queue-ttl abc`; a required option
        # left out, `batch create f.jsonl` without --model; an unknown option nothing is close to):
        # argparse printed its usage block first, 7 to 14 lines of options above the one that says
        # what is wrong.
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` says more)\n")


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    if (choice := re.search(r"invalid choice: '([^']*)'", message)) is not None:
        names = [str(c) for a in parser._actions if a.choices for c in a.choices]  # argparse keeps them there
        # In any case: a choice taken in any case (--priority hihg) is echoed as given (any_case_of).
        by_folded = {name.casefold(): name for name in names}
        close = [by_folded[c] for c in difflib.get_close_matches(choice.group(1).casefold(), list(by_folded), n=1)]
    elif (unknown := re.search(r"unrecognized arguments: (.*)", message)) is not None:
        options = {o for p in _parsers(parser) for a in p._actions for o in a.option_strings}
        words = [w.split("=")[0] for w in unknown.group(1).split() if w.startswith("-")]
        close = [m for w in words for m in difflib.get_close_matches(w, sorted(options), n=1)]
    else:
        return ""
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _chosen_parser(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the innermost command `parsed` names (`batch create`'s for `asyncinfer batch
    create ...`); `parser` itself when it has no command."""
    for action in parser._actions:
        if isinstance(action, SubParsers):
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            if chosen is not None:
                return _chosen_parser(chosen, parsed)
    return parser


def _missing_command(parser: argparse.ArgumentParser, message: str) -> list[str]:
    """The commands of the parser's subcommand argument, when the message says it alone is missing."""
    missing = re.fullmatch(r"the following arguments are required: (\S+)", message)
    if missing is None:
        return []
    for action in parser._actions:
        if isinstance(action, SubParsers) and missing.group(1) in (action.metavar, action.dest):
            return list(action.choices)
    return []


def _missing_positionals(parser: argparse.ArgumentParser, message: str) -> str:
    """What to give, `NAMES: PROG [options] POSITIONALS`, when the message says positional
    arguments alone are missing; "" otherwise (a required option, a subcommand: argparse's or
    _missing_command's)."""
    missing = re.fullmatch(r"the following arguments are required: (.+)", message)
    if missing is None:
        return ""
    positionals = [a for a in parser._actions if not a.option_strings and not isinstance(a, SubParsers)]
    names = {str(a.metavar or a.dest): a for a in positionals}
    wanted = missing.group(1).split(", ")
    if not wanted or any(name not in names for name in wanted):
        return ""
    shapes = {"+": "{0} [{0} ...]", "*": "[{0} ...]", "?": "[{0}]"}
    shown = {
        name: "{" + ",".join(map(str, a.choices)) + "}" if a.choices and not a.metavar else name
        for name, a in names.items()
    }
    words = [shapes.get(str(a.nargs), "{0}").format(shown[name]) for name, a in names.items()]
    return f"{', '.join(wanted)}: {parser.prog} [options] {' '.join(words)}"


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and every subcommand's, at any depth."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, SubParsers):
            for sub in dict.fromkeys(action.choices.values()):
                found += _parsers(sub)
    return found


def new_parser() -> tuple[argparse.ArgumentParser, SubParsers[argparse.ArgumentParser]]:
    """The top-level parser (with the client options) and its subcommands, still empty."""
    parser: argparse.ArgumentParser = SuggestingParser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--version", action=VersionAction)
    client_commands.add_client_options(parser, top_level=True)
    # COMMAND: the usage line listed every command, and the help listed them twice.
    return parser, parser.add_subparsers(dest="command", required=True, metavar="COMMAND")


class VersionAction(argparse._VersionAction):
    """argparse's --version, reading the installed version only when it is given: importlib.metadata
    and the read were ~30 ms of every command's start (session 39)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        self.version = f"%(prog)s {package_version()}"
        super().__call__(parser, namespace, values, option_string)


def package_version() -> str:
    """The installed distribution's version ("unknown" from a source tree that is not installed)."""
    from importlib import metadata

    try:
        return metadata.version("asyncinfer")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_tool_commands(commands: SubParsers[argparse.ArgumentParser]) -> None:
    """config, hash-key, webhook-secret and completion."""
    commands.add_parser("config", help="print the complete commented configuration")
    hash_key_command = commands.add_parser("hash-key", help="print the SHA-256 of an API key for gateway.api_keys")
    hash_key_command.add_argument("key", help="the API key, or - to read it from stdin (keeps it out of shell history)")
    webhook_secret = commands.add_parser("webhook-secret", help="print a fresh webhook signing secret (whsec_)")
    webhook_secret.add_argument("--tenant", default="default", help="the tenant it signs for (default: default)")
    nats_users = commands.add_parser(
        "nats-users",
        help="write one NATS NKey seed per service and print the nats-server users block",
        description="Writes DIR/gateway.nk and DIR/scheduler.nk (with --batcher, DIR/batcher.nk too: batchers "
        "with batcher.claim_check_io), 0600, keeping any that exist, and prints the nats-server `authorization` "
        "block that lets each service do exactly what it needs (asyncinfer.nats_users), then each service's "
        "nats settings. Stream and bucket names come from --config (default: the defaults).",
    )
    nats_users.add_argument("directory", help="where the seed files go (a Secret's mount, say)")
    nats_users.add_argument("--batcher", action="store_true", help="a user for batchers that move claim checks")
    nats_users.add_argument("--config", help="the services' configuration file (its nats section)")
    completion_command = commands.add_parser(
        "completion",
        help="print a tab-completion script for bash, zsh or fish",
        description="bash: source <(asyncinfer completion bash), or save it in ~/.local/share/bash-completion/"
        "completions/asyncinfer. zsh: save it as _asyncinfer in a folder of $fpath. fish: asyncinfer completion "
        "fish | source, or save it as ~/.config/fish/completions/asyncinfer.fish.",
    )
    completion_command.add_argument("shell", choices=completion.SHELLS)


def build_parser() -> argparse.ArgumentParser:
    """The client-only parser: the tool commands and the client commands."""
    parser, commands = new_parser()
    parser.epilog = CLIENT_ONLY_EPILOG
    add_tool_commands(commands)
    client_commands.register(commands)
    return parser


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs a tool or client command (parsed by parser, which `completion` describes); its exit code."""
    if client_commands.is_client_command(args):
        return client_commands.run(args)
    if args.command == "completion":
        sys.stdout.write(completion.script(parser, args.shell))
        return 0
    if args.command == "config":
        # Here, as in _nats_users: the configuration's classes (pydantic) are most of a client command's start.
        from asyncinfer.config import render_default_config

        sys.stdout.write(render_default_config())
        return 0
    if args.command == "webhook-secret":
        secret = new_secret()
        print(secret)
        print("# add to the [webhooks] section (the receiver verifies signatures with the same secret):")
        print(f'# secrets = [{{ tenant = "{args.tenant}", secret = "{secret}" }}]')
        return 0
    if args.command == "nats-users":
        return _nats_users(args)
    if args.command == "hash-key":
        print(hash_key(sys.stdin.readline().strip() if args.key == "-" else args.key))
        return 0
    raise AssertionError(f"not a tool or client command: {args.command!r}")  # the parser allows no other


def _nats_users(args: argparse.Namespace) -> int:
    from pathlib import Path

    from asyncinfer.config import load_config
    from asyncinfer.errors import ConfigError
    from asyncinfer.nats_users import INBOX_PREFIXES, authorization_block, users_with_seeds

    try:
        nats = load_config(args.config).nats
        users, seeds = users_with_seeds(Path(args.directory), nats, batcher=args.batcher)
    except (ConfigError, OSError) as exc:
        print(f"asyncinfer: error: {exc}", file=sys.stderr)
        return 2
    print("# Add to the nats-server configuration (public keys only; the seeds stay with the services):")
    sys.stdout.write(authorization_block(users))
    print("# Each service's own settings (a service with another's seed or inbox prefix is refused):")
    for service, path in seeds.items():
        section = "ASYNCINFER_NATS__"
        # A batcher opens NATS only with claim_check_io: without it, its seed and prefix went unused.
        turned_on = " ASYNCINFER_BATCHER__CLAIM_CHECK_IO=true" if service == "batcher" else ""
        print(
            f"#   {service}: {section}NKEY_SEED_FILE={path.resolve()} {section}INBOX_PREFIX={INBOX_PREFIXES[service]}"
            + turned_on
        )
    return 0


# `asyncinfer list | head`: the reader went away; the shell's code for a process ended by SIGPIPE.
EXIT_BROKEN_PIPE = 141


def exit_quietly_on_broken_pipe(run: Callable[[], int]) -> int:
    try:
        return run()
    except BrokenPipeError:
        # Stop quietly, as Unix tools do, instead of a traceback; stdout goes to /dev/null so that
        # the interpreter's final flush does not raise again.
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        # A Ctrl-C before the command's own handling began (building its parser reads the package's
        # metadata): 130, as a shell reports it, not a traceback (a CI run's Ctrl-C test met it).
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """The client-only command (`python -m asyncinfer`, or `python -m asyncinfer.cli`)."""

    def command() -> int:
        parser = build_parser()
        return run_command(parser.parse_args(argv), parser)

    return exit_quietly_on_broken_pipe(command)


if __name__ == "__main__":
    sys.exit(main())
