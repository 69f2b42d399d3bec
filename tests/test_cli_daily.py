"""The client CLI's daily-life surface (issue 18): `--version`, `python -m asyncinfer`, and a
`dlq purge --all` that asks first. Run as a person runs it: a subprocess, on a terminal (a pty)
where the test needs one."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import grpc
import pytest

from asyncinfer.client import AsyncInferClientError, InvalidArgumentError, RetryPolicy, UnavailableError
from asyncinfer.commands.hints import connection_hint
from asyncinfer.commands.options import Options
from asyncinfer.commands.output import exit_code_for, report_error
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.embedded_nats import free_port
from asyncinfer.errors import FieldViolation
from services import cli as services_cli
from services.batcher.models.demo import FAILING_MODEL_MESSAGE
from services.dev_ca import ensure_dev_tls
from tests.stack import StartStack
from tests.waits import WAIT_S

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def run_cli(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncinfer", *argv],
        cwd=REPO,
        env=ENV,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version_prints_the_package_version() -> None:
    done = run_cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"asyncinfer {metadata.version('asyncinfer')}"
    # The installed command (services.cli, with the server commands) says the same.
    script = Path(sys.executable).parent / "asyncinfer"
    if script.exists():
        installed = subprocess.run([script, "--version"], env=ENV, capture_output=True, text=True, timeout=60)
        assert (installed.returncode, installed.stdout) == (0, done.stdout), installed.stderr


def test_python_m_asyncinfer_is_the_client_cli_and_says_where_the_servers_are() -> None:
    done = run_cli("--help")
    assert done.returncode == 0, done.stderr
    assert "dlq" in done.stdout
    assert "submit" in done.stdout
    help_text = " ".join(done.stdout.split())
    assert (
        "the commands that start servers (up, gateway, scheduler, batcher) are in the installed `asyncinfer` command"
        in help_text
    )
    done = run_cli("hash-key", "secret")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip()) == 64
    # The server commands are not there: a usage error naming the choice.
    done = run_cli("up")
    assert done.returncode == 2
    assert "invalid choice: 'up'" in done.stderr


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("up", ("embedded nats-server", "pip install 'asyncinfer[all]'", ".asyncinfer/webhook-secret")),
        ("gateway", ("JobService and BatchService", "JetStream at nats.url")),
        ("scheduler", ("dispatches queued jobs", "JetStream at nats.url", "sends the webhooks")),
        ("batcher", ("batcher.scheduler_address", "KServe v2", "torch")),
        ("console", ("console.gateway_address", "console.scheduler_address", "console.ops_key_file")),
    ],
)
def test_each_server_commands_help_says_what_it_runs_what_it_needs_and_one_example(
    command: str, says: tuple[str, ...]
) -> None:
    """`asyncinfer up --help` and the servers' said only their usage and options."""
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", command, "--help"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    description = done.stdout.split("\n\n")[1]
    assert description.startswith("Runs "), done.stdout
    prose = " ".join(description.split())
    for fact in says:
        assert fact in prose, (fact, done.stdout)
    example = done.stdout.split("example:\n", 1)[1].splitlines()[0].strip()
    assert f"asyncinfer {command} --config asyncinfer.toml" in example  # whole, on one line
    # ... and the variables that set its configuration (it named none).
    environment = " ".join(done.stdout.split("environment:", 1)[-1].split())
    assert "ASYNCINFER_<SECTION>__<KEY> (ASYNCINFER_GATEWAY__PORT=50061)" in environment, done.stdout
    assert "$ASYNCINFER_SECRETS_DIR" in environment, done.stdout
    assert all(len(line) <= 100 for line in done.stdout.splitlines() if not line.startswith("  ")), done.stdout


