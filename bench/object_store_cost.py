"""What storing and reading a batch chunk's bytes costs, outside the stack: 50 puts of 4 MB into
the objects bucket of a fresh nats-server (result-sized 512 KB chunks, then upload-sized 128 KB),
each followed by 50 whole-range reads, with nats-server's and this client's CPU seconds.

    .venv/bin/python -m bench.object_store_cost

The figures a file batch's nats-server and batcher CPU are read against (docs/BATCHES.md, "The CPU
budget on 2 cores"): what the same bytes cost on an idle machine.
"""

from __future__ import annotations

import os
import time

from asyncinfer.blob_meta import CHUNK_BYTES, RESULT_CHUNK_BYTES
from asyncinfer.blobs import ensure_objects_bucket
from asyncinfer.nats.connection import connect
from bench.system.common import bench_config, measured_cpu, run_against_a_nats_server

PUTS = 50
CHUNK_RECORDS_BYTES = 4 << 20  # a 2,048-record MLP chunk's rows (2 KB each)


async def measure(url: str, nats_pid: int) -> None:
    config = bench_config(url)
    nc = await connect(config.nats, name="object-store-cost")
    store = await ensure_objects_bucket(nc, config.nats)
    data = os.urandom(CHUNK_RECORDS_BYTES)
    for chunk_bytes in (RESULT_CHUNK_BYTES, CHUNK_BYTES):
        for action in ("put", "read"):
            with measured_cpu({"nats-server": nats_pid}) as used:
                for i in range(PUTS):
                    ref = f"out/0190c0de-0000-7000-8000-{i:012d}"
                    if action == "put":
                        await store.put_bytes("t", ref, data, expires_at=time.time() + 3600, chunk_bytes=chunk_bytes)
                    else:
                        await store.read_range("t", ref, 0, len(data))
            print(
                f"{action} {PUTS} x 4 MB, {chunk_bytes >> 10} KB chunks: nats-server "
                f"{used.processes_s['nats-server']:.2f} CPU-s, client {used.this_process_s:.2f} CPU-s, {used.wall_s:.2f} s"
            )
    await nc.close()


def main() -> None:
    run_against_a_nats_server(measure)


if __name__ == "__main__":
    main()
