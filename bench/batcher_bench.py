"""Batcher benchmark (not a test): the same model, on this machine, in one run:

(a) direct batched torch at batch sizes 1, 8, 32, 128 (the physical limit);
(b) this batcher's KServe ModelInfer (batcher in its own process) with 1, 32, 128 concurrent
    single-item tritonclient.grpc.aio clients;
(c) Triton's own dynamic batcher (PyTriton, its own process): same model, max batch size,
    queue delay, client and concurrencies;
(d) a trivial unary grpc.aio call (1 KB in, 2 bytes out) at the same concurrencies: the ceiling
    per-request RPC overhead puts on a Python server here.

Models: an MLP 512->2048->2048->512 FP32 and minilm-l6 on texts of mixed length. Each figure is
the median of --runs windows (min-max alongside). Writes bench/results/batcher.md and .png.

    .venv/bin/python bench/batcher_bench.py [--window 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.batcher_servers import ECHO_METHOD, free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CONCURRENCY = (1, 32, 128)
BATCH_SIZES = (1, 8, 32, 128)
# Max batch size, max queue delay (ms), torch intra-op threads in both servers (0: torch's default,
# the core count). Every server runs with torch's default threads: a reference runs the way its
# users run it (Triton's users do not pin torch to one thread), and ours is held to the same.
MODELS = {"mlp": (128, 2.0, 0), "minilm": (64, 5.0, 0)}
# minilm's calls take seconds at 128 clients: its windows are this many times --window long, so
# that each holds enough calls for a p99.
WINDOW_FACTOR = {"mlp": 1.0, "minilm": 3.0}

WORDS = [
    "the",
    "batcher",
    "packs",
    "queued",
    "jobs",
    "into",
    "batches",
    "so",
    "that",
    "one",
    "model",
    "call",
    "serves",
    "many",
    "callers",
    "while",
    "latency",
    "stays",
    "low",
    "and",
    "padding",
    "waste",
    "stays",
    "small",
    "across",
    "length",
    "buckets",
    "on",
    "a",
    "small",
    "machine",
]


def make_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 8, 16, 32, 64)))) for _ in range(count)]


@dataclass
class Window:
    rate: float
    p50_ms: float
    p99_ms: float


@dataclass
class Row:
    model: str
    setup: str
    concurrency: int
    windows: list[Window] = field(default_factory=list)
    mean_batch: float | None = None

    def median(self, attr: str) -> float:
        return statistics.median(getattr(w, attr) for w in self.windows)

    def span(self, attr: str) -> tuple[float, float]:
        values = [getattr(w, attr) for w in self.windows]
        return min(values), max(values)


# --- (a) direct torch ------------------------------------------------------------------------


def direct(model: str, batch_size: int, window_s: float) -> Window:
    import torch

    if model == "mlp":
        from bench.batcher_models import build_mlp, torch_device

        device = torch_device()
        mlp = build_mlp().to(device)
        x = torch.randn(batch_size, 512)

        def step() -> None:
            # Host to device and back, as a server does per batch.
            with torch.inference_mode():
                mlp(x.to(device)).cpu()
    else:
        from asyncinfer.config import BatcherConfig
        from bench.batcher_models import minilm_config
        from services.batcher.backends.loading import load_backend

        backend = load_backend(minilm_config(128, 5.0), BatcherConfig())
        texts = np.array([t.encode() for t in make_texts(batch_size, seed=batch_size)], dtype=np.object_)

        def step() -> None:
            backend.infer_batch({"text": texts})

    step()
    latencies = []
    start = time.perf_counter()
    while time.perf_counter() - start < window_s:
        t0 = time.perf_counter()
        step()
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    return Window(len(latencies) * batch_size / elapsed, _pct(latencies, 50), _pct(latencies, 99))


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


# --- servers ---------------------------------------------------------------------------------


class Server:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log = RESULTS / f".{args[0]}-{self.port}.log"
        argv = [sys.executable, str(ROOT / "bench" / "batcher_servers.py"), args[0], str(self.port), *args[1:]]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT
            )
        deadline = time.monotonic() + 120
        while b"READY" not in self.log.read_bytes():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args} did not start: {self.log.read_bytes()[-2000:].decode(errors='replace')}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.unlink(missing_ok=True)


async def drive(call: Any, concurrency: int, window_s: float, warmup_s: float = 0.5) -> Window:
    """Closed loop: `concurrency` clients, each sending its next request when its last one is
    answered. The window opens once every client's first request has been answered (past the
    start-up burst) and warmup_s more. Throughput counts the requests that ended inside the
    window; latency takes every request that started inside it, each client finishing its last
    one, so slow requests are never left out (with latencies near the window's length, counting
    only requests that both started and ended inside it would keep the fast ones)."""
    latencies: list[float] = []
    completed = 0
    window = [math.inf, math.inf]
    first_answers = asyncio.Event()
    waiting_first = concurrency

    async def client(index: int) -> None:
        nonlocal completed, waiting_first
        first = True
        while (started := time.perf_counter()) < window[1]:
            await call(index)
            ended = time.perf_counter()
            if started >= window[0]:
                latencies.append(ended - started)
            if window[0] <= ended < window[1]:
                completed += 1
            if first:
                first = False
                waiting_first -= 1
                if waiting_first == 0:
                    first_answers.set()

    async def clock() -> None:
        await first_answers.wait()
        await asyncio.sleep(warmup_s)
        window[0] = time.perf_counter()
        window[1] = window[0] + window_s

    await asyncio.gather(clock(), *(client(i) for i in range(concurrency)))
    return Window(completed / window_s, _pct(latencies, 50), _pct(latencies, 99))


def infer_call(client: Any, model: str, remote_name: str, triton_shape: bool) -> Any:
    import tritonclient.grpc.aio as triton

    if model == "mlp":
        rng = np.random.default_rng(0)
        payloads = [rng.standard_normal((1, 512), dtype=np.float32) for _ in range(64)]
        name, datatype = "x", "FP32"
        output = "y"
    else:
        texts = make_texts(256, seed=7)
        shape = (1, 1) if triton_shape else (1,)
        payloads = [np.array([t.encode()], dtype=np.object_).reshape(shape) for t in texts]
        name, datatype = "text", "BYTES"
        output = "embedding"
    inputs = []
    for payload in payloads:
        infer_input = triton.InferInput(name, list(payload.shape), datatype)
        infer_input.set_data_from_numpy(payload)
        inputs.append(infer_input)
    wanted = [triton.InferRequestedOutput(output)]
    counter = [0]

    async def call(_index: int) -> None:
        counter[0] += 1
        result = await client.infer(remote_name, [inputs[counter[0] % len(inputs)]], outputs=wanted)
        assert result.as_numpy(output) is not None

    return call


async def measure_server(
    url: str,
    model: str,
    remote_name: str,
    triton_shape: bool,
    runs: int,
    window_s: float,
    setup: str,
    metrics_port: int = 0,
    concurrencies: tuple[int, ...] = CONCURRENCY,
) -> list[Row]:
    import tritonclient.grpc.aio as triton

    rows = []
    client = triton.InferenceServerClient(url)
    try:
        call = infer_call(client, model, remote_name, triton_shape)
        for concurrency in concurrencies:
            row = Row(model, setup, concurrency)
            before = batch_totals(metrics_port, remote_name) if metrics_port else (0.0, 0.0)
            for _ in range(runs):
                row.windows.append(await drive(call, concurrency, window_s))
            if metrics_port:
                after = batch_totals(metrics_port, remote_name)
                row.mean_batch = (after[0] - before[0]) / max(after[1] - before[1], 1.0)
            rows.append(row)
            print(
                f"  {setup:8} {model:6} c={concurrency:<4} {row.median('rate'):8.0f}/s p99 {row.median('p99_ms'):6.1f} ms",
                flush=True,
            )
    finally:
        await client.close()
    return rows


async def measure_echo(url: str, runs: int, window_s: float) -> list[Row]:
    import grpc

    rows = []
    async with grpc.aio.insecure_channel(url) as channel:
        method = channel.unary_unary(ECHO_METHOD)
        payload = os.urandom(1024)

        async def call(_index: int) -> None:
            await method(payload)

        for concurrency in CONCURRENCY:
            row = Row("-", "grpc-echo", concurrency)
            for _ in range(runs):
                row.windows.append(await drive(call, concurrency, window_s))
            rows.append(row)
            print(
                f"  echo c={concurrency:<4} {row.median('rate'):8.0f}/s p99 {row.median('p99_ms'):6.1f} ms", flush=True
            )
    return rows


def batch_totals(metrics_port: int, model_name: str) -> tuple[float, float]:
    """The batcher's (rows, batches) so far, from its Prometheus metrics."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    values = {"sum": 0.0, "count": 0.0}
    for line in body.splitlines():
        for key in values:
            if line.startswith(f'asyncinfer_batch_size_{key}{{model="{model_name}"}}'):
                values[key] = float(line.split()[-1])
    return values["sum"], values["count"]


