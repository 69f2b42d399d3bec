"""NATS bootstrap shared by the services: connecting, and declaring the streams, buckets and
consumers they use. Declarations are idempotent, so every service can run them at start-up in any
order; the scheduler owns the consumers.
"""

from __future__ import annotations

from typing import Any

import nats
import structlog
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from asyncinfer.config import NatsConfig
from asyncinfer.errors import Unavailable
from asyncinfer.jobs import WORK_SUBJECT_PREFIX, Priority

log = structlog.get_logger("asyncinfer.nats")

INITIAL_CONNECT_ATTEMPTS = 3


async def connect(config: NatsConfig, *, name: str) -> NatsClient:
    """Connects with reconnects on; Unavailable if the server cannot be reached at all."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", error=str(exc))

    async def on_disconnected() -> None:
        log.warning("nats_disconnected")

    async def on_reconnected() -> None:
        log.info("nats_reconnected")

    options: dict[str, Any] = {
        "servers": [u.strip() for u in config.url.split(",") if u.strip()],
        "name": name,
        "connect_timeout": config.connect_timeout_s,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
    }
    if config.credentials_file:
        options["user_credentials"] = config.credentials_file
    # With unlimited attempts nats-py retries the *first* connect forever too, so a wrong URL
    # would hang start-up. Connect with a few attempts, then allow unlimited reconnects.
    options["max_reconnect_attempts"] = INITIAL_CONNECT_ATTEMPTS
    try:
        client = await nats.connect(**options)
    except Exception as exc:  # nats raises several unrelated types here
        raise Unavailable(f"cannot connect to NATS at {config.url}: {exc}") from exc
    client.options["max_reconnect_attempts"] = -1
    return client


async def ensure_work_stream(js: JetStreamContext, config: NatsConfig) -> None:
    """The WorkQueue stream of queued jobs: a message leaves it when its job's result is stored."""
    stream = api.StreamConfig(
        name=config.work_stream,
        description="asyncinfer queued jobs, one subject per model and priority",
        subjects=[f"{WORK_SUBJECT_PREFIX}.>"],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE,
        num_replicas=config.replicas,
        duplicate_window=config.duplicate_window_s,
        discard=api.DiscardPolicy.NEW,
        allow_msg_ttl=True,
    )
    try:
        await js.stream_info(config.work_stream)
    except NotFoundError:
        await js.add_stream(stream)
        log.info("stream_created", stream=config.work_stream)


async def ensure_jobs_bucket(js: JetStreamContext, config: NatsConfig) -> KeyValue:
    """The KV bucket of job records. Direct gets are off: a record read right after a write must
    see the write (followers may lag), and compare-and-set needs the latest revision."""
    try:
        return await js.key_value(config.jobs_bucket)
    except BucketNotFoundError:
        kv = await js.create_key_value(
            bucket=config.jobs_bucket,
            description="asyncinfer job records, keyed <tenant>.<job_id>",
            history=1,
            storage=api.StorageType.FILE,
            replicas=config.replicas,
            direct=False,
        )
        log.info("bucket_created", bucket=config.jobs_bucket)
        return kv


def work_consumer_name(model_name: str, priority: Priority) -> str:
    return f"work-{model_name}-{priority.subject_token}"


async def ensure_work_consumer(
    js: JetStreamContext, config: NatsConfig, *, model_name: str, priority: Priority, ack_wait_s: float
) -> str:
    """The durable pull consumer of one (model, priority) subject; returns its name.

    MaxAckPending is raised far above the default 1000, at which delivery silently stops: the
    scheduler, not the consumer, bounds what is in flight (by batcher credits)."""
    from asyncinfer.jobs import work_subject

    name = work_consumer_name(model_name, priority)
    consumer = api.ConsumerConfig(
        durable_name=name,
        filter_subject=work_subject(model_name, priority),
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=1_000_000,
        max_waiting=512,
        num_replicas=config.replicas if config.replicas > 1 else 0,
    )
    await js.add_consumer(config.work_stream, consumer)
    return name
