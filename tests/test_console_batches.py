"""The console's batch pages (issue 19) in a real headless chromium against a live stack: a batch
created a moment earlier on the batches page, its own page following it to COMPLETED with no
reload, its output file downloaded in input order, and a batch that cannot finish (no batcher)
cancelled from its page. Screenshots go to test-artifacts/console/."""

from __future__ import annotations

import io
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from asyncinfer.client import AsyncClient
from asyncinfer.config import Config
from tests.batch_helpers import batches_stub, create_request, demo_records, jsonl, npy_bytes, upload, wait_until
from tests.browser import Browser
from tests.stack import StartStack
from tests.test_console import ARTIFACTS, OPS_KEY, TENANT_KEY, StartConsole, keyed
from tests.test_console import browser as browser_fixture
from tests.test_console import chromium as chromium_fixture
from tests.test_console import start_console as start_console_fixture

pytestmark = pytest.mark.timeout(120)
RECORDS = 300
MISSING = "01a2325c-0000-7000-8000-000000000000"
# The console tests' fixtures, under the names the tests ask for.
browser = browser_fixture
chromium = chromium_fixture
start_console = start_console_fixture


def batch_config(config: Config) -> Config:
    return config.replace(batches={"chunk_records": 50, "drive_interval_s": 0.05})


async def test_a_batch_shows_on_the_batches_page_and_its_page_follows_it_to_completed(
    config: Config, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    # No batcher yet: the batch waits IN_PROGRESS until one starts, with the page open.
    stack = await start_stack(batch_config(config), batcher=False)
    console = await start_console(stack)
    stub = batches_stub(stack.channel)
    records = demo_records(RECORDS)
    request = create_request(await upload(stack.jobs, jsonl(records)), labels={"team": "search"})
    batch_id = (await stub.CreateBatch(request)).batch.batch_id
    await wait_until(stub, batch_id, lambda batch: batch.request_counts.total == RECORDS)

    await browser.goto(console.url + "batches")
    await browser.wait_for_text(batch_id, "#batches")
    row = await browser.evaluate(
        f"[...document.querySelectorAll('#batches tbody tr')].find(r => r.innerText.includes('{batch_id}'))"
        ".innerText.split('\\t')"
    )
    assert row[1] == "IN_PROGRESS"
    assert row[2] == "demo"
    assert row[3:6] == ["0", "0", str(RECORDS)]  # done, failed, total
    assert row[6].strip() == "0%"
    # Tracing off (the default): no column of dashes for trace IDs.
    assert "trace" not in await browser.evaluate("[...document.querySelectorAll('#batches th')].map(t => t.innerText)")
    await browser.screenshot(ARTIFACTS / "batches.png")

    await browser.click_and_load(f"#batches a[href='/batches/{batch_id}']")
    text = await browser.text("#batch")
    assert "IN_PROGRESS (live)" in text
    assert f"0 done, 0 failed of {RECORDS}" in text
    assert "team=search" in text
    assert "cancel batch" in text  # loopback, no API keys: the console may act
    assert not await browser.evaluate("!!document.querySelector('#download-output')")  # not before the end
    await browser.evaluate("window.stillTheSamePage = true")
    await browser.screenshot(ARTIFACTS / "batch-waiting.png")

    # A batcher comes: the open page counts up to the end by itself.
    await stack.start_batcher()
    await browser.wait_for_text("COMPLETED", "#batch", timeout_s=60)
    text = await browser.text("#batch")
    assert f"{RECORDS} done, 0 failed of {RECORDS}" in text
    assert "100%" in text
    assert "(live)" not in text
    assert "cancel batch" not in text
    assert await browser.evaluate("window.stillTheSamePage === true")  # no reload
    rate = await browser.evaluate(
        "[...document.querySelectorAll('#batch tr')].find(r => r.cells[0].innerText === 'records/s').cells[1].innerText"
    )
    assert float(rate) > 0
    await browser.screenshot(ARTIFACTS / "batch-completed.png")

    # The download link streams the output file: one line per record, in input order.
    href = await browser.evaluate("document.querySelector('#download-output').getAttribute('href')")
    async with aiohttp.ClientSession() as session, session.get(console.url + href.lstrip("/")) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Disposition"] == f'attachment; filename="batch-{batch_id}-output.jsonl"'
        assert answer.headers["Transfer-Encoding"] == "chunked"  # streamed as read, not held whole
        lines = [json.loads(line) for line in (await answer.text()).splitlines() if line]
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in records]
    assert lines[1]["outputs"]["y"] == [[3.0, 4.0, -1.0, 3.0]]  # the demo model's 2x + 1 of record r1
    assert not await browser.evaluate("!!document.querySelector('#download-npz')")  # a JSONL input: JSONL only

    # From the batch to its chunk jobs (the jobs list leaves them out unless asked for by the
    # batch's label, which no page offered), and from one of them back to the batch.
    await browser.click_and_load("#chunk-jobs")
    await browser.wait_for_text("SUCCEEDED", "#jobs")
    chunk_rows = await browser.evaluate("document.querySelectorAll('#jobs tbody tr').length")
    assert chunk_rows == RECORDS // 50  # chunk_records 50: a job per chunk
    await browser.click_and_load("#jobs tbody tr a[href^='/jobs/']")
    field = "[...document.querySelectorAll('#job tr')].find(r => r.cells[0].innerText === 'batch')"
    assert (await browser.evaluate(f"{field}.cells[1].innerText")).startswith(f"{batch_id}, records ")
    await browser.click_and_load(f"#job a[href='/batches/{batch_id}']")
    await browser.wait_for_text("COMPLETED", "#batch")

    # Back on the list, the batch shows completed.
    await browser.goto(console.url + "batches")
    row_text = f"[...document.querySelectorAll('#batches tbody tr')].find(r => r.innerText.includes('{batch_id}'))"
    assert "COMPLETED" in await browser.evaluate(f"{row_text}.innerText")
    assert "100%" in await browser.evaluate(f"{row_text}.innerText")


