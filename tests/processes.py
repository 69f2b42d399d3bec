"""Services as their own processes (`asyncinfer <service> --config ...`), for the tests that kill
them with SIGKILL and start them again on the same port."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.waits import START_S

BIN = Path(sys.executable).parent


async def until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Polls a condition until it holds (bounded)."""
    give_up_at = time.monotonic() + timeout_s
    while True:
        if condition():
            return
        if time.monotonic() > give_up_at:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class Service:
    """One service process, restartable on the same port."""

    def __init__(self, name: str, config_file: Path, log_dir: Path, port: int) -> None:
        self.name = name
        self.port = port
        self._config_file = config_file
        self._log_dir = log_dir
        self._process: subprocess.Popen[str] | None = None
        self.starts = 0

    async def start(self) -> None:
        process = await asyncio.to_thread(self._spawn)
        assert process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), START_S)
        if f"serving on 127.0.0.1:{self.port}" not in line:
            # It printed something else, or exited (stdout closed): its log (stderr) says why.
            code = await asyncio.to_thread(self._exit_code)
            log = self._log_path().read_text()[-3000:]
            raise AssertionError(f"{self.name} did not start: stdout {line!r}, exit code {code}, its log:\n{log}")

    def _exit_code(self) -> int | None:
        assert self._process is not None
        try:
            return self._process.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def _log_path(self) -> Path:
        return self._log_dir / f"{self.name}-{self.starts}.log"

    def _spawn(self) -> subprocess.Popen[str]:
        self.starts += 1
        log = open(self._log_path(), "w")  # noqa: SIM115 - closed below
        process = subprocess.Popen(
            [str(BIN / "asyncinfer"), self.name, "--config", str(self._config_file)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ},
        )
        log.close()
        self._process = process
        return process

    def kill(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGKILL)
        self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if self._process is not None and self._process.stdout is not None:
            self._process.stdout.close()
