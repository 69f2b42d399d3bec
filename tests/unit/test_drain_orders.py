"""Drain orders to every scheduler (asyncinfer.drain_orders): whom an order addresses and expects
to answer, each scheduler's outcome (an unanswered one listed, not left out), and the codec."""

from __future__ import annotations

import pytest

from asyncinfer.drain_orders import (
    ANSWER_MARGIN_S,
    DrainAction,
    DrainAnswer,
    DrainOrder,
    SchedulerOutcome,
    decode_answer,
    decode_order,
    encode_answer,
    encode_order,
    expected,
    outcomes,
)

pytestmark = pytest.mark.unit


def test_an_order_to_every_scheduler_expects_each_named_one_that_reports() -> None:
    every = DrainOrder(action=DrainAction.DRAIN, timeout_s=5.0)
    assert every.addresses("a:50052")
    assert every.addresses("b:50052")
    # A nameless snapshot is a scheduler of a release without orders: nothing to wait for.
    assert expected(every, ["a:50052", "b:50052", ""]) == {"a:50052", "b:50052"}
    named = DrainOrder(action=DrainAction.DRAIN, scheduler="b:50052")
    assert named.addresses("b:50052")
    assert not named.addresses("a:50052")
    assert expected(named, ["a:50052", "b:50052"]) == {"b:50052"}


def test_the_sender_waits_the_drains_timeout_and_a_margin_an_undrain_the_margin() -> None:
    assert DrainOrder(action=DrainAction.DRAIN, timeout_s=5.0).answer_wait_s == 5.0 + ANSWER_MARGIN_S
    assert DrainOrder(action=DrainAction.UNDRAIN, timeout_s=5.0).answer_wait_s == ANSWER_MARGIN_S


def test_outcomes_list_every_expected_scheduler_and_any_other_that_answered_by_name() -> None:
    a = DrainAnswer(scheduler="a", in_flight=2)
    late = DrainAnswer(scheduler="c")  # started as the order went
    assert outcomes({"b", "a"}, {"a": a, "c": late}) == (
        SchedulerOutcome("a", a),
        SchedulerOutcome("b", None),
        SchedulerOutcome("c", late),
    )


def test_orders_and_answers_round_trip_and_a_foreign_payload_is_refused() -> None:
    order = DrainOrder(action=DrainAction.UNDRAIN, timeout_s=1.5, scheduler="a:50052")
    assert decode_order(encode_order(order)) == order
    assert b'"v":1' in encode_order(order)
    answer = DrainAnswer(scheduler="a:50052", in_flight=3, was_draining=True)
    assert decode_answer(encode_answer(answer)) == answer
    # A negative wait read from the wire waits nothing.
    assert decode_order(b'{"v":1,"action":"drain","timeout_s":-4}').timeout_s == 0.0
    for bad in (b"not json", b'{"v":1,"action":"explode"}', b'{"action":"drain"}'):
        with pytest.raises(ValueError):  # noqa: PT011 - the codec's one error type
            decode_order(bad)
    with pytest.raises(ValueError):  # noqa: PT011
        decode_answer(b'{"v":1}')
