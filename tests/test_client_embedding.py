"""The blocking Client where users embed it (a helper's pass, session 25): a web app's threads
sharing one Client while one of them closes it, a Client dropped without close(), a process forked
after the SDK was used, Ctrl-C in a notebook's `run`."""

from __future__ import annotations

import gc
import socket
import threading

import pytest

from asyncinfer.client import Client, RetryPolicy


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
