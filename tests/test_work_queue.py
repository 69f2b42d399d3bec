"""Pulling work against a real nats-server (the pulls themselves: test_pull_inbox.py): queues found
empty not asked again until a publish is seen or the poll interval has passed; the records that
queued notices bring."""

from __future__ import annotations

import time

import pytest

from asyncinfer.codecs.envelope import encode_envelope
from asyncinfer.codecs.record import encode_record
from asyncinfer.config import Config
from asyncinfer.contract import TENANT_HEADER, routing_headers
from asyncinfer.declarations import ensure_work_consumer, ensure_work_stream
from asyncinfer.jobs import PRIORITIES_BY_RANK, JobRecord, JobState, Priority, WorkEnvelope, work_subject
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg, api
from asyncinfer.nats.pull_inbox import PullInbox
from asyncinfer.queued_notice import decode_queued_notice, encode_queued_notice
from services.scheduler.priority import PrioritySelector
from services.scheduler.queued_records import QueuedRecords
from services.scheduler.work_queue import ModelQueues, tenant_of

MODEL = "demo"


async def consumers(nc: NatsClient, config: Config) -> dict[Priority, str]:
    js = nc.jetstream()
    await ensure_work_stream(js, config.nats)
    return {
        p: await ensure_work_consumer(js, config.nats, model_name=MODEL, priority=p, ack_wait_s=30)
        for p in PRIORITIES_BY_RANK
    }


async def delivered(nc: NatsClient, config: Config, consumer: str) -> int:
    """How many pulls of `consumer` nats-server has answered with a message."""
    info = await nc.jetstream().consumer_info(config.nats.work_stream, consumer)
    return info.delivered.consumer_seq or 0


async def test_a_queue_found_empty_is_asked_again_after_a_publish_or_the_interval(
    nc: NatsClient, config: Config
) -> None:
    names = await consumers(nc, config)
    now = [1000.0]
    queues = ModelQueues(
        nc,
        config.nats.work_stream,
        MODEL,
        PrioritySelector(dict.fromkeys(PRIORITIES_BY_RANK, 1), aging_s=60.0),
        empty_for_s=0.25,
        clock=lambda: now[0],
    )
    assert await queues.pull_next(4) == []
    assert all(queues.known_empty(p) for p in PRIORITIES_BY_RANK)
    js = nc.jetstream()
    # A message no publish was seen for (an AckWait expiry, a delayed retry): not asked for...
    await js.publish(work_subject(MODEL, Priority.HIGH), b"high")
    await js.publish(work_subject(MODEL, Priority.LOW), b"low")
    assert await queues.pull_next(4) == []
    assert await delivered(nc, config, names[Priority.HIGH]) == 0
    # ...until a publish to its queue is seen,
    queues.note_publish(Priority.HIGH)
    taken = await queues.pull_next(4)
    assert [m.data for m in taken] == [b"high"]
    # or until the interval has passed.
    assert await delivered(nc, config, names[Priority.LOW]) == 0
    now[0] += 0.25
    taken += await queues.pull_next(4)
    assert [m.data for m in taken] == [b"high", b"low"]
    for msg in taken:
        await msg.ack()
    await queues.close()


async def test_a_pull_says_whether_it_found_jobs_already_waiting(nc: NatsClient, config: Config) -> None:
    """What the dispatcher's linger reads (services.scheduler.dispatch_linger): jobs that were
    waiting when the pull asked mean a stream that outpaces the rounds; an empty pull does not."""
    await consumers(nc, config)
    queues = ModelQueues(
        nc, config.nats.work_stream, MODEL, PrioritySelector(dict.fromkeys(PRIORITIES_BY_RANK, 1), aging_s=60.0)
    )
    assert await queues.pull_next(4) == []
    assert not queues.found_waiting
    js = nc.jetstream()
    for n in range(2):
        await js.publish(work_subject(MODEL, Priority.NORMAL), b"job %d" % n)
    taken = await queues.pull_next(4)
    assert [m.data for m in taken] == [b"job 0", b"job 1"]
    assert queues.found_waiting
    assert await queues.pull_next(4) == []
    assert not queues.found_waiting
    for msg in taken:
        await msg.ack()
    await queues.close()


