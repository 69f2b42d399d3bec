"""Batch jobs over files (issue 15), end to end against a real nats-server, the real gateway,
scheduler and batcher: a JSONL upload in, its output in input order and its error file out, with
chunks of more records than the model's max_batch_size."""

from __future__ import annotations

import asyncio
import io
import os
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2
from prometheus_client import generate_latest

from asyncinfer import batch_inputs
from asyncinfer.commands.ops import dead_letter_json
from asyncinfer.config import DEMO_MODEL, Config
from asyncinfer.contract import BYTES_IN_HEADER
from asyncinfer.jobs import BATCH_LABEL, Priority
from asyncinfer.v1 import batch_service_pb2, job_service_pb2, ops_service_pb2, ops_service_pb2_grpc
from services.console.app import ConsoleApp
from services.gateway.batch_prepare import chunk_ref
from tests.batch_helpers import (
    batches_stub,
    create_request,
    demo_records,
    errors,
    jsonl,
    npy_bytes,
    npz_output,
    outputs,
    upload,
    wait_ended,
    wait_until,
)
from tests.processes import until as until_true
from tests.stack import Stack, StartStack
from tests.test_gateway import submit_request
from tests.test_scheduler import until


def batch_config(config: Config, **batches: Any) -> Config:
    return config.replace(
        batches={"chunk_records": 100, "drive_interval_s": 0.05, **batches},
        models=[
            DEMO_MODEL.model_dump(),
            {
                **DEMO_MODEL.model_dump(),
                "name": "masked",
                "outputs": [{**DEMO_MODEL.outputs[0].model_dump(), "name": "succeeded"}],
            },
            {
                **DEMO_MODEL.model_dump(),
                "name": "flaky",
                "loader": "services.batcher.models.demo:build_flaky_model",
                "max_attempts": 1,
            },
        ],
    )


def expected_y(record: dict[str, Any]) -> list[float]:
    (row,) = record["inputs"]["x"]
    return [2 * v + 1 for v in row]


async def test_a_jsonl_batch_runs_in_chunks_and_its_output_keeps_input_order(
    config: Config, start_stack: StartStack
) -> None:
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    records = demo_records(450)  # 5 chunks of up to 100, each more rows than max_batch_size 32
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, jsonl(records))))
    assert created.batch.state == batch_service_pb2.BATCH_STATE_VALIDATING
    assert created.batch.priority == 3  # LOW by default

    batch = await wait_ended(stub, created.batch.batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (450, 450, 0)
    assert batch.chunks_total == 5
    assert batch.chunks_done == 5
    lines = await outputs(stub, batch.batch_id)
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in records]
    for line, record in zip(lines, records, strict=True):
        (y,) = line["outputs"]["y"]
        assert y == pytest.approx(expected_y(record))
    assert await errors(stub, batch.batch_id) == []
    got = await stub.GetBatch(batch_service_pb2.GetBatchRequest(batch_id=batch.batch_id))
    assert got.batch.request_counts.completed == 450
    assert got.batch.records_per_second > 0
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await npz_output(stub, batch.batch_id)  # its records are known by custom_id: JSONL only
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "NPZ_OUTPUT_NEEDS_ARRAY_INPUT" in str(refused.value.trailing_metadata())


async def test_a_chunk_that_ends_frees_its_slot_at_once_not_at_the_next_tick(
    config: Config, start_stack: StartStack
) -> None:
    """The driver hears each chunk job end from the gateway's watch feed and submits the next
    chunk then: with one chunk in flight and a tick a minute apart, five chunks run in seconds
    (read only at the ticks, each chunk after the first would wait for one: four minutes)."""
    stack = await start_stack(batch_config(config, drive_interval_s=60.0, chunks_in_flight=1))
    stub = batches_stub(stack.channel)
    records = demo_records(450)
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, jsonl(records))))

    batch = await wait_ended(stub, created.batch.batch_id, timeout_s=30.0)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert (batch.chunks_total, batch.chunks_done, batch.request_counts.completed) == (5, 5, 450)
    lines = await outputs(stub, batch.batch_id)
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in records]


