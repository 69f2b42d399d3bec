"""What one pass of the objects bucket's sweep costs as the bucket fills (asyncinfer.blob_sweep, run by
the scheduler's BlobSweeper every 60 s with its orphan purge on), outside the stack: a fresh
nats-server, a few large objects (4 x 16 MiB results, 128 chunks each), then small ones (100 B,
half results `out/<job_id>`, half uploads `in/<id>` of 4 tenants, kept an hour) up to 1,000,
10,000 and 50,000. At each size, passes in the steady state (nothing expired, nothing orphaned),
two ways alternated, CHURN new objects stored before each pass: every meta read each pass (the
sweep before) and only the metas stored since the sweeper's last pass (its MetaCursor; with three
kinds of pass alternated, it reads the 3 x CHURN stored since its last); beside them, the chunk
subjects' listing alone (a stream info with a subject filter), which both make. Wall time, this
process's CPU (the sweeping scheduler's: the gateway takes no part) and bytes received,
nats-server's CPU; the last column is the pass's CPU, this process's and nats-server's together,
as a share of one core over the sweep's 60 s interval.

    .venv/bin/python -m bench.blob_sweep_cost [--sizes 1000,10000,50000] [--rounds 4]

The figures docs/ARCHITECTURE.md ("The sweep at scale") quotes: bench/results/blob_sweep_cost.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable

from asyncinfer import blob_sweep
from asyncinfer.blob_meta import result_ref
from asyncinfer.blobs import BlobStore, ensure_objects_bucket
from asyncinfer.config import LoggingConfig
from asyncinfer.ids import new_job_id
from asyncinfer.logs import configure_logging
from asyncinfer.nats.connection import connect
from bench.system.common import bench_config, measured_cpu, run_against_a_nats_server
from services.scheduler.blobs import DEFAULT_SWEEP_INTERVAL_S

SIZES = (1_000, 10_000, 50_000)
ROUNDS = 4
LARGE_OBJECTS = 4
LARGE_OBJECT_BYTES = 16 << 20
SMALL_OBJECT_BYTES = 100
TENANTS = ("t0", "t1", "t2", "t3")
PUTS_AT_ONCE = 256
CHURN = 100  # objects stored before each measured pass (a cursor pass reads the 300 since its last)
ORPHANS_AFTER_S = 300.0  # the scheduler's bound with the default upload_idle_timeout_s


async def fill(store: BlobStore, have: int, want: int) -> None:
    """Small objects until the bucket holds `want` (it holds `have`): even ones results, odd ones uploads."""
    expires_at = time.time() + 3600
    data = os.urandom(SMALL_OBJECT_BYTES)
    for first in range(have, want, PUTS_AT_ONCE):
        puts = []
        for i in range(first, min(first + PUTS_AT_ONCE, want)):
            ref = result_ref(new_job_id()) if i % 2 == 0 else f"in/{new_job_id()}"
            puts.append(store.put_bytes(TENANTS[i % len(TENANTS)], ref, data, expires_at=expires_at))
        await asyncio.gather(*puts)


async def measure(url: str, nats_pid: int, sizes: list[int], rounds: int) -> None:
    config = bench_config(url)
    nc = await connect(config.nats, name="blob-sweep-cost")
    store = await ensure_objects_bucket(nc, config.nats)
    large = os.urandom(LARGE_OBJECT_BYTES)
    for _ in range(LARGE_OBJECTS):
        await store.put_bytes("t0", result_ref(new_job_id()), large, expires_at=time.time() + 3600)

    cursor = blob_sweep.MetaCursor()

    async def every_meta() -> None:  # as the sweeper did
        assert await blob_sweep.sweep(store, orphans_after_s=ORPHANS_AFTER_S) == 0

    async def since_last_pass() -> None:  # as it does now: its cursor kept between passes
        assert await blob_sweep.sweep(store, orphans_after_s=ORPHANS_AFTER_S, cursor=cursor) == 0

    async def chunk_subjects() -> None:
        await blob_sweep._chunk_subjects(store)

    passes: dict[str, Callable[[], Awaitable[None]]] = {
        "every meta read (before)": every_meta,
        "metas since the last pass": since_last_pass,
        "  of which chunk subjects": chunk_subjects,
    }
    stored = 0
    for size in sizes:
        started = time.perf_counter()
        await fill(store, stored, size)
        stored = size
        print(
            f"\n{size} small objects + {LARGE_OBJECTS} x {LARGE_OBJECT_BYTES >> 20} MiB "
            f"(stored in {time.perf_counter() - started:.0f} s), {CHURN} more before each pass, "
            f"median of {rounds} rounds, alternated:",
            flush=True,
        )
        results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in passes}
        for round_number in range(rounds):
            order = list(passes.items()) if round_number % 2 == 0 else list(reversed(passes.items()))
            for name, one_pass in order:
                await fill(store, stored, stored + CHURN)
                stored += CHURN
                received_before = nc.stats["in_bytes"]
                with measured_cpu({"nats-server": nats_pid}) as used:
                    await one_pass()
                received_mb = (nc.stats["in_bytes"] - received_before) / 1e6
                results[name].append(
                    (
                        1000 * used.wall_s,
                        1000 * used.this_process_s,
                        1000 * used.processes_s["nats-server"],
                        received_mb,
                    )
                )
        print(f"  (the cursor's last pass read {cursor.metas_read} metas; it lists {len(cursor.metas)})")
        for name, rows in results.items():
            wall, client, server, received = (statistics.median(column) for column in zip(*rows, strict=True))
            share = (client + server) / 1000 / DEFAULT_SWEEP_INTERVAL_S
            print(
                f"  {name:26s} {wall:6.0f} ms (rounds {', '.join(f'{row[0]:.0f}' for row in rows)}), "
                f"this process {client:5.0f} CPU-ms, {received:6.2f} MB received, nats-server {server:4.0f} CPU-ms"
                f" = {share:.2%} of a core over {DEFAULT_SWEEP_INTERVAL_S:.0f} s",
                flush=True,
            )
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(str(size) for size in SIZES))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    configure_logging(LoggingConfig(level="warning"), service="bench")
    run_against_a_nats_server(lambda url, pid: measure(url, pid, sizes, args.rounds))


if __name__ == "__main__":
    main()
