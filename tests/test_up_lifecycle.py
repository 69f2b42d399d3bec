"""`asyncinfer up` starts only when it can start whole, stops quietly, and does not outlive its NATS.

- A busy port (a second `up`, or anything else listening) is named in one line before anything
  starts: no nats-server, no store, no traceback, a non-zero exit.
- Ctrl-C (SIGINT to its process group, as a terminal sends it) stops the services in reverse
  order, NATS last, exit 0, without a warning or an error line, ending the scheduler's held pulls
  rather than waiting them out. On a terminal it says so in two lines; its JSON logs keep each
  service's stop.
- Its embedded nats-server dying stops `up` with EXIT_UNAVAILABLE and one error line.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from asyncinfer.embedded_nats import pid_alive
from asyncinfer.runner import EXIT_FORCED, EXIT_UNAVAILABLE
from tests.test_cli_daily import AS_A_TERMINALS_FOREGROUND_JOB
from tests.test_up_grpcurl import (
    BIN,
    SUBMIT_BODY,
    UpProcess,
    close,
    ctrl_c,
    grpcurl,
    json_stream,
    start_on_free_ports,
    start_up,
    write_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SERVICES = {"up", "nats", "gateway", "scheduler", "batcher", "console"}
SNAKE_CASE = re.compile(r"^[a-z][a-z0-9_]*$")
# Guards a hang alone: how fast a stop is, is not timed (a loaded CI machine took 9.7 s for what
# takes ~1 s); what made it slow is asserted instead (held_pulls_ended_at_stop).
STOPPED_WITHIN_S = 60.0


def held_pulls_ended_at_stop(logs: list[dict[str, object]]) -> dict[str, object]:
    """The scheduler's count of how the pulls it held open when its stop began ended."""
    (ended,) = [e for e in logs if e["event"] == "held_pulls_ended_at_stop"]
    return {k: v for k, v in ended.items() if k not in ("event", "level", "timestamp", "service", "logger_name")}


def listening(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def run_up_once(config_path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "asyncinfer"), "up", "--config", str(config_path)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def up_in(folder: Path) -> Iterator[UpProcess]:
    """An `up` running in `folder` (its configuration and store there) until the generator ends."""
    running, _config_path, _ports = start_on_free_ports(folder)
    try:
        yield running
    finally:
        close(running)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[UpProcess]:
    """An `up` of the test's own, for a test that stops it or makes it stop."""
    yield from up_in(tmp_path)


@pytest.fixture(scope="module")
def running_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """One `up` for the tests that leave it running as they found it (they try a second `up`
    beside it, submit a job, read its settings): each asserts it still serves, and none sees what
    another did (a start of `up` is 3-4 s)."""
    yield from up_in(tmp_path_factory.mktemp("running-up"))


def folder_of(up: UpProcess) -> Path:
    """The folder `up` runs in: its configuration and its store's."""
    return up.stderr.parent


def set_in_section(text: str, section: str, key: str, value: int) -> str:
    """The TOML text with `key = value` in `[section]` (which write_config writes with that key)."""
    pattern = re.compile(rf"(^\[{section}\]\n(?:(?!\[).*\n)*?){key} = .*$", re.MULTILINE)
    changed, count = pattern.subn(rf"\g<1>{key} = {value}", text)
    assert count == 1, (section, key)
    return changed


@pytest.mark.parametrize(
    ("section", "key"), [("embedded_nats", "monitor_port"), ("gateway", "port"), ("batcher", "metrics_port")]
)
def test_a_busy_port_is_named_in_one_line_and_nothing_starts(tmp_path: Path, section: str, key: str) -> None:
    # Something else listens on the port this setting asks for; taken before the other ports are
    # chosen, so none of them can be the same port.
    holder = listening(0)
    busy_port = holder.getsockname()[1]
    config_path, _ports = write_config(tmp_path)
    try:
        config_path.write_text(set_in_section(config_path.read_text(), section, key, busy_port))
        done = run_up_once(config_path, tmp_path)
    finally:
        holder.close()
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert f"already in use: 127.0.0.1:{busy_port} ({section}.{key})" in lines[0]
    # ... with the variable that moves it to a free port, ready to paste (a second `up` beside a
    # first had to work out nine names from "ASYNCINFER_EMBEDDED_NATS__PORT=...").
    moved = re.search(rf"run this one on free ports: ASYNCINFER_{section.upper()}__{key.upper()}=(\d+) \(", lines[0])
    assert moved is not None, lines[0]
    suggested = int(moved.group(1))
    assert suggested > busy_port
    listening(suggested).close()  # free
    assert done.stdout == ""  # no banner, not even "asyncinfer stopped": nothing had started
    assert not (tmp_path / "data").exists()  # no nats-server ran: no store, no nats-server.log


@pytest.mark.parametrize("in_the_way", ["data", "data/nats"])
def test_a_store_folder_up_cannot_make_is_named_in_one_line(tmp_path: Path, in_the_way: str) -> None:
    """A file where the store's folder (or the folder holding it, .asyncinfer) must be: `up` ended
    in FileExistsError's traceback, from the lock or from starting its nats-server. (Running as
    root, a folder without write permission cannot be made for the test: a file stands for it.)"""
    config_path, _ports = write_config(tmp_path)
    (tmp_path / in_the_way).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / in_the_way).write_text("not a folder\n")

    done = run_up_once(config_path, tmp_path)

    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if not line.startswith("{")]  # the log's JSON lines
    assert lines == [
        f"asyncinfer: cannot use the JetStream store {tmp_path / 'data' / 'nats'}: a file is where a folder must be "
        f"({tmp_path / in_the_way}). Give `up` a folder it can write: embedded_nats.store_dir in the configuration "
        "file, or ASYNCINFER_EMBEDDED_NATS__STORE_DIR=... before the command"
    ], done.stderr
    assert not (tmp_path / "data" / "nats-server.pid").exists()


