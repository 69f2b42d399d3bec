"""The pure core of batch jobs (asyncinfer.batches, asyncinfer.batch_inputs): chunk plans and their
transitions, the record's codec, chunk job IDs, and input parsing. No server."""

from __future__ import annotations

import base64
import io
import itertools
import json
import zipfile
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncinfer import batches
from asyncinfer.batch_inputs import (
    MAX_LINE_BYTES,
    ChunkBuilder,
    LineSplitter,
    LongLine,
    RecordInvalid,
    array_chunks,
    array_inputs,
    detect_format,
    npy_chunk,
    npy_layout,
    parse_line,
)
from asyncinfer.batch_webhooks import callback_due, error_ref, output_ref
from asyncinfer.batches import (
    CREATE_RECORD_WITHIN_S,
    BatchRecord,
    BatchState,
    Chunk,
    ChunkOutcome,
    ChunkStatus,
    ErrorLine,
    InputFormat,
    chunk_job_id,
    create_settled_after_s,
    create_settles_in_s,
    may_read_its_input,
)
from asyncinfer.config import DEMO_MODEL
from asyncinfer.ids import is_job_id, job_id_time_ms, new_job_id
from asyncinfer.jobs import CallbackSpec, JobError, JobState, Priority
from asyncinfer.tensors import ModelSignature, Tensor, TensorSpec
from services.gateway.batch_convert import batch_to_proto
from services.gateway.batch_files import PIECE_BYTES, output_lines
from services.gateway.batch_npz import ArchiveSink

pytestmark = pytest.mark.unit

SIGNATURE = DEMO_MODEL.signature
TEXT = ModelSignature(inputs=(TensorSpec("text", "BYTES", (-1,)),), outputs=(TensorSpec("e", "FP32", (-1, 2)),))


def record(chunks: tuple[Chunk, ...] = (), **changes: object) -> BatchRecord:
    base = BatchRecord(
        batch_id=new_job_id(),
        tenant="acme",
        model_name="demo",
        model_version="1",
        input_ref="in/x",
        input_format=None,
        state=BatchState.IN_PROGRESS,
        priority=Priority.LOW,
        max_attempts=1,
        create_time=100.0,
        expires_at=200.0,
        result_retention_s=60.0,
        chunks=chunks,
        total=sum(c.records for c in chunks),
    )
    return base.evolve(**changes)


def queued(*ranges: tuple[int, int]) -> tuple[Chunk, ...]:
    return tuple(Chunk(s, e, ChunkStatus.QUEUED) for s, e in ranges)


MODEL_ERROR = JobError(code=13, reason="MODEL_ERROR", message="boom")


def test_a_succeeded_chunk_is_done_and_counted() -> None:
    settled = batches.settle_chunks(
        record(queued((0, 10), (10, 20))), [ChunkOutcome(0, JobState.SUCCEEDED)], max_splits=5
    )
    assert [c.status for c in settled.chunks] == [ChunkStatus.DONE, ChunkStatus.QUEUED]
    assert settled.counts.completed == 10
    assert not batches.finished(settled)


def test_a_failed_chunk_splits_in_halves_until_one_record_fails_alone() -> None:
    current = record(queued((0, 8)))
    poison = 5
    while not batches.finished(current):
        current = batches.mark_submitted(current, [c.start for c in batches.to_submit(current, window=100)])
        outcomes = [
            ChunkOutcome(c.start, JobState.FAILED, MODEL_ERROR)
            if c.start <= poison < c.end
            else ChunkOutcome(c.start, JobState.SUCCEEDED)
            for c in current.chunks
            if c.status is ChunkStatus.QUEUED
        ]
        current = batches.settle_chunks(current, outcomes, max_splits=100)
    failed = [c for c in current.live_chunks if c.status is ChunkStatus.FAILED]
    assert [(c.start, c.end, c.code) for c in failed] == [(5, 6, "INTERNAL")]
    assert current.counts.completed == 7
    assert current.splits == 3  # log2(8)
    starts = [c.start for c in current.live_chunks]
    assert starts == sorted(starts)


def test_past_the_split_limit_a_failed_chunk_fails_whole() -> None:
    settled = batches.settle_chunks(
        record(queued((0, 8))), [ChunkOutcome(0, JobState.FAILED, MODEL_ERROR)], max_splits=0
    )
    assert [(c.status, c.records) for c in settled.chunks] == [(ChunkStatus.FAILED, 8)]
    assert settled.counts.failed == 8


