"""A batcher session's outbound queue (services.scheduler.outbound): in order, except that a work
order overtakes the lower-priority work orders queued before it; cancels, controls and the
stream's end keep their place."""

from __future__ import annotations

import asyncio

import pytest

from asyncinfer.jobs import Priority
from services.scheduler.messages import CancelOrder, ModelControlOrder, WorkOrder
from services.scheduler.outbound import Outbound, OutboundQueue

pytestmark = pytest.mark.unit


def order(job_id: str, priority: Priority = Priority.NORMAL) -> WorkOrder:
    return WorkOrder(job_id=job_id, attempt=1, model_name="demo", model_version="1", priority=priority, tenant="t")


def drain(queue: OutboundQueue) -> list[str]:
    taken: list[Outbound] = []
    while not queue.empty():
        taken.append(queue.get_nowait())
    names = []
    for message in taken:
        if isinstance(message, WorkOrder):
            names.append(message.job_id)
        elif isinstance(message, CancelOrder):
            names.append(f"cancel {message.job_id}")
        elif isinstance(message, ModelControlOrder):
            names.append(f"control {message.request_id}")
        else:
            names.append("end")
    return names


def fill(queue: OutboundQueue, *messages: Outbound) -> OutboundQueue:
    for message in messages:
        queue.put_nowait(message)
    return queue


def test_orders_of_one_priority_keep_their_order() -> None:
    queue = fill(OutboundQueue(), *(order(f"job-{i}") for i in range(5)))
    assert queue.qsize() == 5
    assert drain(queue) == [f"job-{i}" for i in range(5)]


def test_an_order_overtakes_lower_priority_orders_queued_before_it() -> None:
    queue = fill(
        OutboundQueue(),
        order("chunk-1", Priority.LOW),
        order("chunk-2", Priority.LOW),
        order("interactive", Priority.NORMAL),
        order("urgent", Priority.HIGH),
        order("chunk-3", Priority.LOW),
        order("interactive-2", Priority.NORMAL),
    )
    assert drain(queue) == ["urgent", "interactive", "interactive-2", "chunk-1", "chunk-2", "chunk-3"]


def test_cancels_controls_and_the_end_keep_their_place() -> None:
    queue = fill(
        OutboundQueue(),
        order("chunk-1", Priority.LOW),
        order("interactive", Priority.NORMAL),
        CancelOrder(job_id="chunk-1", attempt=1),
        order("urgent", Priority.HIGH),  # behind the cancel: it does not pass it
        ModelControlOrder(request_id=7, action="LOAD", model_name="demo"),
        order("after-control", Priority.HIGH),
        None,
    )
    assert drain(queue) == [
        "interactive",
        "chunk-1",
        "cancel chunk-1",
        "urgent",
        "control 7",
        "after-control",
        "end",
    ]


async def test_get_waits_for_a_message_and_get_nowait_refuses_an_empty_queue() -> None:
    queue = OutboundQueue()
    with pytest.raises(asyncio.QueueEmpty):
        queue.get_nowait()
    waiting = asyncio.create_task(queue.get())
    await asyncio.sleep(0)
    assert not waiting.done()
    queue.put_nowait(order("late", Priority.LOW))
    taken = await asyncio.wait_for(waiting, 1.0)
    assert isinstance(taken, WorkOrder)
    assert taken.job_id == "late"
    assert queue.empty()