async def test_an_idle_gateways_batch_driver_sleeps_and_a_new_batch_is_driven_at_once(
    config: Config, start_stack: StartStack
) -> None:
    """A measurement pass on an idle `asyncinfer up` (session 27): the batch driver woke every
    drive_interval_s (0.2 s) with no batch to drive. With none it now sleeps until a batch is
    created, cancelled or prepared here, or until the next adoption pass (a minute here): no round
    in 1 s where the tick is every 50 ms. A batch created then is driven at once, to its end."""
    stack = await start_stack(batch_config(config, drive_interval_s=0.05, adopt_interval_s=60.0))
    driver = stack.gateway.batch_driver
    assert driver is not None
    await until_true(lambda: driver.rounds >= 1, timeout_s=10.0)
    rounds = driver.rounds
    await asyncio.sleep(1.0)  # the idle window being measured: nothing to wait for
    assert driver.rounds == rounds, f"{driver.rounds - rounds} rounds in 1 s without a batch"
    stub = batches_stub(stack.channel)
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, jsonl(demo_records(150)))))
    batch = await wait_ended(stub, created.batch.batch_id, timeout_s=30.0)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert (batch.chunks_done, batch.request_counts.completed) == (2, 150)


async def test_a_bad_line_is_one_error_line_and_the_rest_run(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    records: list[Any] = demo_records(120)
    records[3] = {"custom_id": "short", "inputs": {"x": [[1, 2, 3]]}}
    records[50] = {"custom_id": "unknown-input", "inputs": {"z": [[1, 2, 3, 4]]}}
    data = jsonl(records).replace(b'"custom_id": "r77"', b'"custom_id": "r77",,')  # not JSON
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, data)))
    batch = await wait_ended(stub, created.batch.batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (120, 117, 3)
    bad = await errors(stub, batch.batch_id)
    assert [(e["line"], e["custom_id"], e["code"]) for e in bad] == [
        (4, "short", "INVALID_ARGUMENT"),
        (51, "unknown-input", "INVALID_ARGUMENT"),
        (78, "", "INVALID_ARGUMENT"),
    ]
    assert [e.line for e in batch.first_errors] == [4, 51, 78]
    good = [r["custom_id"] for i, r in enumerate(records) if i not in (3, 50, 77)]
    assert [line["custom_id"] for line in await outputs(stub, batch.batch_id)] == good


async def test_booleans_beside_numbers_are_one_error_line_not_ones_and_zeros(
    config: Config, start_stack: StartStack
) -> None:
    """numpy makes [true, 2.5] a float array: the demo model's FP32 input ran true and false as 1
    and 0 (the batch COMPLETED, the line's outputs computed from them). Such a line is now one line
    of the error file naming the input, and the rest run."""
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    records: list[Any] = demo_records(6)
    records[1] = {"custom_id": "mixed", "inputs": {"x": [[True, 2.5, 0, 1]]}}
    records[4] = {"custom_id": "flags", "inputs": {"x": [[True, False, True, True]]}}
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, jsonl(records))))
    batch = await wait_ended(stub, created.batch.batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 4, 2)
    bad = await errors(stub, batch.batch_id)
    assert [(e["line"], e["custom_id"], e["code"], e["message"]) for e in bad] == [
        (
            2,
            "mixed",
            "INVALID_ARGUMENT",
            "input 'x' mixes booleans (true/false) with numbers, which would run as 1 and 0: FP32 takes numbers only",
        ),
        (5, "flags", "INVALID_ARGUMENT", "input 'x' is FP32: give numbers, not booleans (true/false)"),
    ]
    assert [line["custom_id"] for line in await outputs(stub, batch.batch_id)] == ["r0", "r2", "r3", "r5"]


