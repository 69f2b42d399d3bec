"""The batch commands and SDK calls (issue 15) against the real in-process stack: `asyncinfer batch
create FILE --model demo --wait --out --errors` as a subprocess, then get, list and download; the
SDK's create_batch, watch_batch and download."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import re
import shlex
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from asyncinfer.blob_meta import input_chunks_filter
from asyncinfer.client import AsyncClient, Callback, RetryPolicy
from asyncinfer.client.batches import create_batch_request, write_file
from asyncinfer.client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from asyncinfer.commands.output import local_time
from asyncinfer.config import Config
from asyncinfer.embedded_nats import free_port
from asyncinfer.nats.streams import count_messages
from asyncinfer.v1 import batch_service_pb2, batch_service_pb2_grpc, job_pb2, ops_service_pb2, ops_service_pb2_grpc
from services.gateway.batch_service import BatchService
from services.gateway.blobs import ClaimCheck
from tests.batch_helpers import demo_records, jsonl
from tests.stack import StartStack
from tests.test_claim_check import objects_stream_state
from tests.test_cli_daily import AS_A_TERMINALS_FOREGROUND_JOB
from tests.test_client_typing import _count_list_models as count_list_models
from tests.webhook_receiver import webhook_config

# Its tests start the CLI as processes, several each (an interpreter start apiece): 19-38 s on a
# loaded machine, against the default 120 s.
pytestmark = pytest.mark.timeout(300)
CLI = [sys.executable, "-m", "asyncinfer"]


async def cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 90)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def small_batches(config: Config) -> Config:
    return config.replace(batches={"chunk_records": 40, "drive_interval_s": 0.05})


async def test_batch_create_wait_writes_the_output_and_error_files(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    stack = await start_stack(small_batches(config))
    records = demo_records(100)
    source = tmp_path / "records.jsonl"
    source.write_bytes(jsonl(records) + b"not json\n")
    out, errors = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    code, printed, stderr = await cli(
        "batch", "create", str(source), "--model", "demo", "--wait", "--out", str(out), "--errors", str(errors),
        "--gateway", stack.address,
    )  # fmt: skip
    assert code == 0, stderr
    assert "COMPLETED  100/101 done  1 failed" in printed
    # stderr is a pipe here, where the progress bar is silent: the follow's lines say how it went.
    assert "COMPLETED  100/101 done  1 failed" in stderr.splitlines()[-1]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in records]
    assert [json.loads(line)["line"] for line in errors.read_text().splitlines()] == [101]
    batch_id = printed.split()[0]
    created_printed = printed

    # Both streams one pipe (`2>&1 | tee log`, a CI step's log): the end is said once, by the
    # summary (the follow's last line said it too, the same status twice).
    process = await asyncio.create_subprocess_exec(
        *CLI, "batch", "create", str(source), "--model", "demo", "--wait", "--gateway", stack.address,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    merged = (await asyncio.wait_for(process.communicate(), 90))[0].decode()
    assert process.returncode == 0, merged
    assert merged.count("COMPLETED  100/101 done  1 failed") == 1, merged
    # Without --out, how to read the output (it said the counts alone); without --errors, the
    # failed lines under the summary and how to get them all: the first-hour
    # pass, session 32, met a batch FAILED in validation saying "see the error file" and no more.
    merged_lines = merged.splitlines()
    at = next(i for i, line in enumerate(merged_lines) if "COMPLETED  100/101 done  1 failed" in line)
    assert merged_lines[at + 1] == "  line 101: INVALID_ARGUMENT not a JSON line: Expecting value at column 1", merged
    second_id = merged_lines[at].split()[0]
    assert merged_lines[at + 2 :] == [
        f"  the output file: asyncinfer batch download {second_id} --out results.jsonl",
        f"  the error file, every failed line: asyncinfer batch download {second_id} --errors errors.jsonl",
    ], merged
    assert len(created_printed.splitlines()) == 2, created_printed  # with --errors: the failed line, no hint

    code, printed, stderr = await cli("batch", "get", batch_id, "--json", "--gateway", stack.address)
    assert code == 0, stderr
    got = json.loads(printed)
    assert (got["state"], got["completed"], got["failed"]) == ("COMPLETED", 100, 1)
    code, printed, _ = await cli("batch", "list", "--gateway", stack.address)
    assert batch_id in printed
    code, printed, _ = await cli("batch", "download", batch_id, "--gateway", stack.address)
    assert [json.loads(line)["custom_id"] for line in printed.splitlines()] == [r["custom_id"] for r in records]
    # Into a reader that is gone (`... | head -1`): quietly, with the SIGPIPE exit code.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        closed = await asyncio.create_subprocess_exec(
            *CLI, "batch", "download", batch_id, "--gateway", stack.address, stdout=write_end, stderr=asyncio.subprocess.PIPE
        )  # fmt: skip
        _, err = await asyncio.wait_for(closed.communicate(), 90)
    finally:
        os.close(write_end)
    assert (closed.returncode, err.decode()) == (141, "")
    again = tmp_path / "errors-again.jsonl"
    code, printed, stderr = await cli("batch", "download", batch_id, "--errors", str(again), "--gateway", stack.address)
    assert (code, printed) == (0, ""), stderr  # the error file alone: no output lines on stdout
    assert again.read_bytes() == errors.read_bytes()


async def test_the_sdk_creates_watches_and_downloads_a_batch(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    stack = await start_stack(small_batches(config))
    async with AsyncClient(stack.address) as client:
        batch = await client.create_batch(jsonl(demo_records(120)), "demo", labels={"run": "nightly"})
        assert batch.state == "VALIDATING"
        seen = [update async for update in client.watch_batch(batch)]
        assert seen[-1].state == "COMPLETED"
        assert seen[-1].completed == 120
        assert [u.completed for u in seen] == sorted(u.completed for u in seen)  # progress only grows
        written = await client.download(batch, tmp_path / "out.jsonl")
        assert written == (tmp_path / "out.jsonl").stat().st_size
        assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 120
        assert (await client.get_batch(batch.batch_id)).labels == {"run": "nightly"}
        # Cancelling a batch that ended returns it as it is (as cancelling a finished job does).
        ended = await client.cancel_batch(batch)
        assert (ended.batch_id, ended.state, ended.completed) == (batch.batch_id, "COMPLETED", 120)
        code, printed, stderr = await cli("batch", "cancel", batch.batch_id, "--gateway", stack.address)
        assert (code, printed.split()[:2]) == (0, [batch.batch_id, "COMPLETED"]), stderr
        # Refusals come as the SDK's errors, the streaming calls' as every other call's.
        with pytest.raises(FailedPreconditionError, match="NPZ_OUTPUT_NEEDS_ARRAY_INPUT"):
            await client.output_arrays(batch)  # a JSONL batch's output is JSONL
        unknown = "01a2488d-5587-770c-ba2e-e4d6ee785b4f"
        with pytest.raises(NotFoundError):
            await client.download(unknown, tmp_path / "never.jsonl")
        with pytest.raises(NotFoundError):
            await client.wait_batch(unknown)
        assert not (tmp_path / "never.jsonl").exists()


async def test_failed_lines_that_say_the_same_are_shown_as_one(config: Config, start_stack: StartStack) -> None:
    """Under a summary, consecutive failed lines with one code and message are one line, and the
    failed lines past the first ten are counted: a cancelled batch showed ten lines of "CANCELLED
    the batch was cancelled before this record ran", a file with one mistake throughout ten of the
    same message, and neither said how many more there were."""
    stack = await start_stack(small_batches(config))
    short = [{"custom_id": f"s{i}", "inputs": {"x": [[1, 2, 3]]}} for i in range(12)]
    lines = jsonl(demo_records(30)) + b"not json\n" + jsonl(short)
    async with AsyncClient(stack.address) as client:
        batch = await client.wait_batch(await client.create_batch(lines, "demo"))
    assert (batch.state, batch.completed, batch.failed) == ("COMPLETED", 30, 13)
    shape = "INVALID_ARGUMENT input 'x' must have shape [-1, 4] (-1: any; the record's own batch dimension first), got [1, 3]"
    for command in ("get", "watch"):
        code, printed, stderr = await cli("batch", command, batch.batch_id, "--gateway", stack.address)
        assert code == 0, stderr
        assert printed.splitlines()[1:] == [
            "  line 31: INVALID_ARGUMENT not a JSON line: Expecting value at column 1",
            f"  lines 32-40 ('s0' to 's8'): {shape}",
            "  and 3 more",
            f"  the output file: asyncinfer batch download {batch.batch_id} --out results.jsonl",
            f"  the error file, every failed line: asyncinfer batch download {batch.batch_id} --errors errors.jsonl",
        ], printed


async def test_a_download_of_a_batch_without_output_says_where_its_errors_are(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    """The first-hour pass, session 38: `batch download` of a batch none of whose records succeeded
    (here FAILED in validation) printed nothing and exited 0, the reason for its records unsaid."""
    stack = await start_stack(small_batches(config))
    async with AsyncClient(stack.address) as client:
        batch = await client.wait_batch(await client.create_batch(b"not json\nnor this\n", "demo"))
    assert (batch.state, batch.completed) == ("FAILED", 0)
    hint = (
        f"asyncinfer: batch {batch.batch_id} has no output: none of its records succeeded; why, line by line: "
        f"asyncinfer batch download {batch.batch_id} --errors errors.jsonl\n"
    )
    out = tmp_path / "results.jsonl"
    for where in ((), ("--out", str(out))):
        code, printed, stderr = await cli("batch", "download", batch.batch_id, *where, "--gateway", stack.address)
        assert (code, printed, stderr) == (0, "", hint), where
    assert out.read_bytes() == b""
    # Given --errors, the command writes them as asked, and says nothing.
    errors = tmp_path / "errors.jsonl"
    code, printed, stderr = await cli(
        "batch", "download", batch.batch_id, "--errors", str(errors), "--gateway", stack.address
    )
    assert (code, printed, stderr) == (0, "", "")
    assert [json.loads(line)["line"] for line in errors.read_text().splitlines()] == [1, 2]


async def test_create_batch_keeps_no_upload_it_does_not_use(config: Config, start_stack: StartStack) -> None:
    """The SDK uploads the file, then creates the batch. A create that is refused (an unknown model)
    deletes that upload, and one answered by an earlier batch under the same idempotency key
    (which reads its own upload of the same file) deletes the new one: neither is left counting
    against the tenant's stored uploads."""
    stack = await start_stack(small_batches(config))
    bucket = stack.config.nats.objects_bucket

    async def stored_chunks() -> int:
        return await count_messages(stack.nc, f"OBJ_{bucket}", input_chunks_filter(bucket, "default"), timeout_s=2.0)

    data = jsonl(demo_records(50))
    async with AsyncClient(stack.address) as client:
        first = await client.wait_batch(await client.create_batch(data, "demo", idempotency_key="nightly"))
        assert first.completed == 50
        stored = await stored_chunks()  # its upload, and the files its run wrote beside it
        again = await client.create_batch(data, "demo", idempotency_key="nightly")
        assert (again.batch_id, again.deduplicated) == (first.batch_id, True)
        assert await stored_chunks() == stored
        with pytest.raises(NotFoundError, match="MODEL_NOT_FOUND"):
            await client.create_batch(data, "no-such-model")
        assert await stored_chunks() == stored
        # An option the request cannot carry fails before anything is uploaded.
        with pytest.raises(ValueError, match="unknown priority 'urgent'"):
            await client.create_batch(data, "demo", priority="urgent")
        with pytest.raises(ValueError, match="unknown input_format 'csv'"):
            await client.create_batch(data, "demo", input_format="csv")
        with pytest.raises(TypeError):
            await client.create_batch(data, "demo", bogus=1)
        assert await stored_chunks() == stored


