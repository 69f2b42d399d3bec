"""Do JetStream atomic batches (ADR-50) save anything when they coalesce concurrent writes? A
micro-benchmark against one nats-server, in one run: N publishes of 200 bytes with 128 in flight,
(A) one request per message (what a submit does today), (B) atomic batches of 100 (99 publishes
without a reply, then the commit as a request: one answer per batch). Rate, and the CPU of the
server and of this client.

    .venv/bin/python -m bench.system.atomic_batches [--messages 6000] [--rounds 3]

Writes bench/results/atomic_batches.{json,md}. Measured in session 6 before deciding how to
coalesce submits' writes (issue 14): see the report's note.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import nats
import uvloop

from bench.system.common import ProcessGroup, cpu_seconds, log, ratio, row, summarize, write_results

SECTION = "atomic_batches"
CONCURRENCY = 128
PER_BATCH = 100
BATCHES_IN_FLIGHT = 4  # 400 messages in flight at most: B is not held back by its window
PAYLOAD = b"x" * 200


async def one_by_one(nc: nats.NATS, subject: str, count: int) -> None:
    room = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with room:
            answer = await nc.request(f"{subject}.{i}", PAYLOAD, timeout=10, headers={"Nats-Msg-Id": f"{subject}{i}"})
            assert b'"error"' not in answer.data, answer.data

    await asyncio.gather(*(one(i) for i in range(count)))


async def batched(nc: nats.NATS, subject: str, count: int) -> None:
    room = asyncio.Semaphore(BATCHES_IN_FLIGHT)

    async def batch(first: int) -> None:
        async with room:
            batch_id = nc.new_inbox().rpartition(".")[2]
            last = min(first + PER_BATCH, count) - first
            for n in range(1, last + 1):
                headers = {
                    "Nats-Batch-Id": batch_id,
                    "Nats-Batch-Sequence": str(n),
                    "Nats-Msg-Id": f"{subject}{first + n}",
                }
                if n < last:
                    await nc.publish(f"{subject}.{first + n}", PAYLOAD, headers=headers)
                else:
                    answer = await nc.request(
                        f"{subject}.{first + n}", PAYLOAD, timeout=10, headers={**headers, "Nats-Batch-Commit": "1"}
                    )
                    assert b'"error"' not in answer.data, answer.data

    await asyncio.gather(*(batch(first) for first in range(0, count, PER_BATCH)))


async def measure(url: str, pid: int, rounds: int, count: int) -> dict[str, dict[str, list[float]]]:
    nc = await nats.connect(url)
    found: dict[str, dict[str, list[float]]] = {"A: one request per message": {}, "B: atomic batches of 100": {}}
    try:
        for round_number in range(rounds):
            for (name, figures), send in zip(found.items(), (one_by_one, batched), strict=True):
                stream = f"S{round_number}{name[0]}"
                config = {"name": stream, "subjects": [f"{stream.lower()}.>"], "storage": "file", "allow_atomic": True}
                await nc.request(f"$JS.API.STREAM.CREATE.{stream}", json.dumps(config).encode())
                server_before, client_before = cpu_seconds(pid), cpu_seconds(os.getpid())
                started = time.perf_counter()
                await send(nc, stream.lower(), count)
                elapsed = time.perf_counter() - started
                figures.setdefault("messages/s", []).append(count / elapsed)
                figures.setdefault("nats-server CPU per message, µs", []).append(
                    (cpu_seconds(pid) - server_before) / count * 1e6
                )
                figures.setdefault("client CPU per message, µs", []).append(
                    (cpu_seconds(os.getpid()) - client_before) / count * 1e6
                )
                log(f"round {round_number + 1}, {name}: {count / elapsed:.0f}/s")
    finally:
        await nc.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with ProcessGroup() as group, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        server = group.nats()
        assert server.process is not None
        found = runner.run(measure(server.url, server.process.pid, args.rounds, args.messages))
    rows = [
        row(f"{name}: {label}", values, label.rsplit(" ", 1)[-1])
        for name, f in found.items()
        for label, values in f.items()
    ]
    a, b = ({label: float(summarize(v)["value"]) for label, v in f.items()} for f in found.values())
    ratios = [ratio(f"B / A: {label}", b[label] / a[label], "B kept only if it wins", None) for label in a]
    notes = [
        f"{args.rounds} rounds of {args.messages} messages each way, {CONCURRENCY} in flight (B: {PER_BATCH} per batch, "
        f"{BATCHES_IN_FLIGHT} batches in flight), a fresh file stream each, one nats-server 2.15.",
        "An atomic batch is staged on the server until its commit and checked as a whole; ADR-50 says it is about "
        "all-or-nothing, not speed. The fast-ingest batches of 2.14 (allow_batched) are for long flow-controlled "
        "streams of writes (the first message waits for the server's flow settings), not for coalescing a few "
        "concurrent submits.",
    ]
    write_results(SECTION, "JetStream atomic batches vs one request per message", rows, ratios, notes)
    log(f"wrote bench/results/{SECTION}.md")


if __name__ == "__main__":
    main()
