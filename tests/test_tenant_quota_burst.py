"""Issue 17: a tenant quota under a 128-client burst, with the scheduler killed (SIGKILL) and
restarted twice mid-burst. The count is the work stream's own (one subject per unfinished job),
so afterwards it is exactly the jobs not yet ended, nothing drifts, no submit fails for
contention, the tenant is never over its limit (one gateway) and is not locked out after."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from asyncinfer.config import Config, render_default_config
from asyncinfer.contract import tenant_work_subjects
from asyncinfer.embedded_nats import NatsServerProcess, free_port
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.nats.connection import connect
from asyncinfer.nats.streams import count_subjects
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from tests.processes import Service, until
from tests.test_crash import crash_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CLIENTS = 128
CHANNELS = 16
LIMIT = 100
JOBS = 1200
TENANT = "default"


def submit_request() -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([1, 2, 3, 4])
    return job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])


async def test_tenant_quota_exact_under_a_128_client_burst_with_scheduler_kills(
    nats_server: NatsServerProcess, tmp_path: Path
) -> None:
    ports = {name: free_port() for name in ("gateway", "scheduler", "batcher")}
    config = crash_config(nats_server.url, ports).replace(gateway={"max_queued_per_tenant": LIMIT})
    config_file = tmp_path / "asyncinfer.toml"
    config_file.write_text(render_default_config(config))
    services = {name: Service(name, config_file, tmp_path, ports[name]) for name in ports}
    nc = await connect(Config().replace(nats={"url": nats_server.url}).nats, name="quota-test")
    accepted: list[str] = []
    outcomes: Counter[str] = Counter()
    over_limit: list[int] = []
    counts: list[int] = []
    stop = asyncio.Event()

    async def queued() -> int:
        return await count_subjects(nc, config.nats.work_stream, tenant_work_subjects(TENANT), timeout_s=5.0)

    async def client(stub: job_service_pb2_grpc.JobServiceStub) -> None:
        request = submit_request()
        while len(accepted) < JOBS:
            try:
                response = await stub.SubmitJob(request, timeout=30)
            except grpc.aio.AioRpcError as error:
                status = status_details(error)
                reason = unpack_details(status)["ErrorInfo"].reason if status is not None else ""
                outcomes[f"{error.code().name} {reason}".strip()] += 1
                await asyncio.sleep(0.02)
                continue
            outcomes["OK"] += 1
            accepted.append(response.job.job_id)

    async def sample() -> None:
        while not stop.is_set():
            count = await queued()
            counts.append(count)
            if count > LIMIT:
                over_limit.append(count)
            await asyncio.sleep(0.02)

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{ports['gateway']}") for _ in range(CHANNELS)]
    stubs = [job_service_pb2_grpc.JobServiceStub(channel) for channel in channels]
    sampler: asyncio.Task[None] | None = None
    clients: list[asyncio.Task[None]] = []
    try:
        for name in ("gateway", "scheduler", "batcher"):
            await services[name].start()
        sampler = asyncio.create_task(sample())
        clients = [asyncio.create_task(client(stubs[i % CHANNELS])) for i in range(CLIENTS)]
        for at in (300, 700):
            await until(lambda at=at: len(accepted) >= at or any(t.done() for t in clients), 60)
            services["scheduler"].kill()
            await services["scheduler"].start()
        await asyncio.wait_for(asyncio.gather(*clients), 90)

        stub = stubs[0]

        async def all_ended() -> bool:
            for start in range(0, len(accepted), 1000):
                ids = accepted[start : start + 1000]
                reply = await stub.GetJobs(job_service_pb2.GetJobsRequest(job_ids=ids))
                if not all(r.job.state == job_pb2.JOB_STATE_SUCCEEDED for r in reply.results):
                    return False
            return True

        give_up_at = time.monotonic() + 60
        while not await all_ended():
            assert time.monotonic() < give_up_at, "jobs did not end"
            await asyncio.sleep(0.2)
        stop.set()
        await sampler
        # Everything ended: the count is exactly 0, and the tenant may submit again at once.
        assert await queued() == 0
        fresh = (await stub.SubmitJob(submit_request(), timeout=5)).job
        assert fresh.state == job_pb2.JOB_STATE_QUEUED
    finally:
        stop.set()
        for task in [*clients, *([sampler] if sampler else [])]:
            task.cancel()
        await asyncio.gather(*clients, *([sampler] if sampler else []), return_exceptions=True)
        for channel in channels:
            await channel.close(None)
        for service in services.values():
            service.stop()
        await nc.close()
        print(
            f"quota burst: {len(accepted)} accepted, outcomes {dict(outcomes)}, "
            f"count samples {len(counts)} max {max(counts, default=0)} (limit {LIMIT})"
        )

    assert len(accepted) >= JOBS
    assert len(set(accepted)) == len(accepted)
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED TENANT_QUOTA_EXCEEDED"}, outcomes
    assert outcomes["RESOURCE_EXHAUSTED TENANT_QUOTA_EXCEEDED"] > 0  # the limit was reached
    assert not over_limit, over_limit
    assert max(counts) >= LIMIT * 0.9  # the burst did fill the quota
