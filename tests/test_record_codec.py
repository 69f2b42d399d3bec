"""The record codec writes what the generic unversioned encoder wrote before it (a loop over
dataclasses.fields with dataclasses.asdict: version 0), plus its version and less its defaults, in
the same key order; and JobRecord.evolve equals dataclasses.replace."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.errors import FieldViolation
from asyncinfer.jobs import BatchInfo, BlobRef, CallbackSpec, JobError, JobRecord, JobState, Priority
from asyncinfer.tensors import Tensor

pytestmark = pytest.mark.unit


def _tensor_to_json(tensor: Tensor) -> dict[str, Any]:
    return {
        "name": tensor.name,
        "datatype": tensor.datatype,
        "shape": list(tensor.shape),
        "data": base64.b64encode(tensor.data).decode("ascii"),
    }


def error_to_json(error: JobError | None) -> dict[str, Any] | None:
    if error is None:
        return None
    return {
        "code": error.code,
        "reason": error.reason,
        "message": error.message,
        "violations": [[v.field, v.description] for v in error.violations],
        "retriable": error.retriable,
    }


def generic_encode_record(record: JobRecord) -> bytes:
    """The unversioned (v0) encoder as it was before it was written out by hand (the reference)."""
    obj: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        if f.name == "revision":
            continue
        value = getattr(record, f.name)
        if f.name == "outputs":
            value = [_tensor_to_json(t) for t in value]
        elif f.name in ("error", "last_error"):
            value = error_to_json(value)
        elif isinstance(value, BatchInfo | BlobRef | CallbackSpec):
            value = dataclasses.asdict(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        if value is None or value == () or value == {} or value == "":
            continue
        obj[f.name] = value
    return json.dumps(obj, separators=(",", ":")).encode()


FULL = JobRecord(
    job_id="0190a3b4-0000-7000-8000-000000000001",
    tenant="acme",
    model_name="demo",
    model_version="2",
    state=JobState.SUCCEEDED,
    priority=Priority.HIGH,
    create_time=1.5,
    update_time=2.25,
    max_attempts=3,
    result_retention_s=86400.0,
    attempt=2,
    labels={"team": "x", "run": "é"},
    idempotency_key="key-1",
    start_time=1.75,
    end_time=2.25,
    queue_duration_s=0.25,
    run_duration_s=0.5,
    deadline=100.0,
    execution_timeout_s=30.0,
    batch=BatchInfo(batcher_id="b-1", batch_size=8, compute_s=0.001),
    error=JobError(code=3, reason="BAD", message="bad input", violations=(FieldViolation("x", "too big"),)),
    last_error=JobError(code=14, reason="WORKER_LOST", message="gone", retriable=True),
    outputs=(Tensor("y", "FP32", (1, 2), b"\x00" * 8), Tensor("z", "BYTES", (1,), b"\x01\x00\x00\x00a")),
    result_ref=BlobRef("results/acme/1", 1 << 20, "ab" * 32),
    input_ref=BlobRef("inputs/acme/1", 12, "cd" * 32),
    callback=CallbackSpec("https://example.com/hook", ("SUCCEEDED", "FAILED")),
    batcher_id="b-1",
    revision=7,
)
MINIMAL = JobRecord(
    job_id="0190a3b4-0000-7000-8000-000000000002",
    tenant="default",
    model_name="demo",
    model_version="",
    state=JobState.QUEUED,
    priority=Priority.NORMAL,
    create_time=0.0,
    update_time=0.0,
    max_attempts=1,
    result_retention_s=60.0,
)


def assert_writes_version_0_plus_v(record: JobRecord) -> None:
    """Version 1 is version 0 with `v` first and the defaults version 0 still wrote (attempt 0, no
    outputs) left out."""
    new = json.loads(encode_record(record))
    old = json.loads(generic_encode_record(record))
    assert new.pop("v") == 1
    if old["attempt"] == 0:
        del old["attempt"]
    if old["outputs"] == []:
        del old["outputs"]
    added_since_fields = (
        "claim_revision",
        "failed_attempts",
        "given_back_attempts",
        "handed_back_in_a_row",
        "dead_letter_sequence",
    )
    for added_since in added_since_fields:  # added since, defaults left out
        if old.get(added_since) == 0:
            del old[added_since]
    assert list(new.items()) == list(old.items())


def test_encode_record_writes_the_generic_encoders_fields() -> None:
    kept_claim = FULL.evolve(claim_revision=5, claim_fingerprint="ef" * 32)  # fields added since version 1
    for record in (
        FULL,
        MINIMAL,
        FULL.evolve(labels={}, outputs=(), callback=CallbackSpec("https://h/", ())),
        kept_claim,
        FULL.evolve(queued_server_time=1.625),  # added since version 1
        FULL.evolve(failed_attempts=2),  # added since version 1
        FULL.evolve(given_back_attempts=4),  # added since version 1
        FULL.evolve(handed_back_in_a_row=3),  # added since version 1
        FULL.evolve(handed_back_in_a_row=2, handed_back_by=("b1", "b2")),  # added since version 1
        FULL.evolve(state=JobState.FAILED, dead_letter_sequence=17),  # added since version 1
    ):
        assert_writes_version_0_plus_v(record)
        assert decode_record(encode_record(record), revision=record.revision) == record


optional_floats = st.none() | st.floats(allow_nan=False, allow_infinity=False)
texts = st.text(max_size=8)


@settings(max_examples=200, deadline=None)
@given(
    model_version=texts,
    idempotency_key=texts,
    batcher_id=texts,
    labels=st.dictionaries(texts, texts, max_size=3),
    attempt=st.integers(0, 5),
    times=st.tuples(*[optional_floats] * 6),
    state=st.sampled_from(list(JobState)),
    with_parts=st.tuples(*[st.booleans()] * 6),
)
def test_encode_record_matches_the_generic_encoder_on_any_record(
    model_version: str,
    idempotency_key: str,
    batcher_id: str,
    labels: dict[str, str],
    attempt: int,
    times: tuple[float | None, ...],
    state: JobState,
    with_parts: tuple[bool, ...],
) -> None:
    batch, error, last_error, outputs, refs, callback = with_parts
    record = FULL.evolve(
        model_version=model_version,
        idempotency_key=idempotency_key,
        batcher_id=batcher_id,
        labels=labels,
        attempt=attempt,
        start_time=times[0],
        end_time=times[1],
        queue_duration_s=times[2],
        run_duration_s=times[3],
        deadline=times[4],
        execution_timeout_s=times[5],
        state=state,
        batch=FULL.batch if batch else None,
        error=FULL.error if error else None,
        last_error=FULL.last_error if last_error else None,
        outputs=FULL.outputs if outputs else (),
        result_ref=FULL.result_ref if refs else None,
        input_ref=FULL.input_ref if refs else None,
        callback=FULL.callback if callback else None,
    )
    assert_writes_version_0_plus_v(record)


def test_evolve_equals_dataclasses_replace() -> None:
    changes: dict[str, Any] = {"state": JobState.RUNNING, "attempt": 3, "revision": 9, "outputs": ()}
    assert FULL.evolve(**changes) == dataclasses.replace(FULL, **changes)
    assert FULL.evolve() == FULL
