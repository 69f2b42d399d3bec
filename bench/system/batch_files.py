"""Batch jobs over files (issue 15), against direct batched torch in the same run.

    .venv/bin/python -m bench.system.batch_files [--quick] [--models mlp,minilm] [--records N] [--texts N]

Per model: nats-server, gateway, scheduler and batcher as their own processes; the file is
uploaded (the MLP 512→2048→2048→512: an NPY of N FP32 records, default 200,000; minilm-l6: a JSONL
of N texts of mixed length, default 5,000), a batch created over it, and followed to its end.
Measured: records/s of the run (IN_PROGRESS to its end, and from CreateBatch), against direct
torch over the same records at the model's max_batch_size with torch's default threads, run just
before the services start and just after they stop (the ratio is to the mean of the two), and for
the MLP against a second reference run after them: the same batches on two threads calling the
model at once, torch at one thread each (on 2 cores the faster way to call torch directly, and the
way the batcher computes the MLP here: BATCH_INFLIGHT); JetStream bytes stored per record (every
stream's bytes, before and after);
each service's RSS sampled during the run (start, peak, end); and interactive jobs (one record,
NORMAL priority, SubmitJob + WatchJob) sent one at a time during the batch: their latency against
one chunk's compute at the direct rate.

Writes bench/results/batch_files.json and .md. BENCH_BATCHER_ENV=NAME=VALUE[,NAME=VALUE] sets
environment variables for the batcher's process alone (an A/B of, say, OMP_WAIT_POLICY).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from asyncinfer.nats.connection import connect
from asyncinfer.v1 import (
    batch_service_pb2,
    batch_service_pb2_grpc,
    job_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    tensor_pb2,
)
from bench.batcher_bench import MODELS, make_texts
from bench.batcher_models import minilm_config, mlp_config
from bench.system.backlog_tools import batcher_config, services_config, wait_batchers
from bench.system.common import RESULTS, ROOT, ProcessGroup, cpu_seconds, log, machine_facts, page_faults

CHUNK_RECORDS = 2048
# Batches a model computes at once here: the MLP as docs/BATCHES.md advises for file batches on
# CPU (two batches at once, torch's threads split between them by the batcher: 1.4x one batch on
# every core, bench/results/batch_files_ab.md); minilm one at a time, as it ships.
BATCH_INFLIGHT = {"mlp": 2, "minilm": 1}
IDLE_WINDOW_S = 5.0
TERMINAL = {
    batch_service_pb2.BATCH_STATE_COMPLETED,
    batch_service_pb2.BATCH_STATE_FAILED,
    batch_service_pb2.BATCH_STATE_EXPIRED,
    batch_service_pb2.BATCH_STATE_CANCELLED,
}
JOB_TERMINAL = {job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_EXPIRED}


def mlp_file(count: int) -> tuple[bytes, np.ndarray[Any, Any]]:
    x = np.random.default_rng(0).standard_normal((count, 512), dtype=np.float32)
    buffer = io.BytesIO()
    np.save(buffer, x)
    return buffer.getvalue(), x


def minilm_file(count: int) -> tuple[bytes, list[str]]:
    texts = make_texts(count, seed=11)
    lines = (json.dumps({"custom_id": f"t{i}", "inputs": {"text": [t]}}) for i, t in enumerate(texts))
    return ("\n".join(lines) + "\n").encode(), texts


@dataclass(frozen=True, kw_only=True)
class ServiceVariant:
    """How the services run in one measurement (an A/B changes one of these): the batches the
    model computes at once (torch's threads then split by the batcher), whether the batcher reads
    the chunks' rows and stores their outputs itself (`batcher.claim_check_io`: off as it ships;
    set only when True, so an older tree's configuration stays valid), and the tree whose code they
    run (None: this one; another revision's worktree for an A/B of code), how many batchers serve
    the model (several per GPU: one event loop each), and the model's loader (bench.batcher_models:
    build_light measures the services' own cost per record; direct torch still runs the MLP)."""

    label: str = "shipped"
    inflight_batches: int | None = None  # None: BATCH_INFLIGHT's
    claim_check_io: bool = False
    source: Path | None = None
    batchers: int = 1
    loader: str | None = None
    switch_interval_s: float | None = None  # the batcher's sys.setswitchinterval (None: Python's 5 ms)
    max_batch: int | None = None  # the model's max_batch_size, and direct torch's batch (None: MODELS')
    # Added to nats-server's environment (NAME=VALUE pairs: Go's GOGC, GODEBUG), None: inherited.
    nats_env: tuple[tuple[str, str], ...] = ()
    # The objects' bytes in a directory the services share, their metadata in NATS (the product
    # option nats.objects_directory, which replaced session 33's bench-only dir-store prototype);
    # the batch's outputs are then checked (check_outputs).
    objects_dir: bool = False


def direct_streams_rate(data: Any, batch_size: int, streams: int) -> float:
    """MLP records/s with `streams` threads each calling the model on its own share of the records,
    torch at one intra-op thread each: the other way to spend the cores on independent batches."""
    import threading

    import torch

    from bench.batcher_models import build_mlp, torch_device

    device = torch_device()  # $BENCH_DEVICE, as the batcher's model (each batch copied from the host)
    mlp = build_mlp().to(device)
    x = torch.from_numpy(data)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    starts = list(range(0, len(x), batch_size))

    def work(k: int) -> None:
        with torch.inference_mode():
            for start in starts[k::streams]:
                mlp(x[start : start + batch_size].to(device)).cpu()

    workers = [threading.Thread(target=work, args=(k,)) for k in range(streams)]
    try:
        started = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return len(x) / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads_before)


def direct_rate(model: str, data: Any, batch_size: int) -> float:
    """Records/s of the model called directly on the same records, batch_size at a time."""
    import torch

    if model == "mlp":
        from bench.batcher_models import build_mlp, torch_device

        device = torch_device()  # $BENCH_DEVICE, as the batcher's model (each batch copied from the host)
        mlp = build_mlp().to(device)
        x = torch.from_numpy(data)
        with torch.inference_mode():
            mlp(x[:batch_size].to(device)).cpu()  # warm-up (CUDA's first call initialises it)
            started = time.perf_counter()
            for start in range(0, len(x), batch_size):
                mlp(x[start : start + batch_size].to(device)).cpu()
        return len(x) / (time.perf_counter() - started)
    from asyncinfer.config import BatcherConfig
    from services.batcher.backends.loading import load_backend

    backend = load_backend(minilm_config(batch_size, 5.0), BatcherConfig())
    texts = np.array([t.encode() for t in data], dtype=np.object_)
    started = time.perf_counter()
    for start in range(0, len(texts), batch_size):
        backend.infer_batch({"text": texts[start : start + batch_size]})
    return len(texts) / (time.perf_counter() - started)


def profile_path(variant: ServiceVariant, service: str) -> Path | None:
    """Where a py-spy profile of the service goes when BENCH_PROFILE_DIR names a folder (the first
    batcher only): <folder>/<variant>-<service>-<n>.txt, n counting the variant's rounds."""
    folder = os.environ.get("BENCH_PROFILE_DIR")
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{variant.label}-{service}")
    taken = len(list(Path(folder).glob(f"{stem}-*.txt")))
    return Path(folder) / f"{stem}-{taken + 1}.txt"


def switch_interval_site(folder: Path, interval_s: float) -> str:
    """A PYTHONPATH whose sitecustomize sets the GIL switch interval at start (then the inherited
    PYTHONPATH, which a GPU machine's wheels need)."""
    return site_path(folder, "switch-interval", switch_interval_source(interval_s))


def switch_interval_source(interval_s: float) -> str:
    return f"import sys\nsys.setswitchinterval({interval_s!r})\n"


def site_path(folder: Path, name: str, source: str) -> str:
    """A PYTHONPATH whose sitecustomize (in folder/name) runs `source` at start, then this tree's
    root (where the bench's own modules are) and the inherited PYTHONPATH."""
    site = folder / name
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(source)
    return os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def services_env(folder: Path, variant: ServiceVariant) -> tuple[dict[str, str], dict[str, str]]:
    """The environment the variant adds to every service's process and to the batchers' (whose
    sitecustomize also sets the switch interval): objects-dir's directory (nats.objects_directory)."""
    every: dict[str, str] = {}
    if variant.objects_dir:
        directory = folder / "objects-dir"
        directory.mkdir(exist_ok=True)  # the services check it exists at start
        every["ASYNCINFER_NATS__OBJECTS_DIRECTORY"] = str(directory)
    batchers = dict(every)
    if variant.switch_interval_s is not None:
        batchers["PYTHONPATH"] = site_path(folder, "site-batchers", switch_interval_source(variant.switch_interval_s))
    return every, batchers


def directory_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def fold_batchers(result: dict[str, Any], batchers: int) -> None:
    """Several batchers' CPU seconds and page faults summed under "batcher" (each kept too)."""
    if batchers < 2:
        return
    for key in ("cpu_s", "page_faults"):
        each = [result[key][n] for n in result[key] if n.startswith("batcher")]
        result[key]["batcher"] = round(sum(each), 2)
        for n in [n for n in result[key] if n.startswith("batcher-")]:
            del result[key][n]
        result[f"{key}_each_batcher"] = each


def batches_overrides() -> dict[str, float]:
    """The `batches` settings BENCH_BATCHES=NAME=VALUE[,NAME=VALUE] sets for a run (numbers)."""
    pairs = (item.split("=", 1) for item in os.environ.get("BENCH_BATCHES", "").split(",") if item)
    return {name: float(value) for name, value in pairs}


async def stored_bytes(nats_url: str) -> int:
    """Bytes in every JetStream stream (work, records, objects, batches)."""
    from asyncinfer.config import NatsConfig

    nc = await connect(NatsConfig(url=nats_url), name="bench-bytes")
    try:
        js = nc.jetstream()
        return sum((s.state.bytes or 0) for s in await js.streams_info())
    finally:
        await nc.close()


async def upload(jobs: Any, data: bytes) -> str:
    async def requests() -> Any:
        yield job_service_pb2.UploadInputRequest(metadata=job_service_pb2.UploadInputMetadata(size_bytes=len(data)))
        for start in range(0, len(data), 1 << 20):
            yield job_service_pb2.UploadInputRequest(chunk=data[start : start + (1 << 20)])

    return (await jobs.UploadInput(requests())).ref.ref


def interactive_request(model: str, name: str) -> job_service_pb2.SubmitJobRequest:
    if model == "mlp":
        x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 512])
        x.raw_contents = np.ones((1, 512), dtype="<f4").tobytes()
        return job_service_pb2.SubmitJobRequest(model_name=name, inputs=[x], priority=job_pb2.PRIORITY_NORMAL)
    t = tensor_pb2.InferInputTensor(name="text", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(b"an interactive request while the batch runs")
    return job_service_pb2.SubmitJobRequest(model_name=name, inputs=[t], priority=job_pb2.PRIORITY_NORMAL)


async def interactive(
    jobs: Any, request: job_service_pb2.SubmitJobRequest, stop: asyncio.Event
) -> list[tuple[float, dict[str, float]]]:
    """One interactive job at a time until `stop`: each one's latency (s), and where its time went
    (its record's queue and run durations, its batch's compute; the rest is the calls' own time)."""
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        job = (await jobs.SubmitJob(request)).job
        final = job
        async for update in jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id)):
            if update.job.state in JOB_TERMINAL:
                final = update.job
                break
        spent = {
            "queue_s": final.queue_duration.ToNanoseconds() / 1e9,
            "run_s": final.run_duration.ToNanoseconds() / 1e9,
            "compute_s": final.batch.compute_duration.ToNanoseconds() / 1e9,
        }
        latencies.append((time.perf_counter() - started, spent))
        await asyncio.sleep(0.5)
    return latencies