async def test_a_line_over_the_limit_is_one_error_line_and_is_not_held_whole(
    config: Config, start_stack: StartStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line past MAX_LINE_BYTES (here 1 MiB) is counted as it streams, not gathered: a 24-MiB line
    took the preparation's memory past 48 MiB (each piece was joined to all of the line before it,
    a copy per piece), and a 1-GiB one (a JSON array sent as one line) hours of the gateway's loop."""
    monkeypatch.setattr(batch_inputs, "MAX_LINE_BYTES", 1 << 20)
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    records = demo_records(6)
    long_line = b'[{"custom_id": "a", "inputs": {"x": [[' + b"1.0, " * ((24 << 20) // 5) + b"1.0]]}}]\n"
    data = jsonl(records[:3]) + long_line + jsonl(records[3:]).rstrip(b"\n")  # the last line has no newline
    ref = await upload(stack.jobs, data)
    del data
    tracemalloc.start()
    try:
        created = await stub.CreateBatch(create_request(ref))
        batch = await wait_ended(stub, created.batch.batch_id)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    bad = await errors(stub, batch.batch_id)
    assert bad == [
        {
            "line": 4,
            "custom_id": "",
            "code": "INVALID_ARGUMENT",
            "message": f"the line is {len(long_line) - 1} bytes, over {1 << 20}",
        }
    ]
    assert [line["custom_id"] for line in await outputs(stub, batch.batch_id)] == [r["custom_id"] for r in records]
    assert peak < 8 << 20, f"the preparation held {peak} bytes for a line of {len(long_line)}"


async def test_too_many_bad_lines_fail_the_batch(config: Config, start_stack: StartStack) -> None:
    """A batch failed at validation never ran, and reads so (as OpenAI's Batch API's: failed_at,
    never in_progress_at): no in_progress_time, no chunks, and on the console's page no "in progress
    since" nor a link to chunk jobs it never had. (It said in progress since its failure, chunks 0
    of 1, and linked an empty jobs list.)"""
    stack = await start_stack(batch_config(config, max_invalid_fraction=0.1))
    stub = batches_stub(stack.channel)
    data = jsonl(demo_records(10)) + b"nonsense\n" * 5
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, data)))
    batch = await wait_ended(stub, created.batch.batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_FAILED
    assert "5 of 15 lines failed validation" in batch.failure_message
    assert len(await errors(stub, batch.batch_id)) == 5
    assert await outputs(stub, batch.batch_id) == []
    got = (await stub.GetBatch(batch_service_pb2.GetBatchRequest(batch_id=batch.batch_id))).batch
    assert got.HasField("end_time")
    assert not got.HasField("in_progress_time"), "a batch failed at validation never ran"
    assert (got.chunks_total, got.chunks_done) == (0, 0)
    counts = got.request_counts
    assert (counts.total, counts.completed, counts.failed) == (15, 0, 5)
    assert got.records_per_second == 0
    assert not got.HasField("estimated_finish_time")
    console = ConsoleApp(
        stack.config.replace(
            console={"port": 0, "gateway_address": stack.address, "scheduler_address": stack.ops_address}
        )
    )
    await console.start()
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{console.url}batches/{batch.batch_id}") as page,
        ):
            text = await page.text()
    finally:
        await console.stop()
    assert "5 of 15 lines failed validation" in text
    assert "<tr><td>in progress since</td><td>-</td></tr>" in text
    assert "<tr><td>chunks</td><td>-</td></tr>" in text
    assert 'id="chunk-jobs"' not in text


async def test_an_input_format_the_file_is_not_fails_the_batch_saying_what_it_is(
    config: Config, start_stack: StartStack
) -> None:
    """A declared input_format that the file's first bytes contradict: FAILED, naming both, rather
    than every NPY byte failing as a JSONL line or numpy's own parse error."""
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    npy = io.BytesIO()
    np.save(npy, np.ones((5, 4), dtype=np.float32))
    cases = [
        (npy.getvalue(), batch_service_pb2.BATCH_INPUT_FORMAT_JSONL, "input_format says JSONL, but the file is NPY"),
        (
            jsonl(demo_records(5)),
            batch_service_pb2.BATCH_INPUT_FORMAT_NPY,
            "input_format says NPY, but the file is not",
        ),
    ]
    for data, declared, said in cases:
        created = await stub.CreateBatch(create_request(await upload(stack.jobs, data), input_format=declared))
        batch = await wait_ended(stub, created.batch.batch_id)
        assert batch.state == batch_service_pb2.BATCH_STATE_FAILED
        assert batch.failure_message.startswith(said), batch.failure_message
    # Its NPZ output: refused as a failed batch's (it said "reads a JSONL file" of the NPY one).
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await npz_output(stub, batch.batch_id)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "FAILED before any record ran" in (refused.value.details() or "")


