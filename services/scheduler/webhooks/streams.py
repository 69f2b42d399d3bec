"""The NATS side of webhooks: the WEBHOOKS stream of pending deliveries, its durable consumer, and
the durable consumer on the jobs bucket's stream that feeds the notifier every record write.

Both consumers are durable and shared by every scheduler: each message goes to one of them, and
what was not acked (a scheduler died) is redelivered to another.
"""

from __future__ import annotations

from asyncinfer.config import Config, NatsConfig
from asyncinfer.contract import WEBHOOK_FEED_CONSUMER as FEED_CONSUMER
from asyncinfer.contract import WEBHOOK_SENDER_CONSUMER as SENDER_CONSUMER
from asyncinfer.contract import WEBHOOK_SUBJECTS, kv_stream, kv_subject
from asyncinfer.nats import JetStreamContext, api
from asyncinfer.nats.streams import declaration, ensure_stream

FEED_ACK_WAIT_S = 30.0
# Delayed retries stay unacked (a NAK with a delay) for up to the retry horizon, so the pending
# count is not a measure of work in flight: the sender bounds that itself.
MAX_PENDING = 1_000_000


def jobs_stream(config: NatsConfig) -> str:
    return kv_stream(config.jobs_bucket)


async def ensure_webhooks_stream(js: JetStreamContext, config: NatsConfig) -> None:
    stream = api.StreamConfig(
        name=config.webhooks_stream,
        description="asyncinfer webhook deliveries waiting to be sent or retried",
        subjects=[WEBHOOK_SUBJECTS],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE,
        num_replicas=config.replicas,
        duplicate_window=config.duplicate_window_s,
        discard=api.DiscardPolicy.NEW,
    )

    await ensure_stream(js, stream, retry_for_s=config.connect_timeout_s)


def sender_ack_wait_s(config: Config) -> float:
    """The sender consumer's AckWait. An attempt (resolve, connect, answer) takes at most
    request_timeout_s twice over; past this the message is given to another scheduler, as if this
    one had died."""
    return 2 * config.webhooks.request_timeout_s + 10.0


async def ensure_sender_consumer(js: JetStreamContext, config: Config) -> None:
    ack_wait_s = sender_ack_wait_s(config)
    consumer = api.ConsumerConfig(
        durable_name=SENDER_CONSUMER,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=MAX_PENDING,
        num_replicas=config.nats.replicas if config.nats.replicas > 1 else 0,
    )

    async def declare(_timeout_s: float) -> None:
        await js.add_consumer(config.nats.webhooks_stream, consumer)

    # Through a leader election, as every declaration (a scheduler starting while a node of the
    # cluster was lost failed here: the create timed out).
    await declaration(declare, what=f"declare the {SENDER_CONSUMER} consumer")


async def ensure_feed_consumer(js: JetStreamContext, config: NatsConfig) -> None:
    """DeliverPolicy NEW applies when the consumer is first created; from then on it resumes where
    it stopped, so no record write is missed across restarts."""
    consumer = api.ConsumerConfig(
        durable_name=FEED_CONSUMER,
        filter_subject=kv_subject(config.jobs_bucket, ">"),
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.NEW,
        ack_wait=FEED_ACK_WAIT_S,
        max_deliver=-1,
        num_replicas=config.replicas if config.replicas > 1 else 0,
    )

    async def declare(_timeout_s: float) -> None:
        await js.add_consumer(jobs_stream(config), consumer)

    await declaration(declare, what=f"declare the {FEED_CONSUMER} consumer")