def test_cancelled_and_expired_chunks_are_skipped_not_split() -> None:
    settled = batches.settle_chunks(
        record(queued((0, 4), (4, 8))),
        [ChunkOutcome(0, JobState.CANCELED), ChunkOutcome(4, JobState.EXPIRED)],
        max_splits=10,
    )
    assert [(c.status, c.code) for c in settled.chunks] == [
        (ChunkStatus.SKIPPED, "CANCELLED"),
        (ChunkStatus.SKIPPED, "DEADLINE_EXCEEDED"),
    ]
    assert batches.end_state(settled, now=150.0) is BatchState.EXPIRED


def test_the_window_bounds_the_chunks_in_flight() -> None:
    plan = record((*queued((0, 1)), Chunk(1, 2), Chunk(2, 3), Chunk(3, 4)))
    assert [c.start for c in batches.to_submit(plan, window=3)] == [1, 2]
    assert batches.to_submit(plan, window=1) == ()


def test_a_cancelled_batch_ends_cancelled_and_keeps_its_done_chunks() -> None:
    plan = record((Chunk(0, 5, ChunkStatus.DONE), Chunk(5, 10)), state=BatchState.CANCELLING)
    skipped = batches.skip_waiting(plan, code="CANCELLED", message="cancelled")
    assert batches.finished(skipped)
    ended = batches.finish(skipped, now=150.0)
    assert ended.state is BatchState.CANCELLED
    # As OpenAI's Batch API counts: the records that never ran are neither completed nor failed.
    assert ended.counts == batches.RequestCounts(total=10, completed=5, failed=0, not_run=5)


def test_progress_rate_and_estimate() -> None:
    plan = record((Chunk(0, 50, ChunkStatus.DONE), Chunk(50, 100, ChunkStatus.QUEUED)), in_progress_time=100.0)
    rate, finish = batches.progress_rate(plan, now=110.0)
    assert rate == pytest.approx(5.0)
    assert finish == pytest.approx(120.0)


@given(st.integers(0, 10**6), st.integers(1, 10**4))
def test_chunk_job_ids_are_uuid7_and_the_same_on_every_driver(start: int, size: int) -> None:
    batch_id = "01a23228-043a-76e1-aa02-d43dbcf6731a"
    job_id = chunk_job_id(batch_id, start, start + size)
    assert is_job_id(job_id)
    assert job_id == chunk_job_id(batch_id, start, start + size)
    assert job_id != chunk_job_id(batch_id, start, start + size + 1)


