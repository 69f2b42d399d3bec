"""Each service's /metrics scraped from a real in-process stack after a few jobs: the per-model job
time histograms by final state, counters rather than rate gauges, RPC server metrics by service,
method and code, build_info, and label values in one style (UPPER, as the states)."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc

from asyncinfer.client import AsyncClient, JobState, NotFoundError
from asyncinfer.config import DEMO_MODEL, FLAKY_MODEL, Config
from asyncinfer.metrics import package_version
from asyncinfer.v1 import ops_service_pb2, ops_service_pb2_grpc
from tests.stack import StartStack

X = np.ones((2, 4), dtype=np.float32)
FAILING_X = -np.ones((1, 4), dtype=np.float32)  # flaky fails a job whose first row starts below 0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def scrape(port: int) -> Samples:
    url = f"http://127.0.0.1:{port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    samples: Samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def names(samples: Samples) -> set[str]:
    return {name for name, _labels in samples}


async def test_every_service_exports_job_times_rpc_metrics_and_build_info(
    config: Config, start_stack: StartStack
) -> None:
    ports = {"gateway": free_port(), "scheduler": free_port(), "batcher": free_port()}
    stack_config = config.replace(
        models=[DEMO_MODEL, FLAKY_MODEL],
        gateway={"metrics_port": ports["gateway"]},
        scheduler={"metrics_port": ports["scheduler"]},
        batcher={"metrics_port": ports["batcher"]},
    )
    stack = await start_stack(stack_config, batcher=False)
    async with AsyncClient(stack.address) as client:
        queued = await client.submit("demo", {"x": X})
        assert (await client.cancel(queued)).state is JobState.CANCELED  # ended by the gateway
        with pytest.raises(NotFoundError):
            await client.get("0190b8e4-7c1a-7d3e-8f00-000000000000")

        await stack.start_batcher()
        done = [await client.submit("demo", {"x": X}) for _ in range(3)]
        failing = await client.submit("flaky", {"x": FAILING_X})
        for job in done:
            assert (await client.wait(job, timeout_s=30)).state is JobState.SUCCEEDED
        assert (await client.wait(failing, timeout_s=30)).state is JobState.FAILED
    async with grpc.aio.insecure_channel(stack.ops_address) as channel:
        await ops_service_pb2_grpc.OpsServiceStub(channel).GetQueueStats(ops_service_pb2.GetQueueStatsRequest())
    assert stack.batcher is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.batcher.port}") as channel:
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert (await kserve.ServerLive(service_pb2.ServerLiveRequest())).live
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await kserve.ModelMetadata(service_pb2.ModelMetadataRequest(name="nope"))

    gateway, scheduler, batcher = [await scrape(port) for port in ports.values()]

    for service, samples in (("gateway", gateway), ("scheduler", scheduler), ("batcher", batcher)):
        assert value(samples, "asyncinfer_build_info", service=service, version=package_version()) == 1

    # The job the gateway ended, timed there; the ones the scheduler ended, there.
    canceled = {"model": "demo", "state": "CANCELED"}
    assert value(gateway, "asyncinfer_job_duration_seconds_count", **canceled) == 1
    assert value(gateway, "asyncinfer_job_queue_seconds_count", **canceled) == 1
    assert value(gateway, "asyncinfer_job_run_seconds_count", **canceled) == 0  # it never ran
    succeeded = {"model": "demo", "state": "SUCCEEDED"}
    for histogram in ("queue", "run", "duration"):
        assert value(scheduler, f"asyncinfer_job_{histogram}_seconds_count", **succeeded) == 3
        assert value(scheduler, f"asyncinfer_job_{histogram}_seconds_bucket", le="+Inf", **succeeded) == 3
    assert value(scheduler, "asyncinfer_job_run_seconds_sum", **succeeded) > 0
    duration_sum = value(scheduler, "asyncinfer_job_duration_seconds_sum", **succeeded)
    assert duration_sum >= value(scheduler, "asyncinfer_job_run_seconds_sum", **succeeded)
    failed = {"model": "flaky", "state": "FAILED"}
    assert value(scheduler, "asyncinfer_job_duration_seconds_count", **failed) == 1
    assert value(scheduler, "asyncinfer_job_run_seconds_count", **failed) == 1
    assert value(scheduler, "asyncinfer_job_duration_seconds_sum", **failed) > 0

    # Counters, not rate gauges.
    assert "asyncinfer_completed_per_second" not in names(scheduler)
    assert value(scheduler, "asyncinfer_results_total", model="demo") == 3
    assert value(scheduler, "asyncinfer_jobs_total", **succeeded) == 3
    assert value(batcher, "asyncinfer_batcher_items_total", model="demo", outcome="OK") == 3

    jobs = "asyncinfer.v1.JobService"
    handled = "asyncinfer_rpc_server_handled_total"
    assert value(gateway, handled, service=jobs, method="SubmitJob", code="OK") == 5
    assert value(gateway, handled, service=jobs, method="CancelJob", code="OK") == 1
    assert value(gateway, handled, service=jobs, method="GetJob", code="NOT_FOUND") == 1
    assert value(gateway, handled, service=jobs, method="WatchJob", code="OK") >= 1  # a stream, counted at its end
    assert value(gateway, "asyncinfer_rpc_server_handling_seconds_count", service=jobs, method="SubmitJob") == 5
    ops = "asyncinfer.v1.OpsService"
    assert value(scheduler, handled, service=ops, method="GetQueueStats", code="OK") == 1
    kserve_name = "inference.GRPCInferenceService"
    assert value(batcher, handled, service=kserve_name, method="ServerLive", code="OK") == 1
    code = unknown.value.code().name
    assert value(batcher, handled, service=kserve_name, method="ModelMetadata", code=code) == 1

    # One style of label values: the states' (UPPER_SNAKE), wherever a label is an outcome or a code.
    for samples in (gateway, scheduler, batcher):
        for name, labels in samples:
            for key, label in labels:
                if key in ("state", "outcome", "code", "reason", "priority"):
                    assert label == label.upper(), (name, key, label)


@pytest.mark.unit
def test_the_package_version_is_read_from_the_installed_metadata_once(monkeypatch: pytest.MonkeyPatch) -> None:
    version = package_version()  # read here, or by whatever ran before in this process
    reads: list[str] = []

    def read(name: str) -> str:
        reads.append(name)
        return "9.9.9"

    monkeypatch.setattr("asyncinfer.metrics.metadata.version", read)
    assert [package_version() for _ in range(3)] == [version] * 3
    assert reads == [], "the metadata read once a process, not again at every service's start"
