"""Drain and undrain orders for every scheduler, whichever one an operator reached.

Behind the Kubernetes Service (2 scheduler replicas) a Drain reaches the scheduler the Service
picks. With `all` or `scheduler` that scheduler sends the order on `DRAIN_SUBJECT` (core NATS,
request-reply; every scheduler subscribes), each scheduler it addresses carries it out and answers
to the reply inbox, and the one reached answers the call with each one's result, as Celery's
`control` broadcasts with a destination and gathers the replies for a bounded time. An order is
not kept: a scheduler that starts later, or restarts, dispatches (a drain lasts until Undrain or a
restart, as a single-target Drain's).

Who is expected to answer: the schedulers that report a model (their queue snapshots fresh, as
GetQueueStats' `schedulers` counts them), the one reached included. One that does not answer
within the drain's timeout and ANSWER_MARGIN_S (gone, cut off from NATS, or of a release that does
not subscribe) is listed as unanswered, not left out.

This module is the pure part: the orders and answers, their codec, and which schedulers an order
expects; services/scheduler/cluster_drains.py sends and answers them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum

import msgspec

# After a scheduler's drain wait ends: the time for its answer to come back (an undrain's is this
# alone). A scheduler that has not answered by then is reported as not answering.
ANSWER_MARGIN_S = 2.0

DRAIN_ORDER_VERSION = 1
DRAIN_ANSWER_VERSION = 1


class DrainAction(StrEnum):
    DRAIN = "drain"
    UNDRAIN = "undrain"


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainOrder:
    action: DrainAction
    timeout_s: float = 0.0  # a drain's wait for its jobs in flight
    scheduler: str = ""  # the one scheduler addressed (its instance name); "": every one

    def addresses(self, name: str) -> bool:
        return not self.scheduler or self.scheduler == name

    @property
    def answer_wait_s(self) -> float:
        """How long the sender waits for the answers."""
        wait_s = self.timeout_s if self.action is DrainAction.DRAIN else 0.0
        return wait_s + ANSWER_MARGIN_S


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainAnswer:
    scheduler: str  # the answering one's instance name
    in_flight: int = 0  # a drain's jobs still in flight as its wait ended
    was_draining: bool = False  # before the order


@dataclass(frozen=True, slots=True)
class SchedulerOutcome:
    scheduler: str
    answer: DrainAnswer | None  # None: no answer in time


def expected(order: DrainOrder, reporting: Collection[str]) -> frozenset[str]:
    """The schedulers expected to answer `order`, of those `reporting` (fresh snapshots)."""
    if order.scheduler:
        return frozenset((order.scheduler,))
    return frozenset(name for name in reporting if name)  # a nameless one is of a release without orders


def outcomes(expected_names: Collection[str], answers: Mapping[str, DrainAnswer]) -> tuple[SchedulerOutcome, ...]:
    """Each scheduler expected, with its answer or none, and any other that answered (one that
    started as the order went), by name."""
    names = sorted({*expected_names, *answers})
    return tuple(SchedulerOutcome(name, answers.get(name)) for name in names)


# --- codec ----------------------------------------------------------------------------------------
# Never stored; each form carries `v` so that a later release can change it while schedulers of two
# releases run side by side (a rolling update).


class DrainOrderWire(msgspec.Struct, kw_only=True):
    v: int
    action: str
    timeout_s: float = 0.0
    scheduler: str = ""


class DrainAnswerWire(msgspec.Struct, kw_only=True):
    v: int
    scheduler: str
    in_flight: int = 0
    was_draining: bool = False


_encoder = msgspec.json.Encoder()
_order_decoder = msgspec.json.Decoder(DrainOrderWire)
_answer_decoder = msgspec.json.Decoder(DrainAnswerWire)


def encode_order(order: DrainOrder) -> bytes:
    return _encoder.encode(
        DrainOrderWire(
            v=DRAIN_ORDER_VERSION, action=order.action.value, timeout_s=order.timeout_s, scheduler=order.scheduler
        )
    )


def decode_order(data: bytes) -> DrainOrder:
    """ValueError: not an order this release reads."""
    try:
        wire = _order_decoder.decode(data)
        return DrainOrder(action=DrainAction(wire.action), timeout_s=max(wire.timeout_s, 0.0), scheduler=wire.scheduler)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a drain order: {exc}") from exc


def encode_answer(answer: DrainAnswer) -> bytes:
    return _encoder.encode(
        DrainAnswerWire(
            v=DRAIN_ANSWER_VERSION,
            scheduler=answer.scheduler,
            in_flight=answer.in_flight,
            was_draining=answer.was_draining,
        )
    )


def decode_answer(data: bytes) -> DrainAnswer:
    """ValueError: not an answer this release reads."""
    try:
        wire = _answer_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a drain answer: {exc}") from exc
    return DrainAnswer(scheduler=wire.scheduler, in_flight=wire.in_flight, was_draining=wire.was_draining)
