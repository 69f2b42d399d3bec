"""A/B (session 28, not kept): the services' gRPC on grpcio's EventEngine endpoints (A, its default)
against its older iomgr endpoints (B: GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener,
-event_engine_for_all_other_endpoints in the services' environment), two stacks up at once: round
trips in alternated blocks, with Celery's in the same blocks, then unary bursts of 3,000 alternated,
with CPU per job per process.

    .venv/bin/python -m bench.system.grpc_iomgr_ab [--blocks 16] [--bursts 4]    # ~8 minutes

Why it was tried: a trivial grpc.aio server paced at 200 calls/s makes ~16 context switches per call
on EventEngine (its poller thread hands each event to a worker thread, which wakes the asyncio
poller thread, which wakes the loop) and ~8 on iomgr. The result is in docs/ARCHITECTURE.md ("What
a unary call costs the gateway") and bench/results/ab_grpc_iomgr.txt. The experiments are read once,
when grpc is imported, so they must be in the environment before the process starts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import grpc
import uvloop

from asyncinfer.v1 import job_service_pb2_grpc
from bench.system.common import Child, ProcessGroup
from bench.system.e2e import PAYLOAD, Stack, burst, start_celery
from bench.system.round_trip_ab import trips

IOMGR = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"
TRIPS_PER_BLOCK = 25
BURST = 3000


class WithEnvironment:
    """A ProcessGroup whose services start with `env` added to their environment."""

    def __init__(self, group: ProcessGroup, env: dict[str, str]) -> None:
        self._group = group
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    def service(self, name: str, config: Any, **options: Any) -> Child:
        return self._group.service(name, config, env=self._env, **options)


def celery_trips(count: int) -> list[float]:
    from bench.system.celery_app import noop

    found = []
    for _ in range(count):
        started = time.perf_counter()
        noop.apply_async(args=(PAYLOAD,)).get(timeout=30)
        found.append((time.perf_counter() - started) * 1e3)
    return found


async def main(blocks: int, bursts: int) -> None:
    with ProcessGroup() as group:
        stacks = {
            "A": Stack(group, name="a"),
            "B": Stack(WithEnvironment(group, {"GRPC_EXPERIMENTS": IOMGR}), name="b"),  # type: ignore[arg-type]
        }
        start_celery(group)
        stubs = {
            side: job_service_pb2_grpc.JobServiceStub(grpc.aio.insecure_channel(stack.gateway.address))
            for side, stack in stacks.items()
        }
        for stub in stubs.values():
            await trips(stub, 30)
        celery_trips(20)
        round_trips: dict[str, list[float]] = {"A": [], "B": [], "celery": []}
        for block in range(blocks):
            for side in ["A", "B", "celery"] if block % 2 == 0 else ["celery", "B", "A"]:
                if side == "celery":
                    round_trips[side] += await asyncio.to_thread(celery_trips, TRIPS_PER_BLOCK)
                else:
                    round_trips[side] += await trips(stubs[side], TRIPS_PER_BLOCK)
        p50 = {side: statistics.median(found) for side, found in round_trips.items()}
        for side, found in round_trips.items():
            print(f"round trip {side}: p50 {p50[side]:.2f} ms  p90 {statistics.quantiles(found, n=10)[-1]:.2f}")
        print(
            f"A/celery {p50['A'] / p50['celery']:.2f}  B/celery {p50['B'] / p50['celery']:.2f}  B/A {p50['B'] / p50['A']:.3f}"
        )
        rates: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
        for number in range(bursts):
            for side in ["A", "B"] if number % 2 == 0 else ["B", "A"]:
                measured = await burst(stubs[side], stacks[side], BURST)
                cpu = {k: v / BURST * 1e3 for k, v in measured.cpu_s.items() if "client" not in k}
                rates[side].append((measured.collected_rate, sum(cpu.values())))
                per_process = " ".join(f"{k}={v:.2f}" for k, v in cpu.items())
                print(
                    f"burst {side}: {measured.collected_rate:.0f} jobs/s, CPU/job {sum(cpu.values()):.2f} ms {per_process}"
                )
        for side, found in rates.items():
            rate = statistics.median(r for r, _ in found)
            cpu_ms = statistics.median(c for _, c in found)
            print(f"burst {side} median: {rate:.0f} jobs/s, CPU/job {cpu_ms:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--bursts", type=int, default=4)
    args = parser.parse_args()
    uvloop.run(main(args.blocks, args.bursts))
