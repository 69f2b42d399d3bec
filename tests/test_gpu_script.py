"""bench/gpu.sh, the GPU benchmark, tested where there is no GPU: without nvidia-smi it stops at
once with a clear message and exit code 2; its dry run (GPU_DRY_RUN=1: the same script on the CPU,
tiny sizes) runs every part, the batcher and PyTriton included, and writes the report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu.sh"
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def run(env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path: Path) -> None:
    # A PATH with bash and coreutils but no nvidia-smi (this machine has none anyway).
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "GPU_OUT": str(tmp_path / "gpu.md")}
    done = run(env, 30)
    assert done.returncode == 2, done.stderr
    assert "no NVIDIA GPU here: nvidia-smi is not on PATH" in done.stderr
    assert "GPU_DRY_RUN=1" in done.stderr
    assert not (tmp_path / "gpu.md").exists()


def test_the_dry_run_runs_every_part_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_DRY_RUN": "1",
        "GPU_OUT": str(out),
        "GPU_MODELS": "mlp",  # minilm's parts are the same code; the MLP alone keeps this test short
        "GPU_CLIENTS": "1,4",
    }
    done = run(env, 240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = out.read_text()
    assert "## The CUDA path" in report
    assert "| mlp | cpu | 64 |" in report
    assert "| minilm-l6 | cpu | 64 |" in report
    for clients in (1, 4):
        row = next(line for line in report.splitlines() if line.startswith(f"| mlp | {clients} |"))
        cells = [cell.strip() for cell in row.split("|")]
        assert "-" not in cells[3:5], row  # the batcher's and Triton's figures are there
    assert "a dry run on the CPU" in report
