"""The work stream, the jobs bucket, the queues bucket and the work consumers: what the gateway and
the scheduler declare at start-up. Declarations are idempotent, so every service can run them in any order; the
scheduler owns the consumers.
"""

from __future__ import annotations

from asyncinfer.config import NatsConfig
from asyncinfer.contract import WORK_SUBJECTS, work_filters
from asyncinfer.contract import work_consumer_name as work_consumer_name
from asyncinfer.jobs import Priority
from asyncinfer.nats import JetStreamContext, KeyValue, api
from asyncinfer.nats.kv import KvBucket
from asyncinfer.nats.streams import declaration, ensure_kv_bucket, ensure_stream


async def ensure_work_stream(js: JetStreamContext, config: NatsConfig) -> None:
    """The WorkQueue stream of queued jobs: a message leaves it when its job's result is stored."""
    stream = api.StreamConfig(
        name=config.work_stream,
        description="asyncinfer queued jobs, one subject per job under one per model and priority",
        subjects=[WORK_SUBJECTS],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE,
        num_replicas=config.replicas,
        duplicate_window=config.duplicate_window_s,
        discard=api.DiscardPolicy.NEW,
        allow_msg_ttl=True,
    )

    await ensure_stream(js, stream, retry_for_s=config.connect_timeout_s)


async def ensure_jobs_bucket(js: JetStreamContext, config: NatsConfig) -> KvBucket:
    """The KV bucket of job records. Records carry their retention as a per-message TTL; when one
    expires the server leaves a long-lived marker, so reads can say "retention passed"."""
    kv = await ensure_kv_bucket(
        js,
        config,
        bucket=config.jobs_bucket,
        description="asyncinfer job records, keyed <tenant>.<job_id>",
        limit_marker_ttl_s=config.expired_job_marker_ttl_s,
    )
    return KvBucket(name=config.jobs_bucket, kv=kv, js=js)


async def ensure_queues_bucket(js: JetStreamContext, config: NatsConfig) -> KeyValue:
    """The KV bucket of what the scheduler tells everyone of its queues (asyncinfer.queues)."""
    return await ensure_kv_bucket(
        js,
        config,
        bucket=config.queues_bucket,
        description="asyncinfer queue snapshots, pauses and scheduler heartbeats",
    )


async def ensure_work_consumer(
    js: JetStreamContext, config: NatsConfig, *, model_name: str, priority: Priority, ack_wait_s: float
) -> str:
    """The durable pull consumer of one (model, priority) queue; returns its name. It takes every
    job's subject under the queue's and the queue's own (messages from before subjects were per
    job); a consumer declared with the queue's subject alone is updated to both.

    MaxAckPending is raised far above the default 1000, at which delivery silently stops: the
    scheduler, not the consumer, bounds what is in flight (by batcher credits)."""
    name = work_consumer_name(model_name, priority)
    consumer = api.ConsumerConfig(
        durable_name=name,
        filter_subjects=work_filters(model_name, priority),
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=1_000_000,
        max_waiting=512,
        num_replicas=config.replicas if config.replicas > 1 else 0,
    )

    async def declare(_timeout_s: float) -> None:
        await js.add_consumer(config.work_stream, consumer)

    await declaration(declare, what=f"declare the {name} consumer")
    return name