def purge_all_on_a_terminal(scheduler: str, answer: str) -> tuple[int, str, str]:
    """`dlq purge --all` with stdin and stderr on a pty: (exit code, stdout, what the terminal showed)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "asyncinfer", "dlq", "purge", "--all", "--scheduler", scheduler, "--timeout", "20"],
        cwd=REPO,
        env=ENV,
        stdin=follower,
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
    )
    os.close(follower)
    shown = b""
    try:
        while b"[y/N]" not in shown:
            ready, _, _ = select.select([leader], [], [], 30)
            assert ready, f"no question asked; the terminal shows {shown!r}"
            shown += os.read(leader, 1024)
        os.write(leader, answer.encode() + b"\n")
        out, _ = process.communicate(timeout=30)
    finally:
        process.kill()
        os.close(leader)
    return process.returncode, out, shown.decode()


def test_purge_all_asks_on_a_terminal_and_no_purges_nothing() -> None:
    code, out, shown = purge_all_on_a_terminal("127.0.0.1:1", "n")
    assert (code, out) == (0, "nothing purged\n"), shown  # nothing was called: no scheduler listens there
    assert "delete every dead letter? This cannot be undone. [y/N] " in shown


async def cli(*argv: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "asyncinfer",
        *argv,
        cwd=REPO,
        env=ENV,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.timeout(300)
async def test_dlq_show_reads_as_text_and_json_then_purge_all_on_yes(config: Config, start_stack: StartStack) -> None:
    failing = DEMO_MODEL.model_copy(
        update={"name": "failing", "loader": "services.batcher.models.demo:build_failing_model", "max_attempts": 1}
    )
    stack = await start_stack(config.replace(models=[DEMO_MODEL, failing]))
    where = ["--gateway", stack.address, "--scheduler", stack.ops_address, "--timeout", "20"]
    code, out, err = await cli("submit", "failing", "-i", "x=[[1,2,3,4]]", "--priority", "high", "--wait", *where)
    assert code == 1, err  # FAILED
    for _ in range(100):
        code, out, err = await cli("dlq", "list", "--json", *where)
        if out:
            break
        await asyncio.sleep(0.1)
    (listed,) = [json.loads(line) for line in out.splitlines()]
    sequence = str(listed["sequence"])

    # The text and the JSON at once (two reads, each its own process).
    (code, out, err), (json_code, json_out, json_err) = await asyncio.gather(
        cli("dlq", "show", sequence, *where), cli("dlq", "show", sequence, "--json", *where)
    )
    assert code == 0, err
    lines = out.splitlines()
    assert "model       failing" in lines
    assert "reason      MAX_ATTEMPTS" in lines
    (last_error,) = [line for line in lines if line.startswith("last error")]
    assert last_error.startswith("last error  INTERNAL MODEL_ERROR: "), out  # the code's name, not 13
    assert FAILING_MODEL_MESSAGE in last_error
    assert "{'code'" not in out, "no Python repr"
    assert '                {"name": "x", "datatype": "FP32", "shape": [1, 4]}' in lines, out  # one input a line
    request = json.loads(out[out.index("request     ") + len("request     ") :])
    # The request as sent: no version named (the version is chosen at dispatch: docs/MODEL_VERSIONS.md).
    assert request == {
        "model": "failing",
        "priority": "HIGH",
        "max_attempts": 1,
        "execution_timeout_s": 60.0,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4]}],
    }
    assert json_code == 0, json_err
    shown = json.loads(json_out)
    assert shown["original_request"] == request
    assert shown["last_error"]["code"] == "INTERNAL"

    code, out, terminal = await asyncio.to_thread(purge_all_on_a_terminal, stack.ops_address, "y")
    assert (code, out) == (0, "purged 1 dead letter(s); 0 left\n"), terminal

    # A list cut at --limit (100 by default) says so beside it, with the total; it was cut without a
    # word (the first-hour pass, session 32). A job is dead-lettered before its FAILED record is written.
    submitted = await asyncio.gather(
        *(cli("submit", "failing", "-i", "x=[[1,2,3,4]]", "--wait", *where) for _ in range(2))
    )
    for code, _, err in submitted:
        assert code == 1, err
    (code, out, err), (json_code, json_out, json_err) = await asyncio.gather(
        cli("dlq", "list", "--limit", "1", *where), cli("dlq", "list", "--json", *where)
    )
    assert (code, len(out.splitlines())) == (0, 2), (out, err)
    assert err == "asyncinfer: 2 dead letters in all; this is the oldest; --limit N shows more, --limit 0 all\n"
    assert (json_code, len(json_out.splitlines()), json_err) == (0, 2, ""), (json_out, json_err)


async def cli_async(*argv: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asyncinfer", *argv, cwd=REPO, env=ENV,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, err.decode()


async def test_a_connection_error_says_what_to_check_and_nothing_else(tmp_path: Path) -> None:
    """gRPC's text names no cause ('Socket closed', 'Method not found!'), and its C core printed a
    'Handshake failed' line per retry on a TLS mismatch: each case ends in the error and one hint."""
    tls = ensure_dev_tls(tmp_path / "tls", ["127.0.0.1"])
    plain, secure = grpc.aio.server(), grpc.aio.server()
    plain_port = plain.add_insecure_port("127.0.0.1:0")
    credentials = grpc.ssl_server_credentials([(tls.key_file.read_bytes(), tls.cert_file.read_bytes())])
    secure_port = secure.add_secure_port("127.0.0.1:0", credentials)
    closed_port = free_port()
    await plain.start()
    await secure.start()
    try:
        cases = {
            "TLS handshake failed": ("submit", "demo", "-i", "x=[[1,2,3,4]]", "--gateway", f"127.0.0.1:{plain_port}",
                                     "--tls-ca", str(tls.ca_file)),
            "if it is on TLS, give --tls-ca": ("submit", "demo", "-i", "x=[[1,2,3,4]]", "--gateway",
                                              f"127.0.0.1:{secure_port}"),
            "serves another service": ("dlq", "list", "--scheduler", f"127.0.0.1:{plain_port}"),
            "is the stack up": ("submit", "demo", "-i", "x=[[1,2,3,4]]", "--gateway", f"127.0.0.1:{closed_port}"),
            # .invalid never resolves (RFC 2606): gRPC's "errors resolving ..." alone, after 4.7 s
            "no host has that name": ("submit", "demo", "-i", "x=[[1,2,3,4]]", "--gateway", "nosuchhost.invalid:50051"),
            "no host has that name: is it spelled right?": ("dlq", "list", "--scheduler", "nosuchhost.invalid:50052"),
        }  # fmt: skip
        # Each case its own process, all at once (they share nothing; the refused and the TLS ones
        # try again until a wait would pass their --timeout): the slowest case's time, not the sum.
        ended = await asyncio.gather(*(cli_async(*argv, "--timeout", "3") for argv in cases.values()))
        for hint, (code, err) in zip(cases, ended, strict=True):
            lines = [line for line in err.splitlines() if not line.endswith("trying again for a few seconds")]
            assert code in (5, 6), err
            assert len(lines) == 2, err  # the error and the hint: no gRPC core log lines
            assert lines[0].startswith("asyncinfer: error: "), err
            assert lines[1].startswith("asyncinfer:   hint: "), err
            assert hint in lines[1], err
    finally:
        await plain.stop(None)
        await secure.stop(None)


def test_a_host_name_that_does_not_exist_is_said_at_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--gateway nosuchhost:50051` was tried 7 times (4.7 s) as a gateway not up yet is, though
    DNS had said no such host exists. Counted in waits between tries, not in seconds; a refused
    address, tried again, shows the count is seen."""
    from asyncinfer.cli import main

    monkeypatch.delenv("ASYNCINFER_GATEWAY_ADDRESS", raising=False)
    waits: list[int] = []
    backoff_s = RetryPolicy.backoff_s

    def counted(policy: RetryPolicy, attempt: int, error: AsyncInferClientError) -> float:
        waits.append(attempt)
        return backoff_s(policy, attempt, error)

    monkeypatch.setattr(RetryPolicy, "backoff_s", counted)
    code = main(["models", "--gateway", "nosuchhost.invalid:50051"])
    err = capsys.readouterr().err
    assert code == 5, err
    assert waits == [], err
    assert err.splitlines()[1].startswith("asyncinfer:   hint: no host has that name: is it spelled right?"), err

    assert main(["models", "--gateway", f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 5
    assert waits, capsys.readouterr().err


def test_a_scheduler_that_does_not_listen_is_tried_again_saying_so_as_a_gateway_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first-hour pass, session 38: `models` against a gateway down said it was trying again and
    waited out a stack still starting; `dlq list` (and every command of the scheduler's) failed at
    once, without the line. Both now try again for a few seconds (within --timeout), saying so once."""
    from asyncinfer.cli import main

    waits: list[int] = []
    backoff_s = RetryPolicy.backoff_s

    def counted(policy: RetryPolicy, attempt: int, error: AsyncInferClientError) -> float:
        waits.append(attempt)
        return backoff_s(policy, attempt, error)

    monkeypatch.setattr(RetryPolicy, "backoff_s", counted)
    address = f"127.0.0.1:{free_port()}"
    for argv in (["models", "--gateway", address], ["dlq", "list", "--scheduler", address]):
        waits.clear()
        started = time.monotonic()
        assert main([*argv, "--timeout", "2"]) == 5
        err = capsys.readouterr().err
        lines = err.splitlines()
        assert lines[0] == f"asyncinfer: {address} does not answer yet; trying again for a few seconds", (argv, err)
        assert lines[1].startswith("asyncinfer: error: UNAVAILABLE"), (argv, err)
        assert "nothing listens there" in lines[2], (argv, err)
        assert len(waits) >= 2, (argv, waits)
        assert time.monotonic() - started < 4, "within --timeout"


@pytest.mark.unit
def test_a_server_that_accepts_and_never_answers_gets_a_hint() -> None:
    """A helper's CLI pass, session 24: a gateway stopped (SIGSTOP) or wedged behind its port failed
    with gRPC's "timed out before receiving SETTINGS frame" and no hint."""
    error = UnavailableError(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: connection attempt timed out "
        "before receiving SETTINGS frame",
        code=grpc.StatusCode.UNAVAILABLE,
    )
    options = Options(
        gateway="127.0.0.1:9", scheduler="127.0.0.1:10", api_key=None, ops_key=None, tls_ca_file=None,
        tls_cert_file=None, tls_key_file=None, timeout_s=None, json=False, config=None,
    )  # fmt: skip
    hint = connection_hint(error, options)
    assert hint is not None
    assert hint.startswith("something accepts connections there but does not answer as a gRPC server in time")


@pytest.mark.unit
def test_an_address_that_can_never_answer_is_a_usage_error_naming_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--gateway 127.0.0.1:5005l` (and the like: a port past 65535, no host) failed UNAVAILABLE
    (exit 5) after the SDK's retries (4.5-5.9 s a command), though no try could succeed. Now a usage
    error (2) before any, naming the flag or variable it came from; a valid form is still tried
    (exit 5: nothing listens there)."""
    from asyncinfer.cli import main

    monkeypatch.delenv("ASYNCINFER_GATEWAY_ADDRESS", raising=False)
    monkeypatch.delenv("ASYNCINFER_SCHEDULER_ADDRESS", raising=False)
    cases = [
        (["get", "01a24a3a-cd4b-7284-bc8e-00301d897e79", "--gateway", "127.0.0.1:5005l"], {}, "--gateway '127.0.0.1:5005l': its port '5005l'"),
        (["list"], {"ASYNCINFER_GATEWAY_ADDRESS": "host:99999"}, "ASYNCINFER_GATEWAY_ADDRESS='host:99999': its port '99999'"),
        (["dlq", "list", "--scheduler", ":"], {}, "--scheduler ':': it names no host"),
        (["stats", "--once"], {"ASYNCINFER_SCHEDULER_ADDRESS": "[::1"}, "ASYNCINFER_SCHEDULER_ADDRESS='[::1': its '[' is not closed"),
    ]  # fmt: skip
    for argv, env, says in cases:
        with monkeypatch.context() as scoped:
            for name, value in env.items():
                scoped.setenv(name, value)
            code = main(argv)
        out, err = capsys.readouterr()
        assert (code, out) == (2, ""), (argv, err)
        assert err.startswith(f"asyncinfer: {says}"), (argv, err)
        assert "trying again" not in err, err
    # A valid form is tried: nothing listens on this socket (exit 5, as any address where nothing listens).
    code = main(
        [
            "get",
            "01a24a3a-cd4b-7284-bc8e-00301d897e79",
            "--gateway",
            "unix:/nonexistent/asyncinfer.sock",
            "--timeout",
            "1",
        ]
    )
    assert code == 5, capsys.readouterr().err


async def test_ctrl_c_while_the_command_loads_or_runs_is_a_quiet_130(tmp_path: Path) -> None:
    """A helper's CLI pass, session 24: a Ctrl-C in the first second (the imports) printed a traceback
    of 30-50 lines and could exit 1, which the README gives to a job that did not succeed. Signalled
    at two moments each run shows (not at delays: on a busy machine 0.5 s after the start was still
    Python's own start-up, whose KeyboardInterrupt is Python's to report): as the command loads
    (services.cli's imports, grpc's among them), and once its own handling runs (it says it
    tries the gateway again)."""
    for moment in ("loading", "running"):
        process = await asyncio.create_subprocess_exec(
            *AS_A_TERMINALS_FOREGROUND_JOB, str(Path(sys.executable).parent / "asyncinfer"), "models",
            "--gateway", "127.0.0.1:1", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path,
        )  # fmt: skip
        assert process.stderr is not None
        said = b""
        if moment == "loading":
            await until_loading(process.pid)
        else:
            said = await asyncio.wait_for(process.stderr.readline(), 60)
            assert said.endswith(b"does not answer yet; trying again for a few seconds\n"), said
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode in (130, -signal.SIGINT), (moment, process.returncode, err.decode()[-500:])
        assert b"Traceback" not in err, (moment, err.decode()[-2000:])
        assert b"error" not in said + err, (moment, err.decode())  # interrupted, not failed


def test_the_entry_point_imports_nothing_before_it_takes_ctrl_c() -> None:
    """The window in which a Ctrl-C printed a traceback before the entry point's handler was set
    was Python's start-up and the entry's own imports: `import signal` brought enum, functools and
    collections (6-15 ms, 5 of 48 Ctrl-Cs 30-70 ms after the start printed a traceback from them).
    It imports nothing the interpreter has not loaded by then."""
    probe = "import sys; before = set(sys.modules); import services.entry; print(sorted(set(sys.modules) - before))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "['services', 'services.entry']", done.stdout


# What only the server commands (up, gateway, scheduler, batcher, console) need: a client command
# loaded them all, half its start (session 39: 0.98 s of CPU before, 0.59 s after).
SERVER_ONLY_MODULES = (
    "pydantic",
    "asyncinfer.config",
    "asyncinfer.config.gateway_sections",
    "structlog",
    "rich",
    "pygments",
    "asyncinfer.runner",
    "asyncinfer.logs",
    "services.up.stack",
)


@pytest.mark.parametrize("argv", [["list", "--help"], ["get", "--help"], ["--version"], ["hash-key", "k"]])
def test_a_client_command_loads_none_of_the_servers_modules(argv: list[str]) -> None:
    """Session 39: `asyncinfer list --help` took ~1 s of CPU, most of it building the configuration's
    pydantic classes and importing structlog (which imports rich and pygments) that only the server
    commands use. The installed command's module, run in a fresh interpreter, leaves them unloaded."""
    probe = (
        "import contextlib, io, sys\n"
        "import services.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    services.cli.main({argv!r})\n"
        f"print(sorted(m for m in {SERVER_ONLY_MODULES!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.unit
def test_a_ctrl_c_between_the_entrys_handler_and_the_commands_is_a_quiet_130(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once services.cli is loaded the entry point gives SIGINT back to Python; a Ctrl-C before the
    command's own handling (its first statement) raised out of main() with a traceback."""
    from services import entry

    def interrupted_at_once(_argv: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(services_cli, "main", interrupted_at_once)
    monkeypatch.setattr(sys, "argv", ["asyncinfer", "models"])
    was = signal.getsignal(signal.SIGINT)
    try:
        code = entry.main()
    except KeyboardInterrupt:  # a failure of this test, not the end of the session
        code = None
    finally:
        signal.signal(signal.SIGINT, was)
    assert code == 130


@pytest.mark.unit
def test_a_ctrl_c_while_the_parser_is_built_is_a_quiet_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Building the parser read the package's metadata (its --version): a Ctrl-C there, before the
    command's own handling, printed a traceback (CI, session 29). Since session 39 only --version
    reads it (asyncinfer.cli.VersionAction), as the parser parses: a Ctrl-C there is as quiet."""

    def interrupted(_name: str) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(metadata, "version", interrupted)
    try:
        code = services_cli.main(["--version"])
    except KeyboardInterrupt:  # a failure of this test, not the end of the session
        code = None
    assert code == 130
    assert capsys.readouterr() == ("", "")


async def until_loading(pid: int) -> None:
    """Returns once the process has mapped grpc's compiled core: services.cli is being imported,
    after services.entry set its handler of SIGINT (it imports nothing beyond the standard library).
    (pydantic's, until session 39: a client command no longer imports it.)"""
    maps = Path(f"/proc/{pid}/maps")
    give_up_at = time.monotonic() + 30
    while "cygrpc" not in await asyncio.to_thread(maps.read_text):
        assert time.monotonic() < give_up_at, "the command did not start loading in 30 s"
        await asyncio.sleep(0.005)


def waiting_on_a_terminal(argv: list[str], asks: bytes | None) -> tuple[int, str]:
    """Runs the client command with stdin on a pty, waits until it waits for input (what `asks`
    shows, else a second), sends one Ctrl-C: (exit code, what the terminal showed)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [*AS_A_TERMINALS_FOREGROUND_JOB, sys.executable, "-m", "asyncinfer", *argv], cwd=REPO, env=ENV,
        stdin=follower, stdout=subprocess.DEVNULL, stderr=follower, start_new_session=True,
    )  # fmt: skip
    os.close(follower)
    shown = b""
    try:
        if asks is not None:
            while asks not in shown:
                ready, _, _ = select.select([leader], [], [], 30)
                assert ready, f"it did not ask; the terminal shows {shown!r}"
                shown += os.read(leader, 1024)
        else:
            select.select([leader], [], [], 1.5)
        os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        code = process.wait(timeout=WAIT_S)
    finally:
        process.kill()
        process.wait()
        os.close(leader)
    return code, shown.decode(errors="replace")


# Runs a command with SIGINT as a terminal's foreground job has it: a test run in the background of
# a script (as CI may be) inherits it ignored, and Python then leaves it so. A launcher process, not
# a preexec_fn: that ran Python in a fork of this process, whose gRPC threads were running, and
# gRPC's fork handlers aborted the child now and then (-6, before its exec: CI, session 25).
AS_A_TERMINALS_FOREGROUND_JOB = (
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])",
)


@pytest.mark.parametrize(
    ("argv", "asks"),
    [
        (["dlq", "purge", "--all", "--scheduler", "127.0.0.1:1"], b"[y/N]"),
        (["bulk", "-", "--out", "{tmp}/results.jsonl", "--gateway", "127.0.0.1:1"], None),
        (["submit", "-f", "-", "--gateway", "127.0.0.1:1"], None),
    ],
    ids=["a prompt", "bulk from stdin", "a request from stdin"],
)
def test_one_ctrl_c_stops_a_command_waiting_for_input(argv: list[str], asks: bytes | None, tmp_path: Path) -> None:
    """A helper's CLI pass, session 24: a command reading the terminal took a second Ctrl-C (the read
    held the event loop), and `bulk -` stopped at none (asyncio.run waited for its reading thread)."""
    code, shown = waiting_on_a_terminal([a.replace("{tmp}", str(tmp_path)) for a in argv], asks)
    assert code in (130, -signal.SIGINT), shown
    assert "Traceback" not in shown, shown
    assert list(tmp_path.glob("*.stdin")) == [], "bulk's partial copy of its stdin is removed"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "suggested"),
    [
        (["submitt", "demo"], "did you mean 'submit'?"),
        (["submit", "demo", "-i", "x=[[1,2,3,4]]", "--priorty", "high"], "did you mean '--priority'?"),
        (["batch", "creat", "f.jsonl"], "did you mean 'create'?"),
        (["dlq", "lst"], "did you mean 'list'?"),
        (["xyz"], "'queue', 'stats')"),  # nothing close: the commands there are
    ],
)
def test_a_mistyped_command_or_option_is_told_what_was_meant_in_one_line(
    argv: list[str], suggested: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A first-hour pass (session 25): `asyncinfer submitt` listed 21 commands and `--priorty`
    printed the top-level usage, neither with a hint. Session 31's: the hint came after five lines
    of the parser's usage (the top-level one, naming no subcommand's options); now the one line."""
    with pytest.raises(SystemExit) as exited:
        services_cli.build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.rstrip().endswith(suggested)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([], "asyncinfer: error: give a command: up, config, "),
        (["batch"], "asyncinfer batch: error: give a command: create, get, watch, cancel, list, download "),
        (["dlq"], "asyncinfer dlq: error: give a command: list, show, replay, purge "),
        (["queue"], "asyncinfer queue: error: give a command: pause, resume, drain, undrain "),
    ],
)
def test_a_command_given_without_its_subcommand_names_them_in_one_line(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first-hour pass, session 32: `asyncinfer batch` (or `asyncinfer` alone) printed its usage
    block, then `the following arguments are required: COMMAND`, and `asyncinfer dlq` argparse's
    own name for it, `dlq_action`: none of them said which commands there are."""
    with pytest.raises(SystemExit) as exited:
        services_cli.build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(said), err
    assert err.endswith(f"(`{' '.join(['asyncinfer', *argv])} --help` says what each does)\n"), err


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["watch"], "asyncinfer watch: error: give job_id: asyncinfer watch [options] job_id"),
        (["cancel"], "asyncinfer cancel: error: give job_id: asyncinfer cancel [options] job_id [job_id ...]"),
        (["batch", "get"], "asyncinfer batch get: error: give batch_id: asyncinfer batch get [options] batch_id"),
        (["completion"], "asyncinfer completion: error: give shell: asyncinfer completion [options] {bash,zsh,fish}"),
    ],
)
def test_a_command_given_without_its_argument_says_what_to_give_in_one_line(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first-hour walk: `asyncinfer watch` with no job ID printed argparse's usage block (six
    lines of the client options) before `the following arguments are required: job_id`."""
    with pytest.raises(SystemExit) as exited:
        services_cli.build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"{said} (`{' '.join(['asyncinfer', *argv])} --help` says more)\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["submit", "demo", "--bogus"], "asyncinfer submit: error: unrecognized arguments: --bogus"),
        (["batch", "list", "--zzz"], "asyncinfer batch list: error: unrecognized arguments: --zzz"),
        (
            ["submit", "demo", "-i", "x=[[1,2,3,4]]", "--queue-ttl", "abc"],
            "asyncinfer submit: error: argument --queue-ttl: invalid float value: 'abc'",
        ),
        (
            ["batch", "create", "f.jsonl"],
            "asyncinfer batch create: error: the following arguments are required: --model",
        ),
        (["dlq", "show", "abc"], "asyncinfer dlq show: error: argument sequence: invalid int value: 'abc'"),
    ],
)
def test_any_other_usage_error_is_one_line_from_the_command_given(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first-hour pass, session 38. An option the command does not have was refused by the
    top-level parser, suggesting the closest option of any command: `submit demo --bogus` said "did
    you mean '--out'?", an option submit refuses (bulk's). A value of the wrong type, a required
    option left out: argparse's usage block (7 to 14 lines) before the line saying what was wrong."""
    with pytest.raises(SystemExit) as exited:
        services_cli.build_parser().parse_args(argv)
    assert exited.value.code == 2
    command = " ".join(["asyncinfer", *argv[: 2 if argv[0] in ("batch", "dlq") else 1]])
    assert capsys.readouterr().err == f"{said} (`{command} --help` says more)\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["submit", "demo", "--priority", "urgent"],
            "asyncinfer submit: error: argument --priority: invalid choice: 'urgent' "
            "(choose from 'HIGH', 'NORMAL', 'LOW', in any case)",
        ),
        (
            ["batch", "create", "f.jsonl", "--model", "demo", "--priority", "hihg"],
            "asyncinfer batch create: error: argument --priority: invalid choice: 'hihg'; did you mean 'HIGH'?",
        ),
    ],
)
def test_a_priority_refused_is_echoed_as_typed(argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The first-hour pass, session 38: `--priority urgent` was refused as `invalid choice: 'URGENT'`,
    a value the user never typed (argparse checked its choices after upper-casing it)."""
    with pytest.raises(SystemExit) as exited:
        services_cli.build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"{said}\n"
    assert services_cli.build_parser().parse_args(["submit", "demo", "--priority", "low"]).priority == "LOW"


@pytest.mark.unit
def test_stats_help_says_what_each_column_of_its_table_is(capsys: pytest.CaptureFixture[str]) -> None:
    """The first-hour pass, session 38: `asyncinfer stats` showed WANTED and CREDITS, named nowhere
    (its help had the options alone, the README none of its columns)."""
    from asyncinfer.commands.ops import stats_rows

    with pytest.raises(SystemExit):
        services_cli.build_parser().parse_args(["stats", "--help"])
    said = " ".join(capsys.readouterr().out.split())  # argparse wraps the description
    headers, _ = stats_rows([])
    for header in headers[1:]:  # MODEL: the rows' names
        words = header.replace("BY PRIORITY", "BY PRIORITY:")
        assert words in said, (header, said)
    assert "CREDITS: the work orders its batchers would take now" in said


@pytest.mark.unit
def test_a_refusal_names_its_field_once(capsys: pytest.CaptureFixture[str]) -> None:
    """The message already says `field: description`: its violation line repeated it."""
    message = "invalid request: inputs[0].shape: input 'x' must have shape [-1, 4]"
    error = InvalidArgumentError(
        message,
        code=grpc.StatusCode.INVALID_ARGUMENT,
        violations=(FieldViolation("inputs[0].shape", "input 'x' must have shape [-1, 4]"), FieldViolation("b", "c")),
    )
    assert report_error(error) == exit_code_for(grpc.StatusCode.INVALID_ARGUMENT)
    assert capsys.readouterr().err.splitlines() == [
        f"asyncinfer: error: INVALID_ARGUMENT: {message}",
        "asyncinfer:   b: c",
    ]


def test_a_gateway_that_does_not_answer_is_said_at_once_then_its_hint() -> None:
    """The SDK's retries (3-6 s) were silence before the error: a first-hour pass ran `models` with
    the stack down and waited without a word. (--timeout 2: the tries stop once a wait would pass
    it, after about a second and 3 to 5 of them, rather than the default's 7.)"""
    done = run_cli("models", "--gateway", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert lines[0].endswith("does not answer yet; trying again for a few seconds")
    assert sum("trying again" in line for line in lines) == 1
    assert any("nothing listens there" in line for line in lines)


# Arguments that are file paths: the file system's bytes, opened here and never sent as text.
PATH_ARGUMENTS = frozenset({"-f/--request", "--tls-ca", "--tls-cert", "--tls-key"})


def _client_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Each client command's parser (one with a handler), nested ones (batch create) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _client_commands(sub, (*path, name))
    if callable(parser.get_default("handler")):
        yield path, parser


def _valued(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.nargs != 0 and not isinstance(a, argparse._SubParsersAction)]


@pytest.mark.unit
def test_every_argument_sent_as_text_refuses_bytes_that_are_not_utf8_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Bytes of an argument that are not UTF-8 reach Python as lone surrogates, which protobuf (or
    gRPC's metadata) refuses with a traceback once the call is made: `get $'caf\\xe9'`, `submit demo
    -i $'caf\\xe9=1'`, `--api-key`, `--gateway`, ... Each command's every argument that takes a value,
    but for file paths, is now a usage error (2) naming it, before anything is sent; found by walking
    the parser, so an argument added later without the check fails here."""
    from asyncinfer.cli import build_parser

    parser = build_parser()
    refusals: dict[str, tuple[object, str]] = {}  # "command argument": (exit code, stderr)
    for command, sub in _client_commands(parser):
        valued = _valued(sub)
        for target in valued:
            name = "/".join(target.option_strings) or str(target.metavar or target.dest)
            if name in PATH_ARGUMENTS or target.type is Path:
                continue
            argv = list(command)
            for action in valued:  # the command's required arguments, filled with a valid value
                value = "k=caf\udce9" if action is target else "1"
                if not action.option_strings:
                    argv.append(value)
                elif action is target or action.required:
                    argv += [action.option_strings[-1], value]
            capsys.readouterr()
            code: object = 0
            try:
                parser.parse_args(argv)
            except SystemExit as exited:
                code = exited.code
            refusals[f"{' '.join(command)} {name}"] = (code, capsys.readouterr().err)
    let_through = {
        argument: err for argument, (code, err) in refusals.items()
        if code != 2 or f"argument {argument.rpartition(' ')[2]}: " not in err
    }  # fmt: skip
    checked = list(refusals)
    assert let_through == {}
    for expected in ("submit model", "submit -i/--input", "submit --shape", "get job_id", "batch create --model",
                     "batch download batch_id", "queue pause model", "dlq list --model", "list --api-key",
                     "stats --gateway", "cancel --reason", "queue drain --instance"):  # fmt: skip
        assert expected in checked, checked
    # A file named in -i is the file system's bytes, read here: not refused.
    assert parser.parse_args(["submit", "demo", "-i", "x=@caf\udce9.npy"]).input == ["x=@caf\udce9.npy"]


@pytest.mark.unit
def test_a_key_or_address_from_the_environment_that_cannot_be_sent_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The variables' values are not arguments argparse checks: an API key that is not printable
    ASCII (gRPC metadata) and an address whose bytes are not UTF-8 were tracebacks at the first call."""
    from asyncinfer.cli import main

    monkeypatch.delenv("ASYNCINFER_GATEWAY_ADDRESS", raising=False)
    monkeypatch.delenv("ASYNCINFER_SCHEDULER_ADDRESS", raising=False)
    for variable, value, says in (
        ("ASYNCINFER_API_KEY", "café", "asyncinfer: ASYNCINFER_API_KEY: a key is printable ASCII"),
        ("ASYNCINFER_GATEWAY_ADDRESS", "caf\udce9:1", "asyncinfer: ASYNCINFER_GATEWAY_ADDRESS='caf\\udce9:1' is not UTF-8"),
    ):  # fmt: skip
        with monkeypatch.context() as env:
            env.setenv(variable, value)
            capsys.readouterr()
            assert main(["get", "01a24a3a-cd4b-7284-bc8e-00301d897e79", "--timeout", "1"]) == 2
            assert capsys.readouterr().err.startswith(says)
    monkeypatch.setenv("ASYNCINFER_OPS_KEY", "caf\udce9")
    assert main(["stats", "--once", "--timeout", "1"]) == 2
    assert capsys.readouterr().err.startswith("asyncinfer: ASYNCINFER_OPS_KEY: a key is printable ASCII")


def test_the_live_stats_screen_says_a_retry_in_its_title_not_on_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """`stats` on a terminal redraws its screen in place; a scheduler that does not answer (one
    restarting) was said in a line on stderr, which the screen's redraw then drew over and shifted.
    The screen says it in its own title instead; stderr keeps only the final error."""
    import io
    import socket

    from asyncinfer.cli import main

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    with socket.socket() as sock:  # a port nothing listens on: each call is refused, and retried
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out, err = Terminal(), Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delenv("ASYNCINFER_OPS_KEY", raising=False)
    assert main(["stats", "--scheduler", f"127.0.0.1:{port}", "--timeout", "1"]) != 0
    assert f"127.0.0.1:{port} does not answer; trying again" in out.getvalue()
    assert "trying again" not in err.getvalue(), err.getvalue()
    assert err.getvalue().strip(), "the error that ended it is still said"
