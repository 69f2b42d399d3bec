"""Every stored type's codec: encode -> decode gives back what was encoded; what is written says
its version; and the unversioned (v0) payloads the encoders wrote before the codecs were
versioned (tests/codec_v0_examples.py, taken from those encoders) still decode, so a rolling
upgrade reads what the old processes wrote."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncinfer.codecs.envelope import decode_envelope, encode_envelope, tenant_of_envelope
from asyncinfer.codecs.record import decode_record, encode_record
from asyncinfer.idempotency_claims import Claim
from asyncinfer.jobs import BlobRef, JobError, JobRecord, JobState, Priority, WorkEnvelope, queued_envelope
from asyncinfer.queues import (
    CancelNotice,
    PriorityQueueSnapshot,
    QueueSnapshot,
    decode_pause,
    decode_snapshot,
    encode_pause,
    encode_snapshot,
)
from asyncinfer.tensors import Tensor
from asyncinfer.webhook_status import (
    CallbackEvent,
    DeliveryState,
    DeliveryStatus,
    JobDeliveries,
    decode_deliveries,
    encode_deliveries,
)
from services.scheduler.dead_letters import DeadLetter, decode_dead_letter, encode_dead_letter
from services.scheduler.webhooks.deliveries import Delivery, decode_delivery, encode_delivery
from tests import codec_v0_examples as v0
from tests import codec_v0_readers as old_readers
from tests.test_record_codec import FULL, MINIMAL, generic_encode_record

ENVELOPE_INLINE = WorkEnvelope(
    job_id="0190a3b4-0000-7000-8000-000000000003",
    tenant="acme",
    model_name="demo",
    model_version="1",
    priority=Priority.LOW,
    create_time=10.5,
    max_attempts=3,
    inputs=(
        Tensor("x", "FP32", (1, 2), b"\x00\x00\x80?\x00\x00\x00@"),
        Tensor("s", "BYTES", (1,), b"\x02\x00\x00\x00hi"),
    ),
    deadline=99.0,
    execution_timeout_s=5.0,
)
ENVELOPE_REF = WorkEnvelope(
    job_id="0190a3b4-0000-7000-8000-000000000004",
    tenant="default",
    model_name="demo",
    model_version="",
    priority=Priority.NORMAL,
    create_time=11.0,
    max_attempts=1,
    input_ref=BlobRef("inputs/default/abc", 4096, "ef" * 32),
)
SNAPSHOT = QueueSnapshot(
    model_name="demo",
    updated_at=123.5,
    priorities={"HIGH": PriorityQueueSnapshot(2, 100.0), "LOW": PriorityQueueSnapshot()},
    in_flight=3,
    connected_batchers=1,
    free_credits=4,
    completed_per_s=2.5,
    paused=False,
    desired_batchers=2,
)
DELIVERIES = JobDeliveries(
    deliveries=(
        DeliveryStatus(
            "msg_j_completed_1", CallbackEvent.COMPLETED, 1, DeliveryState.DELIVERED, 2, 5.0, 5.5, 6.0, 200, "", None
        ),
        DeliveryStatus("msg_j_running_1", CallbackEvent.RUNNING, 1),
    ),
    ttl_s=90000.0,
)
CLAIM = Claim("0190a3b4-0000-7000-8000-000000000001", "f" * 64, 42.5)
DEAD_LETTER = DeadLetter(
    job_id=ENVELOPE_INLINE.job_id,
    tenant="acme",
    model_name="demo",
    reason="MAX_ATTEMPTS",
    attempts=3,
    dead_time=200.25,
    original=v0.ENVELOPE_INLINE,
    last_error=JobError(code=14, reason="WORKER_LOST", message="gone", retriable=True),
)
DELIVERY = Delivery(
    webhook_id="msg_j_completed_1",
    tenant="acme",
    job_id="j",
    event=CallbackEvent.COMPLETED,
    job_attempt=1,
    url="https://example.com/hook",
    body='{"type":"job.completed"}',
    ttl_s=90000.0,
)
CANCEL_NOTICE = CancelNotice("j", "acme", "demo")


def version_of(data: bytes) -> int | None:
    value: Any = json.loads(data)
    return value.get("v") if isinstance(value, dict) else None


# (what, value, encode, decode, its v0 payload, the version written, the previous release's reader);
# decode and the reader take the bytes alone.
CASES: list[tuple[str, Any, Any, Any, bytes, int, Any]] = [
    (
        "record (every field)",
        FULL,
        encode_record,
        lambda d: decode_record(d, revision=FULL.revision),
        v0.RECORD_FULL,
        1,
        lambda d: old_readers.decode_record(d, FULL.revision),
    ),
    ("record (minimal)", MINIMAL, encode_record, decode_record, v0.RECORD_MINIMAL, 1, old_readers.decode_record),
    (
        "envelope (inline tensors)",
        ENVELOPE_INLINE,
        encode_envelope,
        decode_envelope,
        v0.ENVELOPE_INLINE,
        2,
        old_readers.decode_envelope,
    ),
    (
        "envelope (input ref)",
        ENVELOPE_REF,
        encode_envelope,
        decode_envelope,
        v0.ENVELOPE_REF,
        2,
        old_readers.decode_envelope,
    ),
    # Still written as version 0: the previous release's readers refuse a `v` in these.
    ("queue snapshot", SNAPSHOT, encode_snapshot, decode_snapshot, v0.SNAPSHOT, 0, old_readers.decode_snapshot),
    (
        "cancel notice",
        CANCEL_NOTICE,
        CancelNotice.encode,
        CancelNotice.decode,
        v0.CANCEL_NOTICE,
        0,
        old_readers.decode_cancel_notice,
    ),
    (
        "webhook delivery status",
        DELIVERIES,
        encode_deliveries,
        decode_deliveries,
        v0.DELIVERIES,
        1,
        old_readers.decode_deliveries,
    ),
    (
        "idempotency claim",
        CLAIM,
        Claim.encode,
        lambda d: Claim.decode(d, 0),
        v0.CLAIM,
        1,
        lambda d: old_readers.decode_claim(d, 0),
    ),
    (
        "dead letter",
        DEAD_LETTER,
        encode_dead_letter,
        decode_dead_letter,
        v0.DEAD_LETTER,
        2,
        old_readers.decode_dead_letter,
    ),
    ("webhook delivery", DELIVERY, encode_delivery, decode_delivery, v0.DELIVERY, 0, old_readers.decode_delivery),
]
CASE_IDS = [case[0] for case in CASES]


@pytest.mark.parametrize(("what", "value", "encode", "decode", "old", "written", "old_reader"), CASES, ids=CASE_IDS)
def test_round_trip_and_version_0_still_decodes(
    what: str, value: Any, encode: Any, decode: Any, old: bytes, written: int, old_reader: Any
) -> None:
    data = encode(value)
    assert (version_of(data) or 0) == written, what
    assert decode(data) == value
    assert version_of(old) is None  # the example really is unversioned
    assert decode(old) == value


@pytest.mark.parametrize(("what", "value", "encode", "decode", "old", "written", "old_reader"), CASES, ids=CASE_IDS)
def test_the_previous_release_reads_what_this_one_writes(
    what: str, value: Any, encode: Any, decode: Any, old: bytes, written: int, old_reader: Any
) -> None:
    """A rolling upgrade runs both releases at once: the old readers (copied verbatim) read every
    payload this release writes."""
    assert old_reader(encode(value)) == value, what


def test_a_dead_letter_counts_the_attempts_given_back_apart() -> None:
    """Version 2: `attempts` holds the attempts that counted, beside those given back, the attempt
    number and the attempts it could spend; the previous release reads `attempts` as its count (the
    honest one), and a letter it wrote (version 1) reads with its count as it was, none given back
    and its limit not known."""
    letter = dataclasses.replace(DEAD_LETTER, attempts=2, given_back_attempts=4, last_attempt=6, allowed_attempts=2)
    data = encode_dead_letter(letter)
    assert decode_dead_letter(data) == letter
    assert old_readers.decode_dead_letter(data).attempts == 2
    written_before = json.loads(data)
    written_before.update(v=1, attempts=6)
    del written_before["given_back_attempts"], written_before["last_attempt"], written_before["allowed_attempts"]
    before = decode_dead_letter(json.dumps(written_before).encode())
    assert (before.attempts, before.given_back_attempts, before.last_attempt, before.allowed_attempts) == (6, 0, 0, 0)


def test_a_submits_work_message_is_its_queued_record() -> None:
    """Version 2: a submit's message carries the record's own fields, and reads back as the QUEUED
    record at revision 0 (the previous release reads the rest of it as before)."""
    record = FULL.evolve(
        state=JobState.QUEUED,
        attempt=0,
        update_time=FULL.create_time,
        start_time=None,
        end_time=None,
        queue_duration_s=None,
        run_duration_s=None,
        batch=None,
        error=None,
        last_error=None,
        outputs=(),
        result_ref=None,
        batcher_id="",
        revision=0,
    )
    envelope = queued_envelope(record, ENVELOPE_INLINE.inputs)
    data = encode_envelope(envelope)
    assert version_of(data) == 2
    decoded = decode_envelope(data)
    assert decoded == envelope
    assert decoded.is_record
    assert decoded.queued_record() == record
    assert (
        decoded.subject
        == f"asyncinfer.work.{record.model_name}.{record.priority.subject_token}.{record.tenant}.{record.job_id}"
    )
    old = old_readers.decode_envelope(data)
    assert (old.job_id, old.inputs, old.max_attempts) == (record.job_id, ENVELOPE_INLINE.inputs, record.max_attempts)
    assert not decode_envelope(encode_envelope(ENVELOPE_REF)).is_record


def test_an_unknown_field_from_a_newer_writer_is_ignored() -> None:
    """A later version may add fields: a reader of this version still reads the rest."""
    obj = json.loads(encode_record(FULL))
    obj["v"], obj["a_field_from_the_future"] = 2, {"x": [1, 2]}
    assert decode_record(json.dumps(obj).encode(), revision=FULL.revision) == FULL


def test_a_malformed_payload_raises_a_value_error() -> None:
    """Every caller catches ValueError (msgspec's DecodeError is one) for an unreadable message."""
    for data in (b"", b"{", b'{"job_id": 1}', b"[]"):
        with pytest.raises(msgspec.DecodeError):
            decode_record(data)
        with pytest.raises(msgspec.DecodeError):
            decode_envelope(data)
    with pytest.raises(msgspec.DecodeError):
        decode_record(encode_record(MINIMAL).replace(b'"QUEUED"', b'"SIDEWAYS"'))


def test_tensor_data_is_base64_so_nats_kv_get_stays_readable() -> None:
    data = encode_record(FULL)
    assert json.loads(data)["outputs"][1]["data"] == "AQAAAGE="
    assert data.isascii() or "é" in data.decode()


def test_pause_round_trip_and_version_0() -> None:
    pause = decode_pause(encode_pause(paused_at=1.5, by="ops"))
    assert (pause.v, pause.paused_at, pause.by) == (1, 1.5, "ops")
    old = decode_pause(v0.PAUSE)
    assert (old.v, old.paused_at, old.by) == (0, 1700000000.5, "ops")


def test_the_tenant_of_an_envelope_is_read_without_the_rest() -> None:
    assert tenant_of_envelope(v0.ENVELOPE_INLINE) == "acme"
    assert tenant_of_envelope(encode_envelope(ENVELOPE_REF)) == "default"
    assert tenant_of_envelope(b"not json") == ""
    assert tenant_of_envelope(b'{"job_id":"x"}') == ""


def test_a_large_tensor_round_trips() -> None:
    big = Tensor("x", "UINT8", (1, 1 << 20), bytes(range(256)) * 4096)
    envelope = dataclasses.replace(ENVELOPE_INLINE, inputs=(big,))
    assert decode_envelope(encode_envelope(envelope)) == envelope


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
    priority=st.sampled_from(list(Priority)),
    with_parts=st.tuples(*[st.booleans()] * 6),
    revision=st.integers(0, 2**40),
)
def test_any_record_round_trips_in_version_1_and_from_version_0(
    model_version: str,
    idempotency_key: str,
    batcher_id: str,
    labels: dict[str, str],
    attempt: int,
    times: tuple[float | None, ...],
    state: JobState,
    priority: Priority,
    with_parts: tuple[bool, ...],
    revision: int,
) -> None:
    batch, error, last_error, outputs, refs, callback = with_parts
    record: JobRecord = FULL.evolve(
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
        priority=priority,
        batch=FULL.batch if batch else None,
        error=FULL.error if error else None,
        last_error=FULL.last_error if last_error else None,
        outputs=FULL.outputs if outputs else (),
        result_ref=FULL.result_ref if refs else None,
        input_ref=FULL.input_ref if refs else None,
        callback=FULL.callback if callback else None,
        revision=revision,
    )
    assert decode_record(encode_record(record), revision=revision) == record
    # generic_encode_record is the unversioned encoder as it was (the v0 writer), and
    # old_readers.decode_record the reader of that release: both directions of a rolling upgrade.
    assert decode_record(generic_encode_record(record), revision=revision) == record
    assert old_readers.decode_record(encode_record(record), revision) == record


