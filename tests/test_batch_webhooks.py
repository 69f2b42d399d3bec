"""A batch's terminal callback (issue 15) through the whole stack to a real HTTP receiver that
verifies every signature with `standardwebhooks`: one signed delivery per batch end (completed,
cancelled), none when none was asked, a URL refused at CreateBatch as a job's is, and one
delivery when the gateway that wrote the end died before enqueueing it (another driver enqueues
it; enqueues from several drivers are one)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest

from asyncinfer.batches import BatchRecord, BatchState
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.errors import Unavailable
from asyncinfer.ids import new_job_id
from asyncinfer.jobs import CallbackSpec
from asyncinfer.v1 import batch_service_pb2, job_pb2
from asyncinfer.webhook_status import (
    DeliveryState,
    deliveries_key,
    encode_deliveries,
    ensure_webhooks_bucket,
    read_deliveries,
)
from services.batcher.models import demo
from services.gateway.batch_callbacks import BatchCallbacks
from services.gateway.batch_store import BatchStore, ensure_batches_bucket
from tests.batch_helpers import batches_stub, create_request, demo_records, jsonl, upload, wait_ended, wait_until
from tests.stack import Stack, StartStack
from tests.test_batch_lifecycle import GATED, gate
from tests.webhook_receiver import Receiver, receiver, webhook_config

__all__ = ["gate", "receiver"]  # the fixtures, used by name
WAIT_S = 30.0


def batch_config(config: Config) -> Config:
    return webhook_config(config).replace(
        batches={"chunk_records": 50, "chunks_in_flight": 2, "drive_interval_s": 0.05, "adopt_interval_s": 0.2},
        models=[DEMO_MODEL.model_dump(), GATED],
    )


def callback(url: str, *events: int) -> job_pb2.Callback:
    return job_pb2.Callback(url=url, events=events)


async def settled(stack: Stack, batch_id: str) -> None:
    """Until the batch's delivery is final and nothing is left on the WEBHOOKS stream (so a
    duplicate, had one been enqueued, would have been sent by now)."""
    js = stack.nc.jetstream()
    kv = await ensure_webhooks_bucket(js, stack.config.nats)
    async with asyncio.timeout(WAIT_S):
        while True:
            entry = await read_deliveries(kv, "default", batch_id)
            info = await js.stream_info(stack.config.nats.webhooks_stream)
            if entry.deliveries and all(d.state.is_final for d in entry.deliveries) and info.state.messages == 0:
                assert [d.state for d in entry.deliveries] == [DeliveryState.DELIVERED]
                return
            await asyncio.sleep(0.05)


def verified(received: Any) -> dict[str, Any]:
    assert not isinstance(received.verified, Exception), received.verified
    body: dict[str, Any] = json.loads(received.body)
    return body


async def test_a_completed_batch_sends_one_signed_webhook_with_its_state(
    config: Config, start_stack: StartStack, receiver: Receiver
) -> None:
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(120)))
    created = await stub.CreateBatch(create_request(ref, callback=callback(receiver.url("/done")), labels={"k": "v"}))
    silent = await stub.CreateBatch(create_request(ref))  # no callback: nothing is sent
    batch_id = created.batch.batch_id
    batch = await wait_ended(stub, batch_id)
    await wait_ended(stub, silent.batch.batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED

    [received] = await receiver.wait_for("/done", 1)
    await settled(stack, batch_id)
    assert len(receiver.received) == 1  # once, and nothing for the batch without a callback
    body = verified(received)
    assert received.headers["webhook-id"] == f"msg_batch_{batch_id}_end"
    assert body["type"] == "batch.completed"
    data = body["data"]
    assert data["batch_id"] == batch_id
    assert data["state"] == "COMPLETED"
    assert data["request_counts"] == {"total": 120, "completed": 120, "failed": 0}
    assert data["output_ref"] == batch.output_ref.ref
    assert data["error_ref"] == batch.error_ref.ref
    assert data["labels"] == {"k": "v"}
    assert data["fetch"] == {"rpc": "asyncinfer.v1.BatchService/GetBatch", "batch_id": batch_id}
    assert {"create_time", "in_progress_time", "finalizing_time", "end_time", "expires_at"} <= data.keys()
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), stack.config.nats), stack.nc)
    record = await store.get("default", batch_id)
    assert record is not None
    assert record.callback_enqueued
    unasked = await store.get("default", silent.batch.batch_id)
    assert unasked is not None
    assert unasked.callback is None
    assert not unasked.callback_enqueued


async def test_a_cancelled_batch_sends_its_cancelled_webhook(
    config: Config, start_stack: StartStack, receiver: Receiver, gate: None
) -> None:
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(300)))
    created = await stub.CreateBatch(
        create_request(ref, model_name="gated", callback=callback(receiver.url("/cancel")))
    )
    batch_id = created.batch.batch_id
    await wait_until(stub, batch_id, lambda b: b.state == batch_service_pb2.BATCH_STATE_IN_PROGRESS)
    await stub.CancelBatch(batch_service_pb2.CancelBatchRequest(batch_id=batch_id))
    demo.GATE.set()
    batch = await wait_ended(stub, batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_CANCELLED
    [received] = await receiver.wait_for("/cancel", 1)
    await settled(stack, batch_id)
    assert len(receiver.at("/cancel")) == 1
    data = verified(received)["data"]
    assert verified(received)["type"] == "batch.cancelled"
    assert data["state"] == "CANCELLED"
    counts = data["request_counts"]
    assert counts["total"] == 300
    assert counts["failed"] == 0  # the records the cancel skipped never ran: neither completed nor failed
    assert counts["completed"] < 300


async def test_a_batch_end_whose_webhook_was_not_enqueued_is_enqueued_once_by_another_driver(
    config: Config, start_stack: StartStack, receiver: Receiver
) -> None:
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(10)))
    # A finished batch (its ID's records ran) ...
    created = await stub.CreateBatch(create_request(ref))
    done = await wait_ended(stub, created.batch.batch_id)
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), stack.config.nats), stack.nc)
    finished = await store.get("default", done.batch_id)
    assert finished is not None
    # ... copied as the terminal write of a batch with a callback whose gateway died right after it.
    orphan = finished.evolve(batch_id=new_job_id(), revision=0, callback=CallbackSpec(url=receiver.url("/orphan")))
    assert orphan.state is BatchState.COMPLETED
    written = await store.write(orphan)
    # Two more gateways enqueue it too (each saw the terminal record without callback_enqueued).
    callbacks = BatchCallbacks(stack.nc.jetstream(), stack.config)
    await asyncio.gather(callbacks.enqueue(written), callbacks.enqueue(written))

    [received] = await receiver.wait_for("/orphan", 1)
    await settled(stack, orphan.batch_id)
    async with asyncio.timeout(WAIT_S):  # the adopting driver records the enqueue
        while True:
            record = await store.get("default", orphan.batch_id)
            if record is not None and record.callback_enqueued:
                break
            await asyncio.sleep(0.05)
    assert len(receiver.at("/orphan")) == 1
    assert verified(received)["data"]["batch_id"] == orphan.batch_id
    assert abs(int(received.headers["webhook-timestamp"]) - time.time()) < 60


async def test_a_callback_url_refused_for_jobs_is_refused_for_batches(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(1)))
    for url, events in (
        ("http://10.1.2.3/hook", ()),  # outside webhooks.allowed_networks
        ("not a url", ()),
        ("http://127.0.0.1:9/hook", (job_pb2.CALLBACK_EVENT_RUNNING,)),  # a batch sends only its end
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateBatch(create_request(ref, callback=callback(url, *events)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, url


async def test_a_late_second_enqueue_of_a_batch_end_being_retried_is_not_attempted(
    config: Config, start_stack: StartStack, receiver: Receiver
) -> None:
    """A review of the webhooks (session 30): a batch's end enqueued again past the WEBHOOKS
    stream's duplicate window (a driver adopting a terminal record whose gateway died before it
    recorded the enqueue) while the first message was waiting out a retry was attempted at once,
    and then retried on its own: a second retry chain of the same webhook, a POST more each time.
    The sender now acks a message new to it whose delivery already has attempts."""
    window_s = 0.5
    settings = batch_config(config).replace(nats={"duplicate_window_s": window_s}, webhooks={"backoff_max_s": 60.0})
    stack = await start_stack(settings)
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(10)))
    done = await wait_ended(stub, (await stub.CreateBatch(create_request(ref))).batch.batch_id)
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), stack.config.nats), stack.nc)
    finished = await store.get("default", done.batch_id)
    assert finished is not None
    # A terminal write with a callback, enqueued by the driver that adopts it; its receiver asks
    # for 30 s before the next attempt.
    receiver.scripts["/late"] = [(503, {"Retry-After": "30"})]  # then 200
    orphan = finished.evolve(batch_id=new_job_id(), revision=0, callback=CallbackSpec(url=receiver.url("/late")))
    written = await store.write(orphan)
    await receiver.wait_for("/late", 1)
    js = stack.nc.jetstream()
    kv = await ensure_webhooks_bucket(js, stack.config.nats)
    async with asyncio.timeout(WAIT_S):  # the attempt recorded, its retry 30 s away
        while True:
            entry = await read_deliveries(kv, "default", orphan.batch_id)
            if entry.deliveries:
                break
            await asyncio.sleep(0.05)
    assert entry.deliveries[0].attempts == 1
    # Past the duplicate window (a server's clock, with no event to wait on), another gateway
    # that saw the record without callback_enqueued enqueues it again: a second message.
    await asyncio.sleep(2 * window_s)
    await BatchCallbacks(js, stack.config).enqueue(written)
    async with asyncio.timeout(WAIT_S):  # the second message is done with (acked)
        while True:
            info = await js.stream_info(stack.config.nats.webhooks_stream)
            if info.state.last_seq == 2 and info.state.messages == 1:
                break
            await asyncio.sleep(0.05)
    (delivery,) = (await read_deliveries(kv, "default", orphan.batch_id)).deliveries
    assert (delivery.state, delivery.attempts) == (DeliveryState.PENDING, 1), "the second message made no attempt"
    assert len(receiver.at("/late")) == 1


async def test_a_second_enqueue_whose_first_message_is_long_overdue_is_attempted(
    config: Config, start_stack: StartStack, receiver: Receiver
) -> None:
    """The other side of the test above: a message new to the sender whose delivery has attempts is
    dropped only while the message that made them is due back (its next attempt not yet an AckWait
    overdue). Past that it is taken for lost (an operator removed the sender's consumer, or the
    stream's message), and the new message carries the delivery on: a second POST of the same
    webhook-id rather than none. Played by hand: after the first attempt the stream is purged and
    the status's next attempt set an hour back; the end is then enqueued again."""
    window_s = 0.5
    settings = batch_config(config).replace(nats={"duplicate_window_s": window_s}, webhooks={"backoff_max_s": 60.0})
    stack = await start_stack(settings)
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(10)))
    done = await wait_ended(stub, (await stub.CreateBatch(create_request(ref))).batch.batch_id)
    store = BatchStore(await ensure_batches_bucket(stack.nc.jetstream(), stack.config.nats), stack.nc)
    finished = await store.get("default", done.batch_id)
    assert finished is not None
    receiver.scripts["/lost"] = [(503, {"Retry-After": "30"})]  # then 200
    orphan = finished.evolve(batch_id=new_job_id(), revision=0, callback=CallbackSpec(url=receiver.url("/lost")))
    written = await store.write(orphan)
    await receiver.wait_for("/lost", 1)
    js = stack.nc.jetstream()
    kv = await ensure_webhooks_bucket(js, stack.config.nats)
    async with asyncio.timeout(WAIT_S):  # the attempt recorded, its message NAKed for 30 s
        while True:
            entry = await read_deliveries(kv, "default", orphan.batch_id)
            if entry.deliveries and entry.deliveries[0].attempts == 1:
                break
            await asyncio.sleep(0.05)
    await js.purge_stream(stack.config.nats.webhooks_stream)  # the first message lost
    overdue = dataclasses.replace(entry.deliveries[0], next_attempt_time=time.time() - 3600.0)
    await kv.put(
        deliveries_key("default", orphan.batch_id),
        encode_deliveries(dataclasses.replace(entry, deliveries=(overdue,))),
    )
    await asyncio.sleep(2 * window_s)  # past the duplicate window (a server's clock: no event)
    await BatchCallbacks(js, stack.config).enqueue(written)
    await receiver.wait_for("/lost", 2)
    async with asyncio.timeout(WAIT_S):
        while True:
            (delivery,) = (await read_deliveries(kv, "default", orphan.batch_id)).deliveries
            if delivery.state is DeliveryState.DELIVERED:
                break
            await asyncio.sleep(0.05)
    assert delivery.attempts == 2


