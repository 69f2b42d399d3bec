"""The rule for when a dispatcher waits before its next pull (services.scheduler.dispatch_linger):
only in a streak of rounds that found jobs already waiting, only after a small round."""

from __future__ import annotations

import pytest

from services.scheduler.dispatch_linger import SMALL_ROUND, DispatchLinger

pytestmark = pytest.mark.unit

LINGER_S = 0.002


def test_a_streak_of_rounds_that_found_jobs_waiting_lingers_after_a_small_round() -> None:
    linger = DispatchLinger(LINGER_S)
    assert linger.after_round(3, found_waiting=True) == 0.0  # one such round is no stream yet
    assert linger.after_round(2, found_waiting=True) == LINGER_S
    assert linger.after_round(1, found_waiting=True) == LINGER_S


def test_a_round_of_jobs_it_waited_for_is_light_load_and_never_lingers() -> None:
    """A job that arrived while the round's pull waited (one at a time, a round trip): no wait,
    however many such rounds come in a row."""
    linger = DispatchLinger(LINGER_S)
    for _ in range(5):
        assert linger.after_round(1, found_waiting=False) == 0.0


@pytest.mark.parametrize("pulled", [0, SMALL_ROUND])
def test_an_empty_or_large_round_does_not_linger(pulled: int) -> None:
    linger = DispatchLinger(LINGER_S)
    linger.after_round(2, found_waiting=True)
    linger.after_round(2, found_waiting=True)
    assert linger.after_round(pulled, found_waiting=pulled > 0) == 0.0


def test_an_empty_round_or_one_it_waited_for_ends_the_streak() -> None:
    linger = DispatchLinger(LINGER_S)
    linger.after_round(2, found_waiting=True)
    assert linger.after_round(0, found_waiting=False) == 0.0
    assert linger.after_round(2, found_waiting=True) == 0.0  # a new streak starts
    assert linger.after_round(1, found_waiting=False) == 0.0
    assert linger.after_round(2, found_waiting=True) == 0.0
    assert linger.after_round(2, found_waiting=True) == LINGER_S


def test_zero_turns_it_off() -> None:
    linger = DispatchLinger(0.0)
    assert [linger.after_round(1, found_waiting=True) for _ in range(4)] == [0.0] * 4
