"""The batcher's own CPU per job on a fixed workload, for an A/B of revisions that does not need a
quiet machine (not a test).

A batcher process (the no-op model, its product defaults: max batch 32, delay 2 ms, one torch
thread) is driven by a fake scheduler in this process over the real work stream (WorkerService
Connect, WorkOrders in, WorkUpdates out), as the scheduler drives it in the system's bursts, with
no NATS, gateway or scheduler beside it. Its CPU (utime + stime from /proc) is read over a fixed
number of jobs after a warm-up, so a busy machine slows the run but hardly moves the figure,
provided the batches are the same: each workload is closed-loop, and the batch sizes the batcher
reports are printed beside the figure, so that a difference in batching is seen, not taken for a
difference in cost.

Workloads:
- singles: one order at a time, the next sent when its result is back (a batch per job: the
  per-batch cost);
- groups: WorkOrders of 32 orders (one full batch each), two groups in flight (the per-item cost);
- burst: WorkOrders of 8 orders, 8 groups in flight (64 jobs, as the system's unary burst has;
  batch sizes then depend on timing, shown beside).

Each --tree (a source tree: this checkout by default, or a worktree of another revision: `git
worktree add --detach /tmp/old eff8486`) runs a fresh batcher per round, the trees taking turns
going first. --profile DIR runs each batcher under cProfile for the measured jobs only (enabled by
SIGUSR1 after the warm-up, written on SIGUSR2) and writes DIR/<label>-<workload>.prof (the
loop's thread; the compute threads are not profiled). --diff A.prof B.prof --jobs N prints the
Python calls per job of each and the functions whose call counts differ: unlike CPU time, the
counts do not depend on what else the machine runs.

    .venv/bin/python bench/batcher_cpu_per_job.py --tree /tmp/old --tree . [--rounds 3] [--jobs 20000]
    .venv/bin/python bench/batcher_cpu_per_job.py --diff DIR/old-groups.prof DIR/new-groups.prof --jobs 5000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from asyncinfer.config import Config  # noqa: E402
from asyncinfer.tensor_codec import to_input_proto  # noqa: E402
from asyncinfer.tensors import Tensor  # noqa: E402
from asyncinfer.v1 import worker_service_pb2, worker_service_pb2_grpc  # noqa: E402
from bench.system.common import (  # noqa: E402
    PYTHON,
    ProcessGroup,
    cpu_seconds,
    free_port,
    grpc_serving,
    log,
    render_changed_keys,
)
from bench.system.noop_model import noop_model_config  # noqa: E402

# name -> (orders per WorkOrders message, messages in flight)
WORKLOADS = {"singles": (1, 1), "groups": (32, 2), "burst": (8, 8)}
PROFILED = ROOT / "bench" / "profiled_service.py"


@dataclass
class Stream:
    """One batcher's work stream as this fake scheduler sees it."""

    outbox: asyncio.Queue[worker_service_pb2.ConnectResponse | None] = field(default_factory=asyncio.Queue)
    credits: int = 0
    answered: int = 0
    errors: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    messages: Counter[str] = field(default_factory=Counter)  # what the batcher sent, by kind
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class FakeScheduler(worker_service_pb2_grpc.WorkerServiceServicer):
    def __init__(self) -> None:
        self.streams: asyncio.Queue[Stream] = asyncio.Queue()

    async def Connect(self, request_iterator: Any, context: Any) -> AsyncIterator[worker_service_pb2.ConnectResponse]:
        first = await anext(aiter(request_iterator))
        assert first.WhichOneof("message") == "hello"
        stream = Stream()
        reader = asyncio.create_task(self._read(request_iterator, stream))
        self.streams.put_nowait(stream)
        try:
            yield worker_service_pb2.ConnectResponse(
                welcome=worker_service_pb2.WorkerWelcome(scheduler_id="bench", takes_batches=True)
            )
            while (message := await stream.outbox.get()) is not None:
                yield message
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, request_iterator: Any, stream: Stream) -> None:
        async for request in request_iterator:
            kind = request.WhichOneof("message")
            stream.messages[kind] += 1
            if kind == "updates":
                for result in request.updates.results:
                    stream.answered += 1
                    stream.errors += result.HasField("error") or result.dropped
                    stream.batch_sizes[result.batch_size] += 1
                stream.credits += sum(grant.credits for grant in request.updates.credits)
            elif kind == "credit":
                stream.credits += request.credit.credits
            elif kind == "result":
                stream.answered += 1
                stream.errors += request.result.HasField("error") or request.result.dropped
                stream.batch_sizes[request.result.batch_size] += 1
            stream.changed.set()
        stream.outbox.put_nowait(None)


