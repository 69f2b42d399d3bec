"""The web console in a real headless chromium (tests/browser.py) against a live stack
(tests/stack.py, in this process; and `asyncinfer up` as a process): what a person sees on each
page, checked in the page's rendered text and SVG. Screenshots go to test-artifacts/console/
(ignored by git) and stay there after the run."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import aiohttp
import numpy as np
import pytest

from asyncinfer.api_keys import hash_key
from asyncinfer.client import AsyncClient, Job, JobState, Priority, QueuePosition, WaitingReason
from asyncinfer.commands.output import TIME_FORMAT
from asyncinfer.config import DEMO_MODEL, FLAKY_MODEL, Config, ModelConfig, load_config
from asyncinfer.embedded_nats import free_port
from asyncinfer.errors import ConfigError
from asyncinfer.jobs import job_key
from asyncinfer.nats import Client as NatsClient
from services.console import html as ui
from services.console import pages_jobs
from services.console.app import ConsoleApp
from services.gateway.app import GatewayApp
from tests import recovering_model
from tests.browser import Browser, Chromium
from tests.stack import Stack, StartStack
from tests.test_up_grpcurl import close, start_on_free_ports

pytestmark = pytest.mark.timeout(120)

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "console"
TENANT_KEY, OPS_KEY, BATCHER_KEY = "console-tenant-key", "console-ops-key", "console-batcher-key"
X = {"x": np.array([[1, 2, 3, 4]], np.float32)}
FAILING_X = {"x": np.array([[-1, 2, 3, 4]], np.float32)}  # flaky fails a row starting below 0

StartConsole = Callable[..., Awaitable[ConsoleApp]]
# Fails every job until the test sets recovering_model.MAY_SUCCEED; one attempt, so a job is
# dead-lettered at its first failure.
RECOVERING_MODEL = ModelConfig.model_validate(
    {
        **DEMO_MODEL.model_dump(),
        "name": "recovering",
        "loader": "tests.recovering_model:build_recovering_model",
        "max_attempts": 1,
    }
)


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    """One chromium for the file's tests (each test's page in a browser context of its own)."""
    running = Chromium(tmp_path_factory.mktemp("chromium"))
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture
async def browser(chromium: Chromium) -> AsyncIterator[Browser]:
    async with Browser.open(chromium) as page:
        yield page


@pytest.fixture
async def start_console() -> AsyncIterator[StartConsole]:
    """Starts consoles against a stack (with console settings added); all stopped at the end."""
    started: list[ConsoleApp] = []

    async def start(stack: Stack, **console: object) -> ConsoleApp:
        settings = {
            "port": 0,
            "gateway_address": stack.address,
            "scheduler_address": stack.ops_address,
            "stats_interval_s": 0.3,
            **console,
        }
        app = ConsoleApp(stack.config.replace(console=settings))
        await app.start()
        started.append(app)
        return app

    yield start
    for app in reversed(started):
        await app.stop()


def keyed(config: Config, tmp_path: Path) -> Config:
    """A stack with API keys (tenant acme, an ops key, the batcher's), serving demo and flaky."""
    key_file = tmp_path / "batcher-key"
    key_file.write_text(BATCHER_KEY)
    return config.replace(
        gateway={
            "api_keys": [
                {"tenant": "acme", "sha256": hash_key(TENANT_KEY)},
                {"role": "ops", "sha256": hash_key(OPS_KEY)},
                {"role": "batcher", "sha256": hash_key(BATCHER_KEY)},
            ]
        },
        batcher={"api_key_file": str(key_file)},
        models=[DEMO_MODEL, FLAKY_MODEL],
    )


async def test_the_jobs_page_shows_a_job_submitted_a_moment_earlier(
    stack: Stack, start_console: StartConsole, browser: Browser
) -> None:
    console = await start_console(stack)
    async with AsyncClient(stack.address) as client:
        done = await client.wait(await client.submit("demo", X, labels={"team": "search"}), timeout_s=30)
    assert done.state is JobState.SUCCEEDED

    await browser.goto(console.url + "jobs")
    await browser.wait_for_text(done.job_id, "#jobs")
    row = await browser.evaluate(
        f"[...document.querySelectorAll('#jobs tr')].find(r => r.innerText.includes('{done.job_id}')).innerText"
    )
    assert "SUCCEEDED" in row
    assert "demo" in row
    assert "team=search" in row
    # Tracing off (the default): no column of dashes for trace IDs.
    assert "trace" not in await browser.evaluate("[...document.querySelectorAll('#jobs th')].map(t => t.innerText)")
    await browser.screenshot(ARTIFACTS / "jobs.png")

    # The filters: a state it is not in hides it; its label finds it.
    await browser.goto(console.url + "jobs?state=FAILED")
    assert done.job_id not in await browser.text("#jobs")
    await browser.goto(console.url + "jobs?label=team%3Dsearch&state=SUCCEEDED&model=demo")
    await browser.wait_for_text(done.job_id, "#jobs")

    # A link whose page token the gateway refuses: its error, said once (its field violation
    # restated the message on a line of its own), and the way back to the first page of those filters.
    await browser.goto(console.url + "jobs?state=SUCCEEDED&page_token=garbage")
    said = (await browser.text(".error")).split("\n")
    assert said == ["INVALID_ARGUMENT INVALID_PAGE_TOKEN: invalid page_token: not a token from ListJobs"], said
    await browser.click_and_load("#first-page")
    assert await browser.evaluate("location.pathname + location.search") == "/jobs?state=SUCCEEDED"
    await browser.wait_for_text(done.job_id, "#jobs")

    # Its page: the record, the batch it ran in, and its timeline (queued, then succeeded).
    await browser.click_and_load(f"a[href='/jobs/{done.job_id}']")
    text = await browser.text("#job")
    assert "SUCCEEDED" in text
    assert "The batch it ran in" in text
    assert "jobs in the batch" in text
    assert "trace ID\t-" in text  # tracing is off in this stack: no trace to look up
    bars = await browser.evaluate("[...document.querySelectorAll('#job rect.bar')].map(b => b.dataset.bar)")
    assert bars == ["queued", "succeeded"]
    await browser.screenshot(ARTIFACTS / "job.png")


async def test_a_queued_job_is_cancelled_from_its_page(
    idle_stack: Stack, start_console: StartConsole, browser: Browser
) -> None:
    """A job's page has a cancel button where the console may act, as a batch's page has (the
    README said the tenant key's jobs are shown and cancelled; the job's page had no button): a
    queued job (no batcher) ends CANCELED, the reason saying the console did it; a read-only
    console shows no button and refuses a cancel posted anyway."""
    console = await start_console(idle_stack)  # loopback, no API keys: it may act
    assert console.writable
    async with AsyncClient(idle_stack.address) as client:
        job = await client.submit("demo", X)
        other = await client.submit("demo", X)

    await browser.goto(console.url + f"jobs/{job.job_id}")
    await browser.wait_for_text("cancel job", "#job")
    await browser.evaluate("window.confirm = () => true")  # the person says yes to the question
    await browser.click_and_load("#job form[action$='/cancel'] button")
    await browser.wait_for_text("asked to cancel: CANCELED", "#message")
    text = await browser.text("#job")
    assert "CANCELED" in text
    assert "canceled by the user: from the web console" in text  # the reason, kept in its error
    assert "cancel job" not in text
    async with AsyncClient(idle_stack.address) as client:
        assert (await client.get(job)).state is JobState.CANCELED
    await browser.screenshot(ARTIFACTS / "job-cancelled.png")

    viewer = await start_console(idle_stack, read_only=True)
    await browser.goto(viewer.url + f"jobs/{other.job_id}")
    await browser.wait_for_text("read-only", "#job")
    assert not await browser.evaluate("!!document.querySelector(\"#job form[action$='/cancel']\")")
    cancel = viewer.url + f"jobs/{other.job_id}/cancel"
    async with aiohttp.ClientSession() as session, session.post(cancel, data={"csrf": "x"}) as answer:
        assert answer.status == 403
    async with AsyncClient(idle_stack.address) as client:
        assert (await client.get(other)).state is JobState.QUEUED


async def test_a_jobs_times_read_as_the_cli_writes_them_local_to_the_second_the_utc_instant_in_a_tooltip(
    config: Config, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    """The first-hour pass, session 38: the console showed times in UTC to the millisecond
    (`2026-12-07 20:48:01.123 UTC`), the CLI local time to the second (`2026-12-07 21:48:01`): one
    job's creation read as two times. The page now shows the reader's local time as the CLI does, the
    UTC instant to the millisecond in its tooltip; a browser at +05:30 shows it so."""
    stack = await start_stack(config)
    console = await start_console(stack)
    async with AsyncClient(stack.address) as client:
        job = await client.wait(await client.submit("demo", X), timeout_s=30)
    assert job.create_time is not None
    await browser.send("Emulation.setTimezoneOverride", timezoneId="Asia/Kolkata")
    await browser.goto(console.url + f"jobs/{job.job_id}")
    times = await browser.evaluate(
        "[...document.querySelectorAll('#job time')].map(t => [t.dateTime, t.innerText, t.title])"
    )
    assert len(times) >= 3, times  # created, started, ended, updated, kept until
    kolkata = ZoneInfo("Asia/Kolkata")
    for machine, shown, tooltip in times:
        at = datetime.fromisoformat(machine)
        assert shown == at.astimezone(kolkata).strftime(TIME_FORMAT), (machine, shown)  # the CLI's format
        assert tooltip == at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC", (machine, tooltip)
    created = datetime.fromisoformat(times[0][0])
    assert abs((created - job.create_time).total_seconds()) < 0.001
    # Where the script does not run (a fetch of the page, curl), UTC, labelled.
    async with aiohttp.ClientSession() as session, session.get(console.url + f"jobs/{job.job_id}") as answer:
        page = await answer.text()
    assert f">{job.create_time.astimezone(UTC).strftime(TIME_FORMAT)} UTC</time>" in page


async def test_a_job_page_shows_its_inline_outputs_first_values_and_names_what_fetches_a_stored_result(
    config: Config, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    """Outputs kept in the record: name, datatype, shape and the first values (at most 8 of each);
    a result stored apart (past inline_result_max_bytes) is named with `asyncinfer get`, not read."""
    stack = await start_stack(config.replace(scheduler={"inline_result_max_bytes": 64}))
    console = await start_console(stack)
    async with AsyncClient(stack.address) as client:
        small = await client.wait(await client.submit("demo", X), timeout_s=30)
        rows = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}  # 12 values: 48 bytes, still inline
        longer = await client.wait(await client.submit("demo", rows), timeout_s=30)
        big = {"x": np.ones((8, 4), np.float32)}  # 128 bytes of outputs: stored apart
        stored = await client.wait(await client.submit("demo", big), timeout_s=30)
    assert small.outputs
    assert longer.outputs
    assert stored.result_ref is not None
    assert not stored.outputs

    await browser.goto(console.url + f"jobs/{small.job_id}")
    cells = await browser.evaluate("[...document.querySelectorAll('#outputs td')].map(c => c.innerText)")
    assert cells == ["y", "FP32", "[1, 4]", "[3, 5, 7, 9]"]  # the demo model's 2x + 1
    assert "asyncinfer get" not in await browser.text("#job")  # all of it is on the page

    await browser.goto(console.url + f"jobs/{longer.job_id}")
    cells = await browser.evaluate("[...document.querySelectorAll('#outputs td')].map(c => c.innerText)")
    assert cells == ["y", "FP32", "[3, 4]", "[1, 3, 5, 7, 9, 11, 13, 15, … 4 more]"]
    assert f"asyncinfer get {longer.job_id} (ReadResult) prints every value" in await browser.text("#job")

    await browser.goto(console.url + f"jobs/{stored.job_id}")
    said = await browser.text("#outputs")
    assert "Too large to keep in the record: stored apart" in said
    assert f"asyncinfer get {stored.job_id} (ReadResult) fetches them" in said
    assert str(stored.result_ref.size_bytes) in said
    await browser.screenshot(ARTIFACTS / "job-outputs.png")


def test_a_job_pages_outputs_are_escaped() -> None:
    """Output names and BYTES values come from a model: markup in them is shown, never run."""
    job = Job(
        job_id="j1",
        model_name="m",
        model_version="1",
        state=JobState.SUCCEEDED,
        priority=Priority.NORMAL,
        attempt=1,
        max_attempts=1,
        revision=3,
        outputs={
            "<b>y</b>": np.array([b"<script>alert(1)</script>", b"x" * 100], dtype=object),
            "n": np.array([1, 2], np.int64),
        },
    )
    page = pages_jobs.job_details(job, now=0.0)
    assert "<script>" not in page
    assert "<b>y</b>" not in page
    assert "&lt;b&gt;y&lt;/b&gt;" in page
    assert "b&#x27;&lt;script&gt;alert(1)&lt;/script&gt;&#x27;" in page
    assert "b&#x27;" + "x" * 40 + "&#x27;…" in page  # a long element is cut
    assert "<td>BYTES</td>" in page
    assert "<td>INT64</td>" in page


@pytest.mark.unit
def test_a_job_page_says_why_its_model_version_does_not_serve() -> None:
    """A job waiting MODEL_LOAD_FAILED: the page shows ListModels' reason beside it (the record has no
    field for it), escaped: an exception's text comes from a model's loader."""
    job = Job(
        job_id="j1",
        model_name="broken",
        model_version="",
        state=JobState.QUEUED,
        priority=Priority.NORMAL,
        attempt=0,
        max_attempts=3,
        revision=1,
        queue=QueuePosition(position=0, estimated_start_time=None, waiting_reason=WaitingReason.MODEL_LOAD_FAILED),
    )
    page = pages_jobs.job_details(job, now=0.0, why_waiting="batcher b1 could not load it: no <module>")
    assert "MODEL_LOAD_FAILED (" in page
    assert "batcher b1 could not load it: no &lt;module&gt;" in page
    assert "<module>" not in page


async def test_a_live_page_says_when_it_stopped_updating_and_keeps_a_selection(
    config: Config,
    start_stack: StartStack,
    start_console: StartConsole,
    browser: Browser,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper's console pass, session 24: with the gateway gone, the jobs page kept its rows and said
    nothing; every refresh swapped the list in again, so a job ID being selected was lost."""
    monkeypatch.setattr(pages_jobs, "JOBS_REFRESH_MS", 1000)  # the test waits for several refreshes
    stack = await start_stack(config.replace(gateway={"port": free_port()}), batcher=False)
    console = await start_console(stack)
    async with AsyncClient(stack.address) as client:
        first = await client.submit("demo", X)
        await browser.goto(console.url + "jobs")
        await browser.wait_for_text(first.job_id, "#jobs-live")

        # A selection in the list holds it still; let go, and the new job comes in.
        select = (
            "(() => { const cell = [...document.querySelectorAll('#jobs-live a')]"
            f".find(a => a.innerText.includes('{first.job_id}')); const range = document.createRange();"
            " range.selectNodeContents(cell); getSelection().removeAllRanges(); getSelection().addRange(range);"
            " return getSelection().toString(); })()"
        )
        assert first.job_id in await browser.evaluate(select)
        second = await client.submit("demo", X)
        stamp = await browser.evaluate("document.querySelector('#jobs-live').dataset.refreshed || '0'")
        await browser.wait_for(
            f"(document.querySelector('#jobs-live').dataset.refreshed || '0') !== '{stamp}'", what="a refresh"
        )
        assert second.job_id not in await browser.text("#jobs-live")
        assert first.job_id in await browser.evaluate("getSelection().toString()")
        await browser.evaluate("getSelection().removeAllRanges()")
        await browser.wait_for_text(second.job_id, "#jobs-live")

    # The gateway goes: the rows stay, under a banner that names what does not answer.
    await stack.gateway.stop(0)
    banner = "(document.querySelector('[data-stale]') || {hidden: true})"
    await browser.wait_for(f"!{banner}.hidden", what="the stale banner")
    said = await browser.evaluate(f"{banner}.innerText")
    assert re.match(r"Not updated since \d\d:\d\d:\d\d: ", said), said  # local, as every time on the pages
    assert said.split(": ", 1)[1].startswith(f"UNAVAILABLE: the gateway ({stack.address}) does not answer"), said
    assert second.job_id in await browser.text("#jobs-live")
    await browser.screenshot(ARTIFACTS / "jobs-gateway-gone.png")
    stack.gateway = GatewayApp(stack.config)
    await stack.gateway.start()
    await browser.wait_for(f"{banner}.hidden", what="the banner gone once the gateway is back")


async def test_pages_fit_a_phone_and_a_long_label_wraps(
    stack: Stack, start_console: StartConsole, browser: Browser
) -> None:
    """A helper's console pass, session 24: one 256-byte label made the jobs table 4,317 px wide, and
    at 390 px the navigation and the tables ran off the screen (the page scrolled sideways)."""
    console = await start_console(stack)
    async with AsyncClient(stack.address) as client:
        await client.submit("demo", X, labels={"note": "x" * 256})
    await browser.send("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=1, mobile=True)
    for path in ("jobs", "queues", "batches", "dead-letters", "models"):
        await browser.goto(console.url + path)
        width = await browser.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, (path, width)
    await browser.goto(console.url + "jobs")
    await browser.screenshot(ARTIFACTS / "jobs-390.png")
    await browser.send("Emulation.clearDeviceMetricsOverride")


async def test_a_job_page_follows_the_job_live_and_the_queue_is_resumed_from_the_console(
    stack: Stack, start_console: StartConsole, browser: Browser
) -> None:
    console = await start_console(stack)  # no API keys, on loopback: it may act
    assert console.writable
    await browser.goto(console.url + "queues")
    await browser.wait_for_text("demo", "#queue-models")
    await browser.click_and_load("#queue-models form[action='/queues/pause'] button")
    await browser.wait_for_text("demo: paused", "#message")
    async with AsyncClient(stack.address) as client:
        job = await client.submit("demo", X)
        await browser.goto(console.url + f"jobs/{job.job_id}")
        await browser.wait_for_text("QUEUED", "#job")
        await browser.wait_for_text("PAUSED", "#job")  # its waiting reason
        await browser.screenshot(ARTIFACTS / "job-waiting.png")

        # Resumed in another tab (a plain form post), the open job page turns SUCCEEDED by itself.
        await resume_in_the_console(console, "demo")
        await browser.wait_for_text("SUCCEEDED", "#job", timeout_s=20)
        assert (await client.get(job)).state is JobState.SUCCEEDED
    assert "(live)" not in await browser.text("#job")
    await browser.screenshot(ARTIFACTS / "job-done.png")


async def resume_in_the_console(console: ConsoleApp, model: str) -> None:
    """What the queue page's resume button posts, with the page's own form token."""
    async with aiohttp.ClientSession() as session:
        async with session.get(console.url + "queues") as page:
            found = re.search(r'name="csrf" value="([^"]+)"', await page.text())
        assert found is not None
        form = {"csrf": found.group(1), "model": model}
        async with session.post(console.url + "queues/resume", data=form) as answer:
            assert answer.status == 200, await answer.text()
            assert f"{model}: dispatching" in await answer.text()


async def test_a_dead_letter_is_replayed_from_its_page(
    config: Config, tmp_path: Path, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    ops_key_file = tmp_path / "ops-key"
    ops_key_file.write_text(OPS_KEY + "\n")
    stack = await start_stack(keyed(config, tmp_path))
    console = await start_console(stack, tenant_key=TENANT_KEY, ops_key_file=str(ops_key_file))
    assert console.writable
    async with AsyncClient(stack.address, api_key=TENANT_KEY) as client:
        failed = await client.wait(await client.submit("flaky", FAILING_X), timeout_s=30)
    assert failed.state is JobState.FAILED

    await browser.goto(console.url + "dead-letters?model=flaky")
    await browser.wait_for_text(failed.job_id, "#dead-letters")
    link = "#dead-letters a[href^='/dead-letters/']"
    sequence = await browser.evaluate(f'document.querySelector("{link}").innerText')
    await browser.click_and_load(link)
    page = await browser.text()
    assert failed.job_id in page
    assert "MODEL_ERROR" in page
    assert '"model": "flaky"' in page  # the original request
    await browser.screenshot(ARTIFACTS / "dead-letter.png")

    await browser.click_and_load("form[action='/dead-letters/replay'] button")
    await browser.wait_for_text("replayed 1", "#message")
    await browser.screenshot(ARTIFACTS / "dead-letter-replayed.png")
    # The job ran again (flaky fails it again): a new dead letter of the same job, the old one gone.
    for _ in range(50):
        await browser.goto(console.url + "dead-letters?model=flaky")
        sequences = await browser.evaluate(
            "[...document.querySelectorAll('#dead-letters tbody tr')]"
            f".filter(r => r.innerText.includes('{failed.job_id}')).map(r => r.cells[0].innerText)"
        )
        if sequences and sequence not in sequences:
            break
        await browser.wait_for("new Promise(r => setTimeout(() => r(true), 200))")
    assert sequences
    assert sequence not in sequences
    async with AsyncClient(stack.address, api_key=TENANT_KEY) as client:
        again = await client.get(failed.job_id)
    assert again.attempt > failed.attempt

    # A console that holds the ops key but is read-only shows the letter without the buttons and
    # refuses a replay posted anyway.
    viewer = await start_console(stack, tenant_key=TENANT_KEY, ops_key=OPS_KEY, read_only=True)
    assert not viewer.writable
    await browser.goto(viewer.url + f"dead-letters/{sequences[0]}")
    await browser.wait_for_text("read-only: console.read_only is set")
    assert not await browser.evaluate("!!document.querySelector(\"form[action='/dead-letters/replay']\")")
    async with (
        aiohttp.ClientSession() as session,
        session.post(viewer.url + "dead-letters/replay", data={"sequence": sequences[0]}) as answer,
    ):
        assert answer.status == 403

    # A console whose tenant key does not reach the job names it without a link (its page would
    # say NOT_FOUND, as if the job were gone).
    ops_only = await start_console(stack, ops_key=OPS_KEY)
    await browser.goto(ops_only.url + "dead-letters?model=flaky")
    await browser.wait_for_text(failed.job_id, "#dead-letters")
    assert not await browser.evaluate(f"!!document.querySelector(\"#dead-letters a[href='/jobs/{failed.job_id}']\")")
    assert "(tenant acme: not this console's)" in await browser.text("#dead-letters")


async def test_a_dead_lettered_jobs_page_links_its_dead_letter(
    config: Config, tmp_path: Path, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    """A failed job's page said its error and nothing of its dead letter: to replay it, an operator
    had to find the letter in the model's list by eye. The page of a dead-lettered job (its error a
    give-up's) now links its letter and names the CLI command that replays it; a console that cannot
    read the letters (no ops key) names the model's dead letters and the CLI commands instead."""
    stack = await start_stack(keyed(config, tmp_path))
    console = await start_console(stack, tenant_key=TENANT_KEY, ops_key=OPS_KEY)
    async with AsyncClient(stack.address, api_key=TENANT_KEY) as client:
        failed = await client.wait(await client.submit("flaky", FAILING_X), timeout_s=30)
        succeeded = await client.wait(await client.submit("flaky", X), timeout_s=30)
    assert failed.state is JobState.FAILED
    assert succeeded.state is JobState.SUCCEEDED

    await browser.goto(console.url + f"jobs/{failed.job_id}")
    await browser.wait_for_text("dead letter", "#job")
    sequence = await browser.evaluate("document.querySelector('#job a#dead-letter').innerText")
    assert sequence.isdigit()
    row = "[...document.querySelectorAll('#job tr')].find(r => r.cells[0].innerText === 'dead letter')"
    said = await browser.evaluate(f"{row}.cells[1].innerText")
    assert said == f"{sequence} (MAX_ATTEMPTS: attempts spent) retry job or asyncinfer dlq replay {sequence}"
    await browser.screenshot(ARTIFACTS / "job-dead-letter.png")
    await browser.click_and_load("#job a#dead-letter")
    assert failed.job_id in await browser.text()
    assert await browser.evaluate("!!document.querySelector(\"form[action='/dead-letters/replay']\")")

    # A job that was not dead-lettered says nothing of one.
    await browser.goto(console.url + f"jobs/{succeeded.job_id}")
    await browser.wait_for_text("SUCCEEDED", "#job")
    assert not await browser.evaluate(f"!!{row}")

    # Without the ops key the scheduler does not answer: the model's letters, and the CLI's way.
    tenant_only = await start_console(stack, tenant_key=TENANT_KEY)
    await browser.goto(tenant_only.url + f"jobs/{failed.job_id}")
    await browser.wait_for_text("dead letter", "#job")
    assert await browser.evaluate("document.querySelector('#job a#dead-letters').getAttribute('href')") == (
        "/dead-letters?model=flaky"
    )
    # Its record names the letter (Job.dead_letter_sequence): the commands take it as they are.
    assert await browser.evaluate(f"{row}.cells[1].innerText") == (
        f"MAX_ATTEMPTS: attempts spent; among flaky's dead letters: asyncinfer dlq show {sequence} shows it, "
        f"asyncinfer dlq replay {sequence} runs it again"
    )


async def test_a_dead_lettered_jobs_page_links_its_own_letter_past_the_letters_it_would_search(
    config: Config,
    tmp_path: Path,
    nc: NatsClient,
    start_stack: StartStack,
    start_console: StartConsole,
    browser: Browser,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead-lettered job's page found its letter by reading its model's first 2,000 letters for
    the job: a job whose letter lay past them (a model with more letters) named only the listing.
    The scheduler now writes the letter's sequence on the record that ends the job, and the page
    links that letter, however many came before it. Here the console reads one letter of the
    model's (as if thousands came first), and a second job failed with the first's error text:
    each page links its own letter. A record written before (no sequence on it) is still searched."""
    stack = await start_stack(keyed(config, tmp_path))
    console = await start_console(stack, tenant_key=TENANT_KEY, ops_key=OPS_KEY)
    async with AsyncClient(stack.address, api_key=TENANT_KEY) as client:
        first = await client.wait(await client.submit("flaky", FAILING_X), timeout_s=30)
        second = await client.wait(await client.submit("flaky", FAILING_X), timeout_s=30)
    assert (first.state, second.state) == (JobState.FAILED, JobState.FAILED)
    assert first.error is not None
    assert second.error is not None
    assert first.error.message == second.error.message  # one error text for both
    assert 0 < first.dead_letter_sequence < second.dead_letter_sequence  # the SDK's Job names each letter
    monkeypatch.setattr(pages_jobs, "DEAD_LETTER_PAGES_READ", 1)
    monkeypatch.setattr(pages_jobs, "DEAD_LETTER_PAGE_SIZE", 1)

    async def linked(job_id: str) -> str:
        await browser.goto(console.url + f"jobs/{job_id}")
        await browser.wait_for_text("dead letter", "#job")
        return str(await browser.evaluate("document.querySelector('#job a#dead-letter')?.innerText ?? ''"))

    assert await linked(second.job_id) == str(second.dead_letter_sequence)
    assert await linked(first.job_id) == str(first.dead_letter_sequence)
    await browser.click_and_load("#job a#dead-letter")
    assert first.job_id in await browser.text()

    # The second job's record as a scheduler of the release before wrote it: no sequence on it. Its
    # page searches the model's letters for the job, as before (with the pages it reads as shipped).
    kv = await nc.jetstream().key_value(config.nats.jobs_bucket)
    entry = await kv.get(job_key("acme", second.job_id))
    assert entry.value is not None
    written_before = json.loads(entry.value)
    assert written_before.pop("dead_letter_sequence") == second.dead_letter_sequence
    await kv.update(entry.key, json.dumps(written_before).encode(), last=entry.revision)
    async with AsyncClient(stack.address, api_key=TENANT_KEY) as client:
        assert (await client.get(second.job_id)).dead_letter_sequence == 0
    monkeypatch.setattr(pages_jobs, "DEAD_LETTER_PAGES_READ", 4)
    monkeypatch.setattr(pages_jobs, "DEAD_LETTER_PAGE_SIZE", 500)
    assert await linked(second.job_id) == str(second.dead_letter_sequence)


async def test_a_dead_lettered_job_is_retried_from_its_own_page(
    config: Config, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    """A failed job's page linked its dead letter but offered no retry (Flower, Temporal's UI and
    SageMaker's each have one on a failed item): the operator went to the letter's page to replay
    it. Now a console that may act has a "retry job" button beside the letter's link, which replays
    that letter: the page comes back saying so with the job QUEUED again (its queue paused here,
    so that it stays there to be seen), and once the model is fixed and the queue resumed the open
    page follows it to SUCCEEDED. A read-only console shows no button (and refuses the form posted
    anyway); a form posted again once the letter is gone comes back with the scheduler's refusal."""
    recovering_model.MAY_SUCCEED.clear()
    stack = await start_stack(config.replace(models=[DEMO_MODEL, RECOVERING_MODEL]))
    console = await start_console(stack)  # loopback, no API keys: it may act
    viewer = await start_console(stack, read_only=True)
    assert console.writable
    assert not viewer.writable
    async with AsyncClient(stack.address) as client:
        failed = await client.wait(await client.submit("recovering", X), timeout_s=30)
        other = await client.wait(await client.submit("recovering", X), timeout_s=30)
    assert failed.state is JobState.FAILED
    assert other.state is JobState.FAILED
    row = "[...document.querySelectorAll('#job tr')].find(r => r.cells[0].innerText === 'dead letter')"
    retry = "#job form[action$='/retry']"

    await browser.goto(viewer.url + f"jobs/{failed.job_id}")
    await browser.wait_for_text("dead letter", "#job")
    sequence = await browser.evaluate("document.querySelector('#job a#dead-letter').innerText")
    assert sequence.isdigit()
    assert not await browser.evaluate(f'!!document.querySelector("{retry}")')
    assert await browser.evaluate(f"{row}.cells[1].innerText") == (
        f"{sequence} (MAX_ATTEMPTS: attempts spent) — asyncinfer dlq replay {sequence} runs it again "
        "(read-only: console.read_only is set)"
    )
    form = {"sequence": sequence, "csrf": "whatever the page had"}
    async with aiohttp.ClientSession() as session:
        async with session.post(viewer.url + f"jobs/{failed.job_id}/retry", data=form) as answer:
            assert answer.status == 403
        await queue_action_in_the_console(session, console, "pause", "recovering")

    await browser.goto(console.url + f"jobs/{failed.job_id}")
    await browser.wait_for_text("retry job", "#job")
    assert await browser.evaluate(f"{row}.cells[1].innerText") == (
        f"{sequence} (MAX_ATTEMPTS: attempts spent) retry job or asyncinfer dlq replay {sequence}"
    )
    await browser.screenshot(ARTIFACTS / "job-retry.png")
    await browser.evaluate("window.confirm = () => true")  # the person says yes to the question
    await browser.click_and_load(f"{retry} button")
    await browser.wait_for_text(f"retried: dead letter {sequence} replayed, the job is queued again", "#message")
    await browser.wait_for_text("QUEUED", "#job")
    await browser.wait_for_text("PAUSED", "#job")  # its waiting reason
    assert not await browser.evaluate(f'!!document.querySelector("{retry}")')
    assert not await browser.evaluate(f"!!{row}")
    await browser.screenshot(ARTIFACTS / "job-retried.png")
    async with AsyncClient(stack.address) as client:
        assert (await client.get(failed.job_id)).state is JobState.QUEUED

        # The model fixed and the queue resumed, the open page follows the job to its end.
        recovering_model.MAY_SUCCEED.set()
        await resume_in_the_console(console, "recovering")
        await browser.wait_for_text("SUCCEEDED", "#job", timeout_s=20)
        done = await client.get(failed.job_id)
    assert done.state is JobState.SUCCEEDED
    assert done.attempt == failed.attempt + 1
    np.testing.assert_array_equal(done.outputs["y"], 2 * X["x"] + 1)

    # The same form again (another tab's, say): the letter is gone, and the page says the refusal.
    # A hand-made form that names another job's letter, or none, replays nothing.
    async with aiohttp.ClientSession() as session:
        token = await csrf_of(session, console)
        other_sequence = str(await first_dead_letter_of(session, console, other.job_id))
        said = {}
        for name, given in (("gone", sequence), ("another's", other_sequence), ("none", "")):
            form = {"sequence": given, "csrf": token}
            async with session.post(console.url + f"jobs/{failed.job_id}/retry", data=form) as answer:
                assert answer.status == 200
                assert answer.url.path == f"/jobs/{failed.job_id}"
                said[name] = re.search(r'id="message">([^<]*)<', await answer.text())
    assert said["gone"] is not None
    assert said["gone"].group(1) == (
        f"refused: NOT_FOUND DEAD_LETTER_NOT_FOUND: no dead letter with sequence {sequence}"
    )
    assert said["another's"] is not None
    assert said["another's"].group(1) == f"refused: dead letter {other_sequence} is not this job&#x27;s"
    assert said["none"] is not None
    assert said["none"].group(1) == "refused: the form names no dead letter (reload the page and try again)"
    async with AsyncClient(stack.address) as client:
        assert (await client.get(other.job_id)).state is JobState.FAILED  # its letter was not replayed


async def first_dead_letter_of(session: aiohttp.ClientSession, console: ConsoleApp, job_id: str) -> int:
    """The sequence of the job's dead letter, as its page links it."""
    async with session.get(console.url + f"jobs/{job_id}") as page:
        found = re.search(r'id="dead-letter" href="/dead-letters/(\d+)"', await page.text())
    assert found is not None
    return int(found.group(1))


async def csrf_of(session: aiohttp.ClientSession, console: ConsoleApp) -> str:
    """The console's form token, as its pages carry it."""
    async with session.get(console.url + "queues") as page:
        found = re.search(r'name="csrf" value="([^"]+)"', await page.text())
    assert found is not None
    return found.group(1)


async def queue_action_in_the_console(
    session: aiohttp.ClientSession, console: ConsoleApp, verb: str, model: str
) -> None:
    """What the queue page's pause or resume button posts."""
    form = {"csrf": await csrf_of(session, console), "model": model}
    async with session.post(console.url + f"queues/{verb}", data=form) as answer:
        assert answer.status == 200, await answer.text()
        assert f"{model}: {'paused' if verb == 'pause' else 'dispatching'}" in await answer.text()


async def test_the_queue_page_updates_after_jobs_are_submitted(
    config: Config, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    stack = await start_stack(config.replace(scheduler={"queue_stats_interval_s": 0.1}), batcher=False)
    console = await start_console(stack)
    await browser.goto(console.url + "queues")
    await browser.wait_for_text("demo", "#queue-models")
    depth = "document.querySelector('#queue-models tbody tr').cells[2].innerText"
    assert await browser.evaluate(depth) == "0"

    async with AsyncClient(stack.address) as client:
        jobs = [await client.submit("demo", X) for _ in range(5)]
        # No reload: the page's refresh brings the depth, and the depth plot draws it.
        await browser.wait_for(f"{depth} === '5'", what="5 queued on the queue page")
        await browser.wait_for(
            "[...document.querySelectorAll('svg[aria-label=\"queued jobs\"] polyline')]"
            ".some(p => p.dataset.series === 'demo' && p.getAttribute('points').split(' ').length > 1)",
            what="the demo series in the queue-depth plot",
        )
        await browser.screenshot(ARTIFACTS / "queues-waiting.png")

        await stack.start_batcher()
        await client.wait_jobs([job.job_id for job in jobs], timeout_s=30)
        await browser.wait_for(f"{depth} === '0'", what="the queue drained on the queue page")
    batchers = "document.querySelector('#queue-models tbody tr').cells[7].innerText"
    assert await browser.evaluate(batchers) == "1"
    # The batch-size plot: the five jobs ran in batches whose sizes times counts make five.
    bars = "[...document.querySelectorAll('svg[aria-label=\"demo: batch sizes, last minute\"] rect.bar')]"
    await browser.wait_for(
        f"{bars}.reduce((n, b) => n + Number(b.dataset.bar) * Number(b.dataset.value), 0) === 5",
        what="the five jobs in the batch-size plot",
    )
    await browser.screenshot(ARTIFACTS / "queues-drained.png")


def test_up_prints_the_console_url_and_serves_the_models(tmp_path: Path) -> None:
    import asyncio

    up, _config_path, _ports = start_on_free_ports(tmp_path)
    try:
        found = re.search(r"web console\s+(http://127\.0\.0\.1:\d+/)", up.banner)
        assert found is not None, up.banner

        async def look() -> str:
            async with Browser.launch(tmp_path / "chromium") as browser:
                await browser.goto(found.group(1) + "models")
                await browser.wait_for_text("flaky", "#models")
                await browser.screenshot(ARTIFACTS / "up-models.png")
                return await browser.text("#models")

        models = asyncio.run(look())
        assert "demo" in models
        assert "x FP32 [-1, 4]" in models
        assert "versions" in models  # every version beside the default
    finally:
        close(up)


@pytest.mark.unit
def test_a_trace_id_links_only_as_32_hex_digits_into_an_escaped_href() -> None:
    template = 'https://tempo.example/explore?left={"query":"{trace_id}"}&x=<b>'
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    link = ui.trace(trace_id, template)
    assert link == (
        '<a class="trace" href="https://tempo.example/explore?left={&quot;query&quot;:&quot;'
        f'{trace_id}&quot;}}&amp;x=&lt;b&gt;" target="_blank" rel="noopener noreferrer">{trace_id}</a>'
    )
    assert ui.trace(trace_id, "") == trace_id  # no template: text
    assert ui.trace("", template) == "-"  # tracing off
    # Not a trace ID (a gateway of another make): shown as text, never put in a link.
    assert ui.trace('"><script>x</script>', template) == "&quot;&gt;&lt;script&gt;x&lt;/script&gt;"
    assert ui.trace(trace_id + "\n", template) == trace_id + "\n"
    # A list's short form: the same link, the ID also in an escaped title; text in a span without one.
    short = ui.trace(trace_id, template, short=True)
    assert short == link.replace('class="trace"', f'class="trace short" title="{trace_id}"')
    assert ui.trace(trace_id, "", short=True) == f'<span class="trace short" title="{trace_id}">{trace_id}</span>'
    assert ui.trace("", template, short=True) == "-"
    hostile = '"><script>x</script>'
    escaped = "&quot;&gt;&lt;script&gt;x&lt;/script&gt;"
    assert ui.trace(hostile, template, short=True) == f'<span class="trace short" title="{escaped}">{escaped}</span>'


@pytest.mark.unit
@pytest.mark.parametrize(
    ("trace_url", "said"),
    [
        ("http://jaeger:16686/trace/", "has no {trace_id}, where the trace ID goes"),
        ("javascript:alert('{trace_id}')", "is not an http:// or https:// URL with a host"),
        ("ftp://jaeger/{trace_id}", "is not an http:// or https:// URL with a host"),
        ("//jaeger:16686/trace/{trace_id}", "is not an http:// or https:// URL with a host"),
        ("http:///trace/{trace_id}", "is not an http:// or https:// URL with a host"),
        ("http://jaeger:16686/trace/{trace_id} x", "has a space or a control character"),
    ],
)
def test_a_trace_url_without_trace_id_or_http_is_refused_at_start_up(tmp_path: Path, trace_url: str, said: str) -> None:
    path = tmp_path / "console.toml"
    path.write_text(f"[console]\ntrace_url = {json.dumps(trace_url)}\n")
    with pytest.raises(ConfigError, match=r"invalid configuration: console\.trace_url: ") as refused:
        load_config(path, environ={})
    assert said in str(refused.value)
    environ = {"ASYNCINFER_CONSOLE__TRACE_URL": trace_url}
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(environ=environ)
    for good in ("http://jaeger:16686/trace/{trace_id}", "HTTPS://grafana/explore?q={trace_id}&{trace_id}"):
        assert load_config(environ={"ASYNCINFER_CONSOLE__TRACE_URL": good}).console.trace_url == good