async def test_an_array_file_numpy_cannot_read_or_too_large_uncompressed_fails_the_batch(
    config: Config, start_stack: StartStack
) -> None:
    """A file that starts like a ZIP and is not one, an NPZ of zeros larger uncompressed than an
    upload may be, and an NPZ with an array the model does not take (it was ignored): FAILED at once. (The first stayed VALIDATING, its preparation tried again with a
    traceback every 30 s until its window ended; the second was decompressed whole.)"""
    stack = await start_stack(batch_config(config.replace(gateway={"max_upload_bytes": 1 << 20})))
    stub = batches_stub(stack.channel)
    bomb = io.BytesIO()
    np.savez_compressed(bomb, x=np.zeros((100_000, 4), dtype=np.float32))  # 1.6 MB, a few KB compressed
    extra = io.BytesIO()  # an array the model does not take (a misnamed one): refused, not ignored
    np.savez(extra, x=np.ones((3, 4), dtype=np.float32), mask=np.ones((3, 4), dtype=np.float32))
    cases = [
        (b"PK\x03\x04" + b"\0" * 64, "not a readable NPZ file: BadZipFile"),
        (bomb.getvalue(), "the NPZ file's arrays are 1600"),
        (extra.getvalue(), "the NPZ file has arrays the model does not take: 'mask'; the model takes: x"),
    ]
    for data, said in cases:
        created = await stub.CreateBatch(create_request(await upload(stack.jobs, data)))
        batch = await wait_ended(stub, created.batch.batch_id)
        assert batch.state == batch_service_pb2.BATCH_STATE_FAILED
        assert batch.failure_message.startswith(said), batch.failure_message


async def test_a_value_past_the_models_range_fails_its_row_streamed_and_names_its_record_read_whole(
    config: Config, start_stack: StartStack
) -> None:
    """A float64 array with one value past FP32's range: streamed from its header (C order), its
    row's chunk fails when read and is split until the row fails alone; read whole (Fortran order,
    NPZ), the batch fails naming the record. (It said "must be FP32, got float64", a dtype that is
    converted, and the same array in C order ran.)"""
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    x = np.ones((150, 4))
    x[120, 1] = 1e300
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, npy_bytes(x))))
    streamed = await wait_ended(stub, created.batch.batch_id)
    assert streamed.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert (streamed.request_counts.completed, streamed.request_counts.failed) == (149, 1)
    bad = await errors(stub, streamed.batch_id)
    assert [(e["line"], e["custom_id"], e["code"]) for e in bad] == [(121, "120", "INVALID_ARGUMENT")]
    assert "do not fit FP32" in bad[0]["message"]
    archive = io.BytesIO()
    np.savez(archive, x=x)
    for data in (npy_bytes(np.asfortranarray(x)), archive.getvalue()):
        created = await stub.CreateBatch(create_request(await upload(stack.jobs, data)))
        whole = await wait_ended(stub, created.batch.batch_id)
        assert whole.state == batch_service_pb2.BATCH_STATE_FAILED
        assert whole.failure_message == "array 'x' (float64) has a value past FP32's range, in record 120"