# --- report ----------------------------------------------------------------------------------


def write_report(rows: list[Row], window_s: float, runs: int, out: str = "batcher") -> None:
    lines = [
        "# Batcher benchmark",
        "",
        f"Machine: {os.cpu_count()} CPUs; windows of {window_s:g} s (minilm: {window_s * WINDOW_FACTOR['minilm']:g} s), "
        "opened once every client's first call is answered and 0.5 s more; throughput counts calls that ended in "
        f"the window, latency every call that started in it; median of {runs} runs "
        "(min-max). Clients: tritonclient.grpc.aio, one channel, N concurrent single-item requests, in the "
        "bench process; servers in their own processes, on uvloop (as the services run). `grpc-echo`: a trivial "
        "unary call (1 KB in, 2 bytes out) with a plain grpc.aio client; `kserve-noop`: a KServe ModelInfer that "
        "answers a canned output at once, driven by the same tritonclient client as the batcher (the ceiling "
        "with this client's own cost included). Max batch / queue delay: MLP 128 / 2 ms, "
        "minilm 64 / 5 ms (the batcher also caps minilm batches at 4096 tokens); the batcher computes one "
        "batch at a time (max_inflight_batches 1, as Triton's one model instance); torch threads in both "
        "servers: torch's default (the core count) for both models. `unbatched`: the same batcher with max batch 1 and no "
        "delay (batching off), the 1-client latency reference.",
        "",
        "| model | setup | concurrency / batch | items/s (min-max) | p50 ms | p99 ms | mean batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lo, hi = row.span("rate")
        batch = f"{row.mean_batch:.1f}" if row.mean_batch else ""
        lines.append(
            f"| {row.model} | {row.setup} | {row.concurrency} | {row.median('rate'):,.0f} ({lo:,.0f}-{hi:,.0f}) | "
            f"{row.median('p50_ms'):.2f} | {row.median('p99_ms'):.2f} | {batch} |"
        )
    checks = target_checks(rows)
    if checks:
        lines += ["", "| target (issue 4) | figure | met |", "|---|---|---|"]
        lines += [f"| {name} | {figure} | {'yes' if met else '**no**'} |" for name, figure, met in checks]
    (RESULTS / f"{out}.md").parent.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out}.md").write_text("\n".join(lines) + "\n")
    plot(rows, out)


