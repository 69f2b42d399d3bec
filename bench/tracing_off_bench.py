"""What tracing costs a job when it is off (the default): the per-job work of each hop that the
trace context touches, timed on whichever checkout is on PYTHONPATH, so an A/B against a tree
without tracing is two runs of this script:

    PYTHONPATH=. python bench/tracing_off_bench.py
    PYTHONPATH=/path/to/other/tree python /path/to/this/bench/tracing_off_bench.py

One row per hop: CPU microseconds per job (process time, so a shared machine's other work does
not count), the best of several rounds of many calls. Only functions both trees have are called.

- gateway: the SubmitJob request's conversion, the QUEUED record, its work message's and queued
  notice's encodings, and the Job answered;
- scheduler: the work message's decoding into the QUEUED record, the RUNNING and SUCCEEDED
  records (evolve + encode), and the work order's message;
- batcher: the engine's item for an order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from asyncinfer.codecs.envelope import decode_envelope, encode_envelope
from asyncinfer.codecs.record import encode_record
from asyncinfer.jobs import JobRecord, JobState, Priority, queued_envelope
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_service_pb2, tensor_pb2
from services.batcher.items import PendingItem
from services.gateway.convert import job_to_proto, submit_request_from_proto
from services.scheduler.messages import WorkOrder
from services.scheduler.worker_service import order_to_proto

CALLS = 2_000
ROUNDS = 25
X = Tensor("x", "FP32", (1, 4), bytes(16))


def request() -> job_service_pb2.SubmitJobRequest:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
    return job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x])


def queued() -> JobRecord:
    return JobRecord(
        job_id="0190a3b4-0000-7000-8000-000000000001",
        tenant="default",
        model_name="demo",
        model_version="1",
        state=JobState.QUEUED,
        priority=Priority.NORMAL,
        create_time=1_700_000_000.125,
        update_time=1_700_000_000.125,
        max_attempts=3,
        result_retention_s=86400.0,
        execution_timeout_s=60.0,
    )


def gateway_hop(message: job_service_pb2.SubmitJobRequest) -> None:
    submit_request_from_proto(message, now=1_700_000_000.0)
    record = queued()
    encode_envelope(queued_envelope(record, (X,)))
    encode_record(record)
    job_to_proto(record)


def scheduler_hop(data: bytes) -> None:
    record = decode_envelope(data).queued_record()
    running = record.evolve(state=JobState.RUNNING, attempt=1, start_time=1_700_000_000.2, batcher_id="b")
    encode_record(running)
    order = WorkOrder(
        job_id=record.job_id,
        attempt=1,
        model_name=record.model_name,
        model_version=record.model_version,
        priority=record.priority,
        tenant=record.tenant,
        inputs=(X,),
        execution_timeout_s=60.0,
    )
    order_to_proto(order)
    encode_record(running.evolve(state=JobState.SUCCEEDED, outputs=(X,), end_time=1_700_000_000.3))


def batcher_hop(loop: asyncio.AbstractEventLoop) -> None:
    PendingItem({"x": X}, loop.create_future(), submitted_at=0.0, expires_at=None, priority=Priority.NORMAL, seq=0)


def best_us(action: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        started = time.process_time()
        for _ in range(CALLS):
            action()
        best = min(best, (time.process_time() - started) / CALLS)
    return best * 1e6


def main() -> None:
    message = request()
    data = encode_envelope(queued_envelope(queued(), (X,)))
    loop = asyncio.new_event_loop()
    rows = {
        "gateway (convert, record, encodings, Job)": best_us(lambda: gateway_hop(message)),
        "scheduler (decode, RUNNING, order, SUCCEEDED)": best_us(lambda: scheduler_hop(data)),
        "batcher (the order's engine item)": best_us(lambda: batcher_hop(loop)),
    }
    loop.close()
    for name, us in rows.items():
        print(f"{name:48} {us:7.2f} us/job")
    print(f"{'total':48} {sum(rows.values()):7.2f} us/job")


if __name__ == "__main__":
    main()
