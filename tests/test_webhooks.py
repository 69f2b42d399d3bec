"""Signed, durable webhooks through the whole stack (gateway -> NATS -> scheduler -> batcher), to a
real HTTP receiver on loopback that verifies every signature with the independent
`standardwebhooks` library."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from standardwebhooks.webhooks import Webhook

from asyncinfer.config import Config
from asyncinfer.grpc_errors import status_details, unpack_details
from asyncinfer.nats.connection import connect
from asyncinfer.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc, tensor_pb2
from services.gateway.app import GatewayApp
from services.scheduler.webhooks.signing import new_secret
from tests.stack import Stack as BaseStack

SECRET = new_secret()
WAIT_S = 15.0
DELIVERED = job_pb2.CALLBACK_DELIVERY_STATE_DELIVERED
PENDING = job_pb2.CALLBACK_DELIVERY_STATE_PENDING
FAILED = job_pb2.CALLBACK_DELIVERY_STATE_FAILED
DISABLED = job_pb2.CALLBACK_DELIVERY_STATE_DISABLED


# --- a webhook receiver -------------------------------------------------------------------------


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    verified: Any  # the payload standardwebhooks verified, or the exception it raised


@dataclass
class Receiver:
    """An HTTP/1.1 server on 127.0.0.1 answering each path from a script (then 200)."""

    secret: str
    scripts: dict[str, list[tuple[int, dict[str, str]]]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    port: int = 0
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _server: asyncio.Server | None = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def at(self, path: str) -> list[Received]:
        return [r for r in self.received if r.path == path]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def wait_for(self, path: str, count: int) -> list[Received]:
        async with asyncio.timeout(WAIT_S), self._changed:
            await self._changed.wait_for(lambda: len(self.at(path)) >= count)
        return self.at(path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            _method, path, _version = (await reader.readline()).decode().split(" ", 2)
            headers: dict[str, str] = {}
            while (line := (await reader.readline()).decode().rstrip("\r\n")) != "":
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            try:
                verified: Any = Webhook(self.secret).verify(body, headers)
            except Exception as exc:
                verified = exc
            script = self.scripts.get(path, [])
            status, extra = script.pop(0) if script else (200, {})
            lines = [f"HTTP/1.1 {status} X", "Content-Length: 0", "Connection: close"]
            lines += [f"{k}: {v}" for k, v in extra.items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            await writer.drain()
            async with self._changed:
                self.received.append(Received(path, headers, body, time.monotonic(), verified))
                self._changed.notify_all()
        finally:
            writer.close()


# --- the stack --------------------------------------------------------------------------------


def webhook_config(config: Config, **webhooks: Any) -> Config:
    settings: dict[str, Any] = {
        "secrets": [{"tenant": "default", "secret": SECRET}],
        "allowed_networks": ["127.0.0.0/8"],
        "backoff_base_s": 0.2,
        "backoff_max_s": 1.0,
        "request_timeout_s": 2.0,
        "retry_horizon_s": 60.0,
    }
    return config.replace(webhooks={**settings, **webhooks})


def demo_input() -> tensor_pb2.InferInputTensor:
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([1, 2, 3, 4])
    return x


class Stack(BaseStack):
    """The shared stack plus a JobService channel and the webhook tests' helpers."""

    def __init__(self, config: Config, scheduler_config: Config | None = None) -> None:
        super().__init__(config, scheduler_config)
        self.channel: grpc.aio.Channel | None = None

    @property
    def jobs(self) -> job_service_pb2_grpc.JobServiceStub:
        assert self.channel is not None
        return job_service_pb2_grpc.JobServiceStub(self.channel)

    async def start(self, *, batcher: bool = True) -> None:
        await super().start(batcher=batcher)
        self.channel = grpc.aio.insecure_channel(self.address)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        await super().stop()

    async def submit(self, url: str, *events: int) -> str:
        request = job_service_pb2.SubmitJobRequest(
            model_name="demo",
            inputs=[demo_input()],
            callback=job_pb2.Callback(url=url, events=events),
            labels={"k": "v"},
        )
        return str((await self.jobs.SubmitJob(request)).job.job_id)

    async def get(self, job_id: str) -> job_pb2.Job:
        return (await self.jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job

    async def until(self, job_id: str, condition: Callable[[job_pb2.Job], bool]) -> job_pb2.Job:
        """GetJob until `condition` holds (a bounded poll)."""
        give_up_at = time.monotonic() + WAIT_S
        while True:
            job = await self.get(job_id)
            if condition(job):
                return job
            assert time.monotonic() < give_up_at, f"still not there after {WAIT_S} s: {job}"
            await asyncio.sleep(0.05)


def all_final(count: int) -> Callable[[job_pb2.Job], bool]:
    return lambda job: (
        len(job.callback_deliveries) == count and all(d.state != PENDING for d in job.callback_deliveries)
    )


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    server = Receiver(SECRET)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def stack(config: Config) -> AsyncIterator[Stack]:
    running = Stack(webhook_config(config))
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


class TopOfRange(random.Random):
    """Pins the backoff jitter to its upper bound, so the delays are exactly the doubling caps."""

    def uniform(self, a: float, b: float) -> float:
        return b


# --- tests ------------------------------------------------------------------------------------


async def test_completed_job_delivers_exactly_the_wanted_events_signed_and_thin(
    stack: Stack, receiver: Receiver
) -> None:
    both = await stack.submit(receiver.url("/both"), job_pb2.CALLBACK_EVENT_RUNNING, job_pb2.CALLBACK_EVENT_COMPLETED)
    default = await stack.submit(receiver.url("/default"))  # no events: the terminal ones
    failed_only = await stack.submit(receiver.url("/failed-only"), job_pb2.CALLBACK_EVENT_FAILED)

    job = await stack.until(both, all_final(2))
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

    job = await stack.until(default, all_final(1))
    assert [d.event for d in job.callback_deliveries] == [job_pb2.CALLBACK_EVENT_COMPLETED]
    (only,) = await receiver.wait_for("/default", 1)
    assert json.loads(only.body)["type"] == "job.completed"

    done = await stack.until(failed_only, lambda j: j.state == job_pb2.JOB_STATE_SUCCEEDED)
    assert list(done.callback_deliveries) == []
    # The receiver saw exactly the wanted events (all enqueued above have arrived by now).
    assert receiver.at("/failed-only") == []
    assert len(receiver.received) == 3


async def test_canceled_job_notifies_canceled(config: Config, receiver: Receiver) -> None:
    running = Stack(webhook_config(config))
    await running.start(batcher=False)  # nothing runs it: it stays QUEUED until canceled
    try:
        job_id = await running.submit(receiver.url("/cancel"))
        await running.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id, reason="test"))
        job = await running.until(job_id, all_final(1))
        assert job.state == job_pb2.JOB_STATE_CANCELED
        assert job.callback_deliveries[0].event == job_pb2.CALLBACK_EVENT_CANCELED
        (received,) = await receiver.wait_for("/cancel", 1)
        assert json.loads(received.body)["type"] == "job.canceled"
        assert json.loads(received.body)["data"]["state"] == "CANCELED"
    finally:
        await running.stop()