async def chunk_timeline(jobs: Any, batch_id: str) -> dict[str, float]:
    """Where a chunk's time went, over the batch's chunk jobs: queued (submit to dispatch), run
    (dispatch to result stored), the batcher's compute of it, and the batcher's idle time between
    one chunk's end and the next one's start (a bubble the pipeline did not fill)."""
    listed = await jobs.ListJobs(job_service_pb2.ListJobsRequest(page_size=1000, labels={"asyncinfer-batch": batch_id}))
    chunks = sorted(listed.jobs, key=lambda j: j.start_time.ToNanoseconds())
    if not chunks:
        return {}
    starts = [j.start_time.ToNanoseconds() / 1e9 for j in chunks]
    ends = [j.end_time.ToNanoseconds() / 1e9 for j in chunks]
    gaps = [max(b - a, 0.0) for a, b in zip(ends, starts[1:], strict=False)]
    return {
        "chunks": len(chunks),
        "queue_s_mean": statistics.mean(j.queue_duration.ToNanoseconds() / 1e9 for j in chunks),
        "run_s_mean": statistics.mean(j.run_duration.ToNanoseconds() / 1e9 for j in chunks),
        "compute_s_mean": statistics.mean(j.batch.compute_duration.ToNanoseconds() / 1e9 for j in chunks),
        "first_start_to_last_end_s": max(ends) - min(starts),
        "gaps_s_sum": sum(gaps),
    }


