"""A label watch (WatchJobs by labels) sends each job's changes in their order: a job's QUEUED comes
as a core-NATS notice and its later changes on the records' feed, so the notice can arrive after the
job's RUNNING change; a change no newer than one the stream sent is dropped (a client saw RUNNING,
then QUEUED)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from asyncinfer.jobs import JobRecord, JobState
from services.gateway.watch_hub import RecordUpdate, WatcherQueue
from services.gateway.watch_many import watch_labels
from tests.test_record_codec import MINIMAL

pytestmark = pytest.mark.unit

QUEUED = MINIMAL.evolve(
    job_id="0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
    tenant="acme",
    create_time=1.0,
    update_time=1.0,
    max_attempts=3,
    labels={"run": "nightly"},
)


class OneSelectorHub:
    """What watch_labels uses of the hub: one selector's queue, fed by the test."""

    closed = False

    def __init__(self) -> None:
        self.queue = WatcherQueue()

    def register_selector(self, tenant: str, labels: dict[str, str]) -> WatcherQueue:
        return self.queue

    def unregister_selector(self, tenant: str, queue: WatcherQueue) -> None:
        pass

    async def ensure_feed(self) -> None:
        pass

    async def ensure_notices(self) -> None:
        pass


def update(record: JobRecord, revision: int) -> RecordUpdate:
    return RecordUpdate(revision, dataclasses.replace(record, revision=revision), record.key)


async def test_a_queued_notice_heard_after_the_running_change_is_not_sent() -> None:
    hub = OneSelectorHub()
    changes = watch_labels(hub, "acme", {"run": "nightly"})  # type: ignore[arg-type]
    running = dataclasses.replace(QUEUED, state=JobState.RUNNING, attempt=1)
    hub.queue.put_nowait(update(running, 5))
    first = await anext(changes)
    hub.queue.put_nowait(update(QUEUED, 0))  # the submit's notice, late
    hub.queue.put_nowait(update(dataclasses.replace(QUEUED, job_id="0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c"), 0))
    second = await anext(changes)
    retried = dataclasses.replace(QUEUED, attempt=1)  # a retry's QUEUED is a newer write: sent
    hub.queue.put_nowait(update(retried, 6))
    third = await anext(changes)
    await changes.aclose()
    states: list[Any] = [
        [(c.job_id[-1], c.record.state) for c in batch if c.record] for batch in (first, second, third)
    ]
    assert states == [[("b", JobState.RUNNING)], [("c", JobState.QUEUED)], [("b", JobState.QUEUED)]]