def test_msgspec_decode_errors_are_value_errors() -> None:
    assert issubclass(msgspec.DecodeError, ValueError)


@pytest.mark.parametrize(
    "module", ["asyncinfer.codecs.parts", "asyncinfer.codecs.record", "asyncinfer.codecs.envelope"]
)
def test_a_codec_imports_first_without_a_cycle(module: str) -> None:
    """A codec imports on its own in a fresh interpreter (where nothing is imported yet), and so
    does the domain module it builds on after it (tests/test_layering.py checks there is no cycle)."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}; from asyncinfer.jobs import JobRecord"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_a_running_records_lease_round_trips_and_the_previous_release_reads_it() -> None:
    lease = "$JS.ACK.WORK.work-demo-normal.1.42.40.1700000000000000000.3"
    running = dataclasses.replace(
        MINIMAL, state=JobState.RUNNING, attempt=1, dispatched_by="host:7001/ab12", lease_subject=lease
    )
    data = encode_record(running)
    assert decode_record(data) == running
    assert old_readers.decode_record(data) == dataclasses.replace(running, dispatched_by="", lease_subject="")


class _Stop33PriorityWire(msgspec.Struct, omit_defaults=True):
    """asyncinfer.queues' wire types as the release before this one (stop 33, 26c41d1^) has them."""

    depth: int = 0
    oldest_create_time: float | None = None