def test_the_record_codec_round_trips() -> None:
    original = record(
        (Chunk(0, 3, ChunkStatus.FAILED, "INTERNAL", "boom"), Chunk(3, 6, ChunkStatus.SPLIT)),
        labels={"team": "x"},
        callback=CallbackSpec("https://example.com/hook"),
        first_errors=(ErrorLine(2, "b", "INVALID_ARGUMENT", "bad"),),
        input_format=InputFormat.NPZ,
        in_progress_time=101.5,
    )
    assert batches.decode_batch(batches.encode_batch(original), 7) == original.evolve(revision=7)
    traced = original.evolve(traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert batches.decode_batch(batches.encode_batch(traced)) == traced
    reading = original.evolve(reading=batches.ReadProgress(1000, 4000, 20, 100.0, 110.0))
    assert batches.decode_batch(batches.encode_batch(reading)) == reading
    assert b"reading" not in batches.encode_batch(original)  # only a batch being read carries it


def test_a_readings_rate_and_estimated_end() -> None:
    rate, end = batches.ReadProgress(1000, 4000, 20, 100.0, 110.0).rate()
    assert rate == pytest.approx(2.0)
    assert end == pytest.approx(140.0)  # a quarter of the bytes in 10 s: the rest in 30 s more
    assert batches.ReadProgress(0, 4000, 0, 100.0, 110.0).rate() == (0.0, None)
    assert batches.ReadProgress(10, 4000, 1, 100.0, 100.0).rate() == (0.0, None)


def test_a_batch_record_leaves_its_unset_traceparent_out_and_skips_a_field_it_does_not_know() -> None:
    """An untraced batch's record has no traceparent (a gateway of the release before reads it);
    a field of a later release is skipped rather than failing every read of the batch."""
    untraced = record((Chunk(0, 3),))
    assert b"traceparent" not in batches.encode_batch(untraced)
    later = json.loads(batches.encode_batch(untraced))
    later["a_later_field"] = [1, 2]
    assert batches.decode_batch(json.dumps(later).encode()) == untraced


@given(
    st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")), max_size=8),
    st.booleans(),
    st.lists(st.integers(0, 100), max_size=6),
)
def test_a_file_cut_anywhere_gives_its_lines_and_a_long_lines_length(
    lines: list[bytes], final_newline: bool, cuts: list[int]
) -> None:
    """The preparation's lines are the file's, however its pieces are cut; a line over the limit
    (here 8 bytes) comes as its length alone."""
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    splitter = LineSplitter(max_line_bytes=8)
    got = [line for a, b in itertools.pairwise(bounds) for line in splitter.feed(data[a:b])]
    got += splitter.end()
    expected = data.split(b"\n")
    if expected[-1] == b"":  # what follows the last newline, or an empty file: no line
        expected.pop()
    assert got == [line if len(line) <= 8 else LongLine(len(line)) for line in expected]


@given(st.lists(st.sampled_from(["ok", "bad", "blank"]), max_size=40), st.integers(1, 7))
def test_parsing_keeps_every_valid_record_once_in_order(kinds: list[str], chunk_records: int) -> None:
    builder = ChunkBuilder(SIGNATURE, chunk_records)
    chunks, bad = [], []
    for line, kind in enumerate(kinds, start=1):
        text = {"ok": json.dumps({"custom_id": f"c{line}", "inputs": {"x": [line, 0, 0, 0]}}), "bad": "{", "blank": ""}
        if kind == "blank":
            continue
        parsed = parse_line(line, text[kind].encode(), SIGNATURE)
        if isinstance(parsed, ErrorLine):
            bad.append(parsed.line)
        elif (closed := builder.add(*parsed)) is not None:
            chunks.append(closed)
    if (last := builder.close()) is not None:
        chunks.append(last)
    assert bad == [i for i, k in enumerate(kinds, start=1) if k == "bad"]
    ids = [e.custom_id for c in chunks for e in c.entries]
    assert ids == [f"c{i}" for i, k in enumerate(kinds, start=1) if k == "ok"]
    assert all(0 < c.end - c.start <= chunk_records for c in chunks)
    for c in chunks:
        x = c.tensors[0].to_numpy()
        assert x.shape == (c.end - c.start, 4)
        assert list(x[:, 0]) == [float(e.line) for e in c.entries]


def test_lines_that_do_not_fit_say_why() -> None:
    def error(text: str) -> str:
        parsed = parse_line(1, text.encode(), SIGNATURE)
        assert isinstance(parsed, ErrorLine)
        return parsed.message

    assert "must have shape" in error('{"custom_id": "a", "inputs": {"x": [[1, 2]]}}')
    assert "one row" in error('{"custom_id": "a", "inputs": {"x": [[1, 2, 3, 4], [1, 2, 3, 4]]}}')
    assert "missing input 'x'" in error('{"custom_id": "a", "inputs": {}}')
    assert "FP32" in error('{"custom_id": "a", "inputs": {"x": [["a", "b", "c", "d"]]}}')
    assert error('{"inputs": {"x": [[1e300, 2, 3, 4]]}}') == (
        "input 'x' has 1e+300, past FP32's range (±3.4028235e+38); the model takes x: FP32 of shape [-1, 4]"
    )
    assert error("{nope") == "not a JSON line: Expecting property name enclosed in double quotes at column 2"
    # Another field is a mistake to name, not to skip: a typo of custom_id, or a bulk line's model.
    assert error('{"custom-id": "a", "inputs": {"x": [[1, 2, 3, 4]]}}') == (
        "unknown field 'custom-id' (a line has custom_id and inputs)"
    )
    assert "unknown field 'model'" in error('{"model": "other", "inputs": {"x": [[1, 2, 3, 4]]}}')


def test_booleans_where_numbers_go_and_numbers_where_booleans_go_are_error_lines() -> None:
    """numpy makes [true, 2.5] a float array and [true, 2] an integer one: an FP32 or INT64 input
    took true and false as 1 and 0, the line's mistake run. Each is now its line's error, saying
    which input; true/false alone (a BOOL array) and numbers for a BOOL input were refused before,
    now saying why; a line of numbers, 0 and 1 among them, and booleans for BOOL still run."""
    ints = ModelSignature(inputs=(TensorSpec("ids", "INT64", (-1, 2)),), outputs=())
    flags = ModelSignature(inputs=(TensorSpec("on", "BOOL", (-1, 2)),), outputs=())

    def parsed(text: str, signature: ModelSignature = SIGNATURE) -> str | dict[str, list[Any]]:
        result = parse_line(2, text.encode(), signature)
        if isinstance(result, ErrorLine):
            assert (result.line, result.code) == (2, "INVALID_ARGUMENT")
            return result.message
        return {name: array.tolist() for name, array in result[1].items()}

    mixed = "mixes booleans (true/false) with numbers, which would run as 1 and 0"
    assert parsed('{"inputs": {"x": [[true, 2.5, 0, 1]]}}') == f"input 'x' {mixed}: FP32 takes numbers only"
    assert parsed('{"inputs": {"x": [[1, 2.5, 3, false]]}}') == f"input 'x' {mixed}: FP32 takes numbers only"
    assert parsed('{"inputs": {"ids": [[true, 2]]}}', ints) == f"input 'ids' {mixed}: INT64 takes numbers only"
    assert parsed('{"inputs": {"x": [[true, false, true, true]]}}') == (
        "input 'x' is FP32: give numbers, not booleans (true/false)"
    )
    assert (
        parsed('{"inputs": {"on": [[1, 0]]}}', flags)
        == "input 'on' is BOOL: give booleans (true or false), not numbers"
    )
    assert parsed('{"inputs": {"on": [[true, 0]]}}', flags) == (
        "input 'on' is BOOL: give booleans (true or false), not numbers"
    )
    assert parsed('{"inputs": {"x": [[1, 0, 2.5, 1.0]]}}') == {"x": [[1.0, 0.0, 2.5, 1.0]]}
    assert parsed('{"inputs": {"ids": [[0, 1]]}}', ints) == {"ids": [[0, 1]]}
    assert parsed('{"inputs": {"on": [[true, false]]}}', flags) == {"on": [[True, False]]}


def test_a_value_its_datatype_cannot_hold_is_an_error_line_saying_why() -> None:
    """A number an input's datatype cannot hold as written is its line's error, never cast (1.5 for
    INT64 was one before too); the line said only "input 'ids' must be INT64 numbers", for a
    fraction as for 300 to UINT8, -1 to an unsigned input or 1e20 to INT64. Each now names the
    value and why, as the CLI's -i does. A whole float (2.0) for an integer input stays an error
    line, naming the value and how to write it, in the CLI's -i words; what fits runs."""

    def parsed(text: str, datatype: str) -> str | list[Any]:
        result = parse_line(
            3, text.encode(), ModelSignature(inputs=(TensorSpec("ids", datatype, (-1, 2)),), outputs=())
        )
        if isinstance(result, ErrorLine):
            assert (result.line, result.code) == (3, "INVALID_ARGUMENT")
            # Each ends with what the model takes, as the CLI's -i and the SDK say it (session 33).
            takes = f"; the model takes ids: {datatype} of shape [-1, 2]"
            assert result.message.endswith(takes), result.message
            return result.message.removesuffix(takes)
        return list(result[1]["ids"].tolist())

    assert parsed('{"inputs": {"ids": [[1.5, 2]]}}', "INT64") == (
        "input 'ids' has 1.5, not a whole number: INT64 takes whole numbers"
    )
    assert parsed('{"inputs": {"ids": [[1e20, 2]]}}', "INT64") == (
        "input 'ids' has 1e+20, past INT64's range (-9223372036854775808 to 9223372036854775807)"
    )
    assert parsed('{"inputs": {"ids": [[300, 2]]}}', "UINT8") == "input 'ids' has 300, past UINT8's range (0 to 255)"
    assert parsed('{"inputs": {"ids": [[-1, 2]]}}', "UINT8") == "input 'ids' has -1, past UINT8's range (0 to 255)"
    assert parsed('{"inputs": {"ids": [[2, 300]]}}', "INT8") == "input 'ids' has 300, past INT8's range (-128 to 127)"
    assert parsed('{"inputs": {"ids": [[-1, 2]]}}', "UINT64") == (
        "input 'ids' has -1, past UINT64's range (0 to 18446744073709551615)"
    )
    assert parsed('{"inputs": {"ids": [[NaN, 2]]}}', "INT32") == (
        "input 'ids' has nan, which INT32 cannot hold: it takes whole numbers"
    )
    assert parsed('{"inputs": {"ids": [[70000, 2]]}}', "FP16") == "input 'ids' has 70000, past FP16's range (±65504)"
    assert parsed('{"inputs": {"ids": [[2.0, 3]]}}', "INT64") == (
        "input 'ids' has 2.0, a float: INT64 takes integers (write 2, not 2.0)"
    )
    assert parsed('{"inputs": {"ids": [["a", "b"]]}}', "INT64") == "input 'ids' must be INT64 numbers"
    assert parsed('{"inputs": {"ids": [[1, 2], [3]]}}', "FP32") == (
        "input 'ids' is not a rectangular array: its rows are not all the same length"
    )
    assert parsed('{"inputs": {"ids": [[-128, 127]]}}', "INT8") == [[-128, 127]]
    assert parsed('{"inputs": {"ids": [[0, 255]]}}', "UINT8") == [[0, 255]]
    assert parsed('{"inputs": {"ids": [[1.5, 65504]]}}', "FP16") == [[1.5, 65504.0]]


def test_a_record_without_a_custom_id_is_known_by_its_line() -> None:
    """The output holds only the records that succeeded and is joined to the input by custom_id,
    so a record that gives none (absent, null or "") gets its line number; a number is its text."""
    for field, expected in (
        ("", "7"),
        (', "custom_id": null', "7"),
        (', "custom_id": ""', "7"),
        (', "custom_id": 42', "42"),
    ):
        parsed = parse_line(7, ('{"inputs": {"x": [[1, 2, 3, 4]]}' + field + "}").encode(), SIGNATURE)
        assert not isinstance(parsed, ErrorLine)
        assert parsed[0].custom_id == expected
    # Another kind is refused: Python's str() made true "True" and an object "{'a': 1}".
    for other in ("true", "1.5", '{"a": 1}', "[1]"):
        refused = parse_line(7, ('{"inputs": {"x": [[1, 2, 3, 4]]}, "custom_id": ' + other + "}").encode(), SIGNATURE)
        assert isinstance(refused, ErrorLine), other
        assert refused.message.startswith("custom_id must be a string (or an integer)"), refused.message
        assert refused.custom_id == "7"


def test_a_change_of_shape_closes_the_chunk() -> None:
    builder = ChunkBuilder(TEXT, 10)
    parsed = [parse_line(i, json.dumps({"inputs": {"text": [f"t{i}"]}}).encode(), TEXT) for i in range(3)]
    for entry in parsed:
        assert not isinstance(entry, ErrorLine)
        assert builder.add(*entry) is None
    closed = builder.close()
    assert closed is not None
    assert closed.tensors[0].to_numpy().tolist() == [b"t0", b"t1", b"t2"]


def test_npy_and_npz_files_are_records_along_the_first_dimension() -> None:
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    npy, npz = io.BytesIO(), io.BytesIO()
    np.save(npy, x)
    np.savez(npz, x=x)
    assert detect_format(npy.getvalue()) is InputFormat.NPY
    assert detect_format(npz.getvalue()) is InputFormat.NPZ
    for data, fmt in ((npy.getvalue(), InputFormat.NPY), (npz.getvalue(), InputFormat.NPZ)):
        chunks = list(array_chunks(array_inputs(data, fmt, SIGNATURE, max_bytes=1 << 20), SIGNATURE, 4))
        assert [(c.start, c.end) for c in chunks] == [(0, 4), (4, 8), (8, 10)]
        assert np.array_equal(np.concatenate([c.tensors[0].to_numpy() for c in chunks]), x)
    wrong = io.BytesIO()
    np.save(wrong, np.zeros((3, 5), dtype=np.float32))
    with pytest.raises(RecordInvalid, match="must have shape"):
        array_inputs(wrong.getvalue(), InputFormat.NPY, SIGNATURE, max_bytes=1 << 20)


def _npz(**arrays: np.ndarray[Any, Any]) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def _with_shape(npy: bytes, shape: tuple[int, ...], *, fortran: bool = False) -> bytes:
    """An NPY file whose header says `shape` (padded to the length of the header it replaces)."""
    header_len = int.from_bytes(npy[8:10], "little")
    header = repr({"descr": "<f4", "fortran_order": fortran, "shape": shape}).encode()
    return npy[:10] + header.ljust(header_len - 1) + b"\n" + npy[10 + header_len :]


@pytest.mark.parametrize(
    ("datatype", "array", "said"),
    [
        (
            "INT8",
            np.array([[1, 2], [3, 300]], dtype=np.int64),
            "array 'x' (int64) has a value past INT8's range, in record 1",
        ),
        (
            "UINT8",
            np.array([[-1, 2], [3, 4]], dtype=np.int64),
            "array 'x' (int64) has a value past UINT8's range, in record 0",
        ),
        (
            "FP16",
            np.array([[1, 2], [3, 1e6]], dtype=np.float32),
            "array 'x' (float32) has a value past FP16's range, in record 1",
        ),
        ("INT32", np.array([[1, 2], [3, 1.5]]), "array 'x' must be INT32, got float64"),  # the kind is at fault
    ],
)
def test_an_array_value_past_the_models_range_names_its_record_not_the_dtype(
    datatype: str, array: Any, said: str
) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, x=array)
    signature = ModelSignature((TensorSpec("x", datatype, (-1, 2)),), ())
    with pytest.raises(RecordInvalid) as refused:
        array_inputs(buffer.getvalue(), InputFormat.NPZ, signature, max_bytes=1 << 20)
    assert str(refused.value) == said