async def test_batch_create_for_a_model_not_served_uploads_nothing(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    """`batch create FILE --model nosuch` was refused (NOT_FOUND MODEL_NOT_FOUND) once the whole
    file had gone up, and the upload deleted again: the objects stream took the file's pieces. The
    command now asks the gateway's models first and sends nothing."""
    stack = await start_stack(small_batches(config))
    source = tmp_path / "records.jsonl"
    source.write_bytes(jsonl(demo_records(50)))
    js = stack.nc.jetstream()
    stream = f"OBJ_{stack.config.nats.objects_bucket}"
    before = (await js.stream_info(stream)).state.last_seq
    code, printed, stderr = await cli("batch", "create", str(source), "--model", "nosuch", "--gateway", stack.address)
    assert (code, printed) == (3, ""), stderr
    assert "NOT_FOUND MODEL_NOT_FOUND: unknown model 'nosuch'; the models served are: demo" in stderr, stderr
    assert (await js.stream_info(stream)).state.last_seq == before  # no piece of the file was stored


async def test_the_sdks_create_batch_for_a_model_not_served_uploads_nothing(
    config: Config, start_stack: StartStack
) -> None:
    """The SDK's create_batch uploaded the whole file, then the create was refused (NOT_FOUND
    MODEL_NOT_FOUND) and the upload deleted: the objects stream took the file's pieces and their
    deletion. It now asks ListModels first (a model it has listed costs no call) and sends nothing;
    a create for a served model after it still runs."""
    stack = await start_stack(small_batches(config))
    js = stack.nc.jetstream()
    stream = f"OBJ_{stack.config.nats.objects_bucket}"
    before = (await js.stream_info(stream)).state.last_seq
    async with AsyncClient(stack.address) as client:
        with pytest.raises(NotFoundError) as refused:
            await client.create_batch(jsonl(demo_records(50)), "nosuch")
        assert refused.value.reason == "MODEL_NOT_FOUND"
        assert "unknown model 'nosuch'; the models served are: demo" in str(refused.value)
        assert (await js.stream_info(stream)).state.last_seq == before  # no piece of the file was stored
        batch = await client.create_batch(jsonl(demo_records(5)), "demo")
        assert (await client.wait_batch(batch, timeout_s=60)).completed == 5


async def test_create_batch_asks_no_models_the_client_has_listed(config: Config, start_stack: StartStack) -> None:
    """The check before create_batch's upload costs no call for a model the client has listed:
    `models()` (what `batch create` asks first) and a create's own ListModels fill the cache that
    submit's typing keeps. `models()` did not, so `batch create` asked ListModels twice."""
    stack = await start_stack(small_batches(config))
    async with AsyncClient(stack.address) as client:
        calls = count_list_models(client)
        assert "demo" in {m.name for m in await client.models()}
        await client.create_batch(jsonl(demo_records(5)), "demo")
        await client.create_batch(jsonl(demo_records(5)), "demo")
        assert calls == [1]


async def test_a_watch_with_a_time_limit_ends_in_deadline_exceeded(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    """As a job's watch does: the batch carries on (here its model's queue is paused), the SDK
    raises DeadlineExceededError and the CLI exits 5 saying so."""
    stack = await start_stack(small_batches(config))
    async with grpc.aio.insecure_channel(stack.ops_address) as channel:
        ops = ops_service_pb2_grpc.OpsServiceStub(channel)
        await ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name="demo"))
        async with AsyncClient(stack.address) as client:
            batch = await client.create_batch(jsonl(demo_records(10)), "demo")
            with pytest.raises(DeadlineExceededError):
                await client.wait_batch(batch, timeout_s=0.5)
            code, _, stderr = await cli(
                "batch", "watch", batch.batch_id, "--timeout", "0.5", "--gateway", stack.address
            )
            assert code == 5, stderr
            assert "DEADLINE_EXCEEDED" in stderr
            assert "Traceback" not in stderr
            # `create --wait` cut short (its --timeout here, as Ctrl-C does) names the batch that goes on.
            source = tmp_path / "records.jsonl"
            source.write_bytes(jsonl(demo_records(3)))
            code, _, stderr = await cli(
                "batch", "create", str(source), "--model", "demo", "--wait", "--timeout", "1", "--gateway", stack.address
            )  # fmt: skip
            assert code == 5, stderr
            assert "goes on; follow it with `asyncinfer batch watch " in stderr, stderr
            code, printed, stderr = await cli("batch", "get", batch.batch_id, "--gateway", stack.address)
            assert code == 0, stderr
            assert "  chunks 0/1 done" in printed  # a running batch's chunks (only --json had them)
            for made in ("", "earlier"):  # a create answered by an earlier batch says so
                code, _, stderr = await cli(
                    "batch", "create", str(source), "--model", "demo", "--idempotency-key", "k", "--gateway", stack.address
                )  # fmt: skip
                assert code == 0, stderr
                assert ("made earlier under this idempotency key" in stderr) == bool(made), stderr
            await ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name="demo"))
            assert (await client.wait_batch(batch, timeout_s=60)).completed == 10


