"""What a purge of dead letters by sequence costs (OpsService.PurgeDeadLetters with `sequences`, or with
`all` and a model: each letter read, then deleted, one at a time), outside the stack: a fresh
nats-server, 1,000 letters stored, then purged with nats-py's delete_msg (a secure erase: the message
overwritten in its file) and with DeadLetterStore.delete (no_erase), in turns, three rounds, with
letters holding a 1x4 FP32 input and a 64 KiB one. Wall time, this process's CPU and nats-server's.

    .venv/bin/python -m bench.dead_letter_purge_cost

The figures services/scheduler/dead_letters.py (DeadLetterStore.delete) quotes.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np
import uvloop

from asyncinfer.codecs.envelope import encode_envelope
from asyncinfer.config import LoggingConfig
from asyncinfer.ids import new_job_id
from asyncinfer.jobs import JobRecord, JobState, Priority, queued_envelope
from asyncinfer.logs import configure_logging
from asyncinfer.nats.connection import connect
from asyncinfer.tensors import Tensor
from bench.system.common import ProcessGroup, bench_config, cpu_seconds
from services.scheduler.dead_letters import DeadLetter, DeadLetterStore, ensure_dead_letter_stream

LETTERS = 1_000
ROUNDS = 3
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
    stream = config.nats.dead_letter_stream

    async def erased(sequence: int) -> bool:
        return await js.delete_msg(stream, sequence)

    ways: dict[str, Callable[[int], Awaitable[bool]]] = {"delete_msg (erase)": erased, "no_erase": store.delete}
    for values, size_label in ((4, "1x4 FP32 input"), (16_384, "64 KiB input")):
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
        letter_bytes = 0
        for _ in range(ROUNDS):
            for name, delete in ways.items():
                now = time.time()
                sequences: list[int] = []
                for first in range(0, LETTERS, STORE_GROUP):
                    group = [letter(now, values) for _ in range(min(STORE_GROUP, LETTERS - first))]
                    stored = await asyncio.gather(*(store.add(one, retention_s=3600.0) for one in group))
                    sequences += [one.sequence for one in stored]
                letter_bytes = len(group[0].original)
                nats_before, client_before, started = cpu_seconds(nats_pid), time.process_time(), time.perf_counter()
                for sequence in sequences:  # as PurgeDeadLetters: each read, then each deleted
                    assert await store.get(sequence) is not None
                for sequence in sequences:
                    assert await delete(sequence)
                wall_ms = 1000 * (time.perf_counter() - started)
                client_ms = 1000 * (time.process_time() - client_before)
                nats_ms = 1000 * (cpu_seconds(nats_pid) - nats_before)
                assert await store.count() == 0
                results[name].append((wall_ms, client_ms, nats_ms))
        print(f"\n{LETTERS} letters with a {size_label} (original {letter_bytes} B), median of {ROUNDS} rounds:")
        for name, rows in results.items():
            wall, client, server = (statistics.median(column) for column in zip(*rows, strict=True))
            print(
                f"  {name:20s} {wall:7.0f} ms ({wall / LETTERS:.2f} ms a letter; rounds "
                f"{', '.join(f'{row[0]:.0f}' for row in rows)}), this process {client:5.0f} CPU-ms, "
                f"nats-server {server:5.0f} CPU-ms"
            )
    await nc.close()


def main() -> None:
    configure_logging(LoggingConfig(level="warning"), service="bench")
    with ProcessGroup() as group:
        nats = group.nats()
        assert nats.process is not None
        uvloop.run(measure(nats.url, nats.process.pid))


if __name__ == "__main__":
    main()
