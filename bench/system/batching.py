"""Batching through the whole system (issue 6, item 3): the batcher benchmark's MLP and minilm-l6
workloads submitted as async jobs by many clients, each submitting one job (SubmitJob) and waiting
for its result (WatchJob until a terminal state), against, in the same run:

- direct batched torch at the batch size the system achieved (its mean batch, from the batcher's
  Prometheus metrics), in the bench process: the physical limit; target >= 80% of it;
- the same batcher's own synchronous KServe v2 ModelInfer path (tritonclient.grpc.aio) at the
  same concurrency;
- the same clients making one call per job ("one_call"): SubmitJob with `wait`, whose answer is the
  finished job (Replicate's Prefer: wait), for information beside the two-call clients;
- the same jobs through the batch APIs ("bulk"): the same number of jobs in flight, as clients that
  each submit JOBS_PER_MESSAGE jobs in one SubmitJobs message and wait for them on one WatchJobs
  stream (what issue 14 builds for clients with many jobs), also against direct torch at the batch
  it achieves.

nats-server, gateway, scheduler and batcher run as separate processes; the clients in the bench
process. Models, batch limits and torch threads are bench/batcher_bench.py's (MODELS).

    .venv/bin/python -m bench.system.batching [--quick] [--models mlp,minilm]

Writes bench/results/batching.json, .md, batching_throughput.png and batching_batch_sizes.png.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from asyncinfer.config import ModelConfig
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from bench.batcher_bench import MODELS, Window, batch_totals, batcher_name, direct, infer_call, make_texts
from bench.batcher_models import minilm_config, mlp_config
from bench.system.backlog_tools import Results, batcher_config, services_config, wait_batchers
from bench.system.common import ProcessGroup, cpu_seconds, matplotlib_pyplot, plot_path

CONCURRENCY = (32, 128)
# The batch-API clients' jobs per SubmitJobs message: CONCURRENCY jobs in flight are
# CONCURRENCY / JOBS_PER_MESSAGE clients.
JOBS_PER_MESSAGE = 16
TERMINAL = {
    job_pb2.JOB_STATE_SUCCEEDED,
    job_pb2.JOB_STATE_FAILED,
    job_pb2.JOB_STATE_CANCELED,
    job_pb2.JOB_STATE_EXPIRED,
    job_pb2.JOB_STATE_TIMED_OUT,
}


def model_config(model: str) -> ModelConfig:
    max_batch, delay_ms, _threads = MODELS[model]
    return (mlp_config if model == "mlp" else minilm_config)(max_batch, delay_ms)


def job_requests(model: str) -> list[job_service_pb2.SubmitJobRequest]:
    """The same inputs as the batcher benchmark's clients, as SubmitJob requests."""
    name = batcher_name(model)
    requests = []
    if model == "mlp":
        rng = np.random.default_rng(0)
        for _ in range(64):
            x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 512])
            x.raw_contents = rng.standard_normal((1, 512), dtype=np.float32).astype("<f4").tobytes()
            requests.append(job_service_pb2.SubmitJobRequest(model_name=name, inputs=[x]))
    else:
        for text in make_texts(256, seed=7):
            t = tensor_pb2.InferInputTensor(name="text", datatype="BYTES", shape=[1])
            t.contents.bytes_contents.append(text.encode())
            requests.append(job_service_pb2.SubmitJobRequest(model_name=name, inputs=[t]))
    return requests


def job_call(stub: job_service_pb2_grpc.JobServiceStub, model: str) -> Any:
    """One client step: submit a job, watch it until it ends; it must have SUCCEEDED."""
    requests = job_requests(model)
    counter = [0]

    async def call(_index: int) -> None:
        counter[0] += 1
        job = (await stub.SubmitJob(requests[counter[0] % len(requests)], timeout=120)).job
        final = None
        async for update in stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id), timeout=120):
            if update.job.state in TERMINAL:
                final = update.job
                break
        if final is None or final.state != job_pb2.JOB_STATE_SUCCEEDED:
            raise RuntimeError(f"job {job.job_id} ended {final.state if final else 'unseen'}: {final}")

    return call


