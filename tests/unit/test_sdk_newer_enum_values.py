"""Enum values newer than the SDK (the protos only add values: a newer gateway's job state, waiting
reason, priority, callback event, delivery state, batch state, input format, model version state,
queue state): each reads as `UNKNOWN_<number>` of its enum, or that name where the SDK gives a
string, never an error; and goes back to the gateway as the same number. Before, an unknown job,
batch or model version state raised ValueError on every read (and the console's pages were a 500),
an unknown priority read as NORMAL, and an unknown waiting reason, callback event or delivery state
as nothing."""

from __future__ import annotations

import enum
import pickle
from collections.abc import Callable
from typing import Any

import pytest

import asyncinfer.client as sdk
from asyncinfer.client import (
    BatchState,
    Callback,
    CallbackDeliveryState,
    CallbackEvent,
    Job,
    JobRequest,
    JobState,
    Priority,
    WaitingReason,
)
from asyncinfer.client import _enums as sdk_enums
from asyncinfer.client._convert import job_from_proto, models_from_proto, state_to_proto, submit_request_to_proto
from asyncinfer.client.batches import batch_from_proto
from asyncinfer.commands.ops import model_stats_json
from asyncinfer.v1 import batch_service_pb2, job_pb2, job_service_pb2, ops_service_pb2

pytestmark = pytest.mark.unit


def queued_job() -> job_pb2.Job:
    return job_pb2.Job(job_id="j", model_name="demo", state=job_pb2.JOB_STATE_QUEUED, priority=job_pb2.PRIORITY_HIGH)


def _state(job: job_pb2.Job) -> None:
    job.state = 99  # type: ignore[assignment]  # the wire's int: protobuf keeps any number of an open enum


def _priority(job: job_pb2.Job) -> None:
    job.priority = 7  # type: ignore[assignment]


def _waiting_reason(job: job_pb2.Job) -> None:
    job.queue.waiting_reason = 42  # type: ignore[assignment]


def _callback_event(job: job_pb2.Job) -> None:
    job.callback.url = "https://example.com/hook"
    job.callback.events.extend([job_pb2.CALLBACK_EVENT_COMPLETED, 9])  # type: ignore[list-item]


def _delivery_event(job: job_pb2.Job) -> None:
    job.callback_deliveries.add(webhook_id="w", event=9, state=job_pb2.CALLBACK_DELIVERY_STATE_DELIVERED)  # type: ignore[arg-type]


def _delivery_state(job: job_pb2.Job) -> None:
    job.callback_deliveries.add(webhook_id="w", event=job_pb2.CALLBACK_EVENT_COMPLETED, state=8)  # type: ignore[arg-type]


JOB_FIELDS: list[tuple[Callable[[job_pb2.Job], None], Callable[[Job], Any], type[enum.StrEnum], int]] = [
    (_state, lambda job: job.state, JobState, 99),
    (_priority, lambda job: job.priority, Priority, 7),
    (_waiting_reason, lambda job: job.queue.waiting_reason, WaitingReason, 42),
    (_callback_event, lambda job: job.callback.events[1], CallbackEvent, 9),
    (_delivery_event, lambda job: job.callback_deliveries[0].event, CallbackEvent, 9),
    (_delivery_state, lambda job: job.callback_deliveries[0].state, CallbackDeliveryState, 8),
]


@pytest.mark.parametrize(("newer", "read", "enum_cls", "number"), JOB_FIELDS, ids=lambda x: getattr(x, "__name__", ""))
def test_a_job_field_newer_than_the_sdk_reads_as_unknown_and_its_number(
    newer: Callable[[job_pb2.Job], None], read: Callable[[Job], Any], enum_cls: type[enum.StrEnum], number: int
) -> None:
    message = queued_job()
    newer(message)
    value = read(job_from_proto(message))
    assert value == f"UNKNOWN_{number}"
    assert isinstance(value, enum_cls)
    assert value.name == value.value == f"UNKNOWN_{number}"
    assert value not in list(enum_cls)
    assert read(job_from_proto(message)) is value  # one object per number: `is` compares as for members
    assert sdk.unknown_number(value) == number
    assert pickle.loads(pickle.dumps(value)) is value
    with pytest.raises(ValueError, match="is not a valid"):
        enum_cls(f"UNKNOWN_{number}")  # still no member: parsing a name is as strict as before
    assert [sdk.unknown_number(member) for member in enum_cls] == [None] * len(enum_cls)


def test_a_job_in_a_state_newer_than_the_sdk_is_not_taken_for_done_and_its_other_fields_read() -> None:
    message = queued_job()
    _state(message)
    job = job_from_proto(message)
    assert not job.done
    assert not job.state.is_terminal
    assert (job.job_id, job.model_name, job.priority) == ("j", "demo", Priority.HIGH)
    assert str(job.state) == f"{job.state}" == "UNKNOWN_99"


