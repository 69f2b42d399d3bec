"""The SDK's retry policy: a call never answered gives up after its attempts; a stream that was
answering is reopened for `stream_resume_s` after it broke."""

from __future__ import annotations

import time

import pytest

from asyncinfer.client import NO_RETRY, RetryPolicy
from asyncinfer.client._retry import StreamBreaks

pytestmark = pytest.mark.unit


def test_a_call_never_answered_still_gives_up_after_its_attempts() -> None:
    policy = RetryPolicy()
    assert policy.allows_attempt(6, broken_at=None)
    assert not policy.allows_attempt(7, broken_at=None), "a wrong address is said within seconds"


def test_a_stream_that_was_answering_is_reopened_for_its_resume_time() -> None:
    policy = RetryPolicy()
    assert policy.allows_attempt(60, broken_at=time.monotonic() - 29.0)
    assert not policy.allows_attempt(60, broken_at=time.monotonic() - 31.0)
    assert not NO_RETRY.allows_attempt(1, broken_at=time.monotonic()), "NO_RETRY never resumes"


def test_the_resume_counts_from_the_first_failure_after_an_answer() -> None:
    breaks = StreamBreaks()
    assert breaks.broke() is None, "a stream never answered is a call that was never answered"
    breaks.answered()
    first = breaks.broke()
    assert first is not None
    assert breaks.broke() == first, "later failures of the same outage keep its start"
    breaks.answered()
    assert breaks.broken_at is None, "an answer ends the outage"
    again = breaks.broke()
    assert again is not None
    assert again >= first