def job_wait_call(stub: job_service_pb2_grpc.JobServiceStub, model: str) -> Any:
    """One client step in one call: SubmitJob with `wait`, answered with the finished job; it must
    have SUCCEEDED."""
    requests = []
    for request in job_requests(model):
        waiting = job_service_pb2.SubmitJobRequest()
        waiting.CopyFrom(request)
        waiting.wait.FromSeconds(60)
        requests.append(waiting)
    counter = [0]

    async def call(_index: int) -> None:
        counter[0] += 1
        job = (await stub.SubmitJob(requests[counter[0] % len(requests)], timeout=120)).job
        if job.state != job_pb2.JOB_STATE_SUCCEEDED:
            raise RuntimeError(f"job {job.job_id} answered {job.state}: {job}")

    return call


def job_bulk_call(stub: job_service_pb2_grpc.JobServiceStub, model: str, per_call: int) -> Any:
    """One batch-API client step: `per_call` jobs in one SubmitJobs message, then one WatchJobs
    stream until every one has ended; each must have SUCCEEDED."""
    requests = job_requests(model)
    counter = [0]

    async def call(_index: int) -> None:
        items = []
        for _ in range(per_call):
            counter[0] += 1
            items.append(job_service_pb2.SubmitJobsItem(job=requests[counter[0] % len(requests)]))

        async def message() -> Any:
            yield job_service_pb2.SubmitJobsRequest(items=items)

        job_ids = []
        async for response in stub.SubmitJobs(message(), timeout=120):
            for answer in response.answers:
                if not answer.HasField("job"):
                    raise RuntimeError(f"a job was refused: {answer.error}")
                job_ids.append(answer.job.job_id)
        open_ids = set(job_ids)
        async for response in stub.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=job_ids), timeout=120):
            for change in response.changes:
                if change.HasField("job") and change.job.state in TERMINAL:
                    if change.job.state != job_pb2.JOB_STATE_SUCCEEDED:
                        raise RuntimeError(f"job {change.job_id} ended {change.job.state}")
                    open_ids.discard(change.job_id)
            if not open_ids:
                break

    return call


