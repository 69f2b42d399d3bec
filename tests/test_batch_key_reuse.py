"""Which creates reusing a batch's idempotency key ask for another batch (services.gateway.
batch_convert.fields_unlike): what they set is compared with the batch holding the key; what they
leave to a default that may have changed since (a hot update's default version or attempts), or to
detection, is not."""

from __future__ import annotations

import dataclasses
import time

import pytest

from asyncinfer.batches import BatchRecord, InputFormat
from asyncinfer.config import Config
from asyncinfer.v1 import batch_service_pb2, job_pb2
from services.gateway.batch_convert import batch_from_request, fields_unlike
from tests.batch_helpers import create_request

pytestmark = pytest.mark.unit

REF = "in/0190c0de-0000-7000-8000-000000000001"


def made(request: batch_service_pb2.CreateBatchRequest, *, at: float) -> BatchRecord:
    return batch_from_request(request, Config(), tenant="default", batch_id="b", now=at)


def test_a_retry_of_the_same_create_is_alike_though_made_later() -> None:
    request = create_request(REF, idempotency_key="k", labels={"run": "nightly"}, completion_window_s=600)
    assert fields_unlike(request, made(request, at=time.time() + 30), made(request, at=time.time())) == []


def test_every_field_a_create_sets_is_compared() -> None:
    first = made(create_request(REF, idempotency_key="k"), at=time.time())
    retries = {
        "input_ref": create_request("in/0190c0de-0000-7000-8000-000000000002", idempotency_key="k"),
        "priority": create_request(REF, idempotency_key="k", priority=job_pb2.PRIORITY_HIGH),
        "max_attempts": create_request(REF, idempotency_key="k", max_attempts=1),
        "completion_window": create_request(REF, idempotency_key="k", completion_window_s=60),
        "labels": create_request(REF, idempotency_key="k", labels={"a": "b"}),
        "input_format": create_request(REF, idempotency_key="k", input_format=batch_service_pb2.BATCH_INPUT_FORMAT_NPY),
    }
    detected = dataclasses.replace(first, input_format=InputFormat.JSONL)
    for field, retry in retries.items():
        assert fields_unlike(retry, made(retry, at=time.time()), detected) == [field]


def test_defaults_that_may_have_changed_and_a_format_not_yet_detected_are_not_compared() -> None:
    request = create_request(REF, idempotency_key="k")
    # The first was made before a hot update changed the model's default version and attempts.
    first = dataclasses.replace(made(request, at=time.time()), model_version="0", max_attempts=7)
    assert fields_unlike(request, made(request, at=time.time()), first) == []
    explicit = create_request(REF, idempotency_key="k", input_format=batch_service_pb2.BATCH_INPUT_FORMAT_JSONL)
    assert fields_unlike(explicit, made(explicit, at=time.time()), made(request, at=time.time())) == []
    pinned = create_request(REF, idempotency_key="k", model_version="1")
    assert fields_unlike(pinned, made(pinned, at=time.time()), first) == ["model_version"]
