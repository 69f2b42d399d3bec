"""A/B of an MLP file batch through `asyncinfer up` (gateway, scheduler and batcher in one process on
the embedded nats-server), `batcher.claim_check_io` off against on, alternated round by round, a
fresh `up` each round.

    .venv/bin/python -m bench.system.up_batch_ab [--records N] [--rounds N]

`up` turns the setting on unless its file says otherwise (services/up/defaults.py); this runs both
ways with the file saying so. Each round: the MLP of bench/system/batch_files.py (two batches at
once, chunks of 2,048 records) over N NPY records, uploaded, then created and waited for through
the SDK; interactive jobs one at a time meanwhile. Writes bench/results/up_batch_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from asyncinfer.client import AsyncClient
from asyncinfer.config import load_config, render_default_config
from asyncinfer.embedded_nats import free_port
from bench.batcher_models import mlp_config
from bench.system.batch_files import BATCH_INFLIGHT, CHUNK_RECORDS, mlp_file
from bench.system.common import PYTHON, RESULTS, ROOT, log, machine_facts

READY_S = 120.0


def up_config(folder: Path, claim_check_io: bool, upload_bytes: int) -> tuple[Path, int]:
    gateway_port = free_port()
    model = mlp_config(128, 2.0).model_copy(update={"max_inflight_batches": BATCH_INFLIGHT["mlp"], "device": "cpu"})
    config = load_config(None, environ={}).replace(
        models=[model],
        embedded_nats={"port": free_port(), "monitor_port": 0, "store_dir": str(folder / "data" / "nats")},
        gateway={"port": gateway_port, "metrics_port": 0, "max_upload_bytes": upload_bytes},
        scheduler={"port": free_port(), "metrics_port": 0},
        batcher={"port": free_port(), "metrics_port": 0, "claim_check_io": claim_check_io},
        console={"port": 0},
        batches={"chunk_records": CHUNK_RECORDS},
    )
    path = folder / "asyncinfer.toml"
    path.write_text(render_default_config(config))
    return path, gateway_port


async def ready(address: str) -> None:
    deadline = time.monotonic() + READY_S
    async with AsyncClient(address, timeout_s=5) as client:
        while time.monotonic() < deadline:
            try:
                job = await client.submit("mlp", {"x": np.zeros((1, 512), np.float32)})
                if (await client.wait(job, timeout_s=60)).succeeded:
                    return
            except Exception:  # not up yet
                await asyncio.sleep(0.5)
    raise RuntimeError(f"up at {address} did not serve the model within {READY_S} s")


async def interactive(address: str, stop: asyncio.Event) -> list[float]:
    latencies: list[float] = []
    async with AsyncClient(address) as client:
        while not stop.is_set():
            started = time.perf_counter()
            job = await client.submit("mlp", {"x": np.ones((1, 512), np.float32)})
            await client.wait(job, timeout_s=60)
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.2)
    return latencies


async def drive(address: str, data: bytes) -> dict[str, Any]:
    """Once `up` serves the model: the batch, with interactive jobs beside it."""
    await ready(address)
    async with AsyncClient(address, timeout_s=600) as client:
        stop = asyncio.Event()
        waits = asyncio.create_task(interactive(address, stop))
        created = await client.create_batch(data, "mlp")
        done = await client.wait_batch(created, timeout_s=600)
        stop.set()
        latencies = await waits
    assert done.in_progress_time is not None
    assert done.end_time is not None
    run_s = (done.end_time - done.in_progress_time).total_seconds()
    return {
        "state": str(done.state),
        "completed": done.completed,
        "run_s": run_s,
        "records_per_s": done.completed / run_s,
        "interactive_s": latencies,
    }


def one_round(data: bytes, claim_check_io: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="up-batch-ab-") as tmp:
        folder = Path(tmp)
        config_path, port = up_config(folder, claim_check_io, len(data) + (1 << 20))
        with (folder / "up.log").open("w") as log_file:
            process = subprocess.Popen(
                [PYTHON, "-m", "services.cli", "up", "--config", str(config_path)],
                cwd=ROOT,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
            try:
                return {"claim_check_io": claim_check_io, **asyncio.run(drive(f"127.0.0.1:{port}", data))}
            finally:
                process.terminate()
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    data, _raw = mlp_file(args.records)
    rows: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for number in range(args.rounds):
        order = [False, True] if number % 2 == 0 else [True, False]
        for claim_check_io in order:
            result = one_round(data, claim_check_io)
            name = "on" if claim_check_io else "off"
            rows[name].append(result)
            log(
                f"round {number + 1}, claim_check_io {name}: {result['records_per_s']:,.0f} records/s, "
                f"{result['state']}, slowest interactive job {max(result['interactive_s'], default=float('nan')):.3f} s"
            )
    lines = [
        "# A/B: an MLP file batch through `asyncinfer up`, `batcher.claim_check_io` off vs on (bench/system/up_batch_ab.py)",
        "",
        f"{args.records:,} NPY records per round, chunks of {CHUNK_RECORDS}, {args.rounds} alternated rounds, a fresh `up` each.",
        f"Machine: {machine_facts()}",
        "",
        "| claim_check_io | records/s, median (min-max) | rounds | interactive jobs: slowest per round, s |",
        "|---|---|---:|---|",
    ]
    for name, results in rows.items():
        rates = [r["records_per_s"] for r in results]
        slowest = ", ".join(f"{max(r['interactive_s'], default=float('nan')):.3f}" for r in results)
        lines.append(
            f"| {name} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) | {len(rates)} | {slowest} |"
        )
    off, on = (statistics.median(r["records_per_s"] for r in rows[n]) for n in ("off", "on"))
    lines += ["", f"on / off: {on / off:.2f}"]
    (RESULTS / "up_batch_ab.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "up_batch_ab.json").write_text(json.dumps({"machine": machine_facts(), "rows": rows}, indent=1))
    log("\n".join(lines))


if __name__ == "__main__":
    main()