async def interruptible_cli(*args: str) -> asyncio.subprocess.Process:
    """`asyncinfer ...` as a terminal's foreground job, which a SIGINT interrupts (Ctrl-C)."""
    return await asyncio.create_subprocess_exec(
        *AS_A_TERMINALS_FOREGROUND_JOB, *CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )


async def test_a_key_reused_for_another_file_names_the_batch_holding_it(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    """`batch create` under a key already used for another file: ALREADY_EXISTS (exit 4), the
    gateway's message naming the batch that holds the key and what differs, then the commands that
    go on from there (it printed the message alone)."""
    stack = await start_stack(small_batches(config))
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_bytes(jsonl(demo_records(3)))
    second.write_bytes(jsonl(demo_records(4)))
    create = ["batch", "create", "--model", "demo", "--idempotency-key", "nightly", "--gateway", stack.address]
    code, printed, stderr = await cli(*create, str(first))
    assert code == 0, stderr
    batch_id = printed.split()[0]
    code, printed, stderr = await cli(*create, str(second))
    assert (code, printed) == (4, ""), stderr
    assert stderr.splitlines()[-2:] == [
        f"asyncinfer: error: ALREADY_EXISTS IDEMPOTENCY_KEY_REUSED: idempotency key 'nightly' was first used for "
        f"batch {batch_id}, with a different request: a key can be sent again only with its first request (a "
        "retry, answered with that batch). Get that batch with GetBatch, or use a new key for a different batch "
        "(differing: input_ref)",
        f"asyncinfer:   hint: that batch: asyncinfer batch get {batch_id}; a new batch: run this again with another "
        "--idempotency-key",
    ], stderr


async def test_ctrl_c_during_the_upload_of_a_batch_create_makes_nothing_and_keeps_nothing(
    config: Config, start_stack: StartStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while `batch create` uploads: no batch exists yet, and the command says so (it said
    nothing: had it made one?); the part of the file sent is purged by the gateway, whose upload
    ends with the connection. The gateway here takes the first MiB and then reads no more, so the
    upload is under way whatever the machine's speed."""
    stack = await start_stack(small_batches(config))
    holding, upload_ended = asyncio.Event(), asyncio.Event()
    upload = ClaimCheck.upload

    async def held_upload(claim_check: ClaimCheck, requests: AsyncIterator[Any], *, tenant: str) -> Any:
        async def first_chunk_then_nothing() -> AsyncIterator[Any]:
            yield await anext(requests)  # the metadata
            yield await anext(requests)  # the first chunk
            holding.set()
            await asyncio.Event().wait()
            yield await anext(requests)

        try:
            return await upload(claim_check, first_chunk_then_nothing(), tenant=tenant)
        finally:
            upload_ended.set()

    monkeypatch.setattr(ClaimCheck, "upload", held_upload)
    source = tmp_path / "records.jsonl"
    source.write_bytes(jsonl(demo_records(40_000)))  # ~3 MiB: 3 chunks of the SDK's
    process = await interruptible_cli(
        "batch", "create", str(source), "--model", "demo", "--wait", "--gateway", stack.address
    )
    await asyncio.wait_for(holding.wait(), 60)
    process.send_signal(signal.SIGINT)
    printed, stderr = (text.decode() for text in await asyncio.wait_for(process.communicate(), 60))
    assert (process.returncode, printed) == (130, ""), stderr
    assert stderr == (
        "asyncinfer: interrupted during the upload: no batch was created, and the gateway discards the part of "
        f"{source} it was sent\n"
    )
    await asyncio.wait_for(upload_ended.wait(), 30)  # the gateway saw the stream go
    assert await objects_stream_state(stack.nc, stack.config) == (0, 0), "the part uploaded is purged"
    async with AsyncClient(stack.address) as client:
        assert await client.list_batches() == ([], "")


async def test_ctrl_c_once_uploaded_says_the_batch_may_exist_and_keeps_the_upload(
    config: Config, start_stack: StartStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C after the upload, while the create is unanswered: the batch may have been made, so
    the command says where to look and keeps the upload (a batch made would read it), which goes
    when its retention ends. The gateway here holds the create unanswered."""
    holding = asyncio.Event()

    async def create_held(*_: Any) -> Any:
        holding.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(BatchService, "CreateBatch", create_held)  # before the gateway registers it
    stack = await start_stack(small_batches(config))
    source = tmp_path / "records.jsonl"
    source.write_bytes(jsonl(demo_records(10)))
    process = await interruptible_cli(
        "batch", "create", str(source), "--model", "demo", "--idempotency-key", "nightly", "--gateway", stack.address
    )  # fmt: skip
    await asyncio.wait_for(holding.wait(), 60)
    process.send_signal(signal.SIGINT)
    printed, stderr = (text.decode() for text in await asyncio.wait_for(process.communicate(), 60))
    assert (process.returncode, printed) == (130, ""), stderr
    said = re.fullmatch(
        r"asyncinfer: interrupted as the batch was being created: it may exist \(`asyncinfer batch list` shows "
        r"it\)\. To find it rather than make a second, run it again under its idempotency key: `asyncinfer batch "
        rf"create {re.escape(str(source))} --model demo --idempotency-key nightly --gateway {stack.address}`; the "
        r"key finds the batch until its completion window and the gateway's result retention have passed \(24 h \+ "
        r"24 h by default\), and if no batch was made it makes it\. Otherwise the upload (\S+) is deleted when its "
        r"retention ends\n",
        stderr,
    )
    assert said is not None, stderr
    async with AsyncClient(stack.address) as client:
        kept = await client.delete_input(said.group(1))  # still there: NotFoundError otherwise
    assert kept.size_bytes == source.stat().st_size


async def test_ctrl_c_once_uploaded_names_the_key_whose_rerun_finds_the_batch(
    config: Config, start_stack: StartStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C after the create reached the gateway, before its answer, with no --idempotency-key:
    the key was the SDK's own, made up and lost with the process, so the batch could only be found
    in `batch list`, and the command run again made a second batch over the same file. The CLI now
    makes the key (a UUID4, as the SDK does) and names the command that runs again under it: that
    command answers the batch made (deduplicated) rather than making another. The gateway here
    makes the batch and then holds the first create's answer."""
    made = asyncio.Event()
    create = BatchService.CreateBatch

    async def create_then_hold(service: BatchService, request: Any, context: Any) -> Any:
        answer = await create(service, request, context)
        if not made.is_set():
            made.set()
            await asyncio.Event().wait()
        return answer

    monkeypatch.setattr(BatchService, "CreateBatch", create_then_hold)  # before the gateway registers it
    stack = await start_stack(small_batches(config))
    source = tmp_path / "records.jsonl"
    source.write_bytes(jsonl(demo_records(10)))
    process = await interruptible_cli(
        "batch", "create", str(source), "--model", "demo", "--label", "run=1", "--gateway", stack.address
    )  # fmt: skip
    await asyncio.wait_for(made.wait(), 60)
    process.send_signal(signal.SIGINT)
    printed, stderr = (text.decode() for text in await asyncio.wait_for(process.communicate(), 60))
    assert (process.returncode, printed) == (130, ""), stderr
    said = re.search(r"run it again under its idempotency key: `(asyncinfer batch create [^`]+)`", stderr)
    assert said is not None, stderr
    rerun = shlex.split(said.group(1))
    key = rerun[rerun.index("--idempotency-key") + 1]
    assert uuid.UUID(key).version == 4, key
    async with AsyncClient(stack.address) as client:
        (first,), _ = await client.list_batches()
        assert first.idempotency_key == key
        code, out, err = await cli(*rerun[1:])
        assert (code, out.strip()) == (0, first.batch_id), err
        assert f"batch {first.batch_id} was made earlier under this idempotency key" in err
        assert [batch.batch_id for batch in (await client.list_batches())[0]] == [first.batch_id], "no second batch"
        assert (await client.wait_batch(first.batch_id, timeout_s=60)).completed == 10


async def test_ctrl_c_during_a_batch_create_wait_names_the_batch_that_goes_on(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    """`batch create --wait` interrupted once the batch is made (its first progress line said so):
    a quiet 130, the batch named with the commands that come back to it, and the batch goes on."""
    stack = await start_stack(small_batches(config))
    source = tmp_path / "records.jsonl"
    source.write_bytes(jsonl(demo_records(10)))
    async with grpc.aio.insecure_channel(stack.ops_address) as channel, AsyncClient(stack.address) as client:
        ops = ops_service_pb2_grpc.OpsServiceStub(channel)
        await ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name="demo"))  # it waits until resumed
        process = await interruptible_cli(
            "batch", "create", str(source), "--model", "demo", "--wait", "--gateway", stack.address
        )
        assert process.stderr is not None
        progress = (await asyncio.wait_for(process.stderr.readline(), 60)).decode()
        batch_id = progress.split()[1]  # "12:00:00  <batch ID>  VALIDATING  0/0 done"
        process.send_signal(signal.SIGINT)
        printed, rest = (text.decode() for text in await asyncio.wait_for(process.communicate(), 60))
        assert (process.returncode, printed) == (130, ""), progress + rest
        # Progress lines the command wrote before the signal reached it may come first (the batch
        # went IN_PROGRESS in between, session 32's CI3): each is the batch's, then the one message.
        *more_progress, message = rest.splitlines(keepends=True) or [""]
        assert all(line.split()[1:2] == [batch_id] for line in more_progress), progress + rest
        assert message == (
            f"asyncinfer: batch {batch_id} goes on; follow it with `asyncinfer batch watch {batch_id}`, then "
            f"`asyncinfer batch download {batch_id}` for its output (or stop it with "
            f"`asyncinfer batch cancel {batch_id}`)\n"
        ), progress + rest
        assert (await client.get_batch(batch_id)).state not in ("CANCELLING", "CANCELLED")
        await ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name="demo"))
        assert (await client.wait_batch(batch_id, timeout_s=60)).completed == 10