async def test_failures_are_retried_with_the_same_id_and_growing_delays(config: Config, receiver: Receiver) -> None:
    stack = Stack(webhook_config(config, backoff_base_s=0.3))
    await stack.start()
    try:
        await _retried_with_growing_delays(stack, receiver)
    finally:
        await stack.stop()


async def _retried_with_growing_delays(stack: Stack, receiver: Receiver) -> None:
    stack.scheduler.webhooks.pin_jitter(TopOfRange())
    receiver.scripts["/flaky"] = [(500, {}), (500, {})]
    job_id = await stack.submit(receiver.url("/flaky"))

    job = await stack.until(job_id, all_final(1))
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
    job_id = await stack.submit(receiver.url("/busy"))
    await stack.until(job_id, all_final(1))
    first, second = await receiver.wait_for("/busy", 2)
    assert second.at - first.at >= 0.95, "backoff alone (at most 0.2 s) would have come back sooner"


async def test_redirects_are_not_followed_and_count_as_failures(stack: Stack, receiver: Receiver) -> None:
    receiver.scripts["/moved"] = [(302, {"Location": receiver.url("/target")})] * 2
    job_id = await stack.submit(receiver.url("/moved"))
    job = await stack.until(job_id, lambda j: any(d.attempts >= 1 for d in j.callback_deliveries))
    (delivery,) = job.callback_deliveries
    assert delivery.state == PENDING
    assert delivery.last_status_code == 302
    assert "redirects are not followed" in delivery.last_error
    assert delivery.HasField("next_attempt_time")
    job = await stack.until(job_id, all_final(1))  # the third attempt answers 200
    assert job.callback_deliveries[0].attempts == 3
    assert receiver.at("/target") == []


async def test_gone_disables_the_url_for_the_tenant(stack: Stack, receiver: Receiver) -> None:
    receiver.scripts["/gone"] = [(410, {})]
    first = await stack.submit(receiver.url("/gone"))
    job = await stack.until(first, all_final(1))
    assert job.callback_deliveries[0].state == DISABLED
    assert job.callback_deliveries[0].last_status_code == 410
    assert job.callback_deliveries[0].attempts == 1

    second = await stack.submit(receiver.url("/gone"))
    job = await stack.until(second, all_final(1))
    (delivery,) = job.callback_deliveries
    assert delivery.state == DISABLED
    assert delivery.attempts == 0, "a disabled URL is not called again"
    assert "410" in delivery.last_error
    assert len(receiver.at("/gone")) == 1