def target_checks(rows: list[Row]) -> list[tuple[str, str, bool]]:
    """Issue 4's targets, from the medians of this run's rows (those it measured)."""
    found = {(r.model, r.setup, r.concurrency): r for r in rows}
    checks: list[tuple[str, str, bool]] = []
    for clients in CONCURRENCY[1:]:
        ours, triton = found.get(("mlp", "batcher", clients)), found.get(("mlp", "triton", clients))
        if ours and triton:
            checks.append(
                _against_triton(f"MLP, {clients} clients: >= 2x Triton's items/s, lower p99", ours, triton, 2)
            )
        echo, noop = found.get(("-", "grpc-echo", clients)), found.get(("mlp", "kserve-noop", clients))
        if ours and echo:
            share = ours.median("rate") / echo.median("rate")
            noop_note = f"; {ours.median('rate') / noop.median('rate'):.2f} of the no-op KServe server" if noop else ""
            checks.append(
                (f"MLP, {clients} clients: >= 70% of the trivial call's rate", f"{share:.2f}{noop_note}", share >= 0.7)
            )
    single, off = found.get(("mlp", "batcher", 1)), found.get(("mlp", "unbatched", 1))
    if single and off:
        slower = single.median("p50_ms") / off.median("p50_ms") - 1
        checks.append(
            (
                "MLP, 1 client: p50 within 10% of batching off",
                f"{single.median('p50_ms'):.2f} vs {off.median('p50_ms'):.2f} ms ({slower:+.0%})",
                slower <= 0.10,
            )
        )
    for clients in CONCURRENCY[1:]:
        ours, triton = found.get(("minilm", "batcher", clients)), found.get(("minilm", "triton", clients))
        if ours and ours.mean_batch:
            torch_rate = direct_rate_at("minilm", ours.mean_batch, rows)
            if torch_rate:
                share = ours.median("rate") / torch_rate
                checks.append(
                    (
                        f"minilm, {clients} clients: >= 90% of direct torch at the mean batch ({ours.mean_batch:.1f})",
                        f"{share:.2f}",
                        share >= 0.9,
                    )
                )
        if ours and triton:
            checks.append(
                _against_triton(f"minilm, {clients} clients: >= Triton's items/s at a lower p99", ours, triton, 1)
            )
    return checks


