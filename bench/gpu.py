"""The GPU benchmark's parts (bench/gpu.sh runs each under a hard timeout, then the report):

    python bench/gpu.py check   --parts DIR                the CUDA path: the batcher on the device
    python bench/gpu.py measure --parts DIR --model mlp    direct torch, the batcher, PyTriton
    python bench/gpu.py report  --parts DIR --out FILE     bench/results/gpu.md from what the parts wrote

The device is $BENCH_DEVICE (gpu.sh: cuda; its dry run: cpu). `check` runs the MLP and minilm-l6
through the batcher's engine on the device and on the CPU and compares the outputs, and says where
the model's weights are. `measure` is bench/batcher_bench.py's: direct batched torch on the device
(host to device and back per batch), this batcher's KServe ModelInfer and PyTriton's dynamic
batcher, each server in its own process on the same device, at 1/32/128 concurrent single-item
tritonclient clients; each row is written to DIR as soon as it is measured, so a part cut short by
its timeout keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import batcher_bench  # noqa: E402
from bench.batcher_bench import MODELS, Row, Server, Window, direct, measure_batcher, measure_server  # noqa: E402


def device() -> str:
    return os.environ.get("BENCH_DEVICE", "cuda")


# --- check: the CUDA path ----------------------------------------------------------------------


async def _engine_outputs(model: Any, inputs: list[Any]) -> tuple[np.ndarray[Any, Any], str]:
    from asyncinfer.config import BatcherConfig
    from services.batcher.backends.loading import load_backend
    from services.batcher.engine import BatchingEngine

    backend = await asyncio.to_thread(load_backend, model, BatcherConfig())
    engine = BatchingEngine()
    engine.add_model(model, backend)
    await engine.start()
    try:
        outcomes = await asyncio.gather(*(engine.infer(model.name, [tensor]) for tensor in inputs))
    finally:
        await engine.stop(grace_s=1.0)
    placed = str(getattr(backend, "device", "?"))
    return np.concatenate([o.outputs[0].to_numpy() for o in outcomes]), placed


async def check(parts: Path) -> None:
    import torch

    from asyncinfer.tensors import Tensor
    from bench.batcher_models import minilm_config, mlp_config

    found: dict[str, Any] = {
        "device": device(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "models": {},
    }
    rng = np.random.default_rng(0)
    xs = [Tensor.from_numpy("x", rng.standard_normal((1, 512), dtype=np.float32)) for _ in range(64)]
    texts = [Tensor.from_numpy("text", np.array([t.encode()], dtype=np.object_)) for t in batcher_bench.make_texts(64)]
    for name, config, inputs in (
        ("mlp", mlp_config(128, 2.0), xs),
        ("minilm-l6", minilm_config(64, 5.0), texts),
    ):
        on_device, placed = await _engine_outputs(config.model_copy(update={"device": device()}), inputs)
        on_cpu, _ = await _engine_outputs(config.model_copy(update={"device": "cpu"}), inputs)
        found["models"][name] = {
            "placed_on": placed,
            "items": len(inputs),
            "max_abs_diff_vs_cpu": float(np.abs(on_device - on_cpu).max()),
            "agrees_with_cpu": bool(np.allclose(on_device, on_cpu, atol=1e-3, rtol=1e-3)),
        }
        print(f"  {name}: on {placed}, max |device - cpu| {found['models'][name]['max_abs_diff_vs_cpu']:.2e}")
    (parts / "check.json").write_text(json.dumps(found, indent=2))


# --- measure -----------------------------------------------------------------------------------


def _save(parts: Path, rows: list[Row]) -> None:
    for row in rows:
        name = f"row-{row.model}-{row.setup}-{row.concurrency}.json"
        (parts / name).write_text(json.dumps(dataclasses.asdict(row)))


async def measure(parts: Path, model: str, window_s: float, runs: int, clients: tuple[int, ...]) -> None:
    max_batch, delay_ms, _threads = MODELS[model]
    args = argparse.Namespace(runs=runs)
    batcher_bench.CONCURRENCY = clients  # type: ignore[assignment]  # measure_batcher reads it
    print(f"(a) direct torch {model} on {device()}", flush=True)
    sizes = os.environ.get("GPU_BATCH_SIZES")
    for size in tuple(int(b) for b in sizes.split(",")) if sizes else batcher_bench.BATCH_SIZES:
        row = Row(model, "direct", size, [await asyncio.to_thread(direct, model, size, window_s) for _ in range(runs)])
        _save(parts, [row])
        print(f"  direct {model} b={size:<4} {row.median('rate'):8.0f}/s", flush=True)
    _save(parts, await measure_batcher(model, max_batch, delay_ms, args, window_s))
    env = {**os.environ, "LD_LIBRARY_PATH": str(sysconfig.get_config_var("LIBDIR"))}
    triton = Server(["pytriton", model, str(max_batch), str(delay_ms)], env=env)
    try:
        print(f"(c) triton {model}", flush=True)
        url = f"127.0.0.1:{triton.port}"
        _save(parts, await measure_server(url, model, model, model == "minilm", runs, window_s, "triton", 0, clients))
    finally:
        triton.stop()


# --- report ------------------------------------------------------------------------------------


def _rows(parts: Path) -> list[Row]:
    rows = []
    for path in sorted(parts.glob("row-*.json")):
        data = json.loads(path.read_text())
        rows.append(Row(data["model"], data["setup"], data["concurrency"], [Window(**w) for w in data["windows"]]))
        rows[-1].mean_batch = data["mean_batch"]
    return rows


def _nvidia_smi() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "(nvidia-smi not available)"
    return out.stdout.strip() or out.stderr.strip()


def report(parts: Path, out: Path, notes: list[str]) -> None:
    checked = json.loads((parts / "check.json").read_text()) if (parts / "check.json").exists() else {}
    rows = _rows(parts)
    window = os.environ.get("GPU_WINDOW_S", "?")
    lines = [
        "# Batcher on a GPU: MLP and minilm-l6, this batcher against PyTriton on the same device",
        "",
        f"Written by `bench/gpu.sh` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Device: "
        f"`{checked.get('device', device())}`; GPU: {_nvidia_smi()}; torch {checked.get('torch', '?')} (CUDA "
        f"{checked.get('torch_cuda')}); Python {checked.get('python', '?')}; {os.cpu_count()} CPUs.",
        "",
        f"Each figure: the median of {os.environ.get('GPU_RUNS', '?')} windows of {window} s (min-max), "
        "bench/batcher_bench.py's closed loop: N concurrent single-item tritonclient.grpc.aio clients in the "
        "bench process, each server in its own process on the same device. Both servers: max batch 128 / "
        "2 ms (MLP 512->2048->2048->512 FP32) and 64 / 5 ms (minilm-l6; the batcher also caps a batch at 4096 "
        "tokens), one batch computing at a time (max_inflight_batches 1, as Triton's one model instance), "
        "torch's default threads. `direct`: batched torch on the device, host to device and back per batch "
        "(batch size in the clients column).",
        "",
    ]
    if checked.get("models"):
        lines += [
            "## The CUDA path",
            "",
            "| model | weights on | items | max abs diff vs CPU | agrees |",
            "|---|---|---|---|---|",
        ]
        for name, found in checked["models"].items():
            lines.append(
                f"| {name} | {found['placed_on']} | {found['items']} | {found['max_abs_diff_vs_cpu']:.2e} | "
                f"{'yes' if found['agrees_with_cpu'] else '**no**'} |"
            )
        lines.append("")
    by_key = {(r.model, r.setup, r.concurrency): r for r in rows}
    lines += [
        "## Throughput and latency",
        "",
        "| model | clients | batcher items/s | Triton items/s | batcher / Triton | batcher p50 / p99 ms | "
        "Triton p50 / p99 ms | batcher mean batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for clients in sorted({r.concurrency for r in rows if r.model == model and r.setup != "direct"}):
            ours, theirs = by_key.get((model, "batcher", clients)), by_key.get((model, "triton", clients))
            lines.append(
                f"| {model} | {clients} | {_rate(ours)} | {_rate(theirs)} | {_ratio(ours, theirs)} | {_lat(ours)} | "
                f"{_lat(theirs)} | {f'{ours.mean_batch:.1f}' if ours and ours.mean_batch else ''} |"
            )
    direct_rows = sorted((r for r in rows if r.setup == "direct"), key=lambda r: (r.model, r.concurrency))
    if direct_rows:
        lines += ["", "| model | direct torch, batch | items/s | p50 ms per batch |", "|---|---|---|---|"]
        lines += [f"| {r.model} | {r.concurrency} | {_rate(r)} | {r.median('p50_ms'):.2f} |" for r in direct_rows]
    if notes:
        lines += ["", "## Notes", "", *[f"- {note}" for note in notes]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def _rate(row: Row | None) -> str:
    if row is None:
        return "-"
    lo, hi = row.span("rate")
    return f"{row.median('rate'):,.0f} ({lo:,.0f}-{hi:,.0f})"


def _lat(row: Row | None) -> str:
    return "-" if row is None else f"{row.median('p50_ms'):.2f} / {row.median('p99_ms'):.2f}"


def _ratio(ours: Row | None, theirs: Row | None) -> str:
    if ours is None or theirs is None or not theirs.median("rate"):
        return "-"
    return f"{ours.median('rate') / theirs.median('rate'):.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("check", "measure", "report"))
    parser.add_argument("--parts", type=Path, required=True, help="folder the parts write to and the report reads")
    parser.add_argument("--model", choices=tuple(MODELS), default="mlp")
    parser.add_argument("--window", type=float, default=float(os.environ.get("GPU_WINDOW_S", "2")))
    parser.add_argument("--runs", type=int, default=int(os.environ.get("GPU_RUNS", "3")))
    parser.add_argument("--clients", default=os.environ.get("GPU_CLIENTS", "1,32,128"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu.md")
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    args = parser.parse_args()
    args.parts.mkdir(parents=True, exist_ok=True)
    batcher_bench.RESULTS.mkdir(parents=True, exist_ok=True)  # the servers' logs go there while they run
    if args.part == "check":
        asyncio.run(check(args.parts))
    elif args.part == "measure":
        clients = tuple(int(c) for c in args.clients.split(","))
        asyncio.run(measure(args.parts, args.model, args.window, args.runs, clients))
    else:
        report(args.parts, args.out, args.note)


if __name__ == "__main__":
    main()
