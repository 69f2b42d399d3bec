"""A/B for issue 14, item 2: what would one durable write per accepted job save over today's two
(the work message, then the job record)? Measured before building it, with its upper bound: the
same gateway with the record write taken out (bench/system/gateway_without_record.py) against
today's, in one run, alternated round by round.

    .venv/bin/python -m bench.system.ab_one_write [--rounds 3]

Per gateway: unary SubmitJob at 128 concurrent clients (closed loop) and SubmitJobs with 100 jobs
per message, accepted jobs/s and the gateway's CPU per accepted job; plus the SubmitJob latency of
one client (back to back). A one-write design would still pay the work publish, so B bounds its
gain from above. Writes bench/results/ab_one_write.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

import grpc
import nats
import uvloop

from asyncinfer.config import render_default_config
from asyncinfer.v1 import job_service_pb2_grpc
from bench.system.common import (
    PYTHON,
    ProcessGroup,
    bench_config,
    free_port,
    grpc_serving,
    log,
    ratio,
    row,
    summarize,
    write_results,
)
from bench.system.submission import FULL, Sizes, closed_loop, grouped_stream_window, submit_request

SECTION = "ab_one_write"
SETUPS = {
    "A: two writes (today)": "services.cli",
    "B: the record write taken out": "bench.system.gateway_without_record",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = Sizes(runs=1, window_s=FULL.window_s, warmup_s=FULL.warmup_s, streams=(1,))
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in SETUPS}
    with ProcessGroup() as group, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        server = group.nats()
        config = bench_config(server.url)

        async def measure(address: str, pid_cpu: Callable[[], float]) -> dict[str, float]:
            request = submit_request()
            found: dict[str, float] = {}
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            try:
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = job_service_pb2_grpc.JobServiceStub(channel)

                    async def submit() -> object:
                        return await stub.SubmitJob(request)

                    one = await closed_loop(submit, 1, sizes)
                    found["SubmitJob, 1 client, p50 ms"] = one.p50
                    before = pid_cpu()
                    window = await closed_loop(submit, 128, sizes)
                    used = pid_cpu() - before
                    found["SubmitJob, 128 clients, accepted jobs/s"] = window.rate
                    found["gateway CPU per accepted job, unary, ms"] = used / max(window.total, 1) * 1e3
                    for stream in ("WORK", "KV_jobs"):
                        await js.purge_stream(stream)
                    grouped = await grouped_stream_window(stub, sizes)
                    found["SubmitJobs, 100 jobs per message, accepted jobs/s"] = grouped.rate
                    for stream in ("WORK", "KV_jobs"):
                        await js.purge_stream(stream)
            finally:
                await nc.close()
            return found

        for round_number in range(1, args.rounds + 1):
            for name, module in SETUPS.items():
                port = free_port()
                gateway_config = config.replace(gateway={"port": port})
                path = group.tmp / f"gateway-{round_number}-{len(figures[name])}.toml"
                path.write_text(render_default_config(gateway_config))
                child = group.command(
                    f"gateway-{name[0]}-{round_number}",
                    [PYTHON, "-m", module, "gateway", "--config", str(path)],
                    ready=lambda c: grpc_serving(c.address),
                    port=port,
                )
                found = runner.run(measure(child.address, child.cpu_seconds))
                group.stop(child, timeout_s=30)
                for label, value in found.items():
                    figures[name].setdefault(label, []).append(value)
                log(f"round {round_number}, {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in found.items()))
    rows = [
        row(f"{name}: {label}", values, label.rsplit(" ", 1)[-1])
        for name in SETUPS
        for label, values in figures[name].items()
    ]
    a, b = ({label: float(summarize(v)["value"]) for label, v in figures[name].items()} for name in SETUPS)
    ratios = [ratio(f"B / A: {label}", b[label] / a[label], "the most one write could change it", None) for label in a]
    notes = [
        f"{args.rounds} rounds, a fresh gateway per setup and round (nats-server shared; no scheduler, so jobs stay "
        f"queued and the streams are purged between windows); {sizes.warmup_s} s warm-up, {sizes.window_s} s windows.",
        "B keeps the work publish and the queued notice and drops only the record write, so it bounds from above "
        "what a one-write submit (the work message as the QUEUED record) could gain at the gateway.",
    ]
    write_results(SECTION, "A/B: one durable write per submit (upper bound) vs today's two", rows, ratios, notes)
    log(f"wrote bench/results/{SECTION}.md")


if __name__ == "__main__":
    main()