async def test_a_batch_that_cannot_finish_is_cancelled_from_its_page(
    config: Config, tmp_path: Path, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    # API keys: the console reads and cancels acme's batches with acme's key, and may act (ops key).
    stack = await start_stack(batch_config(keyed(config, tmp_path)), batcher=False)  # nothing runs its chunks
    console = await start_console(stack, tenant_key=TENANT_KEY, ops_key=OPS_KEY)
    assert console.writable
    async with AsyncClient(stack.address, api_key=TENANT_KEY) as client:
        batch_id = (await client.create_batch(jsonl(demo_records(RECORDS)), "demo")).batch_id
        other = (await client.create_batch(jsonl(demo_records(RECORDS)), "demo")).batch_id

    await browser.goto(console.url + "batches")
    await browser.wait_for_text(batch_id, "#batches")
    assert "Tenant acme's batches" in await browser.text()
    await browser.goto(console.url + f"batches/{batch_id}")
    await browser.wait_for_text("IN_PROGRESS", "#batch")
    await browser.wait_for_text("cancel batch", "#batch")
    await browser.evaluate("window.confirm = () => true")  # the person says yes to the question
    await browser.click_and_load("#batch form[action$='/cancel'] button")
    await browser.wait_for_text("cancelling: CANCELLING", "#message")
    await browser.wait_for_text("CANCELLED", "#batch", timeout_s=30)
    text = await browser.text("#batch")
    assert f"0 done, 0 failed, {RECORDS} not run of {RECORDS}" in text  # as OpenAI's counts: they never ran
    assert "cancel batch" not in text
    await browser.screenshot(ARTIFACTS / "batch-cancelled.png")

    # Its error file: every record, not run.
    href = await browser.evaluate("document.querySelector('#download-errors').getAttribute('href')")
    async with aiohttp.ClientSession() as session, session.get(console.url + href.lstrip("/")) as answer:
        assert answer.status == 200
        errors = [json.loads(line) for line in (await answer.text()).splitlines() if line]
    assert len(errors) == RECORDS
    assert {e["code"] for e in errors} == {"CANCELLED"}

    # A read-only console shows the other batch without the button and refuses a cancel posted anyway.
    viewer = await start_console(stack, tenant_key=TENANT_KEY, ops_key=OPS_KEY, read_only=True)
    await browser.goto(viewer.url + f"batches/{other}")
    await browser.wait_for_text("read-only", "#batch")
    assert "IN_PROGRESS" in await browser.text("#batch")
    assert not await browser.evaluate("!!document.querySelector(\"#batch form[action$='/cancel']\")")
    async with aiohttp.ClientSession() as session:
        async with session.post(viewer.url + f"batches/{other}/cancel", data={"csrf": "x"}) as answer:
            assert answer.status == 403
        # A batch that is not there is a page that says so.
        async with session.get(viewer.url + f"batches/{MISSING}") as answer:
            assert answer.status == 404
    await browser.goto(viewer.url + f"batches/{MISSING}")
    await browser.wait_for_text(f"no batch '{MISSING}'")


async def test_an_array_batch_offers_its_outputs_as_arrays(
    config: Config, start_stack: StartStack, start_console: StartConsole
) -> None:
    """An NPY batch's page links its outputs as NPZ as well, served as the gateway streams it."""
    stack = await start_stack(batch_config(config))
    console = await start_console(stack)
    x = np.arange(120 * 4, dtype=np.float32).reshape(120, 4)
    async with AsyncClient(stack.address) as client:
        batch = await client.wait_batch(await client.create_batch(npy_bytes(x), "demo"))
    assert batch.state == "COMPLETED"
    async with aiohttp.ClientSession() as session:
        async with session.get(console.url + f"batches/{batch.batch_id}") as answer:
            page = await answer.text()
        assert f'href="/batches/{batch.batch_id}/files/npz"' in page
        async with session.get(console.url + f"batches/{batch.batch_id}/files/npz") as answer:
            assert answer.status == 200
            disposition = f'attachment; filename="batch-{batch.batch_id}-output.npz"'
            assert answer.headers["Content-Disposition"] == disposition
            data = await answer.read()
    with np.load(io.BytesIO(data)) as archive:
        assert np.array_equal(archive["y"], 2 * x + 1)
        assert archive["succeeded"].all()


# A Grafana Explore link: quotes, ampersands and braces of its own, which the page must keep as written.
TRACE_URL = 'http://grafana.local:3000/explore?orgId=1&left={"datasource":"tempo","queries":[{"query":"{trace_id}"}]}'
TRACE_LINK = 'document.querySelector("#{page} tr a.trace")'


async def test_a_batchs_and_a_jobs_pages_link_their_trace_ids_to_console_trace_url(
    config: Config, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    """With tracing on, a batch's page shows its CreateBatch's trace ID and a job's page its own; with
    console.trace_url set each is a link into the trace viewer (a new tab, no opener, no referrer),
    the template's own quotes and ampersands intact; without it, the ID as text."""
    stack = await start_stack(batch_config(config.replace(tracing={"enabled": True})), batcher=False)
    linking = await start_console(stack, trace_url=TRACE_URL)
    plain = await start_console(stack)
    async with AsyncClient(stack.address) as client:
        batch = await client.create_batch(jsonl(demo_records(RECORDS)), "demo")
        job = await client.submit("demo", {"x": np.array([[1, 2, 3, 4]], np.float32)})
    assert len(batch.trace_id) == 32
    assert len(job.trace_id) == 32
    assert batch.trace_id != job.trace_id

    for page, path, trace_id in (
        ("batch", f"batches/{batch.batch_id}", batch.trace_id),
        ("job", f"jobs/{job.job_id}", job.trace_id),
    ):
        await browser.goto(linking.url + path)
        await browser.wait_for_text(trace_id, f"#{page}")
        link = TRACE_LINK.format(page=page)
        assert await browser.evaluate(f"{link}.getAttribute('href')") == TRACE_URL.replace("{trace_id}", trace_id)
        assert await browser.evaluate(f"{link}.innerText") == trace_id
        assert await browser.evaluate(f"{link}.target") == "_blank"
        assert await browser.evaluate(f"{link}.rel") == "noopener noreferrer"
        row = f"[...document.querySelectorAll('#{page} tr')].find(r => r.cells[0].innerText === 'trace ID')"
        assert await browser.evaluate(f"{row}.cells[1].innerText") == trace_id
        await browser.screenshot(ARTIFACTS / f"{page}-trace-link.png")

        await browser.goto(plain.url + path)
        await browser.wait_for_text(trace_id, f"#{page}")
        assert await browser.evaluate(f"{row}.cells[1].innerText") == trace_id
        assert not await browser.evaluate(f"!!{link}")


async def test_the_jobs_and_batches_lists_show_each_trace_id_linked_to_console_trace_url(
    config: Config, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    """The lists have a trace column once a row on the page is traced: the ID (its first digits
    shown, the whole of it in the text, to select and copy, and in its tooltip), a link into the
    trace viewer as on the job's and batch's pages where console.trace_url is set, text without
    it. A job that is not traced (submitted while tracing was off, or not sampled) reads "-"."""
    stack = await start_stack(batch_config(config.replace(tracing={"enabled": True})), batcher=False)
    linking = await start_console(stack, trace_url=TRACE_URL)
    plain = await start_console(stack)
    async with AsyncClient(stack.address) as client:
        batch = await client.create_batch(jsonl(demo_records(RECORDS)), "demo")
        job = await client.submit("demo", {"x": np.array([[1, 2, 3, 4]], np.float32)})
    assert len(batch.trace_id) == len(job.trace_id) == 32

    for table, path, row_id, trace_id in (
        ("jobs", "jobs", job.job_id, job.trace_id),
        ("batches", "batches", batch.batch_id, batch.trace_id),
    ):
        row = f"[...document.querySelectorAll('#{table} tbody tr')].find(r => r.innerText.includes('{row_id}'))"
        column = f"[...document.querySelectorAll('#{table} th')].findIndex(th => th.innerText === 'trace')"
        cell = f"{row}.cells[{column}]"
        await browser.goto(linking.url + path)
        await browser.wait_for_text(row_id, f"#{table}")
        assert await browser.evaluate(f"{column}") > 0
        link = f"{cell}.querySelector('a.trace')"
        assert await browser.evaluate(f"{link}.getAttribute('href')") == TRACE_URL.replace("{trace_id}", trace_id)
        assert await browser.evaluate(f"{link}.target") == "_blank"
        assert await browser.evaluate(f"{link}.rel") == "noopener noreferrer"
        assert await browser.evaluate(f"{link}.title") == trace_id
        assert await browser.evaluate(f"{link}.textContent") == trace_id
        # Cut to its first digits on screen: the column stays narrow.
        assert await browser.evaluate(f"{link}.getBoundingClientRect().width < {link}.scrollWidth")
        await browser.screenshot(ARTIFACTS / f"{table}-trace-column.png")

        await browser.goto(plain.url + path)
        await browser.wait_for_text(row_id, f"#{table}")
        assert await browser.evaluate(f"{cell}.textContent") == trace_id
        assert await browser.evaluate(f"{cell}.querySelector('.trace').title") == trace_id
        assert not await browser.evaluate(f"!!{link}")


async def test_a_trace_that_was_not_sampled_is_not_linked(
    config: Config, start_stack: StartStack, start_console: StartConsole, browser: Browser
) -> None:
    """With tracing.sample_ratio 0 every job and batch still has a trace ID (its traceparent, flags
    00), but no span of it is recorded or exported: the lists' trace column and the job's and
    batch's pages linked it into the trace viewer all the same, which showed nothing. The gateway
    now says whether it was sampled (Job/Batch.trace_sampled), and the console links only a sampled
    trace: this one is text, "not sampled" beside it on its page and in its tooltip in a list."""
    traced = config.replace(tracing={"enabled": True, "sample_ratio": 0.0})
    stack = await start_stack(batch_config(traced), batcher=False)
    linking = await start_console(stack, trace_url=TRACE_URL)
    async with AsyncClient(stack.address) as client:
        batch = await client.create_batch(jsonl(demo_records(RECORDS)), "demo")
        job = await client.submit("demo", {"x": np.array([[1, 2, 3, 4]], np.float32)})
    assert len(batch.trace_id) == len(job.trace_id) == 32
    assert (batch.trace_sampled, job.trace_sampled) == (False, False)

    for page, path, trace_id in (
        ("batch", f"batches/{batch.batch_id}", batch.trace_id),
        ("job", f"jobs/{job.job_id}", job.trace_id),
    ):
        await browser.goto(linking.url + path)
        await browser.wait_for_text(trace_id, f"#{page}")
        row = f"[...document.querySelectorAll('#{page} tr')].find(r => r.cells[0].innerText === 'trace ID')"
        assert await browser.evaluate(f"{row}.cells[1].innerText") == f"{trace_id} (not sampled)"
        assert not await browser.evaluate(f"!!{TRACE_LINK.format(page=page)}")

    for table, path, row_id, trace_id in (
        ("jobs", "jobs", job.job_id, job.trace_id),
        ("batches", "batches", batch.batch_id, batch.trace_id),
    ):
        row = f"[...document.querySelectorAll('#{table} tbody tr')].find(r => r.innerText.includes('{row_id}'))"
        column = f"[...document.querySelectorAll('#{table} th')].findIndex(th => th.innerText === 'trace')"
        cell = f"{row}.cells[{column}]"
        await browser.goto(linking.url + path)
        await browser.wait_for_text(row_id, f"#{table}")
        assert await browser.evaluate(f"{column}") > 0
        assert await browser.evaluate(f"{cell}.textContent") == trace_id
        assert not await browser.evaluate(f"!!{cell}.querySelector('a')")
        title = await browser.evaluate(f"{cell}.querySelector('.trace').title")
        assert title == f"{trace_id} (not sampled: no trace to show)"
