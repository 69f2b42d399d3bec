"""The blocking Client where users embed it (a helper's pass, session 25): a web app's threads
sharing one Client while one of them closes it, a Client dropped without close(), a process forked
after the SDK was used, Ctrl-C in a notebook's `run`."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from asyncinfer.client import Client, RetryPolicy

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