def test_an_objects_directory_that_is_not_there_stops_up_in_one_line(tmp_path: Path) -> None:
    """`up` reads nats.objects_directory from the same configuration as the services it runs (off
    by default); a directory that does not exist stops it at start with the setting named, not a
    traceback and not at the first upload."""
    config_path, _ports = write_config(tmp_path)
    missing = tmp_path / "objects"
    config_path.write_text(config_path.read_text() + f'\n[nats]\nobjects_directory = "{missing}"\n')

    done = run_up_once(config_path, tmp_path)

    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert (
        last
        == f"asyncinfer: nats.objects_directory = {str(missing)!r} is not a directory (it must exist, shared by every service)"
    )


def test_a_nats_server_that_cannot_use_its_store_is_said_with_its_own_words(tmp_path: Path) -> None:
    """nats-server refusing the store (its jetstream folder a file) was "exited with 1 as it started
    (its log: ...)": the reason was in its log alone."""
    config_path, _ports = write_config(tmp_path)
    (tmp_path / "data" / "nats").mkdir(parents=True)
    (tmp_path / "data" / "nats" / "jetstream").write_text("not a folder\n")

    done = run_up_once(config_path, tmp_path)

    assert done.returncode == EXIT_UNAVAILABLE, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("asyncinfer: nats-server exited with 1 as it started: "), last
    assert "Can't start JetStream: storage directory is not a directory" in last, last
    assert str(tmp_path / "data" / "nats-server.log") in last


def test_a_second_up_exits_at_once_and_the_first_runs_on(running_up: UpProcess, tmp_path: Path) -> None:
    # The same configuration from another folder, with its own store: every port is the first's.
    up, first = running_up, folder_of(running_up)
    other = tmp_path / "elsewhere"
    other.mkdir()
    config_path = first / "asyncinfer.toml"
    second = other / "asyncinfer.toml"
    second.write_text(config_path.read_text().replace(str(first / "data"), str(other / "data")))

    done = run_up_once(second, other)

    assert done.returncode == 2, (done.stdout, done.stderr)
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "embedded_nats.port" in done.stderr
    assert "gateway.port" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (other / "data").exists()
    # The first one was not disturbed: it still serves, and no second scheduler or batcher joined it.
    assert up.process.poll() is None
    submitted = grpcurl(up.gateway, "asyncinfer.v1.JobService/SubmitJob", data=SUBMIT_BODY)
    assert submitted.returncode == 0, submitted.stderr
    assert sum(entry["event"] == "batcher_connected" for entry in up.logs()) == 1


