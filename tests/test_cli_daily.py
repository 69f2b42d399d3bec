"""The client CLI's daily-life surface (issue 18): `--version`, `python -m asyncinfer`, and a
`dlq purge --all` that asks first. Run as a person runs it: a subprocess, on a terminal (a pty)
where the test needs one."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

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
