"""The console's answers to hand-made requests (a helper's review, session 22): a foreign Host on
a loopback console (DNS rebinding), a token or a number that is not ASCII, numbers past what a
field holds, a page token or model that is wrong, an unknown state: each a page with a 4xx, never
a 500 or a 502 of the caller's own mistake. Plain HTTP against a real console and stack."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncinfer.client import AsyncClient
from asyncinfer.config import DEMO_MODEL, Config
from services.console.app import ConsoleApp
from tests.stack import StartStack
from tests.test_console import OPS_KEY, TENANT_KEY, X, keyed
from tests.test_console import start_console as start_console  # the fixture
from tests.test_progress import PROGRESS_MODEL

pytestmark = pytest.mark.timeout(120)


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
        assert response.headers["Location"].startswith("/dead-letters?model=demo&message=")

    # What is shown: a state in any case filters, the size in use is selected, a queued job's wait so far.
    status, page = await get(http, console, "/jobs?state=queued&page_size=30")
    assert status == 200
    assert queued.job_id in page
    assert "<option selected>30</option>" in page
    assert '<option value="QUEUED" selected>' in page
    status, page = await get(http, console, f"/jobs/{queued.job_id}")
    assert status == 200
    assert re.search(r"<td>queued for</td><td>[0-9.]+ (ms|s)<", page), page


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
    assert re.search(r"<td>progress</td><td>\d+% step \d+ of 1000<", page), page


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