def test_ups_nats_takes_the_work_message_of_a_4_mib_request(running_up: UpProcess) -> None:
    """NATS's default max_payload, 1 MB, refused the work message of a request of 1-4 MiB that the
    gateway accepts (gateway.max_request_bytes): `up` sets 8 MB, as the cluster's nats.conf does."""
    (started,) = [entry for entry in running_up.logs() if entry["event"] == "nats_server_started"]

    async def max_payload() -> int:
        nc = await nats.connect(str(started["url"]))
        try:
            return int(nc.max_payload)
        finally:
            await nc.close()

    assert asyncio.run(max_payload()) == 8 * 1024 * 1024


def test_ctrl_c_stops_services_then_nats_quietly(up: UpProcess) -> None:
    # A job through first, so that every connection has been used when Ctrl-C comes. (Waited for:
    # one dispatched in the millisecond the batcher begins to stop comes back to the queue, with
    # the scheduler's batcher_lost_with_jobs warning; that race is not what this test is about.)
    submitted = grpcurl(up.gateway, "asyncinfer.v1.JobService/SubmitJob", data=SUBMIT_BODY)
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job"]["job_id"]
    watched = grpcurl(up.gateway, "asyncinfer.v1.JobService/WatchJob", data=json.dumps({"job_id": job_id}))
    assert json_stream(watched.stdout)[-1]["job"]["state"] == "JOB_STATE_SUCCEEDED"  # type: ignore[index]
    nats_pid = up.nats_pid()

    ctrl_c(up)
    code = up.process.wait(timeout=STOPPED_WITHIN_S)

    assert code == 0
    assert "asyncinfer stopped" in up.rest_of_output()
    assert not pid_alive(nats_pid)
    logs = up.logs()  # every line is JSON (no stray library line, no traceback)
    loud = [e for e in logs if e["level"] not in ("debug", "info")]
    assert loud == [], loud
    assert {e["service"] for e in logs} == SERVICES  # each line names who logged it, and all did
    names = {str(e["event"]) for e in logs}
    assert all(SNAKE_CASE.match(name) for name in names), sorted(names)
    order = [str(e["event"]) for e in logs]
    stops = ["console_stopped", "batcher_stopped", "scheduler_stopped", "gateway_stopped", "nats_server_stopped"]
    assert all(event in order for event in stops), order
    assert [order.index(event) for event in stops] == sorted(order.index(event) for event in stops)
    # The pulls held open on the idle queues (HOLD_S, 10 s) were ended by the stop, each by a message
    # to its own inbox, not waited out until they expired empty.
    ended = held_pulls_ended_at_stop(logs)
    assert set(ended) == {"interrupted"}, ended


def ctrl_c_on_a_terminal(tmp_path: Path, level: str) -> tuple[int, str]:
    """`up` as a terminal's foreground job (stdin, stdout and stderr on a pty) at logging.level
    `level`, Ctrl-C once it has printed its banner: (exit code, what the terminal showed after)."""
    code, _before, after = up_on_a_terminal(tmp_path, level)
    return code, after