def test_hostile_array_files_are_refused_as_the_files_fault_before_anything_is_allocated() -> None:
    """A hostile-input pass (session 25): a 199-KiB NPZ of zeros grew the gateway by 201 MiB (a
    deflate bomb; 1 GiB uploads are allowed), and files numpy or zipfile refused with another
    error than ValueError (a ZIP that is not one: BadZipFile; a header declaring 10^12 rows:
    MemoryError) left their batch VALIDATING, its preparation tried again for its whole window."""
    bomb = _npz(x=np.zeros((4_000_000, 4), np.float32))  # 64 MB of zeros, ~60 KB compressed
    assert len(bomb) < 200_000
    with pytest.raises(RecordInvalid, match=r"uncompressed; at most 1048576 \(gateway.max_upload_bytes\)"):
        array_inputs(bomb, InputFormat.NPZ, SIGNATURE, max_bytes=1 << 20)
    assert array_inputs(bomb, InputFormat.NPZ, SIGNATURE, max_bytes=1 << 27)["x"].shape == (4_000_000, 4)

    small = io.BytesIO()
    np.save(small, np.zeros((2, 4), np.float32))
    for shape, fortran in (((10**12, 4), False), ((10**12, 4), True)):
        lying = _with_shape(small.getvalue(), shape, fortran=fortran)
        with pytest.raises(RecordInvalid, match="declares shape"):
            array_inputs(lying, InputFormat.NPY, SIGNATURE, max_bytes=1 << 20)
        archive = io.BytesIO()
        with zipfile.ZipFile(archive, "w") as zipped:
            zipped.writestr("x.npy", lying)
        with pytest.raises(RecordInvalid, match=r"the NPZ member 'x\.npy' declares shape"):
            array_inputs(archive.getvalue(), InputFormat.NPZ, SIGNATURE, max_bytes=1 << 20)

    with pytest.raises(RecordInvalid, match="not a readable NPZ file: BadZipFile"):
        array_inputs(b"PK\x03\x04" + b"\0" * 100, InputFormat.NPZ, SIGNATURE, max_bytes=1 << 20)