async def test_the_output_of_an_array_batch_comes_back_as_arrays(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    """An array batch through the SDK (an array in, output_arrays out; arrays by input name make an
    NPZ file) and the CLI (`--out x.npz`): y = 2x + 1 row by row, every record succeeded."""
    stack = await start_stack(small_batches(config))
    x = np.arange(100 * 4, dtype=np.float32).reshape(100, 4)
    async with AsyncClient(stack.address) as client:
        batch = await client.wait_batch(await client.create_batch(x, "demo"))  # the array, as an NPY file
        assert (batch.state, batch.input_format) == ("COMPLETED", "NPY")
        arrays = await client.output_arrays(batch)
        by_name = await client.wait_batch(await client.create_batch({"x": x[:10]}, "demo"))  # an NPZ file
        as_lists = await client.wait_batch(await client.create_batch(x[:3].tolist(), "demo"))  # rows as lists
        assert (as_lists.state, as_lists.input_format, as_lists.completed) == ("COMPLETED", "NPY", 3)
        assert (by_name.state, by_name.input_format) == ("COMPLETED", "NPZ")
        assert np.array_equal((await client.output_arrays(by_name))["y"], 2 * x[:10] + 1)
        # A path ending .npz gets the arrays, as the CLI's --out does (it got the JSONL lines).
        await client.download(by_name, tmp_path / "sdk.npz")
        with np.load(tmp_path / "sdk.npz") as archive:
            assert np.array_equal(archive["y"], 2 * x[:10] + 1)
        await client.download(by_name, tmp_path / "sdk-lines.npz", file="output")  # asked for: as asked
        assert (tmp_path / "sdk-lines.npz").read_bytes().startswith(b'{"custom_id":"0"')
    assert np.array_equal(arrays["y"], 2 * x + 1)
    assert arrays["succeeded"].all()
    out = tmp_path / "results.npz"
    code, _, stderr = await cli("batch", "download", batch.batch_id, "--out", str(out), "--gateway", stack.address)
    assert code == 0, stderr
    code, printed, stderr = await cli("batch", "get", batch.batch_id, "--gateway", stack.address)
    assert printed.splitlines()[1:] == [
        f"  the output file: asyncinfer batch download {batch.batch_id} --out results.npz (or results.jsonl)"
    ], printed
    with np.load(out) as archive:
        assert np.array_equal(archive["y"], 2 * x + 1)
    # And in one command: create, wait, and the arrays written where --out names an .npz.
    source, created = tmp_path / "x.npy", tmp_path / "created.npz"
    np.save(source, x)
    code, _, stderr = await cli(
        "batch", "create", str(source), "--model", "demo", "--wait", "--out", str(created), "--gateway", stack.address
    )  # fmt: skip
    assert code == 0, stderr
    with np.load(created) as archive:
        assert np.array_equal(archive["y"], 2 * x + 1)
        assert archive["succeeded"].all()
    # An array file the model cannot take fails the batch before any record ran: it has no arrays.
    # The --out .npz was refused (BATCH_FAILED, exit 4) and --errors, asked after it, never written.
    misnamed, refused, errors = tmp_path / "z.npz", tmp_path / "refused.npz", tmp_path / "errors.jsonl"
    np.savez(misnamed, z=x)
    code, printed, stderr = await cli(
        "batch", "create", str(misnamed), "--model", "demo", "--wait", "--out", str(refused), "--errors", str(errors),
        "--gateway", stack.address,
    )  # fmt: skip
    assert code == 1, stderr
    assert "FAILED  0/0 done  the NPZ file has arrays the model does not take: 'z'" in printed, printed
    failed_id = printed.split()[0]
    assert len(printed.splitlines()) == 1, printed  # no output to point to, no failed line
    assert stderr.splitlines()[-1] == (
        f"asyncinfer: --out {refused} not written: batch {failed_id} failed before any record ran, so it has no "
        "outputs (its summary says why)"
    ), stderr
    assert errors.read_bytes() == b""  # written: no line failed alone, the file did
    assert not refused.exists()


async def test_a_file_the_command_cannot_read_or_write_is_a_clear_error(tmp_path: Path) -> None:
    """No traceback: a missing input or a label without '=' is a usage error (2), a download to a
    folder that is not there says so (6); none needs a gateway to find out. (Each command a process
    of its own, all at once: they share nothing, and each is mostly its start.)"""
    missing = tmp_path / "missing.jsonl"
    records = tmp_path / "records.jsonl"
    records.write_bytes(jsonl(demo_records(2)))
    present = tmp_path / "one-record.jsonl"
    present.write_bytes(jsonl(demo_records(1)))
    no_folder = tmp_path / "no-such-folder" / "results.jsonl"
    not_an_array = tmp_path / "rows.npy"
    not_an_array.write_bytes(jsonl(demo_records(1)))  # JSONL under an array file's name
    create = ("batch", "create")
    runs = {
        "missing": (*create, str(missing), "--model", "demo"),
        "a folder": (*create, str(tmp_path), "--model", "demo"),
        # A JSONL batch's output asked as arrays: said before anything is uploaded (it was refused
        # NPZ_OUTPUT_NEEDS_ARRAY_INPUT once the whole batch had run).
        "npz out": (*create, str(records), "--model", "demo", "--wait", "--out", str(tmp_path / "out.npz")),
        **{f"window {w}": (*create, str(missing), "--model", "demo", "--window", w) for w in ("nan", "inf", "0")},
        "label": (*create, str(present), "--model", "demo", "--label", "nightly"),
        # Read as JSONL (detected by its first bytes), it failed "not a JSON line" or ran as JSONL.
        "named npy": (*create, str(not_an_array), "--model", "demo"),
        "out without wait": (*create, str(present), "--model", "demo", "--out", str(tmp_path / "o.jsonl")),
        # --out or --errors in a folder that is not there, or a folder itself: said before anything is
        # sent (`create --wait` found it once the whole batch had run, naming "results.jsonl.part").
        "download": ("batch", "download", "01a2488d-5587-770c-ba2e-e4d6ee785b4f", "--out", str(no_folder)),
        "out folder": (*create, str(present), "--model", "demo", "--wait", "--out", str(no_folder)),
        "errors folder": (*create, str(present), "--model", "demo", "--wait", "--errors", str(tmp_path)),
    }
    ended = dict(
        zip(
            runs, await asyncio.gather(*(cli(*argv, "--gateway", "127.0.0.1:1") for argv in runs.values())), strict=True
        )
    )

    code, _, stderr = ended["missing"]
    assert (code, stderr.strip()) == (2, f"asyncinfer: no such file: {missing}")
    code, _, stderr = ended["a folder"]
    assert (code, stderr.strip()) == (2, f"asyncinfer: a directory, not a file: {tmp_path}")
    code, _, stderr = ended["npz out"]
    assert code == 2, stderr
    assert "this file is JSONL: give --out a .jsonl name" in stderr
    for window in ("nan", "inf", "0"):  # nan and inf were tracebacks
        code, _, stderr = ended[f"window {window}"]
        assert code == 2, stderr
        assert "give a positive number of seconds" in stderr
        assert "Traceback" not in stderr
    code, _, stderr = ended["label"]
    assert code == 2, stderr
    assert stderr.strip().endswith(
        "error: argument --label: give KEY=VALUE (a value may be empty, a key not), not 'nightly' "
        "(`asyncinfer batch create --help` says more)"
    ), stderr
    code, _, stderr = ended["named npy"]
    assert (code, stderr.strip()) == (
        2,
        f"asyncinfer: {not_an_array} is named .npy but does not start as an NPY file does (numpy's magic bytes): "
        "another kind of file under that name, or a damaged one? (a JSONL file: --format jsonl)",
    ), stderr
    code, _, stderr = ended["out without wait"]
    assert code == 2, stderr
    assert "add --wait" in stderr  # --out would never be written
    for name in ("download", "out folder"):
        code, _, stderr = ended[name]
        assert (code, stderr.strip()) == (
            2, f"asyncinfer: --out {no_folder}: no such folder {no_folder.parent} (make it first: mkdir -p {no_folder.parent})"
        ), (name, stderr)  # fmt: skip
    code, _, stderr = ended["errors folder"]
    assert (code, stderr.strip()) == (
        2, f"asyncinfer: --errors {tmp_path} is a folder: give the path of a file in it ({tmp_path / 'results.jsonl'})"
    ), stderr  # fmt: skip


@pytest.mark.unit
async def test_a_download_to_a_path_it_cannot_write_names_that_path(tmp_path: Path) -> None:
    """The SDK's download to a folder not there named the `.part` file ("No such file or directory:
    '.../results.jsonl.part'"), a name its caller never gave; to a folder it read the whole file
    first and failed at the rename. Both are said of the path, before a byte is read."""
    read: list[bytes] = []

    async def pieces() -> AsyncIterator[bytes]:
        read.append(b"x")
        yield b"x"

    missing = tmp_path / "no-such-folder" / "results.jsonl"
    with pytest.raises(FileNotFoundError) as not_there:
        await write_file(pieces(), missing)
    assert not_there.value.filename == str(missing)
    with pytest.raises(IsADirectoryError) as folder:
        await write_file(pieces(), tmp_path)
    assert folder.value.filename == str(tmp_path)
    assert read == []
    assert not missing.parent.exists()
    assert not (tmp_path.parent / (tmp_path.name + ".part")).exists()


@pytest.mark.unit
def test_a_callbacks_events_reach_the_request() -> None:
    """A Callback's events pick the ends a batch's webhook is sent for (the SDK took only its URL,
    so `events=[FAILED]` was sent on every end)."""
    failed_only = create_batch_request("in/x", "demo", callback=Callback("https://h.example/b", events=("FAILED",)))
    assert failed_only.callback.url == "https://h.example/b"
    assert list(failed_only.callback.events) == [job_pb2.CALLBACK_EVENT_FAILED]
    every_end = create_batch_request("in/x", "demo", callback="https://h.example/b")
    assert list(every_end.callback.events) == []
    with pytest.raises(ValueError, match="'DONE' is not a valid CallbackEvent"):
        create_batch_request("in/x", "demo", callback=Callback("https://h.example/b", events=("DONE",)))


async def test_a_batch_callback_for_running_is_refused(config: Config, start_stack: StartStack) -> None:
    """A batch sends only its end: RUNNING among a Callback's events is INVALID_ARGUMENT, through the SDK too."""
    stack = await start_stack(webhook_config(config))
    async with AsyncClient(stack.address) as client:
        with pytest.raises(InvalidArgumentError, match="a batch sends only its end"):
            await client.create_batch(
                jsonl(demo_records(2)), "demo", callback=Callback("http://127.0.0.1:9/b", events=("RUNNING",))
            )


async def test_a_create_whose_answer_was_lost_makes_one_batch(config: Config, start_stack: StartStack) -> None:
    """A helper's CLI pass, session 24: the SDK sends a create again after UNAVAILABLE, and without an
    idempotency key the second made a second batch over the same upload, every record run twice.
    It generates one, as submit does; its own retry is not reported `deduplicated`."""
    stack = await start_stack(small_batches(config))
    async with AsyncClient(stack.address, retry=RetryPolicy(initial_backoff_s=0.01)) as client:
        stub: Any = client._batches._stub
        real, calls = stub.CreateBatch, []

        def answer_lost_once(request: Any, **kwargs: Any) -> Any:
            calls.append(request.idempotency_key)
            call = real(request, **kwargs)
            if len(calls) > 1:
                return call

            async def lost() -> Any:
                await call  # the gateway made the batch; the answer never comes back
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "lost"
                )

            return lost()

        stub.CreateBatch = answer_lost_once
        batch = await client.create_batch(jsonl(demo_records(4)), "demo")
        listed, _ = await client.list_batches()
    assert len(calls) == 2
    assert calls[0], "a key was generated"
    assert calls[0] == calls[1]
    assert [b.batch_id for b in listed] == [batch.batch_id]
    assert not batch.deduplicated


