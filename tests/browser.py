"""A real headless browser for tests: Debian's chromium, driven over the Chrome DevTools Protocol
on its websocket (aiohttp's client), no selenium, no playwright.

    async with Browser.launch(tmp_path) as browser:
        await browser.goto("http://127.0.0.1:8070/jobs")
        await browser.wait_for_text("SUCCEEDED")
        await browser.screenshot(artifacts / "jobs.png")

chromium starts with `--remote-debugging-port=0` and writes the port it took to DevToolsActivePort
in its profile folder; one page target is opened and every command goes to it. Missing chromium
fails the test with the line that installs it (`make test` installs it, as root).

Tests of one file share one chromium (`Chromium`, a module-scoped fixture: its start took 1-4 s on a
busy machine, once per test): `Browser.open(chromium)` gives each test a page of its own in a browser
context of its own (cookies, storage and cache apart, as in a fresh profile), disposed of after."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

INSTALL = "chromium is missing: run 'sudo apt-get install -y chromium' (make test installs it when run as root)"
STARTED_WITHIN_S = 30.0
WINDOW = (1280, 900)  # a page's size, width and height


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail(INSTALL)


def _chromium_args(profile: Path) -> list[str]:
    return [
        chromium_binary(),
        "--headless=new",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-gpu",
        "--disable-extensions",
        "--disable-background-networking",
        "--no-sandbox",  # tests run as root in a container, where chromium's sandbox cannot start
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "about:blank",
    ]


class Chromium:
    """One headless chromium process, for the tests of a file to share (`Browser.open`); started
    and stopped synchronously, so a fixture of any scope holds it whatever each test's event loop."""

    def __init__(self, profile: Path) -> None:
        self._profile = profile
        self._process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> None:
        self._profile.mkdir(parents=True, exist_ok=True)
        self._process = subprocess.Popen(
            _chromium_args(self._profile), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + STARTED_WITHIN_S
        while (port := _devtools_port(self._profile / "DevToolsActivePort")) is None:
            if self._process.poll() is not None:
                raise AssertionError(f"chromium exited at start with {self._process.returncode}")
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.01)
        self.port = port

    def stop(self) -> None:
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class Browser:
    def __init__(self, process: asyncio.subprocess.Process | None, session: aiohttp.ClientSession) -> None:
        self._process = process
        self._session = session
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self.console_messages: list[str] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(cls, profile: Path) -> AsyncIterator[Browser]:
        await asyncio.to_thread(profile.mkdir, parents=True, exist_ok=True)
        process = await asyncio.create_subprocess_exec(
            *_chromium_args(profile), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        session = aiohttp.ClientSession()
        browser = cls(process, session)
        try:
            await browser._connect(profile / "DevToolsActivePort")
            yield browser
        finally:
            await browser._close()

    async def _connect(self, port_file: Path) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTED_WITHIN_S
        while (port := await asyncio.to_thread(_devtools_port, port_file)) is None:
            if self._process.returncode is not None:
                raise AssertionError(f"chromium exited at start with {self._process.returncode}")
            assert loop.time() < deadline, "chromium did not open its DevTools port"
            await asyncio.sleep(0.05)
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as answer:
            targets = await answer.json()
        page = next(t for t in targets if t["type"] == "page")
        await self._attach(page["webSocketDebuggerUrl"])
        await self.send("Page.enable")
        await self.send("Runtime.enable")

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, chromium: Chromium) -> AsyncIterator[Browser]:
        """A page of its own in a running chromium, in a new browser context (cookies, storage and
        cache apart from every other context's, as in a fresh profile), of the window's size; the
        context, its page with it, is disposed of at the end."""
        session = aiohttp.ClientSession()
        host = cls(None, session)  # the browser's own endpoint: contexts and targets
        page: Browser | None = None
        try:
            async with session.get(f"http://127.0.0.1:{chromium.port}/json/version") as answer:
                version = await answer.json()
            await host._attach(version["webSocketDebuggerUrl"])
            context = (await host.send("Target.createBrowserContext"))["browserContextId"]
            try:
                created = await host.send(
                    "Target.createTarget",
                    url="about:blank",
                    browserContextId=context,
                    width=WINDOW[0],
                    height=WINDOW[1],
                )
                page = cls(None, session)
                await page._attach(f"ws://127.0.0.1:{chromium.port}/devtools/page/{created['targetId']}")
                await page.send("Page.enable")
                await page.send("Runtime.enable")
                yield page
            finally:
                if page is not None:
                    await page._detach()
                await host.send("Target.disposeBrowserContext", browserContextId=context)
        finally:
            await host._detach()
            await session.close()

    async def _attach(self, url: str) -> None:
        self._ws = await self._session.ws_connect(url, max_msg_size=0)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                self.console_messages.append(" ".join(str(a.get("value", "")) for a in args))
            else:
                self._events.put_nowait(data)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("chromium closed its DevTools connection"))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        await self._ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        answer = await asyncio.wait_for(future, 30)
        if "error" in answer:
            raise AssertionError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def goto(self, url: str) -> None:
        """Navigates and waits for the page's load event."""
        while not self._events.empty():
            self._events.get_nowait()
        answer = await self.send("Page.navigate", url=url)
        assert "errorText" not in answer, f"{url}: {answer['errorText']}"
        await self._wait_event("Page.loadEventFired")

    async def _wait_event(self, method: str, timeout_s: float = 30.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout_s):
            while True:
                event = await self._events.get()
                if event.get("method") == method:
                    return event

    async def evaluate(self, expression: str) -> Any:
        answer = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in answer:
            raise AssertionError(f"{expression}: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    async def text(self, selector: str = "body") -> str:
        """What a person reads in the element (its innerText), '' when it is not there."""
        value = await self.evaluate(f"(document.querySelector({json.dumps(selector)}) || {{innerText: ''}}).innerText")
        return str(value)

    async def wait_for(self, expression: str, *, timeout_s: float = 15.0, what: str = "") -> Any:
        """Polls a JavaScript expression until it is truthy; its value."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what or expression}; the page says: {await self.text()}")
            await asyncio.sleep(0.1)

    async def wait_for_text(self, text: str, selector: str = "body", *, timeout_s: float = 15.0) -> None:
        probe = f"(document.querySelector({json.dumps(selector)}) || {{innerText: ''}}).innerText.includes({json.dumps(text)})"
        await self.wait_for(probe, timeout_s=timeout_s, what=f"{text!r} in {selector}")

    async def click(self, selector: str) -> None:
        """Clicks the element; when that navigates, waits for the new page's load event."""
        while not self._events.empty():
            self._events.get_nowait()
        found = await self.evaluate(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)}); if (!el) return false; el.click(); return true; }})()"
        )
        assert found, f"nothing on the page matches {selector}: {await self.text()}"

    async def click_and_load(self, selector: str) -> None:
        await self.click(selector)
        await self._wait_event("Page.loadEventFired")

    async def screenshot(self, path: Path) -> Path:
        answer = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        await asyncio.to_thread(_write, path, base64.b64decode(answer["data"]))
        return path

    async def _detach(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def _close(self) -> None:
        await self._detach()
        await self._session.close()
        assert self._process is not None, "a launched browser's"
        if self._process.returncode is None:
            self._process.terminate()
        try:
            await asyncio.wait_for(self._process.wait(), 10)
        except TimeoutError:
            self._process.kill()
            await self._process.wait()


def _devtools_port(port_file: Path) -> int | None:
    """The port chromium wrote (first line), once the file is whole (two lines)."""
    try:
        lines = port_file.read_text().splitlines()
    except FileNotFoundError:
        return None
    return int(lines[0]) if len(lines) >= 2 else None


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
