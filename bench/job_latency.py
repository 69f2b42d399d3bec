"""Submit-to-SUCCEEDED latency of single jobs on the demo model, through the whole stack
(real nats-server, gateway, scheduler, batcher in one process; one job at a time, light load).

    .venv/bin/python bench/job_latency.py [--jobs 200]

Prints the median, p90 and p99 of: SubmitJob's own latency, and the time from sending SubmitJob to
WatchJob reporting SUCCEEDED. Figures are reported, never asserted in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from asyncinfer.config import Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.batcher.app import BatcherApp
from services.gateway.app import GatewayApp
from services.scheduler.app import SchedulerApp


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(jobs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, NatsServerProcess(store_dir=Path(tmp) / "nats") as nats:
        config = Config().replace(
            nats={"url": nats.url},
            gateway={"port": 0, "metrics_port": 0},
            scheduler={"port": 0, "metrics_port": 0},
            batcher={"port": 0, "metrics_port": 0, "scheduler_address": None},
            logging={"level": "warning"},
        )
        gateway, scheduler = GatewayApp(config), SchedulerApp(config)
        await gateway.start()
        await scheduler.start()
        batcher = BatcherApp(config.replace(batcher={"scheduler_address": f"127.0.0.1:{scheduler.port}"}))
        await batcher.start()
        x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
        x.contents.fp32_contents.extend([1, 2, 3, 4])
        request = job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])
        submit_ms: list[float] = []
        total_ms: list[float] = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                stub = job_service_pb2_grpc.JobServiceStub(channel)
                for i in range(jobs + 10):
                    t0 = time.perf_counter()
                    job = (await stub.SubmitJob(request)).job
                    t1 = time.perf_counter()
                    async for update in stub.WatchJob(job_service_pb2.WatchJobRequest(job_id=job.job_id)):
                        if update.job.state == job_pb2.JOB_STATE_SUCCEEDED:
                            break
                    t2 = time.perf_counter()
                    if i >= 10:  # warm-up excluded
                        submit_ms.append((t1 - t0) * 1e3)
                        total_ms.append((t2 - t0) * 1e3)
        finally:
            await batcher.stop(2)
            await scheduler.stop(2)
            await gateway.stop(2)
    for name, values in (("SubmitJob", submit_ms), ("submit -> SUCCEEDED", total_ms)):
        print(
            f"{name:20s} n={len(values)}  p50 {statistics.median(values):6.2f} ms  "
            f"p90 {percentile(values, 0.9):6.2f} ms  p99 {percentile(values, 0.99):6.2f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=200)
    asyncio.run(run(parser.parse_args().jobs))