async def test_a_batch_whose_webhook_cannot_be_enqueued_is_not_counted_as_driven(
    config: Config, start_stack: StartStack, receiver: Receiver
) -> None:
    """During a webhook outage the driver keeps an ended batch to enqueue its end at a later tick;
    the gauges of running batches (asyncinfer_batches_driven, asyncinfer_batch_chunks) counted it
    for as long as the outage lasted. Its webhook still goes once the outage is over."""
    stack = await start_stack(batch_config(config))
    driver = stack.gateway.batch_driver
    assert driver is not None
    callbacks = driver._callbacks
    assert callbacks is not None
    refused = 0
    refused_twice = asyncio.Event()
    outage = True
    enqueue = callbacks.enqueue

    async def enqueue_in_an_outage(record: BatchRecord) -> None:
        nonlocal refused
        if not outage:
            await enqueue(record)
            return
        refused += 1
        if refused >= 2:  # a tick after the terminal write's has failed too
            refused_twice.set()
        raise Unavailable("cannot enqueue the batch's webhook: an outage")

    callbacks.enqueue = enqueue_in_an_outage  # type: ignore[method-assign]
    stub = batches_stub(stack.channel)
    ref = await upload(stack.jobs, jsonl(demo_records(120)))
    created = await stub.CreateBatch(create_request(ref, callback=callback(receiver.url("/outage"))))
    batch = await wait_ended(stub, created.batch.batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    async with asyncio.timeout(WAIT_S):
        await refused_twice.wait()

    scraped = generate_latest(stack.gateway.registry).decode()
    assert "asyncinfer_batches_driven 0.0" in scraped
    assert "asyncinfer_batch_chunks{" not in scraped
    assert "asyncinfer_batch_records_per_second{" not in scraped

    outage = False
    [received] = await receiver.wait_for("/outage", 1)
    assert verified(received)["data"]["batch_id"] == batch.batch_id
    await settled(stack, batch.batch_id)
    assert len(receiver.at("/outage")) == 1
