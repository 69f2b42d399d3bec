"""Webhook URL policy (asyncinfer.webhook_urls), signing and backoff, without servers."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import random
import time

import pytest
from standardwebhooks.webhooks import Webhook

from asyncinfer.jobs import CallbackSpec, JobRecord, JobState, Priority
from asyncinfer.webhook_secrets import new_secret
from asyncinfer.webhook_status import CallbackEvent
from asyncinfer.webhook_urls import (
    MAX_URL_LENGTH,
    RefusedUrl,
    check_callback_url,
    is_allowed_address,
    parse_callback_url,
    parse_networks,
    vetted_addresses,
)
from services.scheduler.webhooks.deliveries import event_body
from services.scheduler.webhooks.notifier import due_events
from services.scheduler.webhooks.post_attempt import retry_after_s
from services.scheduler.webhooks.sender import backoff_delay
from services.scheduler.webhooks.signing import signed_headers

pytestmark = pytest.mark.unit

NON_PUBLIC = [
    "10.1.2.3",
    "172.16.0.1",
    "172.31.255.255",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "127.0.0.1",
    "0.0.0.0",
    "100.64.0.1",  # shared address space (CGNAT)
    "224.0.0.1",  # multicast
    "240.0.0.1",  # reserved
    "255.255.255.255",
    "192.0.2.1",  # documentation
    "::1",
    "::",
    "fc00::1",
    "fd12:3456::1",
    "fe80::1",
    "fec0::1",  # site-local
    "ff02::1",  # multicast
    "::ffff:127.0.0.1",  # IPv4-mapped loopback
    "::ffff:10.0.0.1",
    "::ffff:169.254.169.254",
    "2002:7f00:1::",  # 6to4 of 127.0.0.1
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "2001:db8::1",  # documentation
]
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]


@pytest.mark.parametrize("address", NON_PUBLIC)
def test_non_public_addresses_are_refused(address: str) -> None:
    assert not is_allowed_address(ipaddress.ip_address(address), ())


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_allowed(address: str) -> None:
    assert is_allowed_address(ipaddress.ip_address(address), ())


def test_allowed_networks_open_exactly_their_range() -> None:
    allowed = parse_networks(["127.0.0.0/8", "10.1.0.0/16"])
    assert is_allowed_address(ipaddress.ip_address("127.0.0.1"), allowed)
    assert is_allowed_address(ipaddress.ip_address("::ffff:127.0.0.1"), allowed)  # judged as its IPv4
    assert is_allowed_address(ipaddress.ip_address("10.1.200.3"), allowed)
    assert not is_allowed_address(ipaddress.ip_address("10.2.0.1"), allowed)
    assert not is_allowed_address(ipaddress.ip_address("::1"), allowed)
    assert not is_allowed_address(ipaddress.ip_address("192.168.0.1"), allowed)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///etc/passwd", "only http and https"),
        ("ftp://example.com/x", "only http and https"),
        ("gopher://example.com/", "only http and https"),
        ("/relative/path", "only http and https"),
        ("https://user:pw@example.com/hook", "credentials"),
        ("https://user@example.com/hook", "credentials"),
        ("https:///no-host", "no host"),
        ("https://example.com:0/", "port 0"),
        ("https://example.com:99999/", "not a valid URL"),
        ("https://example.com/a b", "printable ASCII"),
        ("https://example.com/\r\nX-Injected: 1", "printable ASCII"),
        ("https://exämple.com/", "printable ASCII"),
        ("https://example.com/" + "a" * MAX_URL_LENGTH, "at most"),
        ("", "give the URL"),
    ],
)
def test_malformed_urls_are_refused(url: str, why: str) -> None:
    with pytest.raises(RefusedUrl, match=why):
        parse_callback_url(url)


def test_url_parts_for_the_request() -> None:
    url = parse_callback_url("https://Hooks.Example.com/in/bound?x=1#frag")
    assert (url.scheme, url.host, url.port, url.target, url.host_header) == (
        "https",
        "hooks.example.com",
        443,
        "/in/bound?x=1",
        "hooks.example.com",
    )
    v6 = parse_callback_url("http://[2606:4700::1]:8080")
    assert (v6.host, v6.port, v6.target, v6.host_header, v6.tls) == (
        "2606:4700::1",
        8080,
        "/",
        "[2606:4700::1]:8080",
        False,
    )


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:8080/hook",  # a name that resolves to loopback
        "http://127.0.0.1/hook",
        "http://[::1]/hook",
        "http://10.0.0.5/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://[::ffff:192.168.0.1]/hook",
        "http://0.0.0.0:80/",
    ],
)
async def test_hosts_resolving_inside_are_refused(url: str) -> None:
    with pytest.raises(RefusedUrl, match=r"webhooks\.allowed_networks"):
        await check_callback_url(url, ())


async def test_localhost_is_allowed_when_loopback_is_and_send_time_vets_again() -> None:
    loopback_v4 = parse_networks(["127.0.0.0/8"])
    parsed = await check_callback_url("http://localhost:9/hook", parse_networks(["127.0.0.0/8", "::1/128"]))
    # At send time only the vetted addresses are connected to ("localhost" may also give ::1).
    addresses = await vetted_addresses(parsed, loopback_v4)
    assert addresses
    assert all(a.version == 4 and a.is_loopback for a in addresses)
    with pytest.raises(RefusedUrl):
        await vetted_addresses(parsed, ())


async def test_unresolvable_host_is_refused() -> None:
    with pytest.raises(RefusedUrl, match="does not resolve"):
        await check_callback_url("https://no-such-host.invalid/hook", ())


def test_signatures_verify_with_the_standard_webhooks_library() -> None:
    secret = new_secret()
    body = b'{"type":"job.completed","data":{"job_id":"x"}}'
    headers = signed_headers(secret, "msg_1", int(time.time()), body)
    assert Webhook(secret).verify(body, headers) == json.loads(body)
    tampered = dict(headers, **{"webhook-id": "msg_2"})
    with pytest.raises(Exception, match=r"(?i)signature"):
        Webhook(secret).verify(body, tampered)
    with pytest.raises(Exception, match=r"(?i)signature"):
        Webhook(new_secret()).verify(body, headers)


def test_backoff_is_full_jitter_under_a_doubling_cap() -> None:
    rng = random.Random(7)
    for failures, cap in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (500, 10.0)]:
        samples = [backoff_delay(failures, base_s=1.0, max_s=10.0, rng=rng) for _ in range(400)]
        assert all(0.0 <= s <= cap for s in samples)
        assert max(samples) > 0.9 * cap, "the whole range is used"
        assert min(samples) < 0.1 * cap, "full jitter reaches down to 0"


def test_retry_after_reads_seconds_and_dates() -> None:
    assert retry_after_s("120", now=0.0) == 120.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412480.0 - 30) == pytest.approx(30.0)
    assert retry_after_s("soon", now=0.0) is None
    assert retry_after_s(None, now=0.0) is None


def _record(state: JobState, *, events: tuple[str, ...] = (), attempt: int = 1, started: bool = True) -> JobRecord:
    return JobRecord(
        job_id="0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
        tenant="acme",
        model_name="demo",
        model_version="1",
        state=state,
        priority=Priority.NORMAL,
        create_time=1.0,
        update_time=3.0,
        max_attempts=3,
        result_retention_s=60.0,
        attempt=attempt,
        start_time=2.0 if started else None,
        end_time=3.0 if state.is_terminal else None,
        callback=CallbackSpec("https://example.com/hook", events),
        labels={"batch": "7"},
    )


def test_events_due_for_each_state() -> None:
    assert due_events(_record(JobState.QUEUED)) == []
    assert due_events(_record(JobState.RUNNING)) == []  # not asked for: terminal events only
    assert due_events(_record(JobState.SUCCEEDED)) == [CallbackEvent.COMPLETED]
    assert due_events(_record(JobState.TIMED_OUT)) == [CallbackEvent.FAILED]
    assert due_events(_record(JobState.EXPIRED, attempt=0, started=False)) == [CallbackEvent.FAILED]
    assert due_events(_record(JobState.CANCELED, started=False)) == [CallbackEvent.CANCELED]
    assert due_events(_record(JobState.CANCELLING)) == []
    assert due_events(_record(JobState.RUNNING, events=("RUNNING",))) == [CallbackEvent.RUNNING]
    # A RUNNING write overwritten before the notifier read it still yields its event.
    assert due_events(_record(JobState.SUCCEEDED, events=("RUNNING", "COMPLETED"))) == [
        CallbackEvent.RUNNING,
        CallbackEvent.COMPLETED,
    ]
    assert due_events(_record(JobState.SUCCEEDED, events=("FAILED",))) == []


def test_body_is_a_thin_summary() -> None:
    record = _record(JobState.SUCCEEDED)
    body = json.loads(event_body(record, CallbackEvent.COMPLETED))
    assert body["type"] == "job.completed"
    assert body["timestamp"].endswith("Z")
    assert body["data"] == {
        "job_id": record.job_id,
        "model_name": "demo",
        "model_version": "1",
        "state": "SUCCEEDED",
        "attempt": 1,
        "given_back_attempts": 0,
        "labels": {"batch": "7"},
        "fetch": {"rpc": "asyncinfer.v1.JobService/GetJob", "job_id": record.job_id},
    }
    running = json.loads(event_body(record, CallbackEvent.RUNNING))
    assert (running["type"], running["data"]["state"]) == ("job.running", "RUNNING")


async def test_a_host_that_does_not_resolve_at_send_time_is_a_failed_attempt_not_a_refusal() -> None:
    """It resolved at submit; a resolver that fails or times out later is retried (the delivery
    ended FAILED after one attempt)."""
    from prometheus_client import CollectorRegistry, Counter

    from asyncinfer.config import WebhooksConfig
    from services.scheduler.webhooks.post_attempt import DeliveryPoster
    from tests.test_codecs import DELIVERY

    settings = WebhooksConfig(secrets=[{"tenant": "acme", "secret": new_secret()}])
    attempts = Counter("attempts", "", ["outcome"], registry=CollectorRegistry())
    poster = DeliveryPoster(settings, attempts, clock=time.time)
    delivery = dataclasses.replace(DELIVERY, url="https://no-such-host.invalid/hook")  # tenant acme's
    try:
        code, error, retry_after = await poster.post(delivery)
    finally:
        await poster.close()
    assert code == 0, "no answer: retried with backoff, as a refused connection is"
    assert "does not resolve" in error
    assert retry_after is None


def test_a_rotation_signs_with_every_secret_and_a_receiver_with_either_verifies() -> None:
    """Two secrets listed for a tenant (old and new): the header carries both signatures, as
    Standard Webhooks allows; a second entry for a tenant was ignored before."""
    from asyncinfer.config import WebhooksConfig

    old, new = new_secret(), new_secret()
    settings = WebhooksConfig(secrets=[{"tenant": "acme", "secret": new}, {"tenant": "acme", "secret": old}])
    assert settings.secrets_for("acme") == (new, old)
    body = b'{"type":"job.completed","data":{"job_id":"x"}}'
    headers = signed_headers(settings.secrets_for("acme"), "msg_1", int(time.time()), body)
    assert len(headers["webhook-signature"].split(" ")) == 2
    assert Webhook(old).verify(body, headers) == json.loads(body)
    assert Webhook(new).verify(body, headers) == json.loads(body)
    with pytest.raises(Exception, match=r"(?i)signature"):
        Webhook(new_secret()).verify(body, headers)


def test_allowed_networks_that_reach_the_cloud_metadata_address_are_warned_of() -> None:
    import structlog
    from prometheus_client import CollectorRegistry, Counter

    from asyncinfer.config import WebhooksConfig
    from services.scheduler.webhooks.post_attempt import DeliveryPoster

    for networks, warned in ((["0.0.0.0/0"], True), (["169.254.0.0/16"], True), (["10.0.0.0/8"], False), ([], False)):
        attempts = Counter("attempts", "", ["outcome"], registry=CollectorRegistry())
        with structlog.testing.capture_logs() as logs:
            DeliveryPoster(WebhooksConfig(allowed_networks=networks), attempts, clock=time.time)
        assert any(e["event"] == "webhooks_may_reach_cloud_metadata" for e in logs) == warned, networks


async def test_a_resolver_without_an_answer_at_submit_is_unavailable_not_a_refused_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A temporary resolver failure said INVALID_ARGUMENT CALLBACK_URL_REFUSED, which no retry
    follows; a host that does not exist stays a refusal."""
    import socket

    from asyncinfer import webhook_urls
    from asyncinfer.config import WebhooksConfig
    from asyncinfer.errors import InvalidArgument, Unavailable
    from services.gateway.callbacks import check_callback

    settings = WebhooksConfig(secrets=[{"tenant": "acme", "secret": new_secret()}])
    callback = CallbackSpec(url="https://hooks.example.com/done")

    async def resolver_says(errno: int, *_args: object) -> list[object]:
        raise socket.gaierror(errno, "from the resolver")

    monkeypatch.setattr(webhook_urls, "_getaddrinfo", lambda *a: resolver_says(socket.EAI_AGAIN))
    with pytest.raises(Unavailable) as unavailable:
        await check_callback(callback, settings, tenant="acme")
    assert unavailable.value.reason == "CALLBACK_URL_UNRESOLVED"
    monkeypatch.setattr(webhook_urls, "_getaddrinfo", lambda *a: resolver_says(socket.EAI_NONAME))
    with pytest.raises(InvalidArgument) as refused:
        await check_callback(callback, settings, tenant="acme")
    assert refused.value.reason == "CALLBACK_URL_REFUSED"