def test_values_newer_than_the_sdk_go_back_to_the_gateway_as_their_numbers() -> None:
    """Resubmitting with a job's priority and callback, or listing the jobs in its state, sends the
    numbers the gateway sent (protobuf's own rule for unknown values): not NORMAL, nor nothing."""
    message = queued_job()
    _priority(message)
    _callback_event(message)
    _state(message)
    job = job_from_proto(message)
    assert job.callback is not None
    request = submit_request_to_proto(
        JobRequest(
            "demo", {"x": [[1.0]]}, priority=job.priority, callback=Callback(job.callback.url, job.callback.events)
        )
    )
    assert request.priority == 7
    assert list(request.callback.events) == [job_pb2.CALLBACK_EVENT_COMPLETED, 9]
    assert state_to_proto(job.state) == 99
    assert state_to_proto(JobState.RUNNING) == job_pb2.JOB_STATE_RUNNING


def test_unspecified_stays_the_apis_default_or_nothing_beside_an_unknown_value() -> None:
    message = queued_job()
    message.priority = job_pb2.PRIORITY_UNSPECIFIED
    message.queue.waiting_reason = job_pb2.WAITING_REASON_UNSPECIFIED
    _callback_event(message)
    message.callback.events.append(job_pb2.CALLBACK_EVENT_UNSPECIFIED)
    job = job_from_proto(message)
    assert job.priority is Priority.NORMAL
    assert job.queue is not None
    assert job.queue.waiting_reason is None
    assert job.callback is not None
    assert job.callback.events == (CallbackEvent.COMPLETED, "UNKNOWN_9")  # the unknown event kept, in place


def test_a_model_version_state_newer_than_the_sdk_reads_as_its_number() -> None:
    answer = job_service_pb2.ListModelsResponse()
    model = answer.models.add(name="demo", version="2")
    model.versions.add(version="1", state=job_service_pb2.MODEL_VERSION_STATE_READY)
    model.versions.add(version="2", state=9)  # type: ignore[arg-type]
    (info,) = models_from_proto(answer)
    assert [v.state for v in info.versions] == ["READY", "UNKNOWN_9"]
    assert info.versions_summary == "1, 2 (unknown_9)"


@pytest.mark.parametrize(
    ("field", "number", "read", "expected"),
    [
        ("state", 99, lambda batch: batch.state, "UNKNOWN_99"),
        ("priority", 7, lambda batch: batch.priority, "UNKNOWN_7"),
        ("input_format", 5, lambda batch: batch.input_format, "UNKNOWN_5"),
    ],
)
def test_a_batch_field_newer_than_the_sdk_reads_as_its_number(
    field: str, number: int, read: Callable[[Any], Any], expected: str
) -> None:
    message = batch_service_pb2.Batch(batch_id="b", model_name="demo", state=batch_service_pb2.BATCH_STATE_IN_PROGRESS)
    setattr(message, field, number)
    batch = batch_from_proto(message)
    assert read(batch) == expected
    assert isinstance(batch.state, BatchState)
    assert batch.done is False


def test_the_clis_queue_stats_show_a_queue_state_or_priority_newer_than_it_as_its_number() -> None:
    """`asyncinfer queue stats --json`, `pause` and `resume` print the queue state by name: one newer
    than the CLI raised ValueError (the console shows "state 99" since 169cbcf)."""
    stats = ops_service_pb2.ModelQueueStats(
        model_name="demo",
        state=99,  # type: ignore[arg-type]
        priorities=[ops_service_pb2.PriorityQueueStats(priority=7, depth=2)],  # type: ignore[arg-type]
    )
    shown = model_stats_json(stats)
    assert shown["state"] == "state 99"
    assert [q["priority"] for q in shown["queues"]] == ["7"]


def _python_312_contains(cls: Any, value: Any) -> bool:
    """Python 3.12's EnumType.__contains__, as it is there (run here on 3.11 to check that the SDK's
    enums do not use it): any instance of the enum is in it, a plain value when a member has it."""
    if isinstance(value, cls):
        return True
    try:
        return value in cls._value2member_map_
    except TypeError:
        return value in cls._unhashable_values_


ENUMS = [JobState, Priority, WaitingReason, CallbackEvent, CallbackDeliveryState, BatchState]


@pytest.mark.parametrize("python_312", [False, True], ids=["this-python", "python-3.12-enum"])
@pytest.mark.parametrize("enum_cls", ENUMS, ids=lambda cls: cls.__name__)
def test_a_value_newer_than_the_sdk_is_not_in_its_enum_on_any_python(
    enum_cls: type[enum.StrEnum], python_312: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: an UNKNOWN_<number> value "is no member". Python 3.12 changed enum's `in`: it took any
    instance of the enum for a member, so `JobState.UNKNOWN_9 in JobState` was True there (False on
    3.11), and a plain string was looked up among the values there (TypeError on 3.11). The SDK's
    enums now say the same on both: run here with 3.12's rule in place of this Python's too."""
    if python_312:
        monkeypatch.setattr(enum.EnumType, "__contains__", _python_312_contains)
    newer = sdk_enums.unknown_value(enum_cls, 99)
    assert newer not in enum_cls
    assert "UNKNOWN_99" not in enum_cls
    member = next(iter(enum_cls))
    assert member in enum_cls
    assert member.value in enum_cls  # a plain string: a member's value
    assert "NOT_A_VALUE" not in enum_cls
    assert ["unhashable"] not in enum_cls
    foreign = JobState.FAILED if enum_cls is CallbackEvent else CallbackEvent.FAILED
    assert foreign not in enum_cls  # another enum's member, though equal to a value as a string