async def sample_rss(children: dict[str, Any], stop: asyncio.Event, into: dict[str, list[int]]) -> None:
    while not stop.is_set():
        for name, child in children.items():
            into.setdefault(name, []).append(child.rss_bytes())
        await asyncio.sleep(0.5)


def rss_by_quarter(samples: list[int]) -> list[int]:
    """RSS (MiB) at a quarter, half, three quarters and the end of the run: flat once warm means
    memory bounded by what is in flight, not growing with the records done."""
    return [round(samples[min(len(samples) - 1, len(samples) * q // 4)] / 2**20) for q in (1, 2, 3, 4)]


async def measure(model: str, records: int, variant: ServiceVariant = ServiceVariant()) -> dict[str, Any]:
    max_batch, delay_ms, _threads = MODELS[model]
    max_batch = variant.max_batch or max_batch
    config_model = (mlp_config if model == "mlp" else minilm_config)(max_batch, delay_ms)
    at_once = BATCH_INFLIGHT[model] if variant.inflight_batches is None else variant.inflight_batches
    config_model = config_model.model_copy(
        update={"max_inflight_batches": at_once, **({"loader": variant.loader} if variant.loader else {})}
    )
    data, raw = mlp_file(records) if model == "mlp" else minilm_file(records)
    chunk = CHUNK_RECORDS if model == "mlp" else 256
    result: dict[str, Any] = {
        "model": model,
        "variant": variant.label,
        "records": records,
        "file_bytes": len(data),
        "chunk_records": chunk,
        "max_inflight_batches": at_once,
        "claim_check_io": variant.claim_check_io,
        "batchers": variant.batchers,
        "loader": config_model.loader,
        "batches_overrides": batches_overrides(),
    }
    # Direct torch before and after the services run: on a shared machine the load moves, and the
    # mean of the two brackets the system's run.
    # A light model's run measures the services alone: no direct reference (nan).
    direct = (lambda: float("nan")) if variant.loader else (lambda: direct_rate(model, raw, max_batch))
    direct_before = await asyncio.to_thread(direct)
    with ProcessGroup() as group:
        nats = group.nats(env=dict(variant.nats_env) or None)
        config = services_config(
            nats.url,
            [config_model],
            # The rest as users get it (8 chunks in flight, a 0.2 s tick) unless BENCH_BATCHES says
            # otherwise (NAME=VALUE,...: a GPU's batcher empties a window of 8 faster than that tick).
            batches={"chunk_records": chunk, **batches_overrides()},
            gateway={"max_upload_bytes": max(len(data) + (1 << 20), 1 << 30)},
        )
        every_env, batchers_env = services_env(group.tmp, variant)
        children = {
            "gateway": group.service("gateway", config, env=every_env, source=variant.source),
            "scheduler": group.service(
                "scheduler",
                config,
                env=every_env,
                source=variant.source,
                profile_path=profile_path(variant, "scheduler"),
            ),
        }
        batcher_env = dict(e.split("=", 1) for e in os.environ.get("BENCH_BATCHER_ENV", "").split(",") if e)
        batcher_env.update(batchers_env)
        for number in range(variant.batchers):
            batcher = batcher_config(config, children["scheduler"].address, batcher_id=f"batcher-{number}")
            if variant.claim_check_io:
                batcher = batcher.replace(batcher={"claim_check_io": True})
            label = "batcher" if number == 0 else f"batcher-{number}"
            children[label] = group.service(
                "batcher",
                batcher,
                env=batcher_env,
                source=variant.source,
                label=label,
                profile_path=profile_path(variant, "batcher") if number == 0 else None,
            )
        await wait_batchers(children["scheduler"].address, config_model.name, variant.batchers)
        before = await stored_bytes(nats.url)
        async with grpc.aio.insecure_channel(children["gateway"].address) as channel:
            jobs = job_service_pb2_grpc.JobServiceStub(channel)
            batches = batch_service_pb2_grpc.BatchServiceStub(channel)
            await jobs.SubmitJob(interactive_request(model, config_model.name))  # warm-up
            idle_before = {name: child.cpu_seconds() for name, child in children.items()}
            await asyncio.sleep(IDLE_WINDOW_S)  # what the services spend with nothing to do, per second
            result["idle_cpu_per_s"] = {
                n: round((c.cpu_seconds() - idle_before[n]) / IDLE_WINDOW_S, 3) for n, c in children.items()
            }
            upload_started = time.perf_counter()
            ref = await upload(jobs, data)
            result["upload_s"] = time.perf_counter() - upload_started
            stop = asyncio.Event()
            rss: dict[str, list[int]] = {}
            sampler = asyncio.create_task(sample_rss(children, stop, rss))
            cpu_before = {name: child.cpu_seconds() for name, child in children.items()}
            faults_before = {name: page_faults(child.pid) for name, child in children.items()}
            nats_cpu_before = cpu_seconds(nats.process.pid) if nats.process is not None else 0.0
            created_at = time.perf_counter()
            created = await batches.CreateBatch(
                batch_service_pb2.CreateBatchRequest(model_name=config_model.name, input_ref=ref)
            )
            waits = asyncio.create_task(interactive(jobs, interactive_request(model, config_model.name), stop))
            async for update in batches.WatchBatch(
                batch_service_pb2.WatchBatchRequest(batch_id=created.batch.batch_id)
            ):
                batch = update.batch
                if batch.state in TERMINAL:
                    break
            result["create_to_end_s"] = time.perf_counter() - created_at
            result["chunk_timeline"] = await chunk_timeline(jobs, created.batch.batch_id)
            result["cpu_s"] = {n: round(c.cpu_seconds() - cpu_before[n], 2) for n, c in children.items()}
            result["page_faults"] = {n: page_faults(c.pid) - faults_before[n] for n, c in children.items()}
            fold_batchers(result, variant.batchers)
            if nats.process is not None:
                result["cpu_s"]["nats-server"] = round(cpu_seconds(nats.process.pid) - nats_cpu_before, 2)
            stop.set()
            latencies = await waits
            await sampler
            # The stream's bytes and, with objects-dir, the objects' files beside them.
            after = await stored_bytes(nats.url) + directory_bytes(group.tmp / "objects-dir")
            result["objects_dir_bytes"] = directory_bytes(group.tmp / "objects-dir")
            if os.environ.get("BENCH_READ_OUTPUTS") == "1":
                result["read_outputs"] = await read_outputs(batches, created.batch.batch_id, children["gateway"])
            outputs = None
            if model == "mlp" and (variant.objects_dir or os.environ.get("BENCH_CHECK_OUTPUTS") == "1"):
                outputs = await read_npz(batches, created.batch.batch_id)
        log(f"{model}: batch {batch_service_pb2.BatchState.Name(batch.state)} {batch.request_counts.completed} done")
    run_s = (batch.end_time.ToNanoseconds() - batch.in_progress_time.ToNanoseconds()) / 1e9
    result.update(
        state=batch_service_pb2.BatchState.Name(batch.state),
        completed=batch.request_counts.completed,
        run_s=run_s,
        records_per_s=batch.request_counts.completed / run_s,
        records_per_s_from_create=batch.request_counts.completed / result["create_to_end_s"],
        stored_bytes_per_record=(after - before) / records,
        input_bytes_per_record=len(data) / records,
        rss_mib={n: [round(v[0] / 2**20), round(max(v) / 2**20), round(v[-1] / 2**20)] for n, v in rss.items() if v},
        rss_mib_by_quarter={n: rss_by_quarter(v) for n, v in rss.items() if v},
        interactive_s=[latency for latency, _ in latencies],
        # Where the slowest one's time went: queued (submit to dispatch), run (dispatch to result
        # stored), of which its batch's compute.
        interactive_slowest=max(latencies, key=lambda pair: pair[0])[1] if latencies else {},
    )
    if outputs is not None:
        if batch.request_counts.completed != records or batch.request_counts.failed:
            raise RuntimeError(f"the batch counted {batch.request_counts} for {records} records")
        # After the services stopped, outside every measured window.
        result["outputs_checked"] = await asyncio.to_thread(check_outputs, outputs, raw, max_batch, variant.loader)
    direct_after = await asyncio.to_thread(direct)
    if model == "mlp" and not variant.loader:
        # The same records on two streams of one thread each: on 2 cores the faster way to run
        # independent batches directly, so a second reference beside torch's default.
        result["direct_two_streams_records_per_s"] = await asyncio.to_thread(direct_streams_rate, raw, max_batch, 2)
    result["direct_before_after"] = [direct_before, direct_after]
    result["direct_records_per_s"] = (direct_before + direct_after) / 2
    result["ratio"] = result["records_per_s"] / result["direct_records_per_s"]
    result["chunk_compute_s"] = chunk / result["direct_records_per_s"]
    return result


async def read_outputs(
    batches: batch_service_pb2_grpc.BatchServiceStub, batch_id: str, gateway: Any
) -> dict[str, dict[str, float]]:
    """BENCH_READ_OUTPUTS=1: the batch's output read whole as NPZ and as JSONL (ReadBatchFile),
    each its seconds, bytes and the gateway's CPU seconds."""
    read: dict[str, dict[str, float]] = {}
    for name, which in (
        ("npz", batch_service_pb2.BATCH_FILE_OUTPUT_NPZ),
        ("jsonl", batch_service_pb2.BATCH_FILE_OUTPUT),
    ):
        cpu_before = gateway.cpu_seconds()
        started = time.perf_counter()
        size = 0
        request = batch_service_pb2.ReadBatchFileRequest(batch_id=batch_id, file=which)
        async for piece in batches.ReadBatchFile(request):
            size += len(piece.chunk)
        read[name] = {
            "s": round(time.perf_counter() - started, 3),
            "bytes": size,
            "gateway_cpu_s": round(gateway.cpu_seconds() - cpu_before, 2),
        }
        log(f"read the output as {name}: {read[name]}")
    return read


async def read_npz(batches: batch_service_pb2_grpc.BatchServiceStub, batch_id: str) -> dict[str, Any]:
    """The batch's output as NPZ (ReadBatchFile), its arrays by name."""
    data = bytearray()
    request = batch_service_pb2.ReadBatchFileRequest(batch_id=batch_id, file=batch_service_pb2.BATCH_FILE_OUTPUT_NPZ)
    async for piece in batches.ReadBatchFile(request):
        data += piece.chunk
    with np.load(io.BytesIO(data)) as archive:
        return {name: archive[name] for name in archive.files}


def check_outputs(outputs: dict[str, Any], raw: Any, batch_size: int, loader: str | None) -> dict[str, Any]:
    """Raises RuntimeError unless every record succeeded and its row is the model's output for its
    own input (computed here, batch_size at a time as the batcher does): each record came out once,
    in its place. Its count and the largest difference from the reference otherwise."""
    import torch

    from bench.batcher_models import build_light, build_mlp

    succeeded = outputs.pop("succeeded")
    if len(outputs) != 1:
        raise RuntimeError(f"the output NPZ holds {sorted(outputs)} beside 'succeeded', not one output")
    ((name, rows),) = outputs.items()
    if len(succeeded) != len(raw) or not succeeded.all() or rows.shape != (len(raw), 512):
        raise RuntimeError(
            f"output {name!r}: {int(succeeded.sum())} of {len(raw)} records succeeded, rows {rows.shape}"
        )
    model = (build_light if loader else build_mlp)()
    worst = 0.0
    with torch.inference_mode():
        for start in range(0, len(raw), batch_size):
            want = model(torch.from_numpy(raw[start : start + batch_size])).numpy()
            got = rows[start : start + batch_size]
            worst = max(worst, float(np.abs(got - want).max()))
            if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                raise RuntimeError(f"records {start}-{start + len(want) - 1}: outputs differ from the model's")
    log(f"outputs checked: {len(raw)} records, each once and right (largest difference {worst:.2e})")
    return {"records": len(raw), "max_abs_diff": worst}


def markdown(results: list[dict[str, Any]], facts: dict[str, Any]) -> str:
    lines = [
        "# Batch jobs over files (bench/system/batch_files.py)",
        "",
        f"Machine: {facts}",
        "",
        "| model | records | chunk | batches at once | records/s (run) | from create | direct torch (before, after) | "
        "ratio to their mean (>= 0.8) | direct torch, two streams of one thread | ratio to it | stored B/record "
        "(input B/record) | RSS MiB start/peak/end | RSS MiB at 1/4, 1/2, 3/4, end | interactive p50 / max s "
        "(the slowest: queued / run / its batch's compute s) | "
        "one chunk's compute s | CPU s from create |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        waits = r["interactive_s"] or [float("nan")]
        rss = ", ".join(f"{n} {'/'.join(map(str, v))}" for n, v in r["rss_mib"].items())
        two = r.get("direct_two_streams_records_per_s")
        streams = f"{two:.0f} | {r['records_per_s'] / two:.2f}" if two else "- | -"
        quarters = ", ".join(f"{n} {'/'.join(map(str, v))}" for n, v in r.get("rss_mib_by_quarter", {}).items())
        lines.append(
            f"| {r['model']} | {r['records']} | {r['chunk_records']} | {r.get('max_inflight_batches', 1)} | "
            f"{r['records_per_s']:.0f} | "
            f"{r['records_per_s_from_create']:.0f} | {r['direct_before_after'][0]:.0f}, {r['direct_before_after'][1]:.0f} | "
            f"{r['ratio']:.2f} | {streams} | "
            f"{r['stored_bytes_per_record']:.0f} ({r['input_bytes_per_record']:.0f}) | {rss} | {quarters} | "
            f"{statistics.median(waits):.2f} / {max(waits):.2f}{slowest_spent(r)} | {r['chunk_compute_s']:.2f} | "
            f"{', '.join(f'{n} {v}' for n, v in r['cpu_s'].items())} |"
        )
    return "\n".join(lines) + "\n"


def slowest_spent(result: dict[str, Any]) -> str:
    spent = result.get("interactive_slowest") or {}
    if not spent:
        return ""
    return f" ({spent['queue_s']:.3f} / {spent['run_s']:.3f} / {spent['compute_s']:.3f})"


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for model in args.models.split(","):
        count = (args.records if model == "mlp" else args.texts) // (20 if args.quick else 1)
        log(f"{model}: {count} records")
        results.append(await measure(model, count))
        log(json.dumps({k: v for k, v in results[-1].items() if k != "interactive_s"}))
    return results


def write(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    facts = machine_facts()
    out = {"quick": args.quick, "machine": facts, "results": results}
    Path(RESULTS / "batch_files.json").write_text(json.dumps(out, indent=2) + "\n")
    Path(RESULTS / "batch_files.md").write_text(markdown(results, facts))
    print(markdown(results, facts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a twentieth of the records, to check the script")
    parser.add_argument("--models", default="mlp,minilm")
    parser.add_argument("--records", type=int, default=200_000, help="MLP records (NPY)")
    parser.add_argument("--texts", type=int, default=5_000, help="minilm texts (JSONL)")
    args = parser.parse_args()
    write(asyncio.run(run(args)), args)


if __name__ == "__main__":
    main()
