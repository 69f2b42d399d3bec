"""`asyncinfer up` owns its JetStream store while it runs: a lock beside the store, and the pid file
of the nats-server it starts there.

Two `up`s on one store (the second given other ports, as the busy-ports message suggested) ran two
nats-servers over the same files: "Stream state outdated ... will rebuild". And an `up` that died
without stopping its nats-server (kill -9, its terminal closed) left the server running, holding
the ports, so the next `up` refused, blaming "another `asyncinfer up`" that did not exist. Now the
second `up` is refused naming the first's pid, and a server left by a dead `up` is stopped: the lock
is free, so no `up` uses it, and its command line names this store's pid file, so it is ours.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from pathlib import Path
from typing import IO

import structlog

from asyncinfer.embedded_nats import pid_alive
from asyncinfer.errors import ConfigError

log = structlog.get_logger("asyncinfer.up")

LEFT_SERVER_STOP_S = 10.0


def lock_path(store: Path) -> Path:
    return store.parent / f"{store.name}.up.lock"


def pid_file(store: Path) -> Path:
    return store.parent / f"{store.name}.nats-server.pid"


def unusable_store(store: Path, error: OSError) -> ConfigError:
    """The error for a store folder `up` cannot make or write in (a file in its way, no permission,
    a read-only disk): it was an OSError's traceback from deep in the start."""
    in_the_way = isinstance(error, FileExistsError | NotADirectoryError)
    why = "a file is where a folder must be" if in_the_way else (error.strerror or str(error))
    where = f" ({error.filename})" if error.filename else ""
    return ConfigError(
        f"cannot use the JetStream store {store}: {why}{where}. Give `up` a folder it can "
        "write: embedded_nats.store_dir in the configuration file, or ASYNCINFER_EMBEDDED_NATS__STORE_DIR=... before "
        "the command"
    )


class StoreLock:
    """Held from before the ports are checked until `up` ends (the process's exit frees it too)."""

    def __init__(self, store: Path) -> None:
        self._store = store
        self._file: IO[str] | None = None

    def acquire_if_used(self) -> None:
        """`acquire`, for a store used before (its folder exists): before the ports are checked, so
        that a second `up` on it is named as such and a server a dead `up` left frees its ports.
        A new store's folder is made only once the ports are known to be free."""
        if lock_path(self._store).parent.exists():
            self.acquire()

    def acquire(self) -> None:
        """Takes the lock (unless held already), or ConfigError naming the `up` that holds it;
        then stops a nats-server a dead `up` left on this store."""
        if self._file is not None:
            return
        path = lock_path(self._store)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise ConfigError(
                f"the JetStream store {self._store} is in use by another `asyncinfer up` (pid {holder}): stop it "
                "(Ctrl-C in its terminal), or run this one on another store and other ports: "
                "ASYNCINFER_EMBEDDED_NATS__STORE_DIR=.asyncinfer/second/nats before the command, which then names "
                "the free ports to add"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle
        stop_left_server(self._store)

    def release(self) -> None:
        """Frees the lock (the file stays: the next holder writes its own pid in it)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def stop_left_server(store: Path) -> None:
    """Stops the nats-server an `up` that died left on this store, if one still runs."""
    pids = pid_file(store)
    try:
        pid = int(pids.read_text().strip())
    except (OSError, ValueError):
        return
    if not _is_our_server(pid, pids):
        pids.unlink(missing_ok=True)
        return
    log.warning(
        "stopping_left_nats_server", pid=pid, store=str(store), why="an earlier `asyncinfer up` died without it"
    )
    os.kill(pid, signal.SIGTERM)
    give_up_at = time.monotonic() + LEFT_SERVER_STOP_S
    while pid_alive(pid) and time.monotonic() < give_up_at:
        time.sleep(0.05)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    pids.unlink(missing_ok=True)


def _is_our_server(pid: int, pids: Path) -> bool:
    """Whether the process is a nats-server started with this store's pid file (a pid reused by
    another process since is left alone)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(args) and args[0].endswith(b"nats-server") and str(pids).encode() in args
