"""NATS bootstrap shared by the services: connecting, and declaring the streams, buckets and
consumers they use. Declarations are idempotent, so every service can run them at start-up in any
order; the scheduler owns the consumers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NoStreamResponseError, NotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from asyncinfer.backoff import retry
from asyncinfer.config import NatsConfig
from asyncinfer.contract import EXPECTED_STREAM_HEADER, MSG_ID_HEADER, WORK_SUBJECTS
from asyncinfer.contract import work_consumer_name as work_consumer_name
from asyncinfer.errors import Unavailable
from asyncinfer.jobs import Priority
from asyncinfer.nats_requests import js_publish

log = structlog.get_logger("asyncinfer.nats")

INITIAL_CONNECT_ATTEMPTS = 3
T = TypeVar("T")

# What a JetStream request raises while a stream has no leader (an election after a node died, a
# cluster still forming) or while the client reconnects to another node: worth trying again.
TRANSIENT_JS_ERRORS: tuple[type[Exception], ...] = (
    asyncio.TimeoutError,  # nats.errors.TimeoutError is one
    NoStreamResponseError,
    nats.errors.NoRespondersError,
    ServiceUnavailableError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
)
# One attempt of a retried JetStream request; leader elections take a few seconds, so several
# short attempts beat one long one.
ATTEMPT_TIMEOUT_S = 2.0


async def retry_transient(operation: Callable[[float], Awaitable[T]], *, retry_for_s: float, what: str) -> T:
    """operation(attempt_timeout_s), tried again on transient JetStream errors until retry_for_s
    has passed; the last error is raised. Only for idempotent operations (a publish with a
    Nats-Msg-Id, a read, a declaration)."""
    give_up_at = time.monotonic() + retry_for_s

    async def attempt() -> T:
        remaining = give_up_at - time.monotonic()
        return await operation(max(min(ATTEMPT_TIMEOUT_S, remaining), 0.1))

    return await retry(attempt, on=TRANSIENT_JS_ERRORS, retry_for_s=retry_for_s, what=what)


async def publish_durably(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    stream: str,
    msg_id: str,
    retry_for_s: float,
    headers: dict[str, str] | None = None,
) -> int:
    """A JetStream publish that survives leader elections: retried with the same Nats-Msg-Id, so
    an attempt that was stored but whose ack was lost is dropped as a duplicate by the stream
    (within its duplicate window) and the retry still gets an ack. Returns the stream sequence."""

    all_headers = {**(headers or {}), MSG_ID_HEADER: msg_id, EXPECTED_STREAM_HEADER: stream}

    async def attempt(timeout_s: float) -> int:
        return await js_publish(js._nc, subject, payload, timeout_s=timeout_s, headers=all_headers)

    return await retry_transient(attempt, retry_for_s=retry_for_s, what=f"publish {subject}")


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
        subjects=[WORK_SUBJECTS],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE,
        num_replicas=config.replicas,
        duplicate_window=config.duplicate_window_s,
        discard=api.DiscardPolicy.NEW,
        allow_msg_ttl=True,
    )

    await ensure_stream(js, stream, retry_for_s=config.connect_timeout_s)


async def ensure_stream(js: JetStreamContext, stream: api.StreamConfig, *, retry_for_s: float) -> None:
    """A stream of ours, created with `stream` unless it exists (an existing one is left as it is)."""
    name = stream.name
    assert name is not None

    async def declare(_: float) -> None:
        try:
            await js.stream_info(name)
        except NotFoundError:
            await js.add_stream(stream)
            log.info("stream_created", stream=name)

    # A cluster that is still electing its meta leader answers 503 or not at all for a moment.
    await retry_transient(declare, retry_for_s=retry_for_s, what=f"declare the {name} stream")


async def ensure_kv_bucket(
    js: JetStreamContext,
    config: NatsConfig,
    *,
    bucket: str,
    description: str,
    limit_marker_ttl_s: float | None = None,
) -> KeyValue:
    """A KV bucket of ours, created on first use (history 1, file storage, the configured
    replicas). Direct gets are off for all of them: a read right after a write must see the write
    (followers may lag), and compare-and-set needs the latest revision. nats-py allows per-message
    TTLs on every bucket it creates."""

    async def declare(_: float) -> KeyValue:
        try:
            return await js.key_value(bucket)
        except BucketNotFoundError:
            kv = await js.create_key_value(
                bucket=bucket,
                description=description,
                history=1,
                storage=api.StorageType.FILE,
                replicas=config.replicas,
                direct=False,
                limit_marker_ttl=limit_marker_ttl_s,
            )
            log.info("bucket_created", bucket=bucket)
            return kv

    # A cluster that is still electing its meta leader answers 503 or not at all for a moment.
    return await retry_transient(declare, retry_for_s=config.connect_timeout_s, what=f"declare the {bucket} bucket")


async def ensure_jobs_bucket(js: JetStreamContext, config: NatsConfig) -> KeyValue:
    """The KV bucket of job records. Records carry their retention as a per-message TTL; when one
    expires the server leaves a long-lived marker, so reads can say "retention passed"."""
    return await ensure_kv_bucket(
        js,
        config,
        bucket=config.jobs_bucket,
        description="asyncinfer job records, keyed <tenant>.<job_id>",
        limit_marker_ttl_s=config.expired_job_marker_ttl_s,
    )


async def ensure_work_consumer(
    js: JetStreamContext, config: NatsConfig, *, model_name: str, priority: Priority, ack_wait_s: float
) -> str:
    """The durable pull consumer of one (model, priority) subject; returns its name.

    MaxAckPending is raised far above the default 1000, at which delivery silently stops: the
    scheduler, not the consumer, bounds what is in flight (by batcher credits)."""
    from asyncinfer.contract import work_subject

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