async def test_a_duration_of_mixed_signs_is_refused_where_submit_refuses_it(
    config: Config, start_stack: StartStack
) -> None:
    """Seconds 5 with nanos -900,000,000 is not a Duration (the protobuf spec: nanos of the
    seconds' sign); SubmitJob refused it, CreateBatch, UploadInput and Drain took it as 0.1 s."""
    stack = await start_stack(batch_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    mixed = duration_pb2.Duration(seconds=5, nanos=-900_000_000)
    ref = await upload(stack.jobs, jsonl(demo_records(1)))
    request = create_request(ref)
    request.completion_window.CopyFrom(mixed)

    async def upload_with_mixed_retention() -> AsyncIterator[job_service_pb2.UploadInputRequest]:
        yield job_service_pb2.UploadInputRequest(metadata=job_service_pb2.UploadInputMetadata(retention=mixed))
        yield job_service_pb2.UploadInputRequest(chunk=b"x")

    async with grpc.aio.insecure_channel(stack.ops_address) as channel:
        ops = ops_service_pb2_grpc.OpsServiceStub(channel)
        for call, field in (
            (stub.CreateBatch(request), "completion_window"),
            (stack.jobs.UploadInput(upload_with_mixed_retention()), "metadata.retention"),
            (ops.Drain(ops_service_pb2.DrainRequest(timeout=mixed)), "timeout"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert "not a valid duration" in (refused.value.details() or ""), field


async def test_a_file_without_records_fails_the_batch(config: Config, start_stack: StartStack) -> None:
    """Blank lines only, or an array of no rows: FAILED, saying so (a batch of nothing is almost
    always the wrong file; OpenAI's Batch API fails it as `empty_file`)."""
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    empty_npy = io.BytesIO()
    np.save(empty_npy, np.zeros((0, 4), dtype=np.float32))
    for data, named in ((b"\n\n", "JSONL"), (empty_npy.getvalue(), "NPY")):
        created = await stub.CreateBatch(create_request(await upload(stack.jobs, data)))
        batch = await wait_ended(stub, created.batch.batch_id)
        assert batch.state == batch_service_pb2.BATCH_STATE_FAILED
        assert batch.failure_message == f"the {named} file holds no records"
        assert batch.request_counts.total == 0


async def test_a_poison_record_is_isolated_by_bisection(config: Config, start_stack: StartStack) -> None:
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    records = [{"custom_id": f"r{i}", "inputs": {"x": [[1.0, i, i, i]]}} for i in range(300)]
    records[137]["inputs"]["x"] = [[-1.0, 0, 0, 0]]  # the flaky model fails on a negative first value
    created = await stub.CreateBatch(
        create_request(await upload(stack.jobs, jsonl(records)), model_name="flaky", max_attempts=1)
    )
    batch = await wait_ended(stub, created.batch.batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert (batch.request_counts.completed, batch.request_counts.failed) == (299, 1)
    bad = await errors(stub, batch.batch_id)
    assert [(e["line"], e["custom_id"]) for e in bad] == [(138, "r137")]
    assert "negative" in bad[0]["message"]
    assert [(e.line, e.custom_id, e.code) for e in batch.first_errors] == [(138, "r137", bad[0]["code"])], (
        "GetBatch's first errors name a record that failed when run, as the error file does"
    )
    assert [line["custom_id"] for line in await outputs(stub, batch.batch_id)] == [
        r["custom_id"] for i, r in enumerate(records) if i != 137
    ]
    # The bisection's failed chunk jobs are dead letters; replaying one would run records whose
    # batch has ended (its result read by nobody): refused, and skipped by "all".
    async with grpc.aio.insecure_channel(stack.ops_address) as channel:
        ops = ops_service_pb2_grpc.OpsServiceStub(channel)
        letters = (await ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest(model_name="flaky"))).dead_letters
        assert letters, "each failed chunk job is a dead letter"
        # Counted apart: the operators' dead-letter alert (jobs to replay) does not fire for a batch's bad records.
        exposition = generate_latest(stack.scheduler.metrics.registry).decode()
        assert 'asyncinfer_dead_letters_total{model="flaky",reason="MAX_ATTEMPTS"} 0.0' in exposition
        assert f'asyncinfer_batch_chunk_dead_letters_total{{model="flaky"}} {float(len(letters))}' in exposition
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ops.ReplayDeadLetters(ops_service_pb2.ReplayDeadLettersRequest(sequences=[letters[0].sequence]))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "error file" in (refused.value.details() or "")
        every = await ops.ReplayDeadLetters(ops_service_pb2.ReplayDeadLettersRequest(all=True, model_name="flaky"))
        assert (every.replayed, every.skipped) == (0, len(letters))
        request = ops_service_pb2.GetDeadLetterRequest(sequence=letters[0].sequence)
        whole = (await ops.GetDeadLetter(request)).dead_letter
    # `dlq show` names the batch (its labels), and the console's page links it and offers no replay.
    shown = dead_letter_json(whole)
    assert shown["original_request"]["labels"][BATCH_LABEL] == batch.batch_id
    console = ConsoleApp(
        stack.config.replace(
            console={"port": 0, "gateway_address": stack.address, "scheduler_address": stack.ops_address}
        )
    )
    await console.start()
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{console.url}dead-letters/{letters[0].sequence}") as page,
        ):
            text = await page.text()
    finally:
        await console.stop()
    assert f'href="/batches/{batch.batch_id}"' in text
    assert "A chunk of a file batch" in text
    assert "/dead-letters/replay" not in text
    assert "/dead-letters/purge" in text


async def test_an_npy_file_runs_record_by_record_along_its_first_dimension(
    config: Config, start_stack: StartStack
) -> None:
    stack = await start_stack(batch_config(config))
    stub = batches_stub(stack.channel)
    x = np.arange(150 * 4, dtype=np.float32).reshape(150, 4)
    buffer = io.BytesIO()
    np.save(buffer, x)
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, buffer.getvalue())))
    batch = await wait_ended(stub, created.batch.batch_id)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert batch.input_format == batch_service_pb2.BATCH_INPUT_FORMAT_NPY  # not given: detected, then reported
    lines = await outputs(stub, batch.batch_id)
    assert [line["custom_id"] for line in lines] == [str(i) for i in range(150)]
    assert np.array_equal(np.array([line["outputs"]["y"][0] for line in lines]), 2 * x + 1)

    # A model whose output is named like the archive's mask has no NPZ output (its mask would hide it).
    named = await stub.CreateBatch(create_request(await upload(stack.jobs, buffer.getvalue()), model_name="masked"))
    assert (await wait_ended(stub, named.batch.batch_id)).state == batch_service_pb2.BATCH_STATE_COMPLETED
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await npz_output(stub, named.batch.batch_id)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "NPZ_OUTPUT_NOT_ARRAYS" in str(refused.value.trailing_metadata())


