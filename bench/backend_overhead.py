"""What the batcher's torch backend adds to a batch over calling the model directly, in one process
with nothing else running (no event loop, no I/O): the MLP at 128 rows a batch on BENCH_DEVICE.

    .venv/bin/python -m bench.backend_overhead [--batches N]

Rows of records/s, each the median of three passes over the same batches:
- direct: `mlp(x.to(device)).cpu()`, each batch copied from the host (batch_files' reference);
- backend, read-only input: TorchBackend.infer_batch on a batch as a chunk's part arrives (a view of
  the order's bytes, read-only);
- backend, writable input: the same on a writable array;
- backend, part to part: what BatchRunner does for a part (assemble, infer, split into a Tensor);
- two threads: the backend, or a part, on two threads at once (max_inflight_batches 2).
Every backend output is first checked against the direct call's (the check fails the run).
Writes bench/results/backend_overhead.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.system.common import RESULTS, log, machine_facts

BATCH = 128


def rate(work: Callable[[int], object], batches: int, passes: int = 3) -> float:
    work(0)  # warm-up
    rates = []
    for _ in range(passes):
        started = time.perf_counter()
        for k in range(batches):
            work(k)
        rates.append(batches * BATCH / (time.perf_counter() - started))
    return statistics.median(rates)


def threaded_rate(work: Callable[[int], object], batches: int, threads: int) -> float:
    work(0)
    started = time.perf_counter()

    def share(t: int) -> None:
        for k in range(t, batches, threads):
            work(k)

    workers = [threading.Thread(target=share, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return batches * BATCH / (time.perf_counter() - started)


def measure(batches: int) -> dict[str, Any]:
    import torch

    from asyncinfer.config import BatcherConfig
    from asyncinfer.tensors import Tensor
    from bench.batcher_models import build_mlp, mlp_config, torch_device
    from services.batcher.assemble import assemble, split
    from services.batcher.backends.loading import load_backend
    from services.batcher.items import ItemShaper, PendingItem

    device = torch_device()
    rng = np.random.default_rng(0)
    data = rng.standard_normal((batches * BATCH, 512), dtype=np.float32)
    raw = [data[k * BATCH : (k + 1) * BATCH].tobytes() for k in range(batches)]
    readonly = [np.frombuffer(b, dtype=np.float32).reshape(BATCH, 512) for b in raw]
    writable = [a.copy() for a in readonly]
    mlp = build_mlp().to(device)
    x = torch.from_numpy(data)
    config = mlp_config(BATCH, 2.0)
    backend = load_backend(config, BatcherConfig())
    shaper = ItemShaper(config, backend)
    signature = backend.signature

    def direct(k: int) -> None:
        with torch.inference_mode():
            mlp(x[k * BATCH : (k + 1) * BATCH].to(device)).cpu()

    def part(k: int) -> None:
        item = PendingItem.__new__(PendingItem)
        item.inputs = {"x": Tensor(name="x", datatype="FP32", shape=(BATCH, 512), data=raw[k])}
        item.rows = BATCH
        item.real_units = item.length = 0
        assembled = assemble([item], signature, shaper, 0.0)
        outputs = backend.infer_batch(assembled.arrays)
        split(config.name, [item], outputs, assembled, signature)

    with torch.inference_mode():
        expected = [mlp(x[k * BATCH : (k + 1) * BATCH].to(device)).cpu().numpy() for k in range(batches)]

    differing: list[int] = []

    def checked(k: int) -> None:
        got = backend.infer_batch({"x": readonly[k]})["y"]
        if not np.allclose(got, expected[k], rtol=1e-4, atol=1e-5):
            differing.append(k)

    # On two threads at once (each on its CUDA stream), then on one.
    def check_share(t: int) -> None:
        for k in range(t, batches, 2):
            checked(k)

    workers = [threading.Thread(target=check_share, args=(t,)) for t in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for k in range(batches):
        checked(k)
    if differing:
        raise SystemExit(f"batches {differing[:10]}: the backend's outputs differ from the direct call's")
    rows = {
        "direct (each batch copied from the host)": rate(direct, batches),
        "backend, read-only input": rate(lambda k: backend.infer_batch({"x": readonly[k]}), batches),
        "backend, writable input": rate(lambda k: backend.infer_batch({"x": writable[k]}), batches),
        "backend, part to part (assemble, infer, split)": rate(part, batches),
        "backend, read-only input, two threads": threaded_rate(
            lambda k: backend.infer_batch({"x": readonly[k]}), batches, 2
        ),
        "backend, part to part, two threads": threaded_rate(part, batches, 2),
        "direct, two threads": threaded_rate(direct, batches, 2),
    }
    return {"device": str(device), "batch": BATCH, "batches": batches, "records_per_s": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--name", default="backend_overhead")
    args = parser.parse_args()
    result = measure(args.batches)
    facts = machine_facts()
    lines = [
        "# The torch backend's cost over a direct call (bench/backend_overhead.py)",
        "",
        f"The MLP, {result['batch']} rows a batch, {result['batches']} batches, on {result['device']}.",
        "",
        "| path | records/s | / direct |",
        "|---|---:|---:|",
    ]
    direct = next(iter(result["records_per_s"].values()))
    for name, value in result["records_per_s"].items():
        lines.append(f"| {name} | {value:,.0f} | {value / direct:.2f} |")
    lines += ["", f"Machine: {facts}", ""]
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"machine": facts, **result}, indent=2) + "\n")
    Path(RESULTS / f"{args.name}.md").write_text("\n".join(lines))
    log("\n".join(lines))


if __name__ == "__main__":
    main()