def test_an_npy_file_streams_row_by_row_from_its_header() -> None:
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    buffer = io.BytesIO()
    np.save(buffer, x)
    data = buffer.getvalue()
    layout = npy_layout(data[:200], SIGNATURE)
    assert layout is not None
    assert (layout.rows, layout.row_bytes) == (10, 16)
    body = data[layout.offset :]
    first, second = npy_chunk(layout, body[:64], 0, SIGNATURE), npy_chunk(layout, body[64:], 4, SIGNATURE)
    assert [(first.start, first.end), (second.start, second.end)] == [(0, 4), (4, 10)]
    assert np.array_equal(np.concatenate([first.tensors[0].to_numpy(), second.tensors[0].to_numpy()]), x)
    assert [e.custom_id for e in second.entries] == [str(i) for i in range(4, 10)]
    fortran = io.BytesIO()
    np.save(fortran, np.asfortranarray(x))
    assert npy_layout(fortran.getvalue(), SIGNATURE) is None  # read whole instead
    wrong = io.BytesIO()
    np.save(wrong, np.zeros((10, 5), dtype=np.float32))
    with pytest.raises(RecordInvalid, match=r"must have shape \[-1, 4\] .* got \[10, 5\]$"):
        npy_layout(wrong.getvalue()[:200], SIGNATURE)  # the file's shape, though no row was read