async def test_a_batch_watch_gives_up_once_the_gateway_stays_away(config: Config, start_stack: StartStack) -> None:
    """A helper's CLI pass, session 24: `batch watch` reopened its stream every 0.5 s for ever, silent,
    against a gateway gone for good; a job's watch gives up RetryPolicy.stream_resume_s after the break."""
    stack = await start_stack(small_batches(config).replace(gateway={"port": free_port()}), batcher=False)
    # Waits of 0.02 to 0.32 s: the 7 attempts are spent within the 1 s, and it is stream_resume_s
    # that ends them (the default's waits, 3-6 s in all, ran out the attempts after it).
    policy = RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.32, stream_resume_s=1.0)
    async with AsyncClient(stack.address, retry=policy) as client:
        batch = await client.create_batch(jsonl(demo_records(3)), "demo")  # no batcher: it stays running
        updates = client.watch_batch(batch)
        assert (await anext(updates)).batch_id == batch.batch_id
        await stack.gateway.stop(0)
        with pytest.raises(UnavailableError):
            await asyncio.wait_for(_drain(updates), 15)


async def test_a_batch_watch_reopens_per_the_clients_retry_policy(config: Config, start_stack: StartStack) -> None:
    """A reviewer's pass: a broken batch watch was opened again every 0.5 s, with no jitter and
    outside the client's RetryPolicy (its on_retry never heard of it). Now as a job's watch: across
    a gateway restart it is reopened after the policy's backoff (on_retry hears each wait) and goes
    on; against a gateway gone for good each wait lies in [c / 2, c] of the policy's ceiling c for
    that attempt, until stream_resume_s after the break."""
    stack = await start_stack(small_batches(config).replace(gateway={"port": free_port()}), batcher=False)
    waits: list[tuple[grpc.StatusCode | None, float]] = []
    retried = asyncio.Event()

    def on_retry(error: Any, delay_s: float) -> None:
        waits.append((error.code, delay_s))
        retried.set()

    policy = RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.32, stream_resume_s=3.0, on_retry=on_retry)
    async with AsyncClient(stack.address, retry=policy) as client:
        batch = await client.create_batch(jsonl(demo_records(3)), "demo")  # no batcher: it stays running
        updates = client.watch_batch(batch)
        assert (await anext(updates)).batch_id == batch.batch_id
        pending = asyncio.ensure_future(anext(updates))  # reads on while the gateway is away

        async def broken() -> None:
            await asyncio.wait_for(retried.wait(), 15)

        await stack.restart_gateway(grace_s=0, while_away=broken)
        again = await asyncio.wait_for(pending, 15)
        assert (again.batch_id, again.done) == (batch.batch_id, False)
        waits.clear()
        answered_after: list[int] = []  # the waits heard before each answer: its next break starts at attempt 1

        async def read_on() -> None:
            async for _ in updates:
                answered_after.append(len(waits))

        await stack.gateway.stop(0)  # a stopping gateway may still answer a reopened stream once
        with pytest.raises(UnavailableError):
            await asyncio.wait_for(read_on(), 15)
    bounds = [0, *answered_after, len(waits)]
    breaks = [waits[start:end] for start, end in itertools.pairwise(bounds)]
    assert len(breaks[-1]) >= 5  # the ceilings 0.02 to 0.32 s, then 0.32 s each, for 3 s
    for heard in breaks:
        for attempt, (code, delay_s) in enumerate(heard, 1):
            ceiling = min(0.32, 0.02 * 2 ** (attempt - 1))
            assert code == grpc.StatusCode.UNAVAILABLE
            assert ceiling / 2 <= delay_s <= ceiling, (attempt, delay_s, waits)