@pytest.mark.parametrize(
    ("claim_check_io", "in_directory"),
    [(False, False), (True, False), (False, True)],
    ids=["scheduler-moves-bytes", "batcher-claim-check-io", "scheduler-moves-bytes-objects-dir"],
)
async def test_an_npy_batch_reads_its_chunks_as_row_ranges_of_the_upload_and_isolates_a_poison_row(
    config: Config, start_stack: StartStack, tmp_path: Path, claim_check_io: bool, in_directory: bool
) -> None:
    """Chunks of an NPY file are descriptors naming rows of the upload (no copy of the records),
    read across the upload's 128 KiB pieces, converted to the model's FP32, and split like any
    chunk when one row is poison; read by the scheduler, or by a batcher with claim_check_io,
    which then also stores each chunk's outputs (over the 1 KiB kept inline) itself. With the
    objects' bytes in a directory (nats.objects_directory), the rows are ranges of the upload's file."""
    directory = tmp_path / "objects"
    directory.mkdir()
    stack_config = batch_config(config, chunk_records=3000).replace(
        nats={"objects_directory": str(directory) if in_directory else None},
        batcher={"claim_check_io": claim_check_io},
        scheduler={"inline_result_max_bytes": 1024},
    )
    stack = await start_stack(stack_config)
    stub = batches_stub(stack.channel)
    x = np.random.default_rng(3).uniform(0, 1, (20_000, 4))  # float64: 640 KB, five pieces of the upload
    x[12_345, 0] = -1.0  # the flaky model fails on a negative first value
    buffer = io.BytesIO()
    np.save(buffer, x)
    created = await stub.CreateBatch(
        create_request(await upload(stack.jobs, buffer.getvalue()), model_name="flaky", max_attempts=1)
    )
    batch = await wait_ended(stub, created.batch.batch_id, timeout_s=120)
    assert batch.state == batch_service_pb2.BATCH_STATE_COMPLETED
    assert (batch.request_counts.completed, batch.request_counts.failed) == (19_999, 1)
    bad = await errors(stub, batch.batch_id)
    assert [(e["line"], e["custom_id"]) for e in bad] == [(12_346, "12345")]
    lines = await outputs(stub, batch.batch_id)
    kept = np.delete(x, 12_345, axis=0).astype(np.float32)
    assert [line["custom_id"] for line in lines] == [str(i) for i in range(20_000) if i != 12_345]
    assert np.allclose(np.array([line["outputs"]["y"][0] for line in lines]), 2 * kept + 1)
    # The same outputs as arrays: every row in input order, the poison row zeros and not succeeded.
    arrays = await npz_output(stub, batch.batch_id)
    assert sorted(arrays) == ["succeeded", "y"]
    succeeded = np.ones(20_000, dtype=np.bool_)
    succeeded[12_345] = False
    assert np.array_equal(arrays["succeeded"], succeeded)
    expected = 2 * x.astype(np.float32) + 1
    expected[12_345] = 0
    assert arrays["y"].dtype == np.float32
    assert arrays["y"].shape == (20_000, 4)
    assert np.allclose(arrays["y"], expected)
    descriptor = await stack.blobs.info("default", chunk_ref(batch.batch_id, 3000, 6000))
    assert descriptor.ref.size_bytes < 1024  # a range of the upload, not its 96,000 bytes of rows
    chunks = await stack.jobs.ListJobs(
        job_service_pb2.ListJobsRequest(page_size=100, labels={"asyncinfer-batch": batch.batch_id})
    )
    stored = {job.result_ref.ref.rpartition("/")[2] for job in chunks.jobs if job.result_ref.ref}
    assert len(stored) >= 6, "every whole chunk's outputs are an object"
    # The scheduler names a result after its job; a batcher after the attempt it ran.
    assert all(name.endswith(".1") == claim_check_io for name in stored)
    # Where the bytes went: the upload, the chunks' descriptors (inputs too, `in.`) and each chunk's
    # stored outputs a file of the directory.
    if in_directory:
        files = os.listdir(directory / config.nats.objects_bucket)
        assert len([name for name in files if not name.startswith("in.")]) >= len(stored)
        assert len([name for name in files if name.startswith("in.")]) > 1
        assert BYTES_IN_HEADER in descriptor.meta["headers"]