def test_an_npz_output_is_sent_in_pieces_under_the_message_limit() -> None:
    """A chunk's rows are MBs: what the archive writer gathered goes out in pieces of at most
    PIECE_BYTES, in order (one piece over gRPC's 4 MiB message limit ended a read)."""
    sink = ArchiveSink()
    data = bytes(range(256)) * (6 * 4096)  # 6 MiB
    sink.write(data[:100])
    sink.write(data[100:])
    pieces = sink.take()
    assert max(len(piece) for piece in pieces) <= PIECE_BYTES
    assert b"".join(pieces) == data
    assert sink.take() == []


def test_output_lines_keep_each_records_batch_dimension_and_write_valid_json() -> None:
    """A JSONL output line per record: numbers as they are (a NaN as null: JSON has none), text
    decoded, each value with the record's batch dimension of 1."""
    y = Tensor.from_numpy("y", np.array([[1.5, float("nan")], [0.00001, -2.0]], dtype=np.float32), "FP32")
    label = Tensor.from_numpy("label", np.array([b"cat", "caf\u00e9".encode()], dtype=np.object_), "BYTES")
    lines = [json.loads(line) for line in output_lines([y, label], [(1, "a"), (2, "b")]).splitlines()]
    assert lines[0] == {"custom_id": "a", "outputs": {"y": [[1.5, None]], "label": ["cat"]}}
    assert lines[1]["custom_id"] == "b"
    assert lines[1]["outputs"]["label"] == ["caf\u00e9"]
    assert lines[1]["outputs"]["y"] == [[pytest.approx(0.00001), -2.0]]


