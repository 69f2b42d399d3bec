"""The blocking Client where users embed it (a helper's pass, session 25): a web app's threads
sharing one Client while one of them closes it, a Client dropped without close(), a process forked
after the SDK was used, Ctrl-C in a notebook's `run`."""

from __future__ import annotations

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