async def desired_batchers_become(stack: Stack, wanted: Callable[[int], bool]) -> None:
    """Polls the scheduler's queue stats (refreshed every few seconds; no event says so)."""
    async with grpc.aio.insecure_channel(stack.ops_address) as channel, asyncio.timeout(30):
        ops = ops_service_pb2_grpc.OpsServiceStub(channel)
        while True:
            stats = await ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name="demo"))
            if wanted(stats.models[0].desired_batchers):
                return
            await asyncio.sleep(0.1)


async def test_a_batch_alone_scales_batchers_from_zero_and_back_and_is_counted(
    config: Config, start_stack: StartStack
) -> None:
    stack = await start_stack(batch_config(config), batcher=False)
    stub = batches_stub(stack.channel)
    await desired_batchers_become(stack, lambda n: n == 0)
    created = await stub.CreateBatch(create_request(await upload(stack.jobs, jsonl(demo_records(300)))))
    await wait_until(stub, created.batch.batch_id, lambda b: b.state == batch_service_pb2.BATCH_STATE_IN_PROGRESS)
    await desired_batchers_become(stack, lambda n: n >= 1)
    await stack.start_batcher()
    batch = await wait_ended(stub, created.batch.batch_id)
    assert batch.request_counts.completed == 300
    await desired_batchers_become(stack, lambda n: n == 0)
    scraped = generate_latest(stack.gateway.registry).decode()
    assert 'asyncinfer_batch_records_total{model="demo",outcome="completed"} 300.0' in scraped
    assert 'asyncinfer_batches_ended_total{model="demo",state="COMPLETED"} 1.0' in scraped


async def test_a_job_cancelled_while_its_queue_is_paused_leaves_the_queues_depth(
    config: Config, start_stack: StartStack
) -> None:
    """The README's cancel recipe (pause, submit, cancel, resume): the paused scheduler's held pull
    took the job and put it back, its cancel deleted the message, and the put-back count, which
    only a pull lowered, kept it in the queue's depth and the desired batchers for good."""
    stack = await start_stack(config.replace(scheduler={"queue_stats_interval_s": 0.2}))
    async with grpc.aio.insecure_channel(stack.ops_address) as channel:
        ops = ops_service_pb2_grpc.OpsServiceStub(channel)
        await until_true(lambda: stack.scheduler.batchers.free_credits("demo") > 0, timeout_s=10.0)
        await ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name="demo"))
        submitted = await stack.jobs.SubmitJob(submit_request())
        await until_put_back(stack, 1)
        await stack.jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=submitted.job.job_id))
        await ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name="demo"))

        async def drained() -> bool:
            stats = await ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest(model_name="demo"))
            (model,) = stats.models
            return sum(p.depth for p in model.priorities) == 0

        await until(drained, timeout_s=10.0)


async def until_put_back(stack: Stack, count: int) -> None:
    def put_back() -> int:
        return sum(d.queues.put_back_count(p) for d in stack.scheduler._dispatchers.all for p in Priority)

    await until_true(lambda: put_back() == count, timeout_s=10.0)