def test_a_line_json_dumps_wrote_with_nan_is_still_a_record() -> None:
    """Lines are decoded by msgspec, which refuses NaN and Infinity; Python's json.dumps writes
    them, so such a line is read by Python's json as before, and a broken line is still an error."""
    entry_and_arrays = parse_line(
        3, json.dumps({"custom_id": "n", "inputs": {"x": [[float("nan"), 1, 2, 3]]}}).encode(), SIGNATURE
    )
    assert not isinstance(entry_and_arrays, ErrorLine)
    entry, arrays = entry_and_arrays
    assert entry.custom_id == "n"
    assert np.isnan(arrays["x"][0, 0])
    assert arrays["x"][0, 1:].tolist() == [1, 2, 3]
    broken = parse_line(4, b'{"custom_id": "b", "inputs": ', SIGNATURE)
    assert isinstance(broken, ErrorLine)
    assert broken.message.startswith("not a JSON line")


def test_a_number_past_any_floats_range_is_an_error_where_infinity_written_is_kept() -> None:
    """1e400 was read as inf and ran (its output null) where 1e300 for FP32 is refused; Infinity,
    as json.dumps writes it, is still kept."""
    past = parse_line(2, b'{"custom_id": "p", "inputs": {"x": [[1, 2, 3, -1e400]]}}', SIGNATURE)
    assert isinstance(past, ErrorLine)
    assert (past.custom_id, past.message) == ("p", "input 'x' has a number past the range of any float (FP64's)")
    written = parse_line(3, json.dumps({"inputs": {"x": [[float("inf"), 1, 2, 3]]}}).encode(), SIGNATURE)
    assert not isinstance(written, ErrorLine)
    assert np.isposinf(written[1]["x"][0, 0])


def test_getbatch_names_the_files_once_they_can_be_read() -> None:
    """ReadBatchFile refuses a batch that has not ended (BATCH_NOT_ENDED), so GetBatch names its
    files only then (it named them while running once a line had failed validation); a FAILED batch
    has them only when lines failed validation (its error file lists them)."""
    running = record(queued((0, 5)), invalid_lines=2)
    assert not batch_to_proto(running, now=150.0).HasField("output_ref")
    done = batch_to_proto(running.evolve(state=BatchState.COMPLETED, end_time=160.0), now=170.0)
    assert (done.output_ref.ref, done.error_ref.ref) == (output_ref(running), error_ref(running))
    failed_lines = running.evolve(state=BatchState.FAILED, end_time=160.0)
    assert batch_to_proto(failed_lines, now=170.0).error_ref.ref == error_ref(running)
    unreadable = record(state=BatchState.FAILED, end_time=160.0)
    assert not batch_to_proto(unreadable, now=170.0).HasField("error_ref")


def test_a_broken_json_line_says_where_once() -> None:
    """json's own message ends in "at" before its position ("Unterminated string starting at"):
    the error line read "starting at at column 15"."""
    bad = parse_line(3, b'{"custom_id": "a", "inputs": {"x": "open', SIGNATURE)
    assert isinstance(bad, ErrorLine)
    assert bad.message == "not a JSON line: Unterminated string starting at column 36"