async def test_a_batch_watch_does_not_retry_internal() -> None:
    """INTERNAL is a server's bug, which no other call or stream retries; a batch watch opened it
    again every 0.5 s for stream_resume_s. Now the stream's error is raised at once."""
    opened: list[str] = []

    class Failing(batch_service_pb2_grpc.BatchServiceServicer):
        async def WatchBatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
            opened.append(request.batch_id)
            yield batch_service_pb2.WatchBatchResponse(
                batch=batch_service_pb2.Batch(
                    batch_id=request.batch_id, state=batch_service_pb2.BATCH_STATE_IN_PROGRESS
                )
            )
            await context.abort(grpc.StatusCode.INTERNAL, "a bug")

    server = grpc.aio.server()
    batch_service_pb2_grpc.add_BatchServiceServicer_to_server(Failing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncClient(f"127.0.0.1:{port}", retry=RetryPolicy(stream_resume_s=5.0)) as client:
            updates = client.watch_batch("01a24a3a-cd4b-7284-bc8e-00301d897e79")
            assert (await anext(updates)).state == "IN_PROGRESS"
            with pytest.raises(InternalError):
                await asyncio.wait_for(_drain(updates), 20)
    finally:
        await server.stop(None)
    assert len(opened) == 1


async def _drain(updates: AsyncIterator[Any]) -> None:
    async for _ in updates:
        pass


async def test_a_download_that_stalls_ends_at_its_timeout() -> None:
    """A helper's CLI pass, session 24: `batch download --timeout 3` from a gateway that stalled
    mid-file waited for ever (the read had no deadline); `get` of a large result the same."""

    class Stalling(batch_service_pb2_grpc.BatchServiceServicer):
        async def ReadBatchFile(self, request: Any, context: Any) -> AsyncIterator[Any]:
            yield batch_service_pb2.ReadBatchFileResponse(chunk=b'{"custom_id": "1"}\n')
            await asyncio.Event().wait()  # and nothing more, the stream open

    server = grpc.aio.server()
    batch_service_pb2_grpc.add_BatchServiceServicer_to_server(Stalling(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            with pytest.raises(DeadlineExceededError):
                await asyncio.wait_for(
                    client.download("01a24a3a-cd4b-7284-bc8e-00301d897e79", io.BytesIO(), timeout_s=1.0), 20
                )
    finally:
        await server.stop(None)


async def test_a_download_outlasts_a_gateway_restart_before_its_first_byte(
    config: Config, start_stack: StartStack, tmp_path: Path
) -> None:
    """Every other call retries UNAVAILABLE (RetryPolicy); a download raised it at once, so
    `batch download` during a gateway's restart or rollout failed where `batch get` waited it out.
    It is now opened again, within the policy and its timeout_s, until its first byte comes (a
    stream that breaks after that still fails whole: test_batch_downloads.py)."""
    retried = asyncio.Event()
    stack = await start_stack(small_batches(config).replace(gateway={"port": free_port()}))
    retry = RetryPolicy(max_attempts=50, on_retry=lambda error, delay_s: retried.set())
    async with AsyncClient(stack.address, retry=retry) as client:
        batch = await client.wait_batch(await client.create_batch(jsonl(demo_records(3)), "demo"), timeout_s=60)
        assert batch.state == "COMPLETED"
        downloads: list[asyncio.Task[int]] = []

        async def download_while_away() -> None:
            downloads.append(asyncio.create_task(client.download(batch, tmp_path / "out.jsonl", timeout_s=60)))
            await asyncio.wait([downloads[0], asyncio.create_task(retried.wait())], return_when="FIRST_COMPLETED")
            if downloads[0].done():  # it raised UnavailableError here, at once
                await downloads[0]

        await stack.restart_gateway(grace_s=0, while_away=download_while_away)
        written = await downloads[0]
    assert retried.is_set()
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert written == (tmp_path / "out.jsonl").stat().st_size
    assert len(lines) == 3


async def test_batch_list_pages_to_its_limit_and_says_when_it_cut(config: Config, start_stack: StartStack) -> None:
    """The first-hour pass, session 32: `batch list` read one page, so `--limit 0` (all, for `list`)
    showed 1 batch, more than 100 could never be listed, and a page short of its size (ListBatches
    reads past withdrawals) was all it showed. It now pages as `list` does, and says beside the list
    when --limit cut it."""
    stack = await start_stack(small_batches(config), batcher=False)  # the batches stay IN_PROGRESS
    async with AsyncClient(stack.address) as client:
        created = [await client.create_batch(jsonl(demo_records(2)), "demo", labels={"n": str(i)}) for i in range(3)]
    made = [batch.batch_id for batch in created]
    newest_first = made[::-1]
    code, printed, stderr = await cli("batch", "list", "--limit", "0", "--json", "--gateway", stack.address)
    assert (code, stderr) == (0, ""), stderr
    assert [json.loads(line)["batch_id"] for line in printed.splitlines()] == newest_first
    code, printed, stderr = await cli("batch", "list", "--limit", "2", "--json", "--gateway", stack.address)
    assert [json.loads(line)["batch_id"] for line in printed.splitlines()] == newest_first[:2]
    assert stderr == "asyncinfer: more batches than these 2 (newest first); --limit N shows more, --limit 0 all\n"
    code, printed, stderr = await cli("batch", "list", "--limit", "1", "--json", "--gateway", stack.address)
    assert [json.loads(line)["batch_id"] for line in printed.splitlines()] == newest_first[:1]
    assert stderr == "asyncinfer: more batches than this one (newest first); --limit N shows more, --limit 0 all\n"
    code, printed, stderr = await cli("batch", "list", "--limit", "3", "--gateway", stack.address)
    assert (code, len(printed.splitlines()), stderr) == (0, 4, ""), (printed, stderr)
    # When each was made and its labels, as `list` shows a job's (it showed neither: batches of one
    # model and size could not be told apart).
    assert printed.splitlines()[0].split() == [
        "BATCH", "STATE", "MODEL", "DONE", "FAILED", "RECORDS/S", "CREATED", "LABELS"
    ], printed  # fmt: skip
    for line, batch in zip(printed.splitlines()[1:], created[::-1], strict=True):
        assert line.split()[0] == batch.batch_id
        assert line.rstrip().endswith(f"{local_time(batch.create_time)}  n={batch.labels['n']}"), line