def record(job_id: str) -> JobRecord:
    now = time.time()
    return JobRecord(
        job_id=job_id,
        tenant="t",
        model_name=MODEL,
        model_version="1",
        state=JobState.QUEUED,
        priority=Priority.NORMAL,
        create_time=now,
        update_time=now,
        max_attempts=3,
        result_retention_s=60.0,
    )


@pytest.mark.unit
def test_a_queued_notice_round_trips_and_garbage_is_refused() -> None:
    data = encode_record(record("j1"))
    assert decode_queued_notice(encode_queued_notice("t.j1", 7, data)) == ("t.j1", 7, data)
    for garbage in (b"", b"7", b"7\n{}", b"x t.j1\n{}"):
        with pytest.raises(ValueError, match="not a queued notice"):
            decode_queued_notice(garbage)


@pytest.mark.unit
def test_queued_records_give_each_record_once_and_keep_only_the_newest() -> None:
    records = QueuedRecords(capacity=2)
    for n in (1, 2, 3):
        records.put(f"t.j{n}", n, encode_record(record(f"j{n}")))
    assert "t.j1" not in records  # the oldest went first
    taken = records.take("t.j2")
    assert taken is not None
    assert (taken.job_id, taken.revision, taken.state) == ("j2", 2, JobState.QUEUED)
    assert records.take("t.j2") is None
    records.put("t.bad", 4, b"not a record")
    assert records.take("t.bad") is None
    assert len(records) == 1


def test_the_tenant_comes_from_the_routing_header_else_from_the_envelope() -> None:
    """Fairness reads the header; a message from a gateway older than the header is read for its
    tenant alone."""
    envelope = WorkEnvelope(
        job_id="j",
        tenant="payload-tenant",
        model_name="demo",
        model_version="",
        priority=Priority.LOW,
        create_time=0.0,
        max_attempts=1,
    )
    data = encode_envelope(envelope)
    headers = routing_headers(tenant="header-tenant", job_id="j", priority=Priority.LOW, model_name="demo")
    assert headers[TENANT_HEADER] == "header-tenant"
    assert tenant_of(Msg(_client=None, subject="s", data=data, headers=headers)) == "header-tenant"
    assert tenant_of(Msg(_client=None, subject="s", data=data, headers={"Nats-Msg-Id": "j"})) == "payload-tenant"
    assert tenant_of(Msg(_client=None, subject="s", data=data)) == "payload-tenant"
    assert tenant_of(Msg(_client=None, subject="s", data=b"junk")) == ""


async def test_a_queue_consumer_takes_job_subjects_and_an_old_one_is_updated(nc: NatsClient, config: Config) -> None:
    """A submit publishes on the job's own subject (asyncinfer.work.<model>.<priority>.<tenant>.<job_id>)
    so that its message, which is its record, can be read back; the queue's consumer takes those
    and the queue's own subject (messages from before). A consumer declared the old way (the
    queue's subject alone, as a previous release did) is updated in place, keeping its place."""
    js = nc.jetstream()
    await ensure_work_stream(js, config.nats)
    queue = work_subject(MODEL, Priority.NORMAL)
    name = "work-demo-normal"
    await js.add_consumer(
        config.nats.work_stream,
        api.ConsumerConfig(durable_name=name, filter_subject=queue, ack_policy=api.AckPolicy.EXPLICIT),
    )
    await js.publish(queue, b"old")
    await ensure_work_consumer(js, config.nats, model_name=MODEL, priority=Priority.NORMAL, ack_wait_s=30)
    info = await js.consumer_info(config.nats.work_stream, name)
    assert info.config.filter_subjects == [queue, f"{queue}.>"]
    assert not info.config.filter_subject
    await js.publish(f"{queue}.acme.job-1", b"new")
    await js.publish(f"{work_subject(MODEL, Priority.HIGH)}.acme.job-2", b"another queue")
    inbox = PullInbox(nc)
    try:
        pulled = await inbox.pull(config.nats.work_stream, name, 5)
    finally:
        await inbox.close()
    assert [m.data for m in pulled] == [b"old", b"new"]
