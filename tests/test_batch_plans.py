"""The autoscaling signal counts running batches' planned chunks (asyncinfer.batch_plans): the
header every batch write carries, read by the scheduler's headers-only watch
(services/scheduler/batch_plans.py), and how desired_batchers weighs them."""

from __future__ import annotations

import asyncio

from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.v1 import batch_service_pb2
from services.batcher.models import demo
from services.scheduler.batch_plans import BatchPlans
from services.scheduler.queue_stats import desired_batchers
from tests.batch_helpers import batches_stub, create_request, demo_records, jsonl, upload, wait_ended, wait_until
from tests.stack import StartStack
from tests.test_batch_lifecycle import GATED, gate

__all__ = ["gate"]  # the fixture, used by name


def test_planned_chunks_count_as_waiting_jobs_up_to_the_window_per_batch() -> None:
    measured = {"connected": 1, "completed_per_s": 1.0, "target_drain_s": 10.0}
    # Between two windows nothing is queued, yet the batch goes on: not zero.
    assert desired_batchers(waiting=0, in_flight=0, **measured) == 0
    assert desired_batchers(waiting=0, in_flight=0, planned=10, planned_batches=1, chunks_in_flight=8, **measured) == 1
    # 108 jobs to come at 1/s per batcher in 10 s: 11, but one batch runs at most 8 chunks at once.
    assert desired_batchers(waiting=8, in_flight=0, **measured) == 1
    assert desired_batchers(waiting=8, in_flight=0, planned=100, planned_batches=1, chunks_in_flight=8, **measured) == 9
    assert (
        desired_batchers(waiting=8, in_flight=0, planned=100, planned_batches=2, chunks_in_flight=8, **measured) == 11
    )
    # A held queue counts only what is in flight, planned or not.
    held = desired_batchers(
        waiting=8, in_flight=1, planned=100, planned_batches=1, chunks_in_flight=8, held=True, **measured
    )
    assert held == 1


async def planned_become(plans: BatchPlans, model: str, wanted: tuple[int, int]) -> None:
    async with asyncio.timeout(30):
        while True:
            if plans.planned(model) == wanted:
                return
            await asyncio.sleep(0.05)


async def test_the_scheduler_sees_a_running_batch_s_planned_chunks_until_they_are_queued(
    config: Config, start_stack: StartStack, gate: None
) -> None:
    stack = await start_stack(
        config.replace(
            batches={"chunk_records": 10, "chunks_in_flight": 2, "drive_interval_s": 0.05},
            models=[DEMO_MODEL.model_dump(), GATED],
        )
    )
    plans = BatchPlans(stack.nc.jetstream(), stack.config.nats.batches_bucket)
    await plans.start(stack.config.nats)
    try:
        stub = batches_stub(stack.channel)
        ref = await upload(stack.jobs, jsonl(demo_records(100)))
        created = await stub.CreateBatch(create_request(ref, model_name="gated"))
        batch_id = created.batch.batch_id
        await wait_until(stub, batch_id, lambda b: b.state == batch_service_pb2.BATCH_STATE_IN_PROGRESS)
        await planned_become(plans, "gated", (8, 1))  # 10 chunks, 2 queued
        assert plans.planned("demo") == (0, 0)
        demo.GATE.set()
        assert (await wait_ended(stub, batch_id)).request_counts.completed == 100
        await planned_become(plans, "gated", (0, 0))
    finally:
        await plans.stop()
