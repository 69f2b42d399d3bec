"""The blocking Client where users embed it (a helper's pass, session 25): a web app's threads
sharing one Client while one of them closes it, a Client dropped without close(), a process forked
after the SDK was used, Ctrl-C in a notebook's `run`."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncinfer.client import Client, DeadlineExceededError, JobState, RetryPolicy
from asyncinfer.config import Config
from asyncinfer.queued_notice import decode_queued_notice
from tests.stack import ThreadedStack

REPO = Path(__file__).resolve().parents[1]


def refused_address() -> str:
    """A loopback port nothing listens on: every attempt fails at once (UNAVAILABLE)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_closing_a_shared_client_answers_the_call_another_thread_is_in() -> None:
    """A Flask app's shutdown closing the Client its request threads share: a thread whose call
    was sleeping before a retry (the gateway unreachable) waited for ever, as nothing was left to
    run it once the loop stopped. It now raises RuntimeError at once."""
    retrying = threading.Event()
    retry = RetryPolicy(max_attempts=1000, initial_backoff_s=0.5, max_backoff_s=0.5, on_retry=lambda *_: retrying.set())
    client = Client(refused_address(), retry=retry)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client.models()
        except BaseException as error:
            outcome.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert retrying.wait(10)  # the call sleeps before its next attempt
    client.close()
    caller.join(5)
    assert not caller.is_alive(), "the call outlived its client's close()"
    assert len(outcome) == 1
    assert isinstance(outcome[0], RuntimeError), outcome
    assert "closed while this call ran" in str(outcome[0])
    with pytest.raises(RuntimeError, match="the client is closed"):
        client.models()
    with pytest.raises(RuntimeError, match="the client is closed"), client:  # at `with`, not at a call in it
        pass


def test_a_client_dropped_without_close_is_closed_with_a_resource_warning() -> None:
    """A web handler making a Client per request and never closing it: each kept a thread and
    3 descriptors for the life of the process (20 such: 20 threads, 58 descriptors)."""
    before = set(threading.enumerate())
    dropped: list[object] = [Client(refused_address())]
    dropped.append(dropped)  # a cycle: freed by the collector, inside the block below
    [thread] = [t for t in threading.enumerate() if t not in before and t.name == "asyncinfer-client"]
    del dropped
    with pytest.warns(ResourceWarning, match="never closed"):
        gc.collect()
    thread.join(5)
    assert not thread.is_alive(), "the dropped client's thread still runs"


FORK_AFTER_USE = textwrap.dedent(
    """
    import asyncio, os, sys
    from asyncinfer.client import AsyncClient, Client

    async def use_async_client():
        await AsyncClient(sys.argv[1]).models()

    Client(sys.argv[1]).close()  # a gunicorn --preload app checking its gateway at import
    pid = os.fork()
    if pid == 0:
        told = 0
        for make in (lambda: Client(sys.argv[1]).models(), lambda: asyncio.run(use_async_client())):
            try:
                make()
            except RuntimeError as error:
                told += "forked from one that had already made an asyncinfer client" in str(error)
            except Exception as error:
                print(type(error).__name__, error)
        os._exit(0 if told == 2 else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def test_a_client_made_in_a_child_forked_after_the_sdk_was_used_says_so() -> None:
    """A worker forked (gunicorn --preload, Celery prefork, multiprocessing on Linux) from a parent
    that had made a client, closed or not, making its own: its first call crashed the worker
    (SIGSEGV), or hung while the parent's client was open. Now RuntimeError, saying what to do."""
    child = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_USE, refused_address()],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-2000:])


@pytest.fixture
def threaded_stack(config: Config) -> Iterator[ThreadedStack]:
    """No batcher (jobs stay QUEUED), on its own loop: the test's thread is free to block, and to
    take a SIGINT."""
    with ThreadedStack(config, batcher=False) as running:
        yield running


class Interrupter:
    """SIGINT to this (the main) thread, as Ctrl-C or a notebook's interrupt would: once the gateway
    queues a job (`on_queued`: the held submit of a run is under way), or once this thread is in
    `Client.wait` (`in_wait`). `queued`: the keys of the jobs queued."""

    def __init__(self, stack: ThreadedStack) -> None:
        self._main = threading.get_ident()
        self._armed = threading.Event()
        self.queued: list[str] = []

        async def heard(msg: Any) -> None:
            self.queued.append(decode_queued_notice(msg.data)[0])
            if self._armed.is_set():
                self._armed.clear()
                signal.pthread_kill(self._main, signal.SIGINT)

        async def subscribe() -> None:
            await stack.stack.nc.subscribe("asyncinfer.queued.>", cb=heard)
            await stack.stack.nc.flush()

        stack.run(subscribe)

    def on_queued(self) -> None:
        self._armed.set()

    @contextlib.contextmanager
    def in_wait(self) -> Iterator[None]:
        done = threading.Event()

        def watch_the_main_thread() -> None:
            # No event says a blocking call has begun: look at the main thread's stack.
            while not done.is_set():
                if any(frame.f_code is Client.wait.__code__ for frame in _stack(sys._current_frames()[self._main])):
                    signal.pthread_kill(self._main, signal.SIGINT)
                    return
                done.wait(0.005)

        thread = threading.Thread(target=watch_the_main_thread, daemon=True)
        thread.start()
        try:
            yield
        finally:  # never a SIGINT after the block, whatever happened in it
            done.set()
            thread.join()


def _stack(frame: Any) -> Iterator[Any]:
    while frame is not None:
        yield frame
        frame = frame.f_back


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in this process, as in a terminal's or a notebook's: pytest-xdist
    runs its workers with SIGINT ignored (the test waited for ever for an interrupt that never came)."""
    was = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, was)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_in_a_blocking_run_or_wait_says_where_the_job_is(threaded_stack: ThreadedStack) -> None:
    """A notebook's `y = client.run(...)` interrupted: the job went on, and nothing said which it was
    (the gateway holds a run's submit until the job ends, so the interrupt mostly comes before any
    job ID is back). The KeyboardInterrupt now carries a note: the idempotency key that finds the
    job, or the job's ID."""
    x = np.ones((1, 4), np.float32)
    with Client(threaded_stack.stack.address) as client:
        interrupter = Interrupter(threaded_stack)
        interrupter.on_queued()
        with pytest.raises(KeyboardInterrupt) as interrupted:
            client.run("demo", {"x": x})
        [note] = interrupted.value.__notes__
        key = note.split("idempotency_key='")[1].split("'")[0]
        found = client.submit("demo", {"x": x}, idempotency_key=key)
        assert interrupter.queued == [f"default.{found.job_id}"], "the key finds the interrupted run's job alone"

        job = client.submit("demo", {"x": x})
        with interrupter.in_wait(), pytest.raises(KeyboardInterrupt) as interrupted:
            client.wait(job.job_id)
        [note] = interrupted.value.__notes__
        assert f"client.wait({job.job_id!r})" in note
        assert client.get(job).state is JobState.QUEUED  # it goes on, and the client still works

        # Its deadline names the job and the run's own time (it said the wait's: "within 0.25 s").
        with pytest.raises(
            DeadlineExceededError, match=r"the run of job \S+ \(it goes on\) did not complete within 1 s"
        ):
            client.run("demo", {"x": x}, timeout_s=1)