async def test_gives_up_after_the_retry_horizon(config: Config, receiver: Receiver) -> None:
    running = Stack(webhook_config(config, retry_horizon_s=0.8, backoff_base_s=0.1, backoff_max_s=0.2))
    await running.start()
    try:
        receiver.scripts["/down"] = [(503, {})] * 100
        job_id = await running.submit(receiver.url("/down"))
        job = await running.until(job_id, all_final(1))
        (delivery,) = job.callback_deliveries
        assert delivery.state == FAILED
        assert delivery.last_status_code == 503
        assert "retry horizon" in delivery.last_error
        assert delivery.attempts >= 2
        attempts = receiver.at("/down")
        assert len(attempts) == delivery.attempts
        assert attempts[-1].at - attempts[0].at <= 0.8 + 0.3, "no attempt long after the horizon"
    finally:
        await running.stop()


async def test_addresses_are_vetted_again_at_send_time(config: Config, receiver: Receiver) -> None:
    # The gateway allowed loopback when the job was submitted; the scheduler (as after a DNS
    # change to an inside address) does not: nothing is sent.
    running = Stack(webhook_config(config), scheduler_config=webhook_config(config, allowed_networks=[]))
    await running.start()
    try:
        job_id = await running.submit(receiver.url("/inside"))
        job = await running.until(job_id, all_final(1))
        (delivery,) = job.callback_deliveries
        assert delivery.state == FAILED
        assert "refused" in delivery.last_error
        assert delivery.last_status_code == 0
        assert receiver.at("/inside") == []
    finally:
        await running.stop()


async def test_deliveries_survive_a_scheduler_restart(config: Config, receiver: Receiver) -> None:
    settings = webhook_config(config, backoff_base_s=0.5, backoff_max_s=0.5)
    receiver.scripts["/later"] = [(503, {})] * 100  # down until the test says otherwise
    first = Stack(settings)
    await first.start()
    job_id = await first.submit(receiver.url("/later"))
    try:
        await receiver.wait_for("/later", 1)
        job = await first.until(job_id, lambda j: any(d.attempts >= 1 for d in j.callback_deliveries))
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
        job = await second.until(job_id, all_final(1))
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
        job_id = await first.submit(receiver.url("/late"), job_pb2.CALLBACK_EVENT_COMPLETED)
        await first.until(job_id, lambda j: j.state == job_pb2.JOB_STATE_SUCCEEDED)
        nc = await connect(config.nats, name="test")
        try:
            info = await nc.jetstream().consumer_info(f"KV_{config.nats.jobs_bucket}", "webhook-notifier")
        finally:
            await nc.close()
        assert info.delivered.consumer_seq == 0
        assert (info.num_pending or 0) >= 1  # the bucket keeps the latest write per job: SUCCEEDED
        assert receiver.at("/late") == []
    finally:
        await first.stop()

    second = Stack(settings)
    await second.start(batcher=False)
    try:
        job = await second.until(job_id, all_final(1))
        assert [d.state for d in job.callback_deliveries] == [DELIVERED]
        assert len(receiver.at("/late")) == 1
    finally:
        await second.stop()


# --- refused at submit ------------------------------------------------------------------------


@pytest.fixture
async def gateway_only(config: Config) -> AsyncIterator[Stack]:
    # allowed_networks empty: loopback is refused.
    running = Stack(webhook_config(config, allowed_networks=[]))
    await running.gateway.start()
    running.channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.gateway.port}")
    try:
        yield running
    finally:
        await running.channel.close()
        await running.gateway.stop(1.0)


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
        await gateway_only.submit(url)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = status_details(info.value)
    assert status is not None
    fields = [v.field for v in unpack_details(status)["BadRequest"].field_violations]
    assert fields == ["callback.url"]
    nc = await connect(config.nats, name="test")
    try:
        js = nc.jetstream()
        assert (await js.stream_info(config.nats.work_stream)).state.messages == 0
        assert (await (await js.key_value(config.nats.jobs_bucket)).status()).values == 0
    finally:
        await nc.close()


async def test_tenant_without_a_secret_cannot_ask_for_callbacks(config: Config) -> None:
    gateway = GatewayApp(config.replace(webhooks={"allowed_networks": ["127.0.0.0/8"]}))  # no secrets
    await gateway.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            request = job_service_pb2.SubmitJobRequest(
                model_name="demo", inputs=[demo_input()], callback=job_pb2.Callback(url="http://127.0.0.1:9/hook")
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await job_service_pb2_grpc.JobServiceStub(channel).SubmitJob(request)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "asyncinfer webhook-secret" in (info.value.details() or "")
            assert "webhooks.secrets" in (info.value.details() or "")
    finally:
        await gateway.stop(1.0)