async def wait(stream: Stream, predicate: Any, timeout_s: float = 120.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            stream.changed.clear()
            await stream.changed.wait()


async def drive(stream: Stream, jobs: int, group: int, in_flight: int, prefix: str) -> None:
    """Sends `jobs` orders in WorkOrders of `group`, at most `in_flight` messages' worth
    unanswered and never past the credits granted; returns once every one is answered."""
    x = to_input_proto(Tensor.from_numpy("x", np.ones((1, 4), dtype=np.float32)))
    start = stream.answered
    sent = 0
    while sent < jobs:
        size = min(group, jobs - sent)
        await wait(
            stream,
            lambda size=size, sent=sent: (
                stream.credits >= size and sent - (stream.answered - start) <= (in_flight - 1) * group
            ),
        )
        orders = worker_service_pb2.WorkOrders()
        for i in range(sent, sent + size):
            work = orders.orders.add(job_id=f"{prefix}-{i}", attempt=1, model_name="noop", tenant="default")
            work.inputs.append(x)
            work.execution_timeout.FromSeconds(60)  # the scheduler sends the job's (its default 60 s)
        stream.credits -= size
        sent += size
        stream.outbox.put_nowait(worker_service_pb2.ConnectResponse(orders=orders))
    await wait(stream, lambda: stream.answered - start >= jobs)


@dataclass
class Measured:
    cpu_ms_per_job: float
    jobs_per_s: float
    mean_batch: float
    batches: dict[int, int]
    messages: dict[str, int]  # the batcher's messages over the measured jobs, by kind


async def one_run(
    group_: ProcessGroup, tree: Path, label: str, workload: str, jobs: int, warmup: int, profile_dir: Path | None
) -> Measured:
    fake = FakeScheduler()
    server = grpc.aio.server()
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(fake, server)
    scheduler_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        port = free_port()
        config = Config().replace(
            batcher={
                "port": port,
                "metrics_port": 0,
                "scheduler_address": f"127.0.0.1:{scheduler_port}",
                "batcher_id": "bench",
                "torch_threads": 1,
            },
            logging={"level": "warning"},
            models=[noop_model_config()],
        )
        config_path = group_.tmp / f"{label}-{workload}.toml"
        config_path.write_text(render_changed_keys(config))
        profile_path = None if profile_dir is None else (profile_dir / f"{label}-{workload}.prof").resolve()
        if profile_path is None:
            argv = [PYTHON, "-m", "services.cli", "batcher", "--config", str(config_path)]
        else:
            argv = [PYTHON, str(PROFILED), str(profile_path), "batcher", "--config", str(config_path)]
        child = await asyncio.to_thread(
            group_.command, label, argv, ready=lambda c: grpc_serving(c.address), port=port, cwd=tree
        )
        try:
            stream = await asyncio.wait_for(fake.streams.get(), 60)
            group, in_flight = WORKLOADS[workload]
            await drive(stream, warmup, group, in_flight, "warm")
            stream.batch_sizes.clear()
            stream.messages.clear()
            errors = stream.errors
            if profile_path is not None:
                os.kill(child.pid, signal.SIGUSR1)
            before, started = cpu_seconds(child.pid), time.perf_counter()
            await drive(stream, jobs, group, in_flight, "job")
            used, took = cpu_seconds(child.pid) - before, time.perf_counter() - started
            if profile_path is not None:
                os.kill(child.pid, signal.SIGUSR2)
                await wait_for_file(profile_path)
            assert stream.errors == errors, f"{stream.errors - errors} jobs failed or were dropped"
            sizes = dict(sorted(stream.batch_sizes.items()))
            batches = {size: count // size for size, count in sizes.items()}
            return Measured(
                cpu_ms_per_job=used / jobs * 1e3,
                jobs_per_s=jobs / took,
                mean_batch=jobs / max(sum(batches.values()), 1),
                batches=batches,
                messages=dict(stream.messages),
            )
        finally:
            await asyncio.to_thread(group_.stop, child)
    finally:
        await server.stop(0)


async def wait_for_file(path: Path) -> None:
    """Until the profile is there (written aside, then renamed: whole when seen)."""
    for _ in range(600):
        if await asyncio.to_thread(path.exists):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no profile written at {path}")


async def main_async(args: argparse.Namespace) -> None:
    trees: list[Path] = args.tree
    labels = [label_of(t) for t in trees]
    results: dict[tuple[str, str], list[Measured]] = {}
    with ProcessGroup(keep_logs=args.keep_logs) as group:
        for round_number in range(args.rounds):
            order = list(zip(trees, labels, strict=True))
            if round_number % 2:
                order.reverse()
            for workload in args.workload:
                for tree, label in order:
                    found = await one_run(group, tree, label, workload, args.jobs, args.warmup, args.profile)
                    results.setdefault((label, workload), []).append(found)
                    log(
                        f"round {round_number + 1} {label} {workload}: {found.cpu_ms_per_job:.4f} ms CPU per job, "
                        f"{found.jobs_per_s:,.0f} jobs/s, mean batch {found.mean_batch:.2f}, batches {found.batches}, "
                        f"messages {found.messages}"
                    )
    print()
    print(f"batcher CPU per job, ms (median, min-max of {args.rounds} rounds; {args.jobs:,} jobs each after "
          f"{args.warmup:,} warm-up; load {os.getloadavg()[0]:.1f} at the end)")  # fmt: skip
    print("| workload | tree | CPU ms/job | min | max | mean batch | jobs/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for workload in args.workload:
        for label in labels:
            runs = results[(label, workload)]
            cpu = [r.cpu_ms_per_job for r in runs]
            print(
                f"| {workload} | {label} | {statistics.median(cpu):.4f} | {min(cpu):.4f} | {max(cpu):.4f} | "
                f"{statistics.median(r.mean_batch for r in runs):.2f} | "
                f"{statistics.median(r.jobs_per_s for r in runs):,.0f} |"
            )
        if len(labels) == 2:
            a, b = (statistics.median(r.cpu_ms_per_job for r in results[(label, workload)]) for label in labels)
            print(f"| {workload} | {labels[1]} / {labels[0]} | {b / a:.3f} | | | | |")


def call_counts(path: Path) -> dict[str, tuple[int, float]]:
    """Calls and own time per function of a cProfile output, keyed without the tree's path."""
    import pstats

    counts: dict[str, tuple[int, float]] = {}
    for (filename, _line, name), (_primitive, calls, own_s, _total, _callers) in pstats.Stats(str(path)).stats.items():  # type: ignore[attr-defined]
        where = filename.split("site-packages/")[-1]
        for root in (str(ROOT), "/tmp/"):
            if where.startswith(root):
                where = "/".join(where[len(root) :].lstrip("/").split("/")[1 if root == "/tmp/" else 0 :])
        key = f"{where}:{name}"
        before = counts.get(key, (0, 0.0))
        counts[key] = (before[0] + calls, before[1] + own_s)
    return counts


def print_diff(a_path: Path, b_path: Path, jobs: int, limit: int = 40) -> None:
    a, b = call_counts(a_path), call_counts(b_path)
    print(f"Python calls per job: A {sum(c for c, _ in a.values()) / jobs:.1f} ({a_path.name}), "
          f"B {sum(c for c, _ in b.values()) / jobs:.1f} ({b_path.name})")  # fmt: skip
    print("| calls per job, A | B | own time per job (profiled), A, us | B, us | function |")
    print("|---:|---:|---:|---:|---|")
    rows = [(b.get(k, (0, 0.0)), a.get(k, (0, 0.0)), k) for k in a.keys() | b.keys()]
    rows = [r for r in rows if abs(r[0][0] - r[1][0]) >= jobs / 1000]  # at least one call in 1,000 jobs
    rows.sort(key=lambda r: -abs(r[0][0] - r[1][0]))
    for (b_calls, b_s), (a_calls, a_s), key in rows[:limit]:
        print(
            f"| {a_calls / jobs:.3f} | {b_calls / jobs:.3f} | {a_s / jobs * 1e6:.2f} | {b_s / jobs * 1e6:.2f} | `{key}` |"
        )


def label_of(tree: Path) -> str:
    import subprocess

    with contextlib.suppress(Exception):
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no", "--", "services", "asyncinfer"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return head + ("+changes" if dirty else "")
    return tree.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="a source tree (repeat for an A/B; default: .)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), default=[])
    parser.add_argument("--profile", type=Path, default=None, help="a folder for cProfile output per run")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--diff", type=Path, nargs=2, metavar=("A_PROF", "B_PROF"), help="compare two profiles")
    args = parser.parse_args()
    if args.diff:
        print_diff(*args.diff, jobs=args.jobs)
        return
    args.tree = [Path(tree).resolve() for tree in args.tree or [str(ROOT)]]
    args.workload = args.workload or ["singles", "groups", "burst"]
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
