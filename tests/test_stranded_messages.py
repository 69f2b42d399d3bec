"""A work message below its consumer's ack floor, which nats-server will not deliver again (the chaos
soak found such messages, bench/soak.py): the scheduler's sweep (services/scheduler/stranded_messages.py)
publishes a live job's message again and deletes a finished job's, each at its second sighting."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from asyncinfer.codecs.envelope import encode_envelope
from asyncinfer.codecs.record import encode_record
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.contract import work_consumer_name, work_filters
from asyncinfer.declarations import ensure_jobs_bucket, ensure_work_stream
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobState, Priority, WorkEnvelope
from asyncinfer.nats import api
from asyncinfer.nats.connection import connect
from services.scheduler.stranded_messages import StrandedMessages


def envelope(job_id: str) -> WorkEnvelope:
    return WorkEnvelope(
        job_id=job_id,
        tenant="default",
        model_name=DEMO_MODEL.name,
        model_version="1",
        priority=Priority.NORMAL,
        create_time=time.time(),
        max_attempts=3,
        is_record=True,
        result_retention_s=3600.0,
    )


async def test_a_stranded_live_jobs_message_is_published_again_and_a_finished_ones_deleted(
    nats_server: NatsServerProcess, tmp_path: Path
) -> None:
    config = Config().replace(nats={"url": nats_server.url})
    nc = await connect(config.nats, name="stranded-test")
    try:
        js = nc.jetstream()
        await ensure_work_stream(js, config.nats)
        store = JobStore(await ensure_jobs_bucket(js, config.nats), work_stream=config.nats.work_stream)
        live, finished, fine = envelope("job-live"), envelope("job-finished"), envelope("job-fine")
        for job in (live, finished, fine):  # stream sequences 1, 2, 3
            await js.publish(job.subject, encode_envelope(job), headers={"Nats-Msg-Id": job.job_id})
        done = dataclasses.replace(finished.queued_record(), state=JobState.SUCCEEDED)
        await store._kv.put(finished.key, encode_record(done))
        # The consumer's floor past the first two, as the soak found it: nothing will deliver them.
        # (Made here by a filter that took the third alone, then widened: a WorkQueue consumer
        # delivers all, from the stream's start.)
        consumer = work_consumer_name(DEMO_MODEL.name, Priority.NORMAL)

        def consumer_config(filters: list[str]) -> api.ConsumerConfig:
            return api.ConsumerConfig(
                durable_name=consumer,
                filter_subjects=filters,
                ack_policy=api.AckPolicy.EXPLICIT,
                deliver_policy=api.DeliverPolicy.ALL,
                ack_wait=30,
                max_deliver=-1,
            )

        await js.add_consumer(config.nats.work_stream, consumer_config([fine.subject]))
        pull = await js.pull_subscribe_bind(consumer, config.nats.work_stream)
        (first,) = await pull.fetch(1, timeout=5)
        assert first.subject == fine.subject
        await first.ack_sync()
        await js.add_consumer(config.nats.work_stream, consumer_config(work_filters(DEMO_MODEL.name, Priority.NORMAL)))
        floor = (await js.consumer_info(config.nats.work_stream, consumer)).ack_floor
        assert floor is not None
        assert floor.stream_seq == 3
        sweep = StrandedMessages(nc, js, store, config, lambda: [DEMO_MODEL.name])

        assert await sweep.check() == 0  # seen once: an ack being applied is not taken for one
        assert await sweep.check() == 2
        assert await sweep.check() == 0

        (again,) = await pull.fetch(1, timeout=5)
        assert again.subject == live.subject
        assert again.headers is not None
        assert again.headers["Nats-Msg-Id"] == "job-live.requeued.1"
        info = await js.stream_info(config.nats.work_stream)
        assert (info.state.first_seq, info.state.messages) == (4, 1)  # 1 and 2 deleted, 3 acked: the new 4
    finally:
        await nc.close()
