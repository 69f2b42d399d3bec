"""The console's answers to hand-made requests (a helper's review, session 22): a foreign Host on
a loopback console (DNS rebinding), a token or a number that is not ASCII, numbers past what a
field holds, a page token or model that is wrong, an unknown state: each a page with a 4xx, never
a 500 or a 502 of the caller's own mistake. Plain HTTP against a real console and stack."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncinfer.client import AsyncClient, InternalError, Job, JobError, JobState, Priority
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.errors import ConfigError
from asyncinfer.jobs import BATCH_LABEL, CHUNK_LABEL
from asyncinfer.v1 import (
    batch_service_pb2,
    batch_service_pb2_grpc,
    job_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    ops_service_pb2,
)
from services.console.app import CSP, ConsoleApp, known_hosts_only
from services.console.backend import DeadLettersPage, JobsPage, _model_queues
from services.console.context import Context
from services.console.history import QueueHistory
from services.console.html import line_chart
from services.console.pages_jobs import _queued_so_far, job_page, jobs_page
from tests.stack import StartStack
from tests.test_console import OPS_KEY, TENANT_KEY, X, keyed
from tests.test_console import start_console as start_console  # the fixture
from tests.test_progress import PROGRESS_MODEL
from tests.webhook_receiver import Receiver, receiver, webhook_config

pytestmark = pytest.mark.timeout(120)
__all__ = ["receiver"]  # the fixture, used by name


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def get(http: aiohttp.ClientSession, console: ConsoleApp, path: str, **headers: str) -> tuple[int, str]:
    async with http.get(console.url.rstrip("/") + path, headers=headers, allow_redirects=False) as response:
        return response.status, await response.text()


async def test_hand_made_requests_get_pages_of_the_right_status(
    config: Config, start_stack: StartStack, start_console: object, http: aiohttp.ClientSession
) -> None:
    stack = await start_stack(config.replace(models=[DEMO_MODEL]), batcher=False)
    console = await start_console(stack)  # type: ignore[operator]
    async with AsyncClient(stack.address) as client:
        queued = await client.submit("demo", X)

    # DNS rebinding: a page of another site whose name now points here names that site.
    status, _ = await get(http, console, "/queues", Host=f"attacker.example:{console.port}")
    assert status == 421
    status, page = await get(http, console, "/queues", Host=f"localhost:{console.port}")
    assert status == 200
    token = re.search(r'name="csrf" value="([^"]+)"', page)
    assert token is not None

    # Numbers: past a field's range, or digits that are not ASCII ('²' passes str.isdigit).
    for path, expected in (
        ("/jobs?page_size=99999999999999999999", 400),
        ("/jobs?page_size=%C2%B2", 400),
        ("/jobs?page_size=0", 400),
        ("/dead-letters/99999999999999999999999", 404),
        ("/dead-letters/%C2%B2", 404),
        ("/jobs?page_token=garbage", 400),  # the gateway's INVALID_ARGUMENT, not a bad gateway
        ("/batches?page_token=garbage", 400),
        ("/jobs?state=BOGUS", 400),
        ("/jobs?label=team", 400),  # not key=value: it was ignored, and the list looked filtered
    ):
        status, page = await get(http, console, path)
        assert status == expected, (path, page[:300])
    status, page = await get(http, console, "/dead-letters?model=nosuch")
    assert status == 404
    assert 'name="model" value="nosuch"' in page  # the filter stays, to correct it

    # A form token that is not ASCII is a stale form, not a 500.
    url = console.url.rstrip("/")
    async with http.post(url + "/queues/pause", data={"model": "demo", "csrf": "é"}) as response:
        assert response.status == 403
    # An action on the dead letters comes back to the view it was asked from.
    form = {"all": "true", "model": "demo", "csrf": token.group(1)}
    async with http.post(url + "/dead-letters/replay", data=form, allow_redirects=False) as response:
        assert response.status == 303
        outcome = response.headers["Location"]
        assert outcome.startswith("/dead-letters?model=demo&message=")
    status, page = await get(http, console, outcome)
    assert 'id="message">replayed 0' in page, page[-2000:]
    # A link's own notice is not shown in the console's voice (it is not the console's outcome).
    spoof = "/dead-letters?message=Your+ops+key+expired%3A+enter+it+at+https%3A%2F%2Fevil.example"
    for path in (spoof, spoof + "&sig=0123456789abcdef0123456789abcdef", outcome.replace("replayed", "purged")):
        status, page = await get(http, console, path)
        assert status == 200
        assert 'id="message"' not in page, path

    # What is shown: a state in any case filters, the size in use is selected, a queued job's wait so far.
    status, page = await get(http, console, "/jobs?state=queued&page_size=30")
    assert status == 200
    assert queued.job_id in page
    assert "<option selected>30</option>" in page
    assert '<option value="QUEUED" selected>' in page
    status, page = await get(http, console, f"/jobs/{queued.job_id}")
    assert status == 200
    assert re.search(r"<td>queued for</td><td>[0-9.]+ (ms|s)<", page), page

    # A page token refused: a link to the list's first page (the same filters), which was not offered.
    for path, first in (
        ("/jobs?page_token=garbage&state=QUEUED", "/jobs?state=QUEUED"),
        ("/batches?page_token=garbage", "/batches"),
        ("/dead-letters?page_token=x&model=demo", "/dead-letters?model=demo"),
    ):
        status, page = await get(http, console, path)
        assert status == 400, path
        assert f'<a id="first-page" href="{first}">the first page</a>' in page, (path, page[-1500:])

    # An empty list says why (each said "none"): the filters, or nothing there yet.
    for path, said in (
        ("/jobs?state=FAILED", "no job matches these filters"),
        ("/batches", "no batches yet: the batches created (asyncinfer batch create, the SDK) show here"),
        ("/dead-letters", "no dead letters: a job that failed on its last attempt lands here"),
        ("/dead-letters?model=demo", "no dead letters of demo: "),
    ):
        status, page = await get(http, console, path)
        assert status == 200, path
        assert f'class="empty">{said}' in page, (path, page[-1500:])


async def test_a_running_jobs_page_shows_its_progress(
    config: Config, start_stack: StartStack, start_console: object, http: aiohttp.ClientSession
) -> None:
    settings = config.replace(
        models=[DEMO_MODEL, PROGRESS_MODEL],
        batcher={"progress_interval_ms": 100.0},
        scheduler={"progress_record_interval_s": 0.2},
    )
    stack = await start_stack(settings)
    console = await start_console(stack)  # type: ignore[operator]
    async with AsyncClient(stack.address) as client:
        job = await client.submit("progress", X)
        async for snapshot in client.watch(job):
            if snapshot.progress is not None and snapshot.revision > 2:  # the record keeps it now
                break
    status, page = await get(http, console, f"/jobs/{job.job_id}")
    assert status == 200
    assert re.search(r'<td>progress</td><td><bdi class="long">\d+% step \d+ of 1000<', page), page


async def test_a_console_with_a_tenant_key_alone_opens_on_the_jobs(
    config: Config, tmp_path: Path, start_stack: StartStack, start_console: Any, http: aiohttp.ClientSession
) -> None:
    """The queues need an ops key where keys are on: it opened on a page saying UNAUTHENTICATED."""
    stack = await start_stack(keyed(config, tmp_path))
    tenant_only = await start_console(stack, tenant_key=TENANT_KEY)
    with_ops = await start_console(stack, tenant_key=TENANT_KEY, ops_key=OPS_KEY)
    for console, home in ((tenant_only, "/jobs"), (with_ops, "/queues")):
        async with http.get(console.url, allow_redirects=False) as answer:
            assert answer.status == 302
            assert answer.headers["Location"] == home
    # Run apart, with a file that leaves the stack's keys out: it named the tenant "default", offered
    # the buttons (a keyless stack's loopback console may act) and opened on the queues.
    apart = ConsoleApp(
        config.replace(
            console={"port": 0, "gateway_address": stack.address, "scheduler_address": stack.ops_address}
            | {"tenant_key": TENANT_KEY}
        )
    )
    await apart.start()
    try:
        assert not apart.writable
        async with http.get(apart.url, allow_redirects=False) as answer:
            assert answer.headers["Location"] == "/jobs"
        status, page = await get(http, apart, "/jobs")
        assert status == 200
        assert "The jobs the console's key reaches" in page
        assert "Tenant default" not in page
    finally:
        await apart.stop()


async def test_beyond_loopback_the_console_answers_only_to_hosts_it_is_known_by(http: aiohttp.ClientSession) -> None:
    """DNS rebinding against a console bound beyond loopback (0.0.0.0 on Kubernetes, reached by a
    port-forward): a page of another site whose name now points at it names that site, and read the
    form token and paused a queue. The policy a 0.0.0.0 bind gets, served here on loopback (tests bind
    nothing else): localhost, IP addresses and console.allowed_hosts; and no POST from another origin."""

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[known_hosts_only(False, ["Console.Example.com"])])
    app.router.add_get("/", ok)
    app.router.add_post("/act", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}"
    try:
        for host, expected in (
            (f"attacker.example:{port}", 421),
            ("console.example.com.attacker.example", 421),
            (f"localhost:{port}", 200),
            (f"10.1.2.3:{port}", 200),  # the pod's or the machine's address
            (f"[fd00::1]:{port}", 200),
            ("console.example.com", 200),  # an ingress's name, as configured (any case)
        ):
            async with http.get(url + "/", headers={"Host": host}) as response:
                assert response.status == expected, host
        for origin, expected in (("http://attacker.example", 403), ("https://console.example.com", 200), ("null", 200)):
            headers = {"Host": "console.example.com", "Origin": origin}
            async with http.post(url + "/act", headers=headers) as response:
                assert response.status == expected, origin
    finally:
        await runner.cleanup()


async def test_every_answer_carries_the_security_headers_aiohttps_own_404_and_405_too(
    http: aiohttp.ClientSession,
) -> None:
    """A path no route has (404) and a method a route does not take (405) are answered by aiohttp
    itself, raised past the console's middleware: they went out without the CSP, nosniff,
    no-referrer and no-store the pages carry. Nothing of this needs the gateway or the scheduler:
    the console's point at a port where nothing listens. Each is a console page (its bar of links
    back, what was wrong): they were aiohttp's bare '404: Not Found' and '405: Method Not Allowed',
    a dead end for an operator who mistyped an address or followed an old link."""
    nowhere = "127.0.0.1:1"
    console = ConsoleApp(
        Config().replace(console={"port": 0, "gateway_address": nowhere, "scheduler_address": nowhere})
    )
    security_headers = {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }
    await console.start()
    try:
        for method, path, expected, said in (
            ("GET", "/no-such-page", 404, "no page at /no-such-page"),
            ("GET", "/batches/0190b8e4-7c1a-7d3e-8f00-0000000000b9/files/input", 404, "no page at /batches/"),
            ("POST", "/jobs", 405, "/jobs is not sent with POST: it takes GET"),
            ("GET", "/queues/pause", 405, "/queues/pause is not sent with GET: it takes POST"),
            ("GET", "/healthz", 200, "ok"),
        ):
            async with http.request(method, console.url.rstrip("/") + path, allow_redirects=False) as response:
                assert response.status == expected, (method, path)
                assert {name: response.headers.get(name) for name in security_headers} == security_headers, path
                text = await response.text()
            assert said in text, (path, text[-500:])
            if expected != 200:
                assert '<a href="/jobs">Jobs</a>' in text, path  # the console's bar, to go on from
    finally:
        await console.stop()


NEWER_JOB_ID = "0190b8e4-7c1a-7d3e-8f00-000000000099"
NEWER_BATCH_ID = "0190b8e4-7c1a-7d3e-8f00-0000000000b9"


def newer_job() -> job_pb2.Job:
    """A job as a gateway newer than this console and SDK may send it: a state, a priority, a waiting
    reason and a delivery event whose numbers they have no name for (the protos add values)."""
    job = job_pb2.Job(job_id=NEWER_JOB_ID, model_name="demo", state=99, priority=7, revision=5)  # type: ignore[arg-type]
    job.queue.waiting_reason = 42  # type: ignore[assignment]
    job.callback.url = "https://example.com/hook"
    job.callback.events.append(9)  # type: ignore[arg-type]
    job.callback_deliveries.add(webhook_id="w", event=9, state=8)  # type: ignore[arg-type]
    return job


class NewerJobService(job_service_pb2_grpc.JobServiceServicer):
    async def ListJobs(self, request: Any, context: Any) -> job_service_pb2.ListJobsResponse:
        return job_service_pb2.ListJobsResponse(jobs=[newer_job()])

    async def GetJob(self, request: Any, context: Any) -> job_service_pb2.GetJobResponse:
        return job_service_pb2.GetJobResponse(job=newer_job())

    async def WatchJob(self, request: Any, context: Any) -> AsyncIterator[job_service_pb2.WatchJobResponse]:
        # As a gateway does: the record newer than after_revision, and the end of the stream once
        # the job is terminal (as the newer gateway takes state 99 to be).
        if request.after_revision < newer_job().revision:
            yield job_service_pb2.WatchJobResponse(job=newer_job())

    async def ListModels(self, request: Any, context: Any) -> job_service_pb2.ListModelsResponse:
        answer = job_service_pb2.ListModelsResponse()
        answer.models.add(name="demo", version="1").versions.add(version="1", state=9)  # type: ignore[arg-type]
        return answer


class NewerBatchService(batch_service_pb2_grpc.BatchServiceServicer):
    def batch(self) -> batch_service_pb2.Batch:
        return batch_service_pb2.Batch(batch_id=NEWER_BATCH_ID, model_name="demo", state=99, priority=7)  # type: ignore[arg-type]

    async def ListBatches(self, request: Any, context: Any) -> batch_service_pb2.ListBatchesResponse:
        return batch_service_pb2.ListBatchesResponse(batches=[self.batch()])

    async def GetBatch(self, request: Any, context: Any) -> batch_service_pb2.GetBatchResponse:
        return batch_service_pb2.GetBatchResponse(batch=self.batch())


class NewerHealth(health_pb2_grpc.HealthServicer):
    async def Check(self, request: Any, context: Any) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=9)  # type: ignore[arg-type]


async def test_a_gateway_newer_than_the_console_and_the_sdk_is_read_by_both(http: aiohttp.ClientSession) -> None:
    """A gateway upgraded before its clients sends enum values they have no name for: the SDK reads
    them as UNKNOWN_<number> and the console shows that. Before, the SDK's job_from_proto raised
    ValueError on every read of such a job, batch_from_proto and models_from_proto too, and the
    console's jobs, job, models, batches and batch pages were a 500 (its /readyz too, for a health
    status newer than it). A stand-in gateway on a real gRPC server sends them: a real one cannot."""
    server = grpc.aio.server()
    job_service_pb2_grpc.add_JobServiceServicer_to_server(NewerJobService(), server)
    batch_service_pb2_grpc.add_BatchServiceServicer_to_server(NewerBatchService(), server)
    health_pb2_grpc.add_HealthServicer_to_server(NewerHealth(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    console = ConsoleApp(
        Config().replace(console={"port": 0, "gateway_address": address, "scheduler_address": address})
    )
    try:
        async with AsyncClient(address) as client:
            job = await client.get(NEWER_JOB_ID)
            assert (job.state, job.priority, job.done) == ("UNKNOWN_99", "UNKNOWN_7", False)
            assert job.queue is not None
            assert job.queue.waiting_reason == "UNKNOWN_42"
            assert [(d.event, d.state) for d in job.callback_deliveries] == [("UNKNOWN_9", "UNKNOWN_8")]
            assert job.callback is not None
            assert job.callback.events == ("UNKNOWN_9",)
            (model,) = await client.models()
            assert model.versions_summary == "1 (unknown_9)"
            # The gateway ended the watch: the job ended, in a state this SDK cannot call terminal.
            with pytest.raises(InternalError, match=r"ended at state UNKNOWN_99 \(newer than this SDK"):
                await client.wait(NEWER_JOB_ID, timeout_s=30)
            batch = await client.get_batch(NEWER_BATCH_ID)
            assert (batch.state, batch.priority, batch.done) == ("UNKNOWN_99", "UNKNOWN_7", False)
        await console.start()
        for path, shown in (
            ("/jobs", "UNKNOWN_99"),
            (f"/jobs/{NEWER_JOB_ID}", "<td>UNKNOWN_8</td>"),  # its delivery's state
            ("/models", "1 (unknown_9)"),
            ("/batches", "UNKNOWN_99"),
            (f"/batches/{NEWER_BATCH_ID}", "UNKNOWN_7"),
        ):
            status, page = await get(http, console, path)
            assert status == 200, (path, page[-2000:])
            assert shown in page, path
        status, page = await get(http, console, "/readyz")
        assert status == 503
        assert f"the gateway at {address}: status 9" in page
    finally:
        await console.stop()
        await server.stop(None)


async def test_a_console_without_keys_refuses_to_bind_beyond_loopback(config: Config) -> None:
    """The services refuse to bind beyond loopback without API keys; a console holding no key reads a
    stack without them, and would hand every job and dead letter to whoever reaches it. It refuses
    before it binds anything."""
    console = ConsoleApp(config.replace(console={"host": "0.0.0.0", "port": 0}))
    with pytest.raises(ConfigError, match="beyond loopback, without keys"):
        await console.start()
    assert console.port == 0


@pytest.mark.unit
def test_a_job_cancelled_in_the_queue_shows_how_long_it_waited() -> None:
    """Its record has no queue duration (it never started): the page said "queued for -" beside a
    timeline that drew its 3.5 s in the queue."""
    created = datetime(2026, 1, 1, tzinfo=UTC)
    job = Job(
        "j", "demo", "1", JobState.CANCELED, Priority.NORMAL, 0, 3, 2,
        create_time=created, end_time=created + timedelta(seconds=3.5),
    )  # fmt: skip
    assert _queued_so_far(job, now=created.timestamp() + 60) == 3.5
    waiting = dataclasses.replace(job, state=JobState.QUEUED, end_time=None)
    assert _queued_so_far(waiting, now=created.timestamp() + 2) == 2.0
    ran = dataclasses.replace(job, state=JobState.SUCCEEDED, start_time=created, queue_duration_s=0.25)
    assert _queued_so_far(ran, now=0) == 0.25


async def test_a_job_page_follows_its_webhook_after_the_job_ended(
    config: Config, start_stack: StartStack, start_console: object, http: aiohttp.ClientSession, receiver: Receiver
) -> None:
    """A helper's console pass, session 24: the page stopped at the job's end, its delivery shown
    PENDING with a next attempt that never moved while it was retried for days."""
    receiver.scripts["/hook"] = [(503, {})] * 100
    stack = await start_stack(webhook_config(config))
    console = await start_console(stack)  # type: ignore[operator]
    async with AsyncClient(stack.address) as client:
        job = await client.submit("demo", X, callback=receiver.url("/hook"))
        await client.wait(job, timeout_s=30)
        await receiver.wait_for("/hook", 1)
    status, page = await get(http, console, f"/jobs/{job.job_id}")
    assert status == 200
    assert "data-refresh=" in page, "ended, but its webhook is still being tried"
    async with http.get(f"{console.url}jobs/{job.job_id}", headers={"X-Console-Fragment": "1"}) as fragment:
        assert "X-Console-Final" not in fragment.headers


async def test_a_short_page_with_more_after_it_says_why() -> None:
    """ListJobs ends a page at 4 MB of records too: 511 rows of the 1,000 asked, and a next link,
    read as if jobs were missing (a helper's console pass)."""

    class OnePageBackend:
        async def list_jobs(self, **_asked: Any) -> JobsPage:
            job = Job("j1", "demo", "1", JobState.QUEUED, Priority.NORMAL, 0, 3, 1)
            return JobsPage(jobs=(job, dataclasses.replace(job, job_id="j2")), next_page_token="t")

    ctx = Context(
        backend=OnePageBackend(),  # type: ignore[arg-type]
        history=QueueHistory(60.0),
        csrf="c",
        writable=False,
        tenant="default",
        stats_interval_s=1.0,
    )
    page = await jobs_page(ctx, make_mocked_request("GET", "/jobs?page_size=50"))
    assert "2 of the 50 asked fit in one answer; the rest follow" in str(page.text)


async def test_the_queue_plots_end_at_the_depth_the_page_shows(
    config: Config, start_stack: StartStack, start_console: Any, http: aiohttp.ClientSession
) -> None:
    """The Queues page's plots lagged its table: they drew the sampler's samples alone, taken every
    stats_interval_s on a clock of their own, so a burst the table showed at once reached the
    queued-jobs plot only at the sampler's next round (measured 0.6 to 2.0 s at the default 2 s),
    and a refresh just before it drew the plot a refresh behind the table. Here the sampler takes
    its round at start and no other (an hour apart): the page drawn right after the burst ends
    the demo series at the five jobs its table shows."""
    stack = await start_stack(batcher=False)  # nothing pulls the jobs: they stay queued
    console = await start_console(stack, stats_interval_s=3600.0)
    async with AsyncClient(stack.address) as client:
        for _ in range(5):
            await client.submit("demo", X)
    status, page = await get(http, console, "/queues", **{"X-Console-Fragment": "1"})
    assert status == 200, page
    row = re.search(r'id="queue-models".*?<tr><td>demo</td><td>[^<]*</td><td[^>]*>(\d+)<', page, re.S)
    assert row is not None, page
    assert row.group(1) == "5"
    plot = page.partition('aria-label="queued jobs"')[2].partition("</svg>")[0]
    assert "<title>demo: 5 jobs, latest</title>" in plot, plot
    rate = page.partition('aria-label="completed jobs per second"')[2].partition("</svg>")[0]
    assert "<title>demo: 0 jobs/s, latest</title>" in rate, rate


@pytest.mark.unit
async def test_a_file_batchs_chunk_job_is_offered_no_retry() -> None:
    """The retry button of a dead-lettered job's page replays its letter; a file batch's chunk job's
    letter cannot be (its failed records are in the batch's error file: the scheduler refuses it
    BATCH_CHUNK_NOT_REPLAYABLE), so its page offers none and says why, while another job's page, on
    the same console that may act, offers it with the letter's sequence."""
    gave_up = JobError(grpc.StatusCode.INTERNAL, "MODEL_ERROR", "it failed (gave up after 2 attempts)")
    plain = Job("j1", "demo", "1", JobState.FAILED, Priority.NORMAL, 2, 2, 5, error=gave_up)
    chunk = dataclasses.replace(plain, job_id="j2", labels={BATCH_LABEL: "b1", CHUNK_LABEL: "0-100"})

    class LettersBackend:
        async def job(self, job_id: str) -> Job:
            return {"j1": plain, "j2": chunk}[job_id]

        async def dead_letters(self, **_asked: Any) -> DeadLettersPage:
            letters = tuple(
                {"sequence": sequence, "job_id": job_id, "tenant": "default", "reason": "MAX_ATTEMPTS"}
                for sequence, job_id in ((7, "j1"), (8, "j2"))
            )
            return DeadLettersPage(letters=letters, next_page_token="", total=2)

    ctx = Context(
        backend=LettersBackend(),  # type: ignore[arg-type]
        history=QueueHistory(60.0),
        csrf="c",
        writable=True,
        tenant="default",
        stats_interval_s=1.0,
    )
    page = await job_page(ctx, make_mocked_request("GET", "/jobs/j1", match_info={"job_id": "j1"}))
    assert '<form class="inline" method="post" action="/jobs/j1/retry"' in str(page.text)
    assert '<input type="hidden" name="sequence" value="7">' in str(page.text)
    page = await job_page(ctx, make_mocked_request("GET", "/jobs/j2", match_info={"job_id": "j2"}))
    assert "/retry" not in str(page.text)
    assert "a file batch's chunk: not replayed (its records are in the batch's error file)" in str(page.text)


@pytest.mark.unit
def test_a_plots_legend_wraps_below_it_for_any_number_of_models() -> None:
    """Names were placed 110 px apart inside the 520-px plot: long ones overlapped, and past four
    models they ran off its edge (a helper's console pass)."""
    series = {f"a-rather-long-model-name-{i}": [(100.0, float(i))] for i in range(6)}
    chart = line_chart("queued jobs", series, now=100.0, span_s=60.0, unit="jobs")
    plot, _, legend = chart.partition("</svg>")
    assert all(f">{name}</text>" not in plot for name in series)
    assert all(f"&#9632; {name}</span>" in legend for name in series)


async def test_readyz_says_whether_the_console_reaches_its_gateway_and_scheduler(
    config: Config, start_stack: StartStack, start_console: Any, http: aiohttp.ClientSession
) -> None:
    """/healthz is liveness (the process answers); /readyz, which the manifests' readiness probe
    asks, is 200 while the gateway and the scheduler answer, 503 naming the one that does not."""
    stack = await start_stack(batcher=False)
    console = await start_console(stack)
    async with http.get(f"{console.url}readyz") as ready:
        assert (ready.status, await ready.text()) == (200, "ready\n")
    await stack.scheduler.stop(1.0)
    async with http.get(f"{console.url}readyz") as gone:
        text = await gone.text()
    assert gone.status == 503, text
    assert text.startswith(f"not ready: cannot reach the scheduler at {stack.ops_address}: UNAVAILABLE"), text
    assert "the gateway" not in text
    async with http.get(f"{console.url}healthz") as alive:
        assert alive.status == 200, "liveness does not depend on the services it reads"


@pytest.mark.unit
def test_a_queue_state_or_priority_newer_than_the_console_is_shown_as_its_number() -> None:
    """A scheduler upgraded before its console may answer GetQueueStats with an enum value the
    console does not know (protos only add values): QueueState.Name raised ValueError, which ended
    the console's queue sampler (its supervisor then stops the process) and made /queues a 500; an
    unknown priority was shown as NORMAL."""
    stats = ops_service_pb2.ModelQueueStats(
        model_name="demo",
        state=99,  # type: ignore[arg-type]
        priorities=[ops_service_pb2.PriorityQueueStats(priority=7, depth=2)],  # type: ignore[arg-type]
    )
    queues = _model_queues(stats)
    assert queues.state == "state 99"
    assert [(p.priority, p.depth) for p in queues.priorities] == [("priority 7", 2)]
    known = _model_queues(ops_service_pb2.ModelQueueStats(model_name="demo", state=ops_service_pb2.QUEUE_STATE_PAUSED))
    assert known.state == "paused"
