"""Which jobs put back here another scheduler took (services.scheduler.work_queue.ModelQueues.checked):
the record names a later delivery of the job's message than the one put back, or the job ended."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from asyncinfer.jobs import JobRecord, JobState, Priority
from services.scheduler.priority import PrioritySelector
from services.scheduler.work_queue import ModelQueues

pytestmark = pytest.mark.unit

JOB = "job-1"


def ack(delivered: int, *, domain: bool = False) -> str:
    """A delivery's ack subject, as nats-server writes it (with a domain and an account hash, or not)."""
    head = "$JS.ACK.hub.ACCOUNTHASH" if domain else "$JS.ACK"
    tail = ".r4nd0m" if domain else ""
    return f"{head}.WORK.work-demo-NORMAL.{delivered}.42.7.1700000000000000000.0{tail}"


def delivery(delivered: int, *, domain: bool = False) -> Any:
    return SimpleNamespace(
        headers={"Asyncinfer-Job-Id": JOB, "Asyncinfer-Tenant": "default"},
        subject=f"asyncinfer.work.demo.normal.default.{JOB}",
        reply=ack(delivered, domain=domain),
        metadata=SimpleNamespace(timestamp=None),
    )


def record(state: JobState, lease_subject: str) -> JobRecord:
    return JobRecord(
        job_id=JOB,
        tenant="default",
        model_name="demo",
        model_version="1",
        state=state,
        priority=Priority.NORMAL,
        create_time=1.0,
        update_time=1.0,
        max_attempts=3,
        result_retention_s=60,
        lease_subject=lease_subject,
    )


def queues_with_put_back(delivered: int, *, domain: bool = False) -> ModelQueues:
    selector = PrioritySelector(dict.fromkeys(Priority, 1), aging_s=60.0)
    queues = ModelQueues(cast(Any, SimpleNamespace()), "WORK", "demo", selector)
    queues.put_back(Priority.NORMAL, delivery(delivered, domain=domain))
    assert [job_id for job_id, _ in queues.put_back_to_check(10)] == [JOB]
    return queues


@pytest.mark.parametrize("domain", [False, True])
def test_a_record_naming_a_later_delivery_or_an_end_forgets_the_put_back(domain: bool) -> None:
    for state, lease in (
        (JobState.RUNNING, ack(3, domain=domain)),  # running elsewhere
        (JobState.QUEUED, ack(3, domain=domain)),  # run elsewhere and given back there
        (JobState.SUCCEEDED, ack(2, domain=domain)),  # ended
    ):
        queues = queues_with_put_back(2, domain=domain)
        queues.checked(JOB, record(state, lease))
        assert queues.put_back_count(Priority.NORMAL) == 0, (state, lease)


def test_a_record_naming_this_delivery_or_an_earlier_one_keeps_the_put_back() -> None:
    for state, lease in (
        (JobState.QUEUED, ack(2)),  # this scheduler's own requeue
        (JobState.RUNNING, ack(2)),  # its requeue's write failed: still this delivery's
        (JobState.QUEUED, ack(1)),  # a held pull's put-back of a job an earlier attempt ran
        (JobState.QUEUED, ""),  # never dispatched
    ):
        queues = queues_with_put_back(2)
        queues.checked(JOB, record(state, lease))
        assert queues.put_back_count(Priority.NORMAL) == 1, (state, lease)
    queues = queues_with_put_back(2)
    queues.checked(JOB, None)  # not written yet, or gone: the listing decides
    assert queues.put_back_count(Priority.NORMAL) == 1