def up_on_a_terminal(tmp_path: Path, level: str) -> tuple[int, str, str]:
    """ctrl_c_on_a_terminal's run: (exit code, what the terminal showed up to the banner's last
    line, what it showed after), without colours."""
    config_path, _ports = write_config(tmp_path)
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [*AS_A_TERMINALS_FOREGROUND_JOB, str(BIN / "asyncinfer"), "up", "--config", str(config_path)],
        cwd=tmp_path,
        env={**os.environ, "ASYNCINFER_LOGGING__LEVEL": level},
        stdin=follower,
        stdout=follower,
        stderr=follower,
        start_new_session=True,
    )
    os.close(follower)
    shown = b""

    def read(wait_s: float) -> bool:
        nonlocal shown
        ready, _, _ = select.select([leader], [], [], wait_s)
        if ready:
            try:
                shown += os.read(leader, 65536)
            except OSError:  # EIO: every process holding the terminal has exited
                return False
        return bool(ready)

    try:
        deadline = time.monotonic() + 90
        while b"Ctrl-C stops everything" not in shown:
            assert process.poll() is None, shown.decode(errors="replace")
            assert time.monotonic() < deadline, shown.decode(errors="replace")
            read(1)
        started = len(shown)
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(timeout=STOPPED_WITHIN_S)
        while read(0.5):  # what it wrote before it exited
            pass
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(leader)
        for pid in nats_servers_of(tmp_path):  # its start line is not shown on a terminal at info
            os.kill(pid, signal.SIGKILL)

    def plain(shown: bytes) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", shown.decode(errors="replace"))  # the colours

    return code, plain(shown[:started]), plain(shown[started:])


