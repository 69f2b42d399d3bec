"""Signed, durable webhooks through the whole stack (gateway -> NATS -> scheduler -> batcher), to a
real HTTP receiver on loopback that verifies every signature with the independent
`standardwebhooks` library."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest

from asyncinfer.codecs.record import decode_record
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.contract import WEBHOOK_FEED_CONSUMER, WEBHOOK_SENDER_CONSUMER, consumer_next_subject, kv_stream
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext, KeyNotFoundError, Msg
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2, worker_service_pb2
from asyncinfer.webhook_status import (
    CallbackEvent,
    DeliveryStatus,
    JobDeliveries,
    deliveries_key,
    disabled_key,
    encode_deliveries,
    webhook_id,
)
from tests.hanging_models import HANG_VALUE, RELEASE
from tests.nats_probes import RequestsSeen
from tests.stack import Stack, StartStack
from tests.test_scheduler import FakeBatcher
from tests.waits import WAIT_S
from tests.webhook_receiver import Receiver, receiver, webhook_config

__all__ = ["receiver"]  # the fixture, used by name

DELIVERED = job_pb2.CALLBACK_DELIVERY_STATE_DELIVERED
PENDING = job_pb2.CALLBACK_DELIVERY_STATE_PENDING
FAILED = job_pb2.CALLBACK_DELIVERY_STATE_FAILED
DISABLED = job_pb2.CALLBACK_DELIVERY_STATE_DISABLED


# --- helpers -------------------------------------------------------------------------------------


def demo_input() -> tensor_pb2.InferInputTensor:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([1, 2, 3, 4])
    return x


async def submit(stack: Stack, url: str, *events: int) -> str:
    request = job_service_pb2.SubmitJobRequest(
        model_name="demo",
        inputs=[demo_input()],
        callback=job_pb2.Callback(url=url, events=events),
        labels={"k": "v"},
    )
    return str((await stack.jobs.SubmitJob(request)).job.job_id)


async def until(stack: Stack, job_id: str, condition: Callable[[job_pb2.Job], bool]) -> job_pb2.Job:
    """GetJob until `condition` holds (a bounded poll: deliveries are written after the job's
    terminal state, where a watch ends)."""
    give_up_at = time.monotonic() + WAIT_S
    while True:
        job = (await stack.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job
        if condition(job):
            return job
        assert time.monotonic() < give_up_at, f"still not there after {WAIT_S} s: {job}"
        await asyncio.sleep(0.05)


def all_final(count: int) -> Callable[[job_pb2.Job], bool]:
    return lambda job: (
        len(job.callback_deliveries) == count and all(d.state != PENDING for d in job.callback_deliveries)
    )


@pytest.fixture
async def stack(config: Config, start_stack: StartStack) -> Stack:
    return await start_stack(webhook_config(config))


class TopOfRange(random.Random):
    """Pins the backoff jitter to its upper bound, so the delays are exactly the doubling caps."""

    def uniform(self, a: float, b: float) -> float:
        return b


# --- tests ------------------------------------------------------------------------------------


async def test_completed_job_delivers_exactly_the_wanted_events_signed_and_thin(
    stack: Stack, receiver: Receiver
) -> None:
    both = await submit(stack, receiver.url("/both"), job_pb2.CALLBACK_EVENT_RUNNING, job_pb2.CALLBACK_EVENT_COMPLETED)
    default = await submit(stack, receiver.url("/default"))  # no events: the terminal ones
    failed_only = await submit(stack, receiver.url("/failed-only"), job_pb2.CALLBACK_EVENT_FAILED)

    job = await until(stack, both, all_final(2))
    assert sorted(d.event for d in job.callback_deliveries) == [
        job_pb2.CALLBACK_EVENT_RUNNING,
        job_pb2.CALLBACK_EVENT_COMPLETED,
    ]
    assert all(d.state == DELIVERED and d.attempts == 1 and d.last_status_code == 200 for d in job.callback_deliveries)
    received = await receiver.wait_for("/both", 2)
    assert sorted(json.loads(r.body)["type"] for r in received) == ["job.completed", "job.running"]
    assert {r.headers["webhook-id"] for r in received} == {d.webhook_id for d in job.callback_deliveries}
    for r in received:
        assert not isinstance(r.verified, Exception), r.verified
        assert abs(int(r.headers["webhook-timestamp"]) - time.time()) < 60
        assert r.headers["host"] == f"127.0.0.1:{receiver.port}"
    completed = next(json.loads(r.body) for r in received if json.loads(r.body)["type"] == "job.completed")
    assert completed["data"]["job_id"] == both
    assert completed["data"]["state"] == "SUCCEEDED"
    assert completed["data"]["model_name"] == "demo"
    assert completed["data"]["labels"] == {"k": "v"}
    assert completed["data"]["fetch"] == {"rpc": "asyncinfer.v1.JobService/GetJob", "job_id": both}
    assert "outputs" not in json.dumps(completed), "the body is a summary, never the outputs"
    assert len(received[0].body) < 1024

    job = await until(stack, default, all_final(1))
    assert [d.event for d in job.callback_deliveries] == [job_pb2.CALLBACK_EVENT_COMPLETED]
    (only,) = await receiver.wait_for("/default", 1)
    assert json.loads(only.body)["type"] == "job.completed"

    done = await until(stack, failed_only, lambda j: j.state == job_pb2.JOB_STATE_SUCCEEDED)
    assert list(done.callback_deliveries) == []
    # The receiver saw exactly the wanted events (all enqueued above have arrived by now).
    assert receiver.at("/failed-only") == []
    assert len(receiver.received) == 3


async def test_canceled_job_notifies_canceled(config: Config, receiver: Receiver, start_stack: StartStack) -> None:
    # No batcher: nothing runs the job, it stays QUEUED until canceled.
    running = await start_stack(webhook_config(config), batcher=False)
    job_id = await submit(running, receiver.url("/cancel"))
    await running.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id, reason="test"))
    job = await until(running, job_id, all_final(1))
    assert job.state == job_pb2.JOB_STATE_CANCELED
    assert job.callback_deliveries[0].event == job_pb2.CALLBACK_EVENT_CANCELED
    (received,) = await receiver.wait_for("/cancel", 1)
    assert json.loads(received.body)["type"] == "job.canceled"
    assert json.loads(received.body)["data"]["state"] == "CANCELED"


async def test_a_jobs_webhook_says_its_attempts_given_back_beside_its_attempt(
    config: Config, receiver: Receiver, start_stack: StartStack
) -> None:
    """A job shed by its batcher twice (each attempt given back) then answered: its job.completed
    says attempt 3 and given_back_attempts 2, so a receiver tells that it ran once, not three
    times (`attempt` alone said 3)."""
    running = await start_stack(webhook_config(config), batcher=False)
    batcher = FakeBatcher(running.scheduler.port, "b1")
    try:
        await batcher.connect()
        await batcher.grant(1)
        job_id = await submit(running, receiver.url("/given-back"))
        for attempt in (1, 2, 3):
            order = await batcher.next_order()
            assert (order.job_id, order.attempt) == (job_id, attempt)
            if attempt < 3:
                shed = worker_service_pb2.WorkResult(job_id=order.job_id, attempt=order.attempt, dropped=True)
                await batcher._call.write(worker_service_pb2.ConnectRequest(result=shed))
                await batcher.grant(1)
            else:
                await batcher.answer(order)
        (received,) = await receiver.wait_for("/given-back", 1)
    finally:
        await batcher.close()
    body = json.loads(received.body)
    assert (body["type"], body["data"]["state"]) == ("job.completed", "SUCCEEDED")
    assert (body["data"]["attempt"], body["data"]["given_back_attempts"]) == (3, 2)


async def test_failures_are_retried_with_the_same_id_and_growing_delays(
    config: Config, receiver: Receiver, start_stack: StartStack
) -> None:
    stack = await start_stack(webhook_config(config, backoff_base_s=0.3))
    await _retried_with_growing_delays(stack, receiver)


async def _retried_with_growing_delays(stack: Stack, receiver: Receiver) -> None:
    stack.scheduler.webhooks.pin_jitter(TopOfRange())
    receiver.scripts["/flaky"] = [(500, {}), (500, {})]
    job_id = await submit(stack, receiver.url("/flaky"))

    job = await until(stack, job_id, all_final(1))
    (delivery,) = job.callback_deliveries
    assert delivery.state == DELIVERED
    assert delivery.attempts == 3
    assert delivery.last_status_code == 200
    assert delivery.last_error == ""
    received = await receiver.wait_for("/flaky", 3)
    assert len(received) == 3
    assert {r.headers["webhook-id"] for r in received} == {delivery.webhook_id}
    assert len({r.body for r in received}) == 1, "every attempt sends the same body"
    assert all(not isinstance(r.verified, Exception) for r in received)
    first_gap = received[1].at - received[0].at
    second_gap = received[2].at - received[1].at
    # backoff_base_s 0.3 at the top of its jitter: 0.3 s, then 0.6 s.
    assert first_gap >= 0.28
    assert second_gap >= 0.58
    assert second_gap - first_gap > 0.15, (first_gap, second_gap)


async def test_retry_after_is_honoured(stack: Stack, receiver: Receiver) -> None:
    receiver.scripts["/busy"] = [(429, {"Retry-After": "1"})]
    job_id = await submit(stack, receiver.url("/busy"))
    await until(stack, job_id, all_final(1))
    first, second = await receiver.wait_for("/busy", 2)
    assert second.at - first.at >= 0.95, "backoff alone (at most 0.2 s) would have come back sooner"


async def test_redirects_are_not_followed_and_count_as_failures(stack: Stack, receiver: Receiver) -> None:
    receiver.scripts["/moved"] = [(302, {"Location": receiver.url("/target")})] * 2
    # The second attempt waits for the first one's record to be read: at the test's short backoff
    # it could otherwise be answered, and the third delivered, before a read (seen under load).
    first_read = asyncio.Event()
    receiver.holds["/moved"] = (1, first_read)
    job_id = await submit(stack, receiver.url("/moved"))
    job = await until(stack, job_id, lambda j: any(d.attempts >= 1 for d in j.callback_deliveries))
    first_read.set()
    (delivery,) = job.callback_deliveries
    assert delivery.state == PENDING
    assert delivery.last_status_code == 302
    assert "redirects are not followed" in delivery.last_error
    assert delivery.HasField("next_attempt_time")
    job = await until(stack, job_id, all_final(1))  # the third attempt answers 200
    assert job.callback_deliveries[0].attempts == 3
    assert receiver.at("/target") == []


async def test_gone_disables_the_url_for_the_tenant(stack: Stack, receiver: Receiver) -> None:
    receiver.scripts["/gone"] = [(410, {})]
    first = await submit(stack, receiver.url("/gone"))
    job = await until(stack, first, all_final(1))
    assert job.callback_deliveries[0].state == DISABLED
    assert job.callback_deliveries[0].last_status_code == 410
    assert job.callback_deliveries[0].attempts == 1

    second = await submit(stack, receiver.url("/gone"))
    job = await until(stack, second, all_final(1))
    (delivery,) = job.callback_deliveries
    assert delivery.state == DISABLED
    assert delivery.attempts == 0, "a disabled URL is not called again"
    assert "410" in delivery.last_error
    assert len(receiver.at("/gone")) == 1


async def test_a_gone_url_is_called_again_once_its_disabled_time_passes(
    config: Config, receiver: Receiver, start_stack: StartStack
) -> None:
    # One 410 (a proxy during a deploy) disabled the URL for good, with nothing to turn it back on.
    running = await start_stack(webhook_config(config, disabled_for_s=1.0))
    receiver.scripts["/gone-for-now"] = [(410, {})]  # then 200
    first = await submit(running, receiver.url("/gone-for-now"))
    assert (await until(running, first, all_final(1))).callback_deliveries[0].state == DISABLED
    bucket = await running.nc.jetstream().key_value(running.config.nats.webhooks_bucket)
    for _ in range(100):  # the server removes the key after its TTL (whole seconds)
        try:
            await bucket.get(disabled_key("default", receiver.url("/gone-for-now")))
        except KeyNotFoundError:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the disabled URL's key outlived its TTL")
    again = await submit(running, receiver.url("/gone-for-now"))
    (delivery,) = (await until(running, again, all_final(1))).callback_deliveries
    assert delivery.state == DELIVERED
    assert len(receiver.at("/gone-for-now")) == 2


async def test_gives_up_after_the_retry_horizon(config: Config, receiver: Receiver, start_stack: StartStack) -> None:
    running = await start_stack(webhook_config(config, retry_horizon_s=0.8, backoff_base_s=0.1, backoff_max_s=0.2))
    receiver.scripts["/down"] = [(503, {})] * 100
    job_id = await submit(running, receiver.url("/down"))
    job = await until(running, job_id, all_final(1))
    (delivery,) = job.callback_deliveries
    assert delivery.state == FAILED
    assert delivery.last_status_code == 503
    assert "retry horizon" in delivery.last_error
    assert delivery.attempts >= 2
    attempts = receiver.at("/down")
    assert len(attempts) == delivery.attempts
    assert attempts[-1].at - attempts[0].at <= 0.8 + 0.3, "no attempt long after the horizon"


async def test_addresses_are_vetted_again_at_send_time(
    config: Config, receiver: Receiver, start_stack: StartStack
) -> None:
    # The gateway allowed loopback when the job was submitted; the scheduler (as after a DNS
    # change to an inside address) does not: nothing is sent.
    running = await start_stack(webhook_config(config), scheduler_config=webhook_config(config, allowed_networks=[]))
    job_id = await submit(running, receiver.url("/inside"))
    job = await until(running, job_id, all_final(1))
    (delivery,) = job.callback_deliveries
    assert delivery.state == FAILED
    assert "refused" in delivery.last_error
    assert delivery.last_status_code == 0
    assert receiver.at("/inside") == []


async def test_deliveries_survive_a_scheduler_restart(config: Config, receiver: Receiver) -> None:
    settings = webhook_config(config, backoff_base_s=0.5, backoff_max_s=0.5)
    receiver.scripts["/later"] = [(503, {})] * 100  # down until the test says otherwise
    first = Stack(settings)
    await first.start()
    job_id = await submit(first, receiver.url("/later"))
    try:
        await receiver.wait_for("/later", 1)
        job = await until(first, job_id, lambda j: any(d.attempts >= 1 for d in j.callback_deliveries))
        assert job.callback_deliveries[0].state == PENDING
        assert first.batcher is not None
        await first.batcher.stop(1.0)
        first.batcher = None
        await first.scheduler.stop(1.0)
    finally:
        await first.stop()
    failed_before = len(receiver.at("/later"))
    receiver.scripts["/later"] = []  # the receiver recovers while no scheduler runs

    second = Stack(settings)
    await second.start(batcher=False)
    try:
        job = await until(second, job_id, all_final(1))
        (delivery,) = job.callback_deliveries
        assert delivery.state == DELIVERED
        assert delivery.attempts == failed_before + 1
        received = receiver.at("/later")
        assert len({r.headers["webhook-id"] for r in received}) == 1
        assert delivery.webhook_id == received[-1].headers["webhook-id"]
    finally:
        await second.stop()


async def test_a_scheduler_without_secrets_reads_no_record_writes_and_a_later_one_catches_up(
    config: Config, receiver: Receiver
) -> None:
    """Without signing secrets the scheduler leaves the record feed alone (three writes per job
    would be read and acked for nothing); a gateway that had secrets first loses no callback: the
    feed waits, and a scheduler with secrets delivers from where it stood."""
    settings = webhook_config(config)
    no_secrets = settings.replace(webhooks={"secrets": []})
    first = Stack(settings, scheduler_config=no_secrets)
    await first.start()
    try:
        job_id = await submit(first, receiver.url("/late"), job_pb2.CALLBACK_EVENT_COMPLETED)
        await until(first, job_id, lambda j: j.state == job_pb2.JOB_STATE_SUCCEEDED)
        info = await first.nc.jetstream().consumer_info(f"KV_{config.nats.jobs_bucket}", "webhook-notifier")
        assert info.delivered.consumer_seq == 0
        assert (info.num_pending or 0) >= 1  # the bucket keeps the latest write per job: SUCCEEDED
        assert receiver.at("/late") == []
    finally:
        await first.stop()

    second = Stack(settings)
    await second.start(batcher=False)
    try:
        job = await until(second, job_id, all_final(1))
        assert [d.state for d in job.callback_deliveries] == [DELIVERED]
        assert len(receiver.at("/late")) == 1
    finally:
        await second.stop()


# --- refused at submit ------------------------------------------------------------------------


@pytest.fixture
async def gateway_only(config: Config, start_stack: StartStack) -> Stack:
    # allowed_networks empty: loopback is refused.
    return await start_stack(webhook_config(config, allowed_networks=[]), scheduler=False, batcher=False)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/hook",
        "http://localhost/hook",
        "http://[::1]/hook",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/hook",
        "file:///etc/passwd",
        "ftp://example.com/hook",
        "https://user:secret@example.com/hook",
        "https://example.com/" + "x" * 3000,
    ],
)
async def test_refused_urls_queue_nothing(gateway_only: Stack, config: Config, url: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await submit(gateway_only, url)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = status_details(info.value)
    assert status is not None
    fields = [v.field for v in unpack_details(status)["BadRequest"].field_violations]
    assert fields == ["callback.url"]
    js = gateway_only.nc.jetstream()
    assert (await js.stream_info(config.nats.work_stream)).state.messages == 0
    assert (await (await js.key_value(config.nats.jobs_bucket)).status()).values == 0


async def test_tenant_without_a_secret_cannot_ask_for_callbacks(config: Config, start_stack: StartStack) -> None:
    no_secrets = config.replace(webhooks={"allowed_networks": ["127.0.0.0/8"]})
    gateway_only = await start_stack(no_secrets, scheduler=False, batcher=False)
    request = job_service_pb2.SubmitJobRequest(
        model_name="demo", inputs=[demo_input()], callback=job_pb2.Callback(url="http://127.0.0.1:9/hook")
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await gateway_only.jobs.SubmitJob(request)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "asyncinfer webhook-secret" in (info.value.details() or "")
    assert "webhooks.secrets" in (info.value.details() or "")


async def test_a_hanging_receiver_gets_its_share_and_the_others_still_get_theirs(
    config: Config, receiver: Receiver, start_stack: StartStack
) -> None:
    """A helper's limits pass, session 24: one receiver that accepted and never answered held every
    delivery slot, and another receiver's webhooks waited for as long as it hung (0 attempts in 200 s).
    Each origin has at most webhooks.max_concurrent_per_origin attempts in flight."""
    open_now = 0
    most_open = 0

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now, most_open
        open_now += 1
        most_open = max(most_open, open_now)
        try:
            await reader.read()  # until the sender gives up (request_timeout_s)
        finally:
            open_now -= 1
            writer.close()

    hanging = await asyncio.start_server(hang, "127.0.0.1", 0)
    try:
        port = hanging.sockets[0].getsockname()[1]
        stack = await start_stack(
            webhook_config(config, max_concurrent_deliveries=4, max_concurrent_per_origin=2, request_timeout_s=3.0)
        )
        for _ in range(12):
            await submit(stack, f"http://127.0.0.1:{port}/hangs")
        await asyncio.sleep(1.0)  # the hanging ones have taken what they may
        healthy = [await submit(stack, receiver.url("/ok")) for _ in range(3)]
        delivered = await receiver.wait_for("/ok", 3)
        assert {json.loads(r.body)["data"]["job_id"] for r in delivered} == set(healthy)
        assert most_open == 2
    finally:
        hanging.close()
        await hanging.wait_closed()


async def test_an_idle_scheduler_holds_its_webhook_pulls_open_and_sends_a_due_delivery_at_once(
    config: Config, nc: NatsClient, receiver: Receiver, start_stack: StartStack
) -> None:
    """A measurement pass on an idle `asyncinfer up` (session 27): the sender and the notifier each
    asked their consumer for messages ~0.87 times a second (nats-py's fetch with a 2-s timeout: a
    no-wait probe, then a pull for the rest). Each now holds one pull open for HOLD_S (10 s): after
    its first, none in 3 s of idle. A job's webhook is still sent as its record is written: the
    held pulls hand over the record write and then the delivery as they are stored."""
    settings = webhook_config(config)
    pulls = {
        consumer: await RequestsSeen.on(nc, consumer_next_subject(stream, consumer), lambda _s, _d: True)
        for stream, consumer in (
            (settings.nats.webhooks_stream, WEBHOOK_SENDER_CONSUMER),
            (kv_stream(settings.nats.jobs_bucket), WEBHOOK_FEED_CONSUMER),
        )
    }
    try:
        stack = await start_stack(settings)
        for seen in pulls.values():
            await seen.wait_for(1)  # the first pull: held from now on
        before = {consumer: seen.count for consumer, seen in pulls.items()}
        await asyncio.sleep(3.0)  # the idle window being measured: nothing to wait for
        asked = {consumer: seen.count - before[consumer] for consumer, seen in pulls.items()}
        assert asked == {WEBHOOK_SENDER_CONSUMER: 0, WEBHOOK_FEED_CONSUMER: 0}, f"pull requests in 3 s of idle: {asked}"
    finally:
        for seen in pulls.values():
            await seen.close()
    submitted = time.monotonic()
    job_id = await submit(stack, receiver.url("/soon"))
    (received,) = await receiver.wait_for("/soon", 1)
    assert json.loads(received.body)["data"]["job_id"] == job_id
    # Nothing waits out a hold (the old fetch held a lone record write, then a lone delivery, for
    # up to 2 s each).
    assert received.at - submitted < 2.0, f"sent {received.at - submitted:.2f} s after the submit"


async def test_a_burst_to_one_receiver_waits_for_its_share_not_for_the_request_timeout(
    config: Config, receiver: Receiver, start_stack: StartStack
) -> None:
    """A scale pass (session 27): 1,000 jobs' webhooks to one healthy receiver arrived over 32 s,
    though the jobs had ended in 2.3 s: a delivery past the origin's share (8) was put back for
    request_timeout_s (15 s) unattempted. It now waits for one of the origin's attempts to end while
    the origin answers; a receiver that hangs still gets only its share (the test above)."""
    stack = await start_stack(
        webhook_config(config, max_concurrent_deliveries=8, max_concurrent_per_origin=2, request_timeout_s=15.0)
    )
    jobs = {await submit(stack, receiver.url("/burst")) for _ in range(30)}
    async with asyncio.timeout(8.0):  # put back for 15 s, the sixth and later waited past it
        delivered = await receiver.wait_for("/burst", len(jobs))
    assert {json.loads(r.body)["data"]["job_id"] for r in delivered} == jobs


async def test_a_busy_sender_pulls_its_deliveries_a_batch_at_a_time(
    config: Config, nc: NatsClient, receiver: Receiver, start_stack: StartStack
) -> None:
    """A measurement pass (session 29): a burst of 1,000 webhooks to one receiver took 1,999 pull
    requests of the sender's. The notifier stores deliveries one at a time, and the sender kept up:
    a held pull of one brought each, then a no-wait pull found nothing after it. A pull is now held
    for as many deliveries as there are free slots, each started as it comes: a pull per batch."""
    settings = webhook_config(config, max_concurrent_deliveries=8, max_concurrent_per_origin=8)
    pulls = await RequestsSeen.on(
        nc, consumer_next_subject(settings.nats.webhooks_stream, WEBHOOK_SENDER_CONSUMER), lambda _s, _d: True
    )
    try:
        stack = await start_stack(settings)
        await pulls.wait_for(1)  # the first, held while idle
        before = pulls.count
        jobs = {await submit(stack, receiver.url("/batch")) for _ in range(40)}
        delivered = await receiver.wait_for("/batch", len(jobs))
        asked = pulls.count - before
    finally:
        await pulls.close()
    assert {json.loads(r.body)["data"]["job_id"] for r in delivered} == jobs
    # A pull per 8 deliveries (the free slots) and the odd expiry; it was two per delivery.
    assert asked <= len(jobs) // 4, f"{asked} pull requests for {len(jobs)} deliveries"


async def test_a_running_delivery_not_yet_attempted_is_enqueued_once_though_the_job_ends(
    config: Config, start_stack: StartStack
) -> None:
    """A review of the webhooks (session 30): the notifier published a job's RUNNING delivery again
    when the job's terminal record came while that delivery had no attempt recorded yet (its
    receiver slow, or the sender behind) and the stream's duplicate window had passed since: a
    second WEBHOOKS message for the same webhook, so a second retry chain and a second POST of it.
    Only a crash between the status write and the publish (the record write comes back unacked)
    calls for publishing it again."""
    window_s = 0.5
    seen: list[str] = []  # the webhook-id of each request, as it came
    came = asyncio.Condition()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Reads the request's head and never answers: the attempt stays in flight, unrecorded.
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            headers = dict(line.lower().split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
            async with came:
                seen.append(headers["webhook-id"])
                came.notify_all()
            await reader.read()  # until the sender gives up (request_timeout_s)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def until_seen(wid: str) -> None:
        async with asyncio.timeout(WAIT_S), came:
            await came.wait_for(lambda: wid in seen)

    hanging_model = DEMO_MODEL.model_copy(
        update={"name": "hang", "loader": "tests.hanging_models:build_hanging_model", "warm_up": False}
    )
    settings = webhook_config(config, request_timeout_s=20.0).replace(
        nats={"duplicate_window_s": window_s}, models=[DEMO_MODEL.model_dump(), hanging_model.model_dump()]
    )
    hanging = await asyncio.start_server(hang, "127.0.0.1", 0)
    RELEASE.clear()
    try:
        port = hanging.sockets[0].getsockname()[1]
        stack = await start_stack(settings)
        x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
        x.contents.fp32_contents.extend([HANG_VALUE, 1, 1, 1])  # runs until RELEASE
        request = job_service_pb2.SubmitJobRequest(
            model_name="hang",
            inputs=[x],
            callback=job_pb2.Callback(
                url=f"http://127.0.0.1:{port}/slow",
                events=[job_pb2.CALLBACK_EVENT_RUNNING, job_pb2.CALLBACK_EVENT_COMPLETED],
            ),
        )
        job_id = (await stack.jobs.SubmitJob(request)).job.job_id
        await until_seen(webhook_id(job_id, CallbackEvent.RUNNING, 1))  # its attempt hangs
        # Past the stream's duplicate window (a server's clock, with no event to wait on): a
        # second publish of the RUNNING delivery would now be stored, not dropped.
        await asyncio.sleep(2 * window_s)
        RELEASE.set()  # the job ends: its terminal record comes to the notifier
        await until_seen(webhook_id(job_id, CallbackEvent.COMPLETED, 1))
        stream = await stack.nc.jetstream().stream_info(settings.nats.webhooks_stream)
        assert stream.state.last_seq == 2, "one message for RUNNING, one for COMPLETED"
        assert seen.count(webhook_id(job_id, CallbackEvent.RUNNING, 1)) == 1
    finally:
        RELEASE.set()
        hanging.close()
        await hanging.wait_closed()


async def enqueue_crashed(
    settings: Config,
    url: str,
    create_time: float,
    then: Callable[[Msg, JetStreamContext], Awaitable[None]],
) -> tuple[str, str]:
    """A notifier that died between a delivery's status write and its publish, played by hand on
    a stack without one: it takes a canceled job's record write, writes the delivery's status
    (created at `create_time`), then does `then` with the write. The job's ID and the webhook's."""
    first = Stack(settings, scheduler_config=settings.replace(webhooks={"secrets": []}))  # no notifier
    await first.start(batcher=False)
    try:
        job_id = await submit(first, url)
        await first.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id, reason="test"))
        js = first.nc.jetstream()
        feed = await js.pull_subscribe_bind(WEBHOOK_FEED_CONSUMER, stream=kv_stream(settings.nats.jobs_bucket))
        (write,) = await feed.fetch(1, timeout=WAIT_S)
        record = decode_record(write.data)
        assert record.job_id == job_id
        wid = webhook_id(job_id, CallbackEvent.CANCELED, record.attempt)
        status = DeliveryStatus(
            webhook_id=wid, event=CallbackEvent.CANCELED, job_attempt=record.attempt, create_time=create_time
        )
        await js.publish(
            f"$KV.{settings.nats.webhooks_bucket}.{deliveries_key('default', job_id)}",
            encode_deliveries(JobDeliveries(deliveries=(status,), ttl_s=3600.0)),
        )
        await then(write, js)
        await feed.unsubscribe()
    finally:
        await first.stop()
    return job_id, wid


async def test_a_crashed_enqueue_whose_record_write_was_replaced_is_published_by_the_next_write(
    config: Config, receiver: Receiver
) -> None:
    """The repair without a redelivery: a notifier died after writing a delivery's status, and the
    job's next write (which yields the same event) replaced the crashed write in the bucket (one
    revision per key) before it could come back. Within half the duplicate window of the entry the
    next write publishes the unattempted delivery (a publish that had landed is dropped as a
    duplicate), so the webhook is not lost. Played by hand: the first notifier takes the canceled
    job's write, writes the status, and its write is acked as if replaced; the job's record is then
    written again, unchanged, as the next write."""
    settings = webhook_config(config)

    async def replaced(write: Msg, js: JetStreamContext) -> None:
        await write.ack()  # gone, as a write replaced before it came back is
        await js.publish(write.subject, write.data)  # the job's next write, yielding the same event

    job_id, wid = await enqueue_crashed(settings, receiver.url("/replaced"), time.time(), replaced)

    second = Stack(settings)
    await second.start(batcher=False)
    try:
        (received,) = await receiver.wait_for("/replaced", 1)
        assert received.headers["webhook-id"] == wid
        job = await until(second, job_id, all_final(1))
        assert [d.state for d in job.callback_deliveries] == [DELIVERED]
    finally:
        await second.stop()


async def test_a_record_write_that_comes_back_publishes_its_unattempted_delivery_again(
    config: Config, receiver: Receiver
) -> None:
    """The repair the test above leaves alone: a notifier whose publish failed (or that died) after
    it wrote a delivery's status leaves the record write unacked, and the write that comes back
    publishes the delivery still unattempted again. Here the first notifier is played by hand: it
    takes the canceled job's record write, writes the delivery's status, then gives the write back."""
    settings = webhook_config(config)

    async def given_back(write: Msg, _js: JetStreamContext) -> None:
        await write.nak()  # as the notifier does when the publish fails

    job_id, wid = await enqueue_crashed(settings, receiver.url("/repaired"), 0.0, given_back)

    second = Stack(settings)
    await second.start(batcher=False)
    try:
        (received,) = await receiver.wait_for("/repaired", 1)
        assert received.headers["webhook-id"] == wid
        job = await until(second, job_id, all_final(1))
        assert [d.state for d in job.callback_deliveries] == [DELIVERED]
    finally:
        await second.stop()