def test_a_line_nested_too_deeply_or_too_long_is_an_error_line() -> None:
    """A helper's batch pass, session 24: a line nested 1,000 levels deep raised RecursionError out of
    the parser, and the batch's preparation failed and started again some 400 times a second, never
    leaving VALIDATING; a 45-MB line was decoded whole, taking the gateway from 123 to 529 MB."""
    deep = parse_line(4, b'{"inputs": {"x": ' + b"[" * 5000 + b"]" * 5000 + b"}}", SIGNATURE)
    assert isinstance(deep, ErrorLine)
    assert (deep.line, deep.code, deep.message) == (4, "INVALID_ARGUMENT", "not a JSON line: nested too deeply")
    long_line = b'{"inputs": {"x": [[' + b"1," * (MAX_LINE_BYTES // 2) + b"1]]}}"
    too_long = parse_line(5, long_line, SIGNATURE)
    assert isinstance(too_long, ErrorLine)
    assert too_long.message == f"the line is {len(long_line)} bytes, over {MAX_LINE_BYTES}"


def test_a_bytes_output_that_is_not_text_keeps_its_bytes() -> None:
    """A helper's CLI pass, session 24: decoded with "replace", non-UTF-8 BYTES were lost in the output
    file, silently ("\\xff\\xfe" became two U+FFFD), where the CLI's JSON writes {"b64": ...}."""
    raw = b"\xff\xfe\x00bad\xc3("
    texts = Tensor.from_numpy("t", np.array([[raw], ["caf\u00e9".encode()]], dtype=object))
    lines = [json.loads(line) for line in output_lines([texts], [(1, "a"), (2, "b")]).splitlines()]
    assert lines[0]["outputs"]["t"] == [[{"b64": base64.b64encode(raw).decode()}]]
    assert lines[1]["outputs"]["t"] == [["caf\u00e9"]]


def test_an_upload_keeps_only_the_batches_that_may_still_read_it() -> None:
    """An upload named every batch ever created over it (a nightly batch grew the list without
    bound); a create keeps those that have not ended, and a name whose record is not written yet
    for the while its create may take (it names the batch first), not one whose record is gone."""
    live = record()
    minted_s = job_id_time_ms(live.batch_id) / 1000.0
    assert may_read_its_input(live.batch_id, live, now=minted_s + 1e6)  # running: however old
    assert may_read_its_input(live.batch_id, live.evolve(state=BatchState.CANCELLING), now=minted_s)
    for ended in (BatchState.COMPLETED, BatchState.FAILED, BatchState.EXPIRED, BatchState.CANCELLED):
        assert not may_read_its_input(live.batch_id, live.evolve(state=ended), now=minted_s)
    assert may_read_its_input(live.batch_id, None, now=minted_s + 1.0)  # its create writes the record next
    assert may_read_its_input(live.batch_id, None, now=minted_s + CREATE_RECORD_WITHIN_S)  # its write in flight
    assert not may_read_its_input(live.batch_id, None, now=minted_s + create_settled_after_s())  # gone, or never
    assert not may_read_its_input("not-a-batch-id", None, now=minted_s)
    # How long a DeleteInput is told to wait for a create under way (its retry hint).
    assert create_settles_in_s(live.batch_id, now=minted_s + 1.0) == pytest.approx(create_settled_after_s() - 1.0)
    assert create_settles_in_s(live.batch_id, now=minted_s + 1e6) == 0.0
    assert create_settles_in_s("not-a-batch-id", now=minted_s) == 0.0


def test_a_withdrawn_batch_is_told_from_one_that_failed_and_asks_for_no_webhook() -> None:
    taker = record(state=BatchState.VALIDATING, callback=CallbackSpec("https://example.com/hook"))
    holder = new_job_id()
    withdrawal = batches.withdrawn_batch(
        taker, batch_id=holder, now=150.0, why=batches.superseded_why(taker.batch_id, 26.0)
    )
    assert (withdrawal.batch_id, withdrawal.state, withdrawal.end_time) == (holder, BatchState.FAILED, 150.0)
    assert taker.batch_id in withdrawal.failure_message
    assert batches.is_withdrawn(withdrawal)
    assert not callback_due(withdrawal)  # nobody asked for its end
    assert withdrawal.kept_until == taker.kept_until  # kept as long as the key's claim
    # A batch that failed on its own (its preparation, its model gone) is no withdrawal, nor one that ran.
    assert not batches.is_withdrawn(
        taker.evolve(state=BatchState.FAILED, failure_message="the model is no longer served")
    )
    assert not batches.is_withdrawn(withdrawal.evolve(in_progress_time=120.0))
    assert not batches.is_withdrawn(withdrawal.evolve(state=BatchState.CANCELLED))
