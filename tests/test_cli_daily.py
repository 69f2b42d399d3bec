"""The client CLI's daily-life surface (issue 18): `--version`, `python -m asyncinfer`, and a
`dlq purge --all` that asks first. Run as a person runs it: a subprocess, on a terminal (a pty)
where the test needs one."""

from __future__ import annotations

import asyncio
import os
import pty
import select
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tests.stack import Stack

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


async def test_purge_all_asks_on_a_terminal_and_does_only_on_yes(stack: Stack) -> None:
    code, out, shown = await asyncio.to_thread(purge_all_on_a_terminal, "127.0.0.1:1", "n")
    assert (code, out) == (0, "nothing purged\n"), shown  # nothing was called: no scheduler listens there
    assert "delete every dead letter? This cannot be undone. [y/N] " in shown
    code, out, shown = await asyncio.to_thread(purge_all_on_a_terminal, stack.ops_address, "y")
    assert (code, out) == (0, "purged 0 dead letter(s); 0 left\n"), shown