def batch_histogram(metrics_port: int, model_name: str) -> dict[float, float]:
    """Cumulative counts of the batcher's asyncinfer_batch_size histogram, by upper bound."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    buckets: dict[float, float] = {}
    prefix = "asyncinfer_batch_size_bucket{"
    for line in body.splitlines():
        if line.startswith(prefix) and f'model="{model_name}"' in line:
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if bound == "+Inf" else float(bound)] = float(line.split()[-1])
    return buckets


async def drive(call: Any, concurrency: int, window_s: float, warmup_s: float = 1.0) -> Window:
    """Like bench.batcher_bench.drive, but the warm-up lasts until every client has finished a
    call (at least warmup_s): with seconds-long calls (minilm, 128 clients) a fixed warm-up would
    start the window before the first completions, in the ramp rather than the steady state."""
    latencies: list[float] = []
    completed = [0]
    state = {"measuring": False, "stop": False}
    warmed = asyncio.Event()

    async def client(index: int) -> None:
        while not state["stop"]:
            started = time.perf_counter()
            await call(index)
            completed[0] += 1
            if completed[0] >= concurrency:
                warmed.set()
            if state["measuring"]:
                latencies.append(time.perf_counter() - started)

    async def clock() -> float:
        await asyncio.sleep(warmup_s)
        await warmed.wait()
        state["measuring"] = True
        begun = time.perf_counter()
        await asyncio.sleep(window_s)
        state["measuring"] = False
        state["stop"] = True
        return time.perf_counter() - begun

    results = await asyncio.gather(clock(), *(client(i) for i in range(concurrency)))
    elapsed = results[0]
    p50, p99 = (float(np.percentile(latencies, q)) * 1000 for q in (50, 99)) if latencies else (math.nan, math.nan)
    return Window(len(latencies) / elapsed, p50, p99)


@dataclass
class Measured:
    model: str
    setup: str  # "system" | "one_call" | "bulk" | "kserve" | "direct"
    concurrency: int  # clients, or jobs in flight ("bulk"), or the batch ("direct")
    windows: list[Window] = field(default_factory=list)
    mean_batch: float = float("nan")
    batch_histogram: dict[float, float] = field(default_factory=dict)
    cpu_share: dict[str, float] = field(default_factory=dict)
    items_per_call: int = 1  # a window counts calls; "bulk" calls carry JOBS_PER_MESSAGE items

    def rates(self) -> list[float]:
        return [w.rate * self.items_per_call for w in self.windows]

    def median_rate(self) -> float:
        return float(np.median(self.rates())) if self.windows else float("nan")


async def measure(
    call: Any,
    model: str,
    setup: str,
    concurrency: int,
    runs: int,
    window_s: float,
    metrics_port: int,
    processes: dict[str, int],
    *,
    items_per_call: int = 1,
) -> Measured:
    name = batcher_name(model)
    result = Measured(model, setup, concurrency, items_per_call=items_per_call)
    before = batch_totals(metrics_port, name)
    hist_before = batch_histogram(metrics_port, name)
    cpu_before = {p: cpu_seconds(pid) for p, pid in processes.items()}
    cpu_before["bench clients"] = time.process_time()
    started = time.monotonic()
    for _ in range(runs):
        result.windows.append(await drive(call, concurrency // items_per_call, window_s, warmup_s=1.0))
    elapsed = time.monotonic() - started
    after = batch_totals(metrics_port, name)
    hist_after = batch_histogram(metrics_port, name)
    result.mean_batch = (after[0] - before[0]) / max(after[1] - before[1], 1.0)
    result.batch_histogram = {b: hist_after[b] - hist_before.get(b, 0.0) for b in hist_after}
    cpu_after = {p: cpu_seconds(pid) for p, pid in processes.items()}
    cpu_after["bench clients"] = time.process_time()
    result.cpu_share = {p: (cpu_after[p] - cpu_before[p]) / elapsed for p in cpu_after}
    print(
        f"  {setup:7} {model:6} c={concurrency:<4} {result.median_rate():8.1f}/s  mean batch "
        f"{result.mean_batch:.1f}  p99 {np.median([w.p99_ms for w in result.windows]):.0f} ms",
        flush=True,
    )
    return result


async def measure_model(model: str, args: argparse.Namespace) -> list[Measured]:
    config_model = model_config(model)
    _max_batch, _delay, torch_threads = MODELS[model]
    os.environ["BENCH_TORCH_THREADS"] = str(torch_threads)
    measured: list[Measured] = []
    with ProcessGroup() as group:
        nats_server = group.nats()
        config = services_config(nats_server.url, [config_model], batcher={"torch_threads": torch_threads})
        gateway = group.service("gateway", config)
        scheduler = group.service("scheduler", config)
        batcher_cfg = batcher_config(config, scheduler.address, metrics=True)
        batcher = group.service("batcher", batcher_cfg)
        await wait_batchers(scheduler.address, config_model.name, 1)
        assert nats_server.process is not None
        processes = {
            "nats-server": nats_server.process.pid,
            "gateway": gateway.pid,
            "scheduler": scheduler.pid,
            "batcher": batcher.pid,
        }
        metrics_port = batcher_cfg.batcher.metrics_port
        import tritonclient.grpc.aio as triton

        async with grpc.aio.insecure_channel(gateway.address) as channel:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            call = job_call(stub, model)
            await asyncio.gather(*(call(i) for i in range(8)))  # warm-up
            for concurrency in args.concurrency:
                measured.append(
                    await measure(call, model, "system", concurrency, args.runs, args.window, metrics_port, processes)
                )
            one_call = job_wait_call(stub, model)
            for concurrency in args.concurrency:
                measured.append(
                    await measure(
                        one_call, model, "one_call", concurrency, args.runs, args.window, metrics_port, processes
                    )
                )
            bulk = job_bulk_call(stub, model, JOBS_PER_MESSAGE)
            for concurrency in args.concurrency:
                measured.append(
                    await measure(
                        bulk,
                        model,
                        "bulk",
                        concurrency,
                        args.runs,
                        args.window,
                        metrics_port,
                        processes,
                        items_per_call=JOBS_PER_MESSAGE,
                    )
                )
        client = triton.InferenceServerClient(batcher.address)
        try:
            kserve = infer_call(client, model, batcher_name(model), False)
            for concurrency in args.concurrency:
                measured.append(
                    await measure(kserve, model, "kserve", concurrency, args.runs, args.window, metrics_port, processes)
                )
        finally:
            await client.close()
    # Direct torch at the batch sizes the system reached, with the services stopped and the
    # batcher's torch threads (so the ratio is the system's overhead, not a thread setting; on a
    # shared machine two OpenMP threads also collapse when another process takes a core).
    import torch

    default_threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads or default_threads)
    try:
        done: set[int] = set()
        for system in [m for m in measured if m.setup in ("system", "one_call", "bulk")]:
            size = max(1, round(system.mean_batch))
            if size in done:
                continue
            done.add(size)
            row = Measured(model, "direct", size)
            row.windows = [await asyncio.to_thread(direct, model, size, args.window) for _ in range(args.runs)]
            row.mean_batch = size
            measured.append(row)
            print(f"  direct  {model:6} b={size:<4} {row.median_rate():8.1f}/s", flush=True)
    finally:
        torch.set_num_threads(default_threads)
    return measured


def report(measured: list[Measured], results: Results, args: argparse.Namespace) -> None:
    for m in measured:
        what = {
            "system": f"async jobs, {m.concurrency} clients (SubmitJob + WatchJob)",
            "one_call": f"async jobs, {m.concurrency} clients (SubmitJob with wait: one call)",
            "bulk": (
                f"async jobs, {m.concurrency} in flight as {m.concurrency // m.items_per_call} clients of "
                f"SubmitJobs ({m.items_per_call} jobs a message) + WatchJobs"
            ),
            "kserve": f"batcher KServe ModelInfer, {m.concurrency} clients",
            "direct": f"direct torch, batch {m.concurrency}",
        }[m.setup]
        note = f"mean batch {m.mean_batch:.1f}; p50 {np.median([w.p50_ms for w in m.windows]):.1f} ms, p99 " + (
            f"{np.median([w.p99_ms for w in m.windows]):.1f} ms"
        )
        if m.setup == "bulk":
            note += " (per message)"
        if m.setup == "direct":
            note = f"per batch: p50 {np.median([w.p50_ms for w in m.windows]):.1f} ms"
        results.row(f"{m.model}: {what}", m.rates(), "items/s", note)
    for system in [m for m in measured if m.setup in ("system", "one_call", "bulk")]:
        size = max(1, round(system.mean_batch))
        direct_row = next(
            m for m in measured if m.setup == "direct" and m.model == system.model and m.concurrency == size
        )
        kserve = next(
            (
                m
                for m in measured
                if m.setup == "kserve" and m.model == system.model and m.concurrency == system.concurrency
            ),
            None,
        )
        value = _div(system.median_rate(), direct_row.median_rate())
        if system.setup == "system":
            results.ratio(
                f"{system.model} at {system.concurrency} clients: system / direct torch at batch {size}",
                value,
                ">= 0.80",
                value >= 0.80,
            )
        elif system.setup == "one_call":
            results.ratio(
                f"{system.model} at {system.concurrency} clients in one call each (SubmitJob with wait): system / "
                f"direct torch at batch {size}",
                value,
                "for information (the target's clients are the two-call ones above)",
                None,
            )
        else:
            results.ratio(
                f"{system.model}, {system.concurrency} jobs in flight through the batch APIs: system / direct "
                f"torch at batch {size}",
                value,
                ">= 0.80",
                value >= 0.80,
            )
        who = f"{system.concurrency} jobs in flight" if system.setup == "bulk" else f"{system.concurrency} clients"
        if kserve is not None:
            results.ratio(
                f"{system.model} at {who}: {system.setup} / batcher's KServe path at {system.concurrency} clients",
                _div(system.median_rate(), kserve.median_rate()),
                "for information (the synchronous path's figure at the same concurrency)",
                None,
            )
        if system.cpu_share:
            shares = ", ".join(
                f"{p} {share:.2f}" for p, share in sorted(system.cpu_share.items(), key=lambda kv: -kv[1])
            )
            services_cpu = sum(share for p, share in system.cpu_share.items() if p != "bench clients")
            per_job_ms = _div(services_cpu, system.median_rate()) * 1000
            compute_ms = _div(1.0, direct_row.median_rate()) * 1000
            results.note(
                f"{system.model} at {who} through the system ({system.setup}), CPU-seconds per second by "
                f"process: {shares} (the machine has {os.cpu_count()} CPUs): {per_job_ms:.1f} ms of service CPU "
                f"per job, against {compute_ms:.2f} ms of direct torch time per item at batch {size}."
            )
    results.note(
        f"Setup: nats-server, gateway, scheduler and batcher as separate processes; clients in the bench process "
        f"(one gRPC channel; each client submits one job and watches it to SUCCEEDED, then the next). Windows "
        f"of {args.window:g} s after 1 s of warm-up, median of {args.runs} (min-max). Models as in the batcher "
        "benchmark: MLP 512-2048-2048-512 FP32 (max batch 128, delay 2 ms, 1 torch thread in the batcher) and "
        "minilm-l6 on mixed-length texts (max batch 64, delay 5 ms, 4096 tokens a batch, torch's default "
        "threads); max_queue_size 1024 (the batcher's credits), max_inflight_batches 1. Direct torch runs in "
        "the bench process after the services have stopped, with the batcher's torch threads (MLP 1, minilm "
        "torch's default), bench/batcher_bench.py's `direct` (for minilm: padded to the longest text of the "
        "batch, where the batcher buckets by length)."
    )


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def plot(measured: list[Measured], models: list[str]) -> list[Path]:
    plt = matplotlib_pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for setup, label in (
            ("system", "async jobs (whole system)"),
            ("one_call", "async jobs, one call each (SubmitJob with wait)"),
            ("bulk", "async jobs, batch APIs (jobs in flight)"),
            ("kserve", "batcher KServe (sync)"),
        ):
            rows = [m for m in measured if m.model == model and m.setup == setup]
            ax.errorbar(
                [m.concurrency for m in rows],
                [m.median_rate() for m in rows],
                yerr=[
                    [m.median_rate() - min(m.rates()) for m in rows],
                    [max(m.rates()) - m.median_rate() for m in rows],
                ],
                marker="o",
                capsize=3,
                label=label,
            )
        for m in [m for m in measured if m.model == model and m.setup == "direct"]:
            ax.axhline(m.median_rate(), linestyle=":", color="grey", linewidth=0.9)
            ax.annotate(f"direct torch, batch {m.concurrency}", (min(CONCURRENCY), m.median_rate()), fontsize=7)
        ax.set(title=f"{model}: items/s", xscale="log", xlabel="concurrent clients", ylabel="items/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    throughput = plot_path("batching", "throughput")
    fig.savefig(throughput, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for m in [m for m in measured if m.model == model and m.setup in ("system", "one_call", "bulk", "kserve")]:
            bounds = sorted(b for b in m.batch_histogram if b != float("inf"))
            counts, previous = [], 0.0
            for bound in bounds:
                counts.append(m.batch_histogram[bound] - previous)
                previous = m.batch_histogram[bound]
            total = sum(counts) or 1.0
            ax.plot(
                [str(int(b)) for b in bounds],
                [c / total for c in counts],
                marker="o",
                label=f"{m.setup} c={m.concurrency}",
            )
        ax.set(title=f"{model}: batch sizes (share of batches, by bucket upper bound)", xlabel="rows per batch (<=)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    sizes = plot_path("batching", "batch_sizes")
    fig.savefig(sizes, dpi=110)
    plt.close(fig)
    return [throughput, sizes]


async def run(args: argparse.Namespace) -> Results:
    results = Results(
        "batching", "Batching through the whole system: MLP and minilm-l6 as async jobs", quick=args.quick
    )
    measured: list[Measured] = []
    for model in args.models:
        print(f"{model}:", flush=True)
        measured += await measure_model(model, args)
    report(measured, results, args)
    results.plots += plot(measured, args.models)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 clients, 1 s windows, 1 run: seconds")
    parser.add_argument("--models", default="mlp,minilm", help="comma-separated: mlp,minilm")
    parser.add_argument("--window", type=float, default=0.0, help="seconds per window (default 3; quick 1.5)")
    parser.add_argument("--runs", type=int, default=0, help="windows per figure (default 3; quick 1)")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.window = args.window or (1.5 if args.quick else 3.0)
    args.runs = args.runs or (1 if args.quick else 3)
    args.concurrency = (32,) if args.quick else CONCURRENCY
    started = time.monotonic()
    results = asyncio.run(run(args))
    path = results.write()
    print(f"wrote {path} in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