class _Stop33SnapshotWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = 0
    model_name: str
    updated_at: float
    priorities: dict[str, _Stop33PriorityWire] = {}
    in_flight: int = 0
    connected_batchers: int = 0
    free_credits: int = 0
    completed_per_s: float = 0.0
    paused: bool = False
    desired_batchers: int = 0
    draining: bool = False


def test_the_release_before_reads_a_snapshot_with_the_newest_time() -> None:
    """A priority's `newest_create_time` (session 24) is a field the release before skips (its
    readers are msgspec's). A reader older than the versioned codecs would refuse it: an upgrade
    from that far back goes through the release before (docs/UPGRADING.md)."""
    burst = dataclasses.replace(SNAPSHOT, priorities={"NORMAL": PriorityQueueSnapshot(5, 100.0, 101.0)})
    data = encode_snapshot(burst)
    assert decode_snapshot(data) == burst
    old = msgspec.json.decode(data, type=_Stop33SnapshotWire)
    assert (old.model_name, old.updated_at, old.in_flight) == ("demo", 123.5, 3)
    assert (old.priorities["NORMAL"].depth, old.priorities["NORMAL"].oldest_create_time) == (5, 100.0)


def test_the_release_before_reads_a_snapshot_naming_its_scheduler() -> None:
    """The writing scheduler's name (session 29) is a field the release before skips, as it does
    `newest_create_time`; a snapshot without one (from that release) reads as unnamed."""
    named = dataclasses.replace(SNAPSHOT, scheduler="scheduler-0:50052")
    data = encode_snapshot(named)
    assert json.loads(data)["scheduler"] == "scheduler-0:50052"
    assert decode_snapshot(data) == named
    old = msgspec.json.decode(data, type=_Stop33SnapshotWire)
    assert (old.model_name, old.connected_batchers, old.free_credits) == ("demo", 1, 4)
    assert "scheduler" not in json.loads(encode_snapshot(SNAPSHOT))  # unnamed: left out
    assert decode_snapshot(encode_snapshot(SNAPSHOT)).scheduler == ""