def _against_triton(name: str, ours: Row, triton: Row, times: float) -> tuple[str, str, bool]:
    """At least `times` Triton's items/s, with a lower p99."""
    ratio = ours.median("rate") / triton.median("rate")
    faster = ours.median("p99_ms") < triton.median("p99_ms")
    figure = f"{ratio:.2f}x; p99 {ours.median('p99_ms'):.1f} vs {triton.median('p99_ms'):.1f} ms"
    return name, figure, ratio >= times and faster


def direct_rate_at(model: str, batch: float, rows: list[Row]) -> float | None:
    """Direct torch's items/s at a batch size, interpolated (in log batch size) between the
    sizes measured."""
    points = sorted((r.concurrency, r.median("rate")) for r in rows if r.model == model and r.setup == "direct")
    if not points:
        return None
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, r0), (b1, r1) in itertools.pairwise(points):
        if b0 <= batch <= b1:
            share = (math.log(batch) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return r0 + share * (r1 - r0)
    return points[-1][1]


def plot(rows: list[Row], out: str = "batcher") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, model in enumerate(MODELS):
        rate_ax, p99_ax = axes[0][col], axes[1][col]
        for setup in ("batcher", "triton", "grpc-echo", "kserve-noop"):
            series = [r for r in rows if r.setup == setup and r.model in (model, "-")]
            if setup == "kserve-noop" and model != "mlp":
                continue
            if not series:
                continue
            xs = [r.concurrency for r in series]
            rate_ax.plot(xs, [r.median("rate") for r in series], marker="o", label=setup)
            if setup not in ("grpc-echo", "kserve-noop"):
                p99_ax.plot(xs, [r.median("p99_ms") for r in series], marker="o", label=setup)
        for r in rows:
            if r.model == model and r.setup == "direct":
                rate_ax.axhline(r.median("rate"), linestyle=":", color="grey", linewidth=0.8)
                rate_ax.annotate(f"torch b={r.concurrency}", (CONCURRENCY[0], r.median("rate")), fontsize=7)
        rate_ax.set(
            title=f"{model}: throughput", xscale="log", yscale="log", xlabel="concurrent clients", ylabel="items/s"
        )
        p99_ax.set(title=f"{model}: p99 latency", xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms")
        rate_ax.legend(fontsize=8)
        p99_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{out}.png", dpi=110)


async def main_async(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    setups = set(args.setups.split(","))
    if "echo" in setups:
        echo = Server(["echo"])
        try:
            print("(d) trivial unary grpc.aio", flush=True)
            rows += await measure_echo(f"127.0.0.1:{echo.port}", args.runs, args.window)
        finally:
            echo.stop()
    for model, (max_batch, delay_ms, torch_threads) in MODELS.items():
        if model not in args.models.split(","):
            continue
        os.environ["BENCH_TORCH_THREADS"] = str(torch_threads)  # read by both servers
        window_s = args.window * WINDOW_FACTOR[model]
        if "noop" in setups and model == "mlp":
            noop = Server(["kecho"])
            try:
                print("(e) KServe ModelInfer doing nothing, same client", flush=True)
                rows += await measure_server(
                    f"127.0.0.1:{noop.port}", model, model, False, args.runs, window_s, "kserve-noop"
                )
            finally:
                noop.stop()
        if "direct" in setups:
            print(f"(a) direct torch {model}", flush=True)
            for size in BATCH_SIZES:
                row = Row(model, "direct", size, [direct(model, size, window_s) for _ in range(args.runs)])
                rows.append(row)
                print(f"  direct {model} b={size:<4} {row.median('rate'):8.0f}/s", flush=True)
        if "unbatched" in setups:
            rows += await measure_unbatched(model, args, window_s)
        if "batcher" in setups:
            rows += await measure_batcher(model, max_batch, delay_ms, args, window_s)
        if "triton" in setups:
            triton_env = {**os.environ, "LD_LIBRARY_PATH": str(sysconfig.get_config_var("LIBDIR"))}
            triton = Server(["pytriton", model, str(max_batch), str(delay_ms)], env=triton_env)
            try:
                print(f"(c) triton {model}", flush=True)
                rows += await measure_server(
                    f"127.0.0.1:{triton.port}", model, model, model == "minilm", args.runs, window_s, "triton"
                )
            finally:
                triton.stop()
    return rows


async def measure_batcher(
    model: str, max_batch: int, delay_ms: float, args: argparse.Namespace, window_s: float, setup: str = "batcher"
) -> list[Row]:
    metrics_port = free_port()
    batcher = Server(["batcher", model, str(max_batch), str(delay_ms), str(metrics_port)])
    try:
        print(f"(b) {setup} {model}", flush=True)
        return await measure_server(
            f"127.0.0.1:{batcher.port}",
            model,
            batcher_name(model),
            False,
            args.runs,
            window_s,
            setup,
            metrics_port,
            concurrencies=(1,) if max_batch == 1 else CONCURRENCY,
        )
    finally:
        batcher.stop()


async def measure_unbatched(model: str, args: argparse.Namespace, window_s: float) -> list[Row]:
    """The batching-off reference: the same batcher and model over the same gRPC path, with
    max_batch_size 1 and no queue delay, at 1 client (the 1-client latency target's baseline)."""
    return await measure_batcher(model, 1, 0.0, args, window_s, setup="unbatched")


def batcher_name(model: str) -> str:
    return "mlp" if model == "mlp" else "minilm-l6"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=2.0, help="seconds measured per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: mlp,minilm")
    parser.add_argument(
        "--setups",
        default="echo,noop,direct,unbatched,batcher,triton",
        help="comma-separated subset of echo,noop,direct,unbatched,batcher,triton",
    )
    parser.add_argument("--out", default="batcher", help="report name under bench/results (.md, .png)")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = asyncio.run(main_async(args))
    write_report(rows, args.window, args.runs, args.out)
    print(f"wrote {RESULTS / args.out}.md and .png in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
