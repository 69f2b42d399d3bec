"""What a purge of dead letters by sequence costs (OpsService.PurgeDeadLetters with `sequences`: every
letter known to be there, then each deleted), outside the stack: a fresh nats-server, 1,000 letters
stored, then purged two ways, alternated, five rounds, with letters holding a 1x4 FP32 input and a 64 KiB
one: each letter read to know it is there (DeadLetterStore.get_many, LETTERS_AT_ONCE reads in flight: the
purge before) and the stream's first, last and deleted sequences asked instead (DeadLetterStore.missing:
one or two stream infos, no letter read), each then deleted with delete_many, without a secure erase.
Wall time, this process's CPU and bytes received, nats-server's CPU. (One at a time against grouped, and
the erase, are the earlier sections of bench/results/dead_letter_purge_cost.txt.)

    .venv/bin/python -m bench.dead_letter_purge_cost

The figures docs/ARCHITECTURE.md ("Replay") quotes.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np

from asyncinfer.codecs.envelope import encode_envelope
from asyncinfer.config import LoggingConfig
from asyncinfer.ids import new_job_id
from asyncinfer.jobs import JobRecord, JobState, Priority, queued_envelope
from asyncinfer.logs import configure_logging
from asyncinfer.nats.connection import connect
from asyncinfer.tensors import Tensor
from bench.system.common import bench_config, measured_cpu, run_against_a_nats_server
from services.scheduler.dead_letters import LETTERS_AT_ONCE, DeadLetter, DeadLetterStore, ensure_dead_letter_stream

LETTERS = 1_000
ROUNDS = 5
STORE_GROUP = 100


def letter(now: float, values: int) -> DeadLetter:
    record = JobRecord(
        job_id=new_job_id(),
        tenant="bench",
        model_name="flaky",
        model_version="",
        state=JobState.QUEUED,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        max_attempts=2,
        result_retention_s=3600.0,
    )
    inputs = (Tensor.from_numpy("x", np.ones((1, values), dtype=np.float32)),)
    original = encode_envelope(queued_envelope(record, inputs))
    return DeadLetter(
        job_id=record.job_id,
        tenant=record.tenant,
        model_name=record.model_name,
        reason="MAX_ATTEMPTS",
        attempts=2,
        dead_time=now,
        original=original,
    )


async def measure(url: str, nats_pid: int) -> None:
    config = bench_config(url)
    nc = await connect(config.nats, name="dead-letter-purge-cost")
    js = nc.jetstream()
    await ensure_dead_letter_stream(js, config.nats)
    store = DeadLetterStore(nc, js, config.nats)

    async def letters_read(sequences: list[int]) -> None:  # as PurgeDeadLetters did
        assert None not in await store.get_many(sequences)
        assert all(outcome is True for outcome in await store.delete_many(sequences))

    async def stream_info(sequences: list[int]) -> None:  # as it does now
        assert await store.missing(sequences) == []
        assert all(outcome is True for outcome in await store.delete_many(sequences))

    ways: dict[str, Callable[[list[int]], Awaitable[None]]] = {
        f"letters read ({LETTERS_AT_ONCE} at once)": letters_read,
        "stream info, none read": stream_info,
    }
    for values, size_label in ((4, "1x4 FP32 input"), (16_384, "64 KiB input")):
        results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in ways}
        letter_bytes = 0
        for _ in range(ROUNDS):
            for name, purge in ways.items():
                now = time.time()
                sequences: list[int] = []
                for first in range(0, LETTERS, STORE_GROUP):
                    group = [letter(now, values) for _ in range(min(STORE_GROUP, LETTERS - first))]
                    stored = await asyncio.gather(*(store.add(one, retention_s=3600.0) for one in group))
                    sequences += [one.sequence for one in stored]
                letter_bytes = len(group[0].original)
                received_before = nc.stats["in_bytes"]
                with measured_cpu({"nats-server": nats_pid}) as used:
                    await purge(sequences)
                wall_ms = 1000 * used.wall_s
                client_ms = 1000 * used.this_process_s
                nats_ms = 1000 * used.processes_s["nats-server"]
                received_mb = (nc.stats["in_bytes"] - received_before) / 1e6
                assert await store.count() == 0
                results[name].append((wall_ms, client_ms, nats_ms, received_mb))
        print(f"\n{LETTERS} letters with a {size_label} (original {letter_bytes} B), median of {ROUNDS} rounds:")
        for name, rows in results.items():
            wall, client, server, received = (statistics.median(column) for column in zip(*rows, strict=True))
            print(
                f"  {name:26s} {wall:7.0f} ms ({wall / LETTERS:.2f} ms a letter; rounds "
                f"{', '.join(f'{row[0]:.0f}' for row in rows)}), this process {client:5.0f} CPU-ms and "
                f"{received:6.2f} MB received, nats-server {server:5.0f} CPU-ms"
            )
    await nc.close()


def main() -> None:
    configure_logging(LoggingConfig(level="warning"), service="bench")
    run_against_a_nats_server(measure)


if __name__ == "__main__":
    main()