def nats_servers_of(tmp_path: Path) -> list[int]:
    """The nats-server processes still running whose command line names a path in `tmp_path` (its
    store folder, its configuration)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"nats-server" in argv[0] and any(str(tmp_path).encode() in arg for arg in argv):
                found.append(int(entry.name))
    return found


def test_ctrl_c_on_a_terminal_is_two_lines(tmp_path: Path) -> None:
    """Each service's stop and disconnect events came after `stopping`, 11 lines for a stop with
    nothing in flight; they stay in the JSON logs (test_ctrl_c_stops_services_then_nats_quietly)."""
    code, after = ctrl_c_on_a_terminal(tmp_path, "info")

    assert code == 0, after
    lines = after.strip().splitlines()
    # Nothing of the start after the banner either: the batcher's scheduler_connected line, which
    # came between the banner and the Ctrl-C (CI, 3 workers, once), is waited for before the banner.
    assert len(lines) == 2, after
    assert re.search(r"\] stopping\s+\[up\] .*Ctrl-C again stops at once", lines[0]), after
    assert re.fullmatch(r"asyncinfer stopped in \d+\.\d s", lines[1].strip()), after


def test_up_on_a_terminal_shows_its_banner_first(tmp_path: Path) -> None:
    """`make up` showed ~16 info lines of each service's start (nats_server_started, gateway_started,
    model_loaded, ...) above its banner, which the user had to scroll back to. On a terminal at
    info, one line says it is starting, then the banner; those lines stay in the JSON logs
    (test_ctrl_c_stops_services_then_nats_quietly) and show at debug, warnings and errors always."""
    code, before, after = up_on_a_terminal(tmp_path, "info")

    assert code == 0, after
    lines = before.strip().splitlines()
    assert lines[0] == "asyncinfer is starting: NATS, the gateway, the scheduler, a batcher and the console ...", before
    assert lines[1] == "asyncinfer is up", before
    assert not re.search(r"\[info\s*\]", before), before


def test_ctrl_c_on_a_terminal_at_debug_shows_each_services_stop(tmp_path: Path) -> None:
    code, before, after = up_on_a_terminal(tmp_path, "debug")

    assert code == 0, after
    starts = ["nats_server_started", "gateway_started", "scheduler_started", "batcher_started", "console_started"]
    assert all(re.search(rf"\] {event}\s", before) for event in starts), before
    stops = ["console_stopped", "batcher_stopped", "scheduler_stopped", "gateway_stopped", "nats_server_stopped"]
    assert all(re.search(rf"\] {event}\s", after) for event in stops), after
    assert re.search(r"^asyncinfer stopped in \d+\.\d s", after, re.MULTILINE), after


@pytest.mark.parametrize("after", ["nats_server_started", "gateway_started"])
def test_ctrl_c_while_a_service_connects_to_nats_stops_quietly(tmp_path: Path, after: str) -> None:
    """Ctrl-C as the gateway (or the scheduler) began connecting to NATS: its abandoned connect
    ended with an error nobody read, and `up` printed asyncio's "Task exception was never
    retrieved" with a traceback, and a nats_disconnected warning, for a stop the user asked for."""
    config_path, _ports = write_config(tmp_path)
    stderr = tmp_path / "up.stderr"
    with stderr.open("w") as err:
        process = subprocess.Popen(
            [str(BIN / "asyncinfer"), "up", "--config", str(config_path)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    nats_pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while f'"event": "{after}"' not in stderr.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, stderr.read_text()
            time.sleep(0.002)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=60) == 0, stderr.read_text()
        logs = [json.loads(line) for line in stderr.read_text().splitlines() if line.strip()]
        nats_pids = [int(e["pid"]) for e in logs if e["event"] == "nats_server_started"]
        loud = [e for e in logs if e["level"] not in ("debug", "info")]
        assert loud == [], loud
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in nats_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_second_ctrl_c_stops_up_at_once_and_its_nats_server(up: UpProcess) -> None:
    """While batches in flight have their grace (up to 10 s, silent), a second Ctrl-C was ignored."""
    nats_pid = up.nats_pid()
    ctrl_c(up)
    deadline = time.monotonic() + 10  # the second once the first was taken (two at once are one signal)
    while not any(e["event"] == "stopping" for e in up.logs()) and time.monotonic() < deadline:
        time.sleep(0.01)
    ctrl_c(up)
    assert up.process.wait(timeout=30) == EXIT_FORCED
    assert any(e["event"] == "stopped_at_once" for e in up.logs())
    deadline = time.monotonic() + 10
    while pid_alive(nats_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(nats_pid)
    assert any(e["event"] == "stopping" and "Ctrl-C again" in str(e.get("hint")) for e in up.logs())


def test_its_terminal_closing_stops_up_and_its_nats_server(up: UpProcess) -> None:
    """SIGHUP to its process group, as a terminal that closes sends it: `up` died by it, leaving
    its nats-server (in a session of its own) running on the ports."""
    nats_pid = up.nats_pid()
    os.killpg(up.process.pid, signal.SIGHUP)
    assert up.process.wait(timeout=60) == 0
    assert "asyncinfer stopped" in up.rest_of_output()
    assert not pid_alive(nats_pid)


def test_up_stops_when_its_nats_server_dies(up: UpProcess) -> None:
    nats_pid = up.nats_pid()
    os.kill(nats_pid, signal.SIGKILL)

    code = up.process.wait(timeout=STOPPED_WITHIN_S)

    assert code == EXIT_UNAVAILABLE
    assert "asyncinfer stopped" in up.rest_of_output()
    # The scheduler's held pulls are cancelled at its stop (no message can end them with NATS
    # away): the stop waited out each pull's hold and 2 s (~7 s), and they ended lost.
    ended = held_pulls_ended_at_stop(up.logs())
    assert set(ended) == {"interrupted"}, ended
    # One line says why it stops, before anything else goes wrong; what the services then log of
    # a NATS that is gone (reconnect attempts, a stats round that fails) are its consequences.
    errors = [e for e in up.logs() if e["level"] == "error"]
    assert errors, up.stderr.read_text()
    assert errors[0]["service"] == "nats"
    assert "nats-server exited" in str(errors[0]["reason"])
    assert [e for e in errors if e["service"] in ("up", "nats")] == errors[:1]
    # The scheduler saw NATS was gone and did not wait out a request timeout per registry entry
    # (one per model) and its heartbeat, which took a stop past 30 s on a slow machine.
    assert any(e["event"] == "stopping_without_nats" and e["service"] == "scheduler" for e in up.logs())
    # A lost held pull is not an operator's concern (one info line per consumer, 15 with the
    # shipped models), and the lost connection is said once per service, not once per try.
    infos = [str(e["event"]) for e in up.logs() if e["level"] != "debug"]
    assert "pull_lost_with_its_connection" not in infos
    assert infos.count("nats_disconnected") <= 3, infos
    # ... and not twice: the server's closing the connection is that line, not a nats_error besides.
    eofs = [e for e in up.logs() if e["event"] == "nats_error" and "EOF" in str(e["error"]) and e["level"] != "debug"]
    assert eofs == [], eofs


def test_a_second_up_on_the_same_store_is_refused_naming_the_first(running_up: UpProcess, tmp_path: Path) -> None:
    """Given other ports (as the busy-ports message suggested), a second `up` on the same store
    ran a second nats-server over the first's files ("Stream state outdated ... will rebuild")."""
    up = running_up
    other = tmp_path / "elsewhere"
    other.mkdir()
    second, _ports = write_config(other)  # ports of its own
    second.write_text(second.read_text().replace(str(other / "data"), str(folder_of(up) / "data")))

    done = run_up_once(second, other)

    assert done.returncode == 2, (done.stdout, done.stderr)
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert f"is in use by another `asyncinfer up` (pid {up.process.pid})" in done.stderr
    assert up.process.poll() is None
    assert grpcurl(up.gateway, "asyncinfer.v1.JobService/SubmitJob", data=SUBMIT_BODY).returncode == 0


def test_a_second_up_in_the_first_ones_folder_starts_on_what_its_refusals_say(running_up: UpProcess) -> None:
    """A second `up` beside a running one: the store's refusal, then the ports' refusal, each say
    what to set, and the command with both starts (the README's way to run on other ports was
    "ASYNCINFER_GATEWAY__PORT=..., one variable per port": nine names to work out)."""
    up, tmp_path = running_up, folder_of(running_up)
    config_path = next(tmp_path.glob("*.toml"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}

    def attempt(assignments: str) -> subprocess.CompletedProcess[str]:
        command = f"{assignments} {BIN / 'asyncinfer'} up --config {config_path}"
        return subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
        )

    store_refused = attempt("")
    assert store_refused.returncode == 2, store_refused.stderr
    store = re.search(r"(ASYNCINFER_EMBEDDED_NATS__STORE_DIR=\S+) before the command", store_refused.stderr)
    assert store is not None, store_refused.stderr
    ports_refused = attempt(store.group(1))
    assert ports_refused.returncode == 2, ports_refused.stderr
    ports = re.search(r"run this one on free ports: ((?:ASYNCINFER_\w+=\d+ ?)+) \(", ports_refused.stderr)
    assert ports is not None, ports_refused.stderr
    second = subprocess.Popen(
        ["bash", "-c", f"exec env {store.group(1)} {ports.group(1)} {BIN / 'asyncinfer'} up --config {config_path}"],
        cwd=tmp_path,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert second.stdout is not None
        printed: list[str] = []
        for line in iter(second.stdout.readline, ""):  # up to the banner's last line (or an early exit)
            printed.append(line)
            if line.startswith("Ctrl-C stops everything"):
                break
        banner = "".join(printed)
    finally:
        os.killpg(second.pid, signal.SIGINT)
        second.wait(timeout=60)
        if second.stdout is not None:
            second.stdout.close()
    assert "JobService (gateway)" in banner, banner
    assert up.process.poll() is None  # the first runs on


def test_a_nats_server_a_killed_up_left_is_stopped_by_the_next_up(tmp_path: Path) -> None:
    """kill -9 of `up` (or its terminal closed) left its nats-server running on the ports, and the
    next `up` refused, blaming another `asyncinfer up` that did not exist."""
    config_path, ports = write_config(tmp_path)
    first = start_up(config_path, ports, tmp_path)
    try:
        left = first.nats_pid()
        first.process.kill()
        first.process.wait()
        assert pid_alive(left)
    finally:
        close_pipe_only(first)
    again = start_up(config_path, ports, tmp_path)
    try:
        assert not pid_alive(left)
        assert any(e["event"] == "stopping_left_nats_server" and e["pid"] == left for e in again.logs())
        assert grpcurl(again.gateway, "asyncinfer.v1.JobService/SubmitJob", data=SUBMIT_BODY).returncode == 0
    finally:
        close(again)


def close_pipe_only(up: UpProcess) -> None:
    """Its output pipe closed once read to the end (the process is dead; its nats-server is left
    running, unlike with close())."""
    while up.lines.get(timeout=10) is not None:
        pass
    if up.process.stdout is not None:
        up.process.stdout.close()