def test_the_release_before_reads_a_stopped_schedulers_last_snapshot() -> None:
    """`stopped` (a scheduler's last snapshot as it stops in order) is a field the release before
    skips: it reads the rest, the other schedulers' view (asyncinfer.snapshot_merge.stopped_snapshot)."""
    last = dataclasses.replace(SNAPSHOT, scheduler="scheduler-1:50052", stopped=True)
    data = encode_snapshot(last)
    assert json.loads(data)["stopped"] is True
    assert decode_snapshot(data) == last
    old = msgspec.json.decode(data, type=_Stop33SnapshotWire)
    assert (old.model_name, old.connected_batchers, old.free_credits) == ("demo", 1, 4)
    assert "stopped" not in json.loads(encode_snapshot(SNAPSHOT))  # written only while true


def test_the_release_before_reads_a_snapshot_with_its_schedulers_put_backs() -> None:
    """A priority's `put_back`, its oldest time and `ack_pending` (session 32) are fields the release before skips:
    it reads the depth (pending and put-backs together), as it did. Left out while 0 / None."""
    own = PriorityQueueSnapshot(5, 100.0, 101.0, put_back=2, put_back_oldest_create_time=99.0, ack_pending=3)
    counted = dataclasses.replace(SNAPSHOT, priorities={"NORMAL": own})
    data = encode_snapshot(counted)
    assert decode_snapshot(data) == counted
    old = msgspec.json.decode(data, type=_Stop33SnapshotWire)
    assert (old.priorities["NORMAL"].depth, old.priorities["NORMAL"].oldest_create_time) == (5, 100.0)
    plain = encode_snapshot(dataclasses.replace(SNAPSHOT, priorities={"NORMAL": PriorityQueueSnapshot(5)}))
    assert json.loads(plain)["priorities"]["NORMAL"] == {"depth": 5}
