"""The client commands of `asyncinfer` (submit, get, watch, cancel, list, bulk, dlq, stats) against
the real in-process stack: gateway + scheduler + batcher serving the demo model y = 2x + 1.

The CLI runs through `asyncinfer.cli.main` in a worker thread (its own event loop), so that the
stack keeps serving on the test's loop; watch runs as a subprocess so the test can read its first
line before letting the job run."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from asyncinfer.cli import main
from asyncinfer.client import AsyncClient, DeadlineExceededError, WaitingReason
from asyncinfer.config import Config, ModelVersionConfig, TensorSpecConfig, render_default_config
from asyncinfer.ids import new_job_id
from services.batcher.models import demo
from tests.stack import Stack, StartStack
from tests.test_batch_lifecycle import GATED, gate
from tests.waits import WAIT_S

__all__ = ["gate"]  # the fixture, used by name

REPO = Path(__file__).resolve().parents[1]


class ThreadStream(io.TextIOBase):
    """sys.stdout / sys.stderr for the test: what a CLI thread writes goes to that thread's buffer,
    everything else (the services' logs) to the stream it replaced."""

    def __init__(self, underlying: Any) -> None:
        self.underlying = underlying
        self.buffers: dict[int, io.StringIO] = {}

    def write(self, text: str) -> int:
        buffer = self.buffers.get(threading.get_ident())
        return buffer.write(text) if buffer is not None else self.underlying.write(text)

    def flush(self) -> None:
        if threading.get_ident() not in self.buffers:
            self.underlying.flush()

    def isatty(self) -> bool:
        return False


class TerminalStream(ThreadStream):
    """A ThreadStream that is a terminal (live lines and progress bars draw on it), which a test can
    wait on until a CLI thread's output shows something (woken by each write, not polled)."""

    def __init__(self, underlying: Any) -> None:
        super().__init__(underlying)
        self.written = threading.Condition()

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        count = super().write(text)
        with self.written:
            self.written.notify_all()
        return count

    def wait_until(self, shows: Callable[[str], bool], timeout_s: float = 20.0) -> str:
        """Blocks until a CLI thread's output so far satisfies `shows`; that output."""
        found: list[str] = []

        def seen() -> bool:
            found[:] = [b.getvalue() for b in list(self.buffers.values()) if shows(b.getvalue())]
            return bool(found)

        with self.written:
            assert self.written.wait_for(seen, timeout_s), "the CLI never showed it"
        return found[0]


class Cli:
    """Runs `asyncinfer ...` in a worker thread and returns (exit code, stdout, stderr); `terminal`
    makes that stream a terminal (TerminalStream)."""

    def __init__(self, stack: Stack, monkeypatch: pytest.MonkeyPatch, *, terminal: str = "") -> None:
        self.stack = stack
        self.stdout = (TerminalStream if terminal == "stdout" else ThreadStream)(sys.stdout)
        self.stderr = (TerminalStream if terminal == "stderr" else ThreadStream)(sys.stderr)
        monkeypatch.setattr(sys, "stdout", self.stdout)
        monkeypatch.setattr(sys, "stderr", self.stderr)

    def _run(self, argv: list[str]) -> tuple[int, str, str]:
        me = threading.get_ident()
        out, err = self.stdout.buffers[me], self.stderr.buffers[me] = io.StringIO(), io.StringIO()
        try:
            return main(argv), out.getvalue(), err.getvalue()
        except SystemExit as exited:  # argparse's usage errors: the process's exit code
            return int(exited.code or 0), out.getvalue(), err.getvalue()
        finally:
            del self.stdout.buffers[me], self.stderr.buffers[me]

    async def __call__(self, *argv: str, gateway: str | None = None) -> tuple[int, str, str]:
        options = [
            "--gateway",
            gateway or self.stack.address,
            "--scheduler",
            self.stack.ops_address,
            "--timeout",
            "20",
        ]
        return await asyncio.to_thread(self._run, [*options, *argv])


def without_ansi(text: str) -> str:
    """What a terminal shows of `text`, less its colours and cursor controls."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def count_jobs(stack: Stack, **filters: Any) -> int:
    async with AsyncClient(stack.address) as client:
        return len([job async for job in client.list(limit=None, **filters)])


# -- submit, get ---------------------------------------------------------------------------------


async def test_submit_inline_and_npy_then_get_json_shows_outputs(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cli = Cli(stack, monkeypatch)
    # JSON ints, typed FP32 from the demo model's signature (the default configuration's).
    code, out, err = await cli("submit", "demo", "--input", "x=[[1,2,3,4]]", "--label", "suite=cli")
    assert code == 0, err
    job_id = out.strip()
    assert len(job_id) == 36, out

    async with AsyncClient(stack.address) as client:
        await client.wait(job_id, timeout_s=20)
    code, out, err = await cli("get", job_id, "--json")
    assert code == 0, err
    job = json.loads(out)
    assert job["job_id"] == job_id
    assert job["state"] == "SUCCEEDED"
    assert job["labels"] == {"suite": "cli"}
    assert stack.batcher is not None
    assert job["batcher_id"] == stack.batcher.batcher_id
    code, out, err = await cli("get", job_id)
    assert code == 0, err
    assert f"ran on      {stack.batcher.batcher_id}" in out
    assert job["outputs"]["y"] == {"datatype": "FP32", "shape": [1, 4], "data": [[3.0, 5.0, 7.0, 9.0]]}

    # A float64 .npy file, one row without the batch dimension: cast and batched per the signature.
    np.save(tmp_path / "x.npy", np.array([0.5, 1.0, 1.5, 2.0]))
    code, out, err = await cli("submit", "demo", "--input", f"x=@{tmp_path / 'x.npy'}", "--wait", "--json")
    assert code == 0, err
    done = json.loads(out)
    assert done["state"] == "SUCCEEDED"
    assert done["outputs"]["y"]["data"] == [[2.0, 3.0, 4.0, 5.0]]

    # Text output of get names the state and the output.
    code, out, err = await cli("get", job_id)
    assert code == 0, err
    assert "SUCCEEDED" in out
    assert "y FP32 [1, 4]" in out


async def test_one_row_without_its_batch_dimension_is_the_same_job_from_the_cli_and_the_sdk(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`-i 'x=[1,2,3,4]'` for the demo model (x: FP32 of shape [-1, 4]) is one row: the CLI added
    the batch dimension the signature has and the value lacks, and the job ran on [[1, 2, 3, 4]];
    the SDK's submit(inputs={"x": [1, 2, 3, 4]}) sent shape [4], refused "input 'x' must have shape
    [-1, 4] (-1: any), got [4]: ...". Both add it now (the model's signature decides), for lists and
    arrays alike; a request file's and a JSONL batch line's values took it already."""
    cli = Cli(stack, monkeypatch)
    code, out, err = await cli("submit", "demo", "-i", "x=[1,2,3,4]", "--wait", "--json")
    assert code == 0, err
    from_cli = json.loads(out)["outputs"]["y"]
    assert from_cli == {"datatype": "FP32", "shape": [1, 4], "data": [[3.0, 5.0, 7.0, 9.0]]}
    async with AsyncClient(stack.address) as client:
        for value in ([1, 2, 3, 4], np.arange(1, 5), np.arange(1, 5, dtype=np.float32)):
            job = await client.submit("demo", {"x": value})
            done = await client.wait(job, timeout_s=20)
            assert done.succeeded, done.error
            outputs = await client.outputs(done)
            assert outputs["y"].shape == (1, 4), value
            assert outputs["y"].tolist() == from_cli["data"], value
        # Already batched, or of another rank: sent as it is (two rows; the gateway judges the rest).
        outputs = await client.run("demo", {"x": [[1, 2, 3, 4], [0, 0, 0, 0]]}, timeout_s=20)
        assert outputs["y"].tolist() == [[3, 5, 7, 9], [1, 1, 1, 1]]


async def test_submit_request_from_stdin(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    request = {"model": "demo", "inputs": {"x": {"datatype": "FP32", "shape": [2, 4], "data": list(range(8))}}}
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(request)))
    code, out, err = await Cli(stack, monkeypatch)("--json", "submit", "--request", "-", "--priority", "high", "--wait")
    assert code == 0, err
    job = json.loads(out)
    assert job["priority"] == "HIGH"
    assert job["outputs"]["y"]["data"] == [[1.0, 3.0, 5.0, 7.0], [9.0, 11.0, 13.0, 15.0]]


async def test_errors_have_their_exit_codes_and_say_why(idle_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    cli = Cli(idle_stack, monkeypatch)
    # The gateway refuses a wrong shape: INVALID_ARGUMENT (4), the field violation on stderr.
    code, out, err = await cli("submit", "demo", "--input", "x=[[1,2,3]]")
    assert code == 4
    assert out == ""
    assert err.startswith("asyncinfer: error: INVALID_ARGUMENT: "), err  # the reason repeats the code: once
    assert "inputs[0].shape" in err
    assert "[-1, 4]" in err
    # An unknown job: NOT_FOUND (3).
    code, _, err = await cli("get", new_job_id())
    assert code == 3
    assert err.startswith("asyncinfer: error: NOT_FOUND JOB_NOT_FOUND: "), err  # a reason of its own: both
    # A model the gateway does not serve, with a text value (not JSON) that only a signature
    # types: NOT_FOUND (3) naming the models served, as the gateway's own refusal; it was a usage
    # error saying "--input text is not valid JSON" (a stack serving no minilm-l6, say).
    code, out, err = await cli("submit", "nosuch", "--input", "text=hello")
    assert code == 3, err
    assert out == ""
    assert err.startswith("asyncinfer: error: NOT_FOUND MODEL_NOT_FOUND: unknown model 'nosuch'"), err
    assert "the models served are: " in err
    assert "demo" in err
    assert "JSON" not in err
    # No inputs: what the model takes (it said only 'no inputs: give --input NAME=VALUE (or "inputs"
    # in the request file)'), and for a model not served, that first (it said "no inputs" too).
    code, out, err = await cli("submit", "demo")
    assert (code, out) == (2, ""), err
    assert err == (
        "asyncinfer: no inputs: model 'demo' takes x: FP32 of shape [-1, 4] (-1: any size); give -i 'x=JSON' "
        '(or NAME=@file.npy), or "inputs" in a request file (--request FILE)\n'
    )
    code, out, err = await cli("submit", "nosuch")
    assert (code, out) == (3, ""), err
    assert err.startswith("asyncinfer: error: NOT_FOUND MODEL_NOT_FOUND: unknown model 'nosuch'"), err
    # Malformed arguments never reach the gateway: usage error (2).
    code, _, err = await cli("submit", "demo", "--input", "x=[1,2")
    assert code == 2
    assert "--input x" in err
    assert "JSON" in err
    code, _, err = await cli("list", "--state", "queued,Done")
    assert code == 2
    assert "unknown state 'Done';" in err, "as given (it said 'DONE')"
    # Nothing listening: UNAVAILABLE (5), within the timeout.
    code, _, err = await cli("get", new_job_id(), "--timeout", "1", gateway="127.0.0.1:1")
    assert code == 5
    assert "UNAVAILABLE" in err


async def test_a_wait_cut_short_still_names_the_job_it_queued(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`submit --wait` whose wait ends first (here --timeout; Ctrl-C the same): the job was
    queued, so its ID is on stderr with how to follow it. Before, nothing named it."""
    cli = Cli(idle_stack, monkeypatch)
    code, out, err = await cli("submit", "demo", "--input", "x=[[1,2,3,4]]", "--wait", "--timeout", "1")
    assert (code, out) == (5, "")
    # One line (it was two: "job ... was queued and goes on; follow it with ..." and the watch's
    # "asyncinfer: error: DEADLINE_EXCEEDED: the watch of job ... (it goes on) ..."): the job, its
    # state when the wait ran out, how to go on.
    (line,) = err.splitlines()
    job_id = line.split()[2]
    assert line == (
        f"asyncinfer: job {job_id} is QUEUED after --timeout 1 s and goes on; follow it with `asyncinfer watch {job_id}`"
    )
    code, out, err = await cli("get", job_id, "--json")
    assert code == 0, err
    assert json.loads(out)["state"] == "QUEUED"


async def test_empty_listings_say_so_plainly(idle_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """`list` and `batch list` with nothing to show printed their table's header alone, which read
    as a listing that failed or was cut; they say "no jobs" ("no batches") now, with the filters
    that chose none, as `dlq list` said "no dead letters". --json prints nothing (no lines), as before."""
    cli = Cli(idle_stack, monkeypatch)
    for argv, expected in (
        (("list",), "no jobs\n"),
        (
            ("list", "--state", "succeeded,failed", "--model", "demo", "--label", "b=2", "--label", "a=1"),
            "no jobs (state SUCCEEDED, FAILED; model demo; label a=1; label b=2)\n",
        ),
        (("batch", "list"), "no batches\n"),
        (("dlq", "list"), "no dead letters\n"),
        (("dlq", "list", "--model", "demo"), "no dead letters of model demo\n"),
    ):
        assert await cli(*argv) == (0, expected, ""), argv
        assert await cli(*argv, "--json") == (0, "", ""), argv


async def test_a_deadline_not_of_timeout_ends_a_wait_as_any_error(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one line of a wait cut short names --timeout: without one, a DEADLINE_EXCEEDED (one a
    gateway or a proxy gave) is said as any error is, the job named, not as a --timeout of None."""

    async def exceeded(*_args: Any, **_kwargs: Any) -> Any:
        raise DeadlineExceededError("the watch did not complete", code=grpc.StatusCode.DEADLINE_EXCEEDED)
        yield  # an async generator, as the SDK's watch

    monkeypatch.setattr(AsyncClient, "watch", exceeded)
    cli = Cli(idle_stack, monkeypatch)
    argv = ["--gateway", idle_stack.address, "submit", "demo", "-i", "x=[[1,2,3,4]]", "--wait"]
    code, out, err = await asyncio.to_thread(cli._run, argv)
    assert (code, out) == (5, ""), err
    queued, error = err.splitlines()
    job_id = queued.split()[2]
    assert queued == f"asyncinfer: job {job_id} was queued and goes on; follow it with `asyncinfer watch {job_id}`"
    assert error.startswith("asyncinfer: error: DEADLINE_EXCEEDED: "), err


# -- watch, cancel, list -------------------------------------------------------------------------


async def test_watch_json_prints_each_state_until_succeeded(
    config: Config, start_stack: StartStack, gate: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gated model holds the job RUNNING until the watch has printed it: a watcher is owed the
    # latest record, not every revision (JobService.WatchJob), and a demo job's RUNNING and SUCCEEDED,
    # written moments apart, reached a loaded machine's watch as SUCCEEDED alone.
    models = [*(m.model_dump() for m in config.models), GATED]
    idle_stack = await start_stack(config.replace(models=models), batcher=False)
    code, out, err = await Cli(idle_stack, monkeypatch)("submit", "gated", "--input", "x=[[1,1,1,1]]")
    assert code == 0, err
    job_id = out.strip()
    watcher = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "asyncinfer.cli",
        "watch",
        job_id,
        "--json",
        "--gateway",
        idle_stack.address,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert watcher.stdout is not None
    first = json.loads(await asyncio.wait_for(watcher.stdout.readline(), WAIT_S))
    assert first["state"] == "QUEUED"  # no batcher yet: it waits
    await idle_stack.start_batcher()
    running = json.loads(await asyncio.wait_for(watcher.stdout.readline(), WAIT_S))
    assert running["state"] == "RUNNING"  # held at the gate until now
    demo.GATE.set()
    rest, stderr = await asyncio.wait_for(watcher.communicate(), WAIT_S)
    assert watcher.returncode == 0, stderr.decode()
    updates = [first, running, *json_lines(rest.decode())]
    states = [u["state"] for u in updates]
    assert states[-1] == "SUCCEEDED"
    revisions = [u["revision"] for u in updates]
    assert revisions == sorted(set(revisions)), "each change once, in order"


async def test_cancel_then_get_and_list_with_filters(idle_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    cli = Cli(idle_stack, monkeypatch)
    ids: dict[str, str] = {}
    for name, team in (("a", "red"), ("b", "red"), ("c", "blue")):
        code, out, err = await cli("submit", "demo", "-i", "x=[[0,0,0,0]]", "--label", f"team={team}")
        assert code == 0, err
        ids[name] = out.strip()

    code, out, err = await cli("cancel", ids["a"], "--reason", "not needed", "--json")
    assert code == 0, err
    assert json.loads(out)["state"] == "CANCELED"
    code, out, _ = await cli("get", ids["a"], "--json")
    assert json.loads(out)["state"] == "CANCELED"
    # An unknown job among several: the others are still canceled, the exit code is NOT_FOUND's.
    code, out, err = await cli("cancel", new_job_id(), ids["b"])
    assert code == 3
    assert "JOB_NOT_FOUND" in err
    assert f"{ids['b']}  CANCELED" in out

    code, out, err = await cli("list", "--json", "--label", "team=red", "--model", "demo")
    assert code == 0, err
    assert {j["job_id"] for j in json_lines(out)} == {ids["a"], ids["b"]}
    code, out, _ = await cli("list", "--json", "--state", "QUEUED,RUNNING")
    assert [j["job_id"] for j in json_lines(out)] == [ids["c"]]
    code, out, err = await cli("list", "--json", "--limit", "2")
    assert [j["job_id"] for j in json_lines(out)] == [ids["c"], ids["b"]], "newest first, at most 2"
    # A list cut at --limit (50 by default) says so beside it; it was cut without a word, so the
    # newest 50 jobs read as all of them (the first-hour pass, session 32).
    assert err == "asyncinfer: more jobs than these 2 (newest first); --limit N shows more, --limit 0 all\n", err
    code, out, err = await cli("list", "--json", "--limit", "1")
    assert [j["job_id"] for j in json_lines(out)] == [ids["c"]]
    assert err == "asyncinfer: more jobs than this one (newest first); --limit N shows more, --limit 0 all\n", err
    code, out, err = await cli("list", "--limit", "3")
    assert (code, len(out.splitlines()), err) == (0, 4, ""), (out, err)
    code, out, err = await cli("list", "--limit", "0", "--json")
    assert (code, len(json_lines(out)), err) == (0, 3, ""), (out, err)
    code, out, _ = await cli("list", "--state", "canceled")
    assert out.splitlines()[0].split()[:3] == ["JOB_ID", "MODEL", "STATE"]
    assert len(out.splitlines()) == 3


async def test_labels_and_idempotency_keys_of_any_text_round_trip_exactly(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a shell hands the CLI in `--label KEY=VALUE` and `--idempotency-key`: the first '='
    splits, the rest is the value; spaces, emoji and unnormalized forms (NFD's "e" + U+0301, not
    NFC's "é") come back as given from get and list, --json or not, and a label filter or a key
    matches only the same code points. What cannot be sent is a usage error (2), before anything
    is: an empty key, an empty --idempotency-key (an unset variable: the command ran with no key,
    and a rerun queued the job again), or bytes that are not UTF-8 (Python hands them over as
    lone surrogates, which protobuf refused with a traceback). What the gateway limits is its
    INVALID_ARGUMENT (4)."""
    cli = Cli(idle_stack, monkeypatch)
    nfd, nfc = "cafe\u0301", "caf\u00e9"
    labels = {"query": "a=b=c", "two words": " spaced out ", "🚀": "✨ ok", nfd: nfd, "empty": ""}
    argv = [arg for key, value in labels.items() for arg in ("--label", f"{key}={value}")]
    key = f"nightly {nfd} 🚀 = 1"
    code, out, err = await cli("submit", "demo", "-i", "x=[[1,2,3,4]]", *argv, "--idempotency-key", key)
    assert code == 0, err
    job_id = out.strip()
    code, out, err = await cli("get", job_id, "--json")
    assert code == 0, err
    job = json.loads(out)
    assert (job["labels"], job["idempotency_key"]) == (labels, key)
    code, out, err = await cli("get", job_id)
    assert code == 0, err
    assert f"labels      {nfd}={nfd}, empty=, query=a=b=c, two words= spaced out , 🚀=✨ ok" in out.splitlines()
    for filters, found in (
        ((f"{nfd}={nfd}", "query=a=b=c", "empty="), [job_id]),
        ((f"{nfc}={nfc}",), []),  # another form of the same text is another label
        (("two words=spaced out",), []),
    ):
        code, out, err = await cli("list", "--json", *(arg for f in filters for arg in ("--label", f)))
        assert code == 0, err
        assert [j["job_id"] for j in json_lines(out)] == found, filters
    # The same key finds the job; the same text in NFC is another key.
    code, out, err = await cli("submit", "demo", "-i", "x=[[1,2,3,4]]", *argv, "--idempotency-key", key)
    assert (code, out.strip()) == (0, job_id), err
    code, out, err = await cli("submit", "demo", "-i", "x=[[1,2,3,4]]", "--idempotency-key", key.replace(nfd, nfc))
    assert code == 0, err
    assert out.strip() != job_id

    queued = await count_jobs(idle_stack)
    for refused, says in (
        (["--idempotency-key", ""], "argument --idempotency-key: it is empty (an unset variable?)"),
        (["--label", "k=caf\udce9"], "argument --label: not UTF-8 text (byte 0xE9 at position 5)"),
        (["--label", "caf\udce9=v"], "argument --label: not UTF-8 text (byte 0xE9 at position 3)"),
        (["--idempotency-key", "caf\udce9"], "argument --idempotency-key: not UTF-8 text (byte 0xE9 at position 3)"),
        (["--label", "=v"], "argument --label: give KEY=VALUE (a value may be empty, a key not), not '=v'"),
        (["--label", "novalue"], "argument --label: give KEY=VALUE (a value may be empty, a key not), not 'novalue'"),
    ):
        code, out, err = await cli("submit", "demo", "-i", "x=[[1,2,3,4]]", *refused)
        assert (code, out) == (2, ""), (refused, err)
        assert says in err, (refused, err)
        assert "Traceback" not in err, err
    for refused in (["--label", "k=caf\udce9"], ["--idempotency-key", ""]):
        code, out, err = await cli("batch", "create", "nosuch.jsonl", "--model", "demo", *refused)
        assert (code, out) == (2, ""), (refused, err)
    code, out, err = await cli("list", "--label", "k=caf\udce9")
    assert (code, out) == (2, ""), err
    # Over the gateway's limits (a label key of 16 emoji is 64 bytes of UTF-8; at most 63).
    code, out, err = await cli("submit", "demo", "-i", "x=[[1,2,3,4]]", "--label", f"{'🚀' * 16}=v")
    assert (code, out) == (4, ""), err
    assert "label keys are 1-63 bytes" in err
    assert await count_jobs(idle_stack) == queued, "nothing refused was queued"


# -- bulk ----------------------------------------------------------------------------------------


def write_bulk_file(path: Path) -> tuple[dict[int, list[float]], set[int], set[int]]:
    """200 lines: valid ones (line -> x row), lines that are not JSON, lines the gateway refuses."""
    valid: dict[int, list[float]] = {}
    not_json: set[int] = set()
    refused: set[int] = set()
    lines: list[str] = []
    for number in range(1, 201):
        if number % 40 == 0:
            lines.append('{"model": "demo", "inputs": ')
            not_json.add(number)
        elif number % 40 == 7:
            lines.append(json.dumps({"inputs": {"x": [[1, 2, 3]]}, "labels": {"bulk": "t"}}))
            refused.add(number)
        else:
            row = [float(number), float(number % 3), -1.0, 0.5]
            lines.append(json.dumps({"inputs": {"x": [row]}, "labels": {"bulk": "t"}}))
            valid[number] = row
    path.write_text("\n".join(lines) + "\n")
    return valid, not_json, refused


def check_results(path: Path, valid: dict[int, list[float]], not_json: set[int], refused: set[int]) -> None:
    results = {entry["line"]: entry for entry in json_lines(path.read_text())}
    assert set(results) == set(valid) | not_json | refused, "one result per line, none twice"
    for number, row in valid.items():
        entry = results[number]
        assert entry["state"] == "SUCCEEDED", entry
        assert entry["outputs"]["y"]["data"] == [[2 * v + 1 for v in row]]
    for number in not_json:
        assert results[number]["error"]["reason"] == "INVALID_LINE"
    for number in refused:
        error = results[number]["error"]
        assert error["code"] == "INVALID_ARGUMENT"
        assert any(v["field"].endswith(".shape") for v in error["violations"]), error


async def test_a_key_reused_with_another_request_says_whose_it_is_and_what_to_do(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`submit --idempotency-key K` again with other inputs: ALREADY_EXISTS (exit 4), the gateway's
    message naming the job that holds the key, then a hint with the commands that go on from there
    (it printed the message alone, which named no command)."""
    cli = Cli(idle_stack, monkeypatch)
    code, out, err = await cli("submit", "demo", "-i", "x=[[1,2,3,4]]", "--idempotency-key", "order-7")
    assert code == 0, err
    job_id = out.strip()
    code, out, err = await cli("submit", "demo", "-i", "x=[[1,2,3,5]]", "--idempotency-key", "order-7")
    assert (code, out) == (4, "")
    assert err.splitlines() == [
        f"asyncinfer: error: ALREADY_EXISTS IDEMPOTENCY_KEY_REUSED: idempotency key 'order-7' was first used for "
        f"job {job_id}, with a different request: a key can be sent again only with its first request (a retry, "
        "answered with that job). Get that job with GetJob, or use a new key for a different request",
        f"asyncinfer:   hint: that job: asyncinfer get {job_id}; a new job: run this again with another "
        "--idempotency-key",
    ]


async def test_bulk_writes_results_and_resumes_without_queuing_twice(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cli = Cli(stack, monkeypatch)
    source = tmp_path / "requests.jsonl"
    valid, not_json, refused = write_bulk_file(source)
    out = tmp_path / "requests.results.jsonl"

    code, stdout, err = await cli("bulk", str(source), "--model", "demo", "--json")
    assert code == 1, err  # some lines did not succeed
    summary = json.loads(stdout)
    assert summary["lines"] == 200
    assert summary["succeeded"] == len(valid)
    assert summary["submitted"] == len(valid)
    assert summary["deduplicated"] == 0
    # A line the gateway refuses INVALID_ARGUMENT is as invalid as one that is not JSON; "refused"
    # is for valid requests the gateway did not take (a quota, a permission).
    assert summary["invalid"] == len(not_json) + len(refused)
    assert summary["refused"] == 0
    assert summary["jobs_not_succeeded"] == 0
    assert summary["not_succeeded"] == len(not_json) + len(refused)
    check_results(out, valid, not_json, refused)
    assert await count_jobs(stack, labels={"bulk": "t"}) == len(valid)

    # Interrupted after half the results were written: the re-run waits for the jobs the state
    # file knows and queues nothing.
    kept = out.read_text().splitlines()[::2]
    out.write_text("\n".join(kept) + "\n")
    code, stdout, err = await cli("bulk", str(source), "--model", "demo", "--json")
    assert code == 1, err
    summary = json.loads(stdout)
    assert summary["submitted"] == 0, summary
    kept_lines = {json.loads(line)["line"] for line in kept}
    # What earlier runs did counts: the lines with a result are done before, the others accepted
    # before (waited for now); invalid and refused lines are counted whichever run found them.
    assert summary["already_done"] == len(kept_lines), summary
    assert summary["accepted_before"] == len(set(valid) - kept_lines), summary
    assert (summary["invalid"], summary["refused"]) == (len(not_json) + len(refused), 0), summary
    assert summary["succeeded"] == len(valid), summary
    code, stdout, err = await cli("bulk", str(source), "--model", "demo")
    assert code == 1, err
    # Zero counts are left out; the file's standing, then this run's.
    assert stdout.splitlines()[0] == f"200 lines: {len(valid)} succeeded, {len(not_json) + len(refused)} invalid.", (
        stdout
    )
    assert stdout.splitlines()[1] == f"This run: 0 submitted, 200 done before. Results: {out}", stdout
    # Then the lines that did not succeed, and why (the first-hour pass, session 38: only counted).
    failures = stdout.splitlines()[2:]
    assert [line.split(":")[0] for line in failures] == [f"  line {n}" for n in sorted(not_json | refused)], stdout
    assert failures[0].startswith("  line 7: INVALID_ARGUMENT: invalid request: inputs[0].shape: "), stdout
    assert failures[1].startswith("  line 40: INVALID_ARGUMENT INVALID_LINE: "), stdout
    check_results(out, valid, not_json, refused)
    assert await count_jobs(stack, labels={"bulk": "t"}) == len(valid)

    # Interrupted before the state file was written (and the results lost): every line is sent
    # again, and the idempotency keys answer each with its first job.
    await asyncio.to_thread(out.unlink)
    await asyncio.to_thread(Path(str(out) + ".state").unlink)
    code, stdout, err = await cli("bulk", str(source), "--model", "demo", "--json")
    assert code == 1, err
    summary = json.loads(stdout)
    assert summary["deduplicated"] == len(valid), summary
    check_results(out, valid, not_json, refused)
    assert await count_jobs(stack, labels={"bulk": "t"}) == len(valid)


async def test_bulk_refuses_a_results_path_that_is_no_file_and_writes_through_a_link(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first-hour pass, session 32: `bulk records.jsonl --out /dev/null` (results not wanted)
    rewrote its results file by a rename at start, which replaced /dev/null itself with a regular
    file (as root; /dev/null.state beside it), and `--out` a link to a file replaced the link. Here
    links in the test's folder: to /dev/null (refused before anything is sent, the link kept) and
    to a results file elsewhere (the file rewritten, the link kept)."""
    cli = Cli(idle_stack, monkeypatch)
    source = tmp_path / "requests.jsonl"
    source.write_text(json.dumps({"inputs": {"x": [[1, 2, 3, 4]]}}) + "\n")
    null = tmp_path / "null"
    null.symlink_to("/dev/null")
    code, _, err = await cli("bulk", str(source), "--model", "demo", "--no-wait", "--out", str(null))
    assert code == 2, err
    assert f"--out {null} is not a file: bulk keeps every line's result there" in err, err
    assert null.is_symlink()
    assert not (tmp_path / "null.state").exists()
    assert await count_jobs(idle_stack) == 0

    (tmp_path / "data").mkdir()
    results = tmp_path / "data" / "results.jsonl"
    earlier = {"line": 7, "state": "SUCCEEDED", "job_id": new_job_id()}
    results.write_text(json.dumps(earlier) + "\n" + '{"line": 8, "torn')  # a torn last line is dropped
    link = tmp_path / "results.jsonl"
    link.symlink_to(Path("data") / "results.jsonl")
    code, _, err = await cli("bulk", str(source), "--model", "demo", "--no-wait", "--out", str(link))
    assert code == 0, err
    assert link.is_symlink()
    assert json_lines(results.read_text()) == [earlier]
    assert await count_jobs(idle_stack) == 1


async def test_bulk_reads_piped_lines_and_a_second_pipe_resumes(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`jq ... | asyncinfer bulk - --out results.jsonl` (it said "no such file: -")."""
    cli = Cli(stack, monkeypatch)
    lines = "".join(json.dumps({"inputs": {"x": [[i, 0, 0, 0]]}, "labels": {"piped": "t"}}) + "\n" for i in range(5))
    out = tmp_path / "piped.results.jsonl"
    code, _, err = await cli("bulk", "-", "--model", "demo")
    assert code == 2
    assert "needs --out" in err
    for _ in range(2):  # the same lines again: resumed, nothing queued twice
        monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
        code, stdout, err = await cli("bulk", "-", "--model", "demo", "--out", str(out), "--json")
        assert code == 0, err
        assert json.loads(stdout)["succeeded"] == 5
    assert sorted(json.loads(line)["line"] for line in out.read_text().splitlines()) == [1, 2, 3, 4, 5]
    assert await count_jobs(stack, labels={"piped": "t"}) == 5
    assert not (tmp_path / "piped.results.jsonl.stdin").exists(), "the spooled lines are not left behind"


async def test_bulk_on_a_paused_queue_shows_its_wait_bar_at_once(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cli = Cli(stack, monkeypatch, terminal="stderr")
    code, _, err = await cli("queue", "pause", "demo")
    assert code == 0, err
    source = tmp_path / "paused.jsonl"
    source.write_text("".join(json.dumps({"inputs": {"x": [[n, 0, 0, 0]]}}) + "\n" for n in range(3)))
    bulk = asyncio.create_task(cli("bulk", str(source), "--model", "demo", "--json"))
    # The bars are drawn by rich: colours and a carriage return before each redraw.
    shown = await asyncio.to_thread(cli.stderr.wait_until, lambda text: "wait   ━" in without_ansi(text))
    assert "0/3" in without_ansi(shown).split("wait   ━")[-1], shown
    assert "submit ━" in without_ansi(shown)  # and the submit bar before it, finished
    assert not bulk.done()
    code, _, err = await cli("queue", "resume", "demo")
    assert code == 0, err
    code, stdout, err = await bulk
    assert code == 0, err
    assert json.loads(stdout)["succeeded"] == 3


async def test_watch_on_a_terminal_ticks_while_the_job_waits(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # a terminal wide enough for the status line (rich wraps a longer one)
    cli = Cli(idle_stack, monkeypatch, terminal="stdout")
    code, out, err = await cli("submit", "demo", "--input", "x=[[1,2,3,4]]")
    assert code == 0, err
    job_id = out.strip()
    watch = asyncio.create_task(cli("watch", job_id))

    def clock_moved(text: str) -> bool:  # two readings of the clock, the job still QUEUED
        # As duration_text writes it: "512 ms", "1.01 s", "10.5 s" (the pattern was the last form
        # alone, "N.N s", so that the wait went on until the clock passed 10 s).
        readings = {m.group(1) for m in re.finditer(r"QUEUED.*?\((\d+(?:\.\d+)? m?s)\)", text)}
        return len(readings) >= 2

    await asyncio.to_thread(cli.stdout.wait_until, clock_moved)
    assert not watch.done()
    await idle_stack.start_batcher()
    code, out, err = await watch
    assert code == 0, err
    assert "SUCCEEDED" in out


# -- dlq, stats ----------------------------------------------------------------------------------


async def test_dlq_and_stats(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    cli = Cli(stack, monkeypatch)
    code, out, err = await cli("dlq", "list", "--json")
    assert (code, out) == (0, ""), err
    code, out, err = await cli("dlq", "list")
    assert code == 0, err
    assert "no dead letters" in out
    # Without a terminal to ask on, purge --all refuses unless told --yes (an answer on stdin is no answer).
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, out, err = await cli("dlq", "purge", "--all")
    assert (code, out) == (2, ""), err
    assert (
        err == "asyncinfer: dlq purge --all deletes every dead letter and there is no terminal to ask on: add --yes\n"
    )
    code, out, err = await cli("dlq", "purge", "--all", "--yes", "--json")
    assert code == 0, err
    assert json.loads(out) == {"purged": 0, "remaining": 0}
    code, _, err = await cli("dlq", "replay")
    assert code == 2
    assert "SEQUENCE" in err
    code, _, err = await cli("dlq", "show", "12345")
    assert code == 3
    assert "DEAD_LETTER_NOT_FOUND" in err

    code, out, err = await cli("stats", "--once", "--json")
    assert code == 0, err
    snapshot = json.loads(out)
    demo = next(m for m in snapshot["models"] if m["model_name"] == "demo")
    assert demo["connected_batchers"] >= 1
    assert {q["priority"] for q in demo["queues"]} >= {"HIGH", "NORMAL", "LOW"}
    code, out, err = await cli("stats", "--once")
    assert code == 0, err
    assert out.splitlines()[0].startswith("MODEL")
    assert "demo" in out


async def test_queue_pause_resume_and_drain(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    cli = Cli(stack, monkeypatch)
    code, out, err = await cli("queue", "pause", "demo", "--json")
    assert code == 0, err
    assert json.loads(out) == {"model_name": "demo", "paused": True, "state": "paused", "queued": 0}
    code, out, err = await cli("submit", "demo", "--input", "x=[[1,2,3,4]]")
    assert code == 0, err
    job_id = out.strip()
    code, out, err = await cli("get", job_id, "--json")
    assert code == 0, err
    assert json.loads(out)["state"] == "QUEUED"
    code, out, err = await cli("queue", "resume", "demo")
    assert code == 0, err
    assert out.strip() == "demo: dispatching, 1 queued"
    code, out, err = await cli("watch", job_id, "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["state"] == "SUCCEEDED"
    code, _, err = await cli("queue", "pause", "no-such-model")
    assert code == 3, err
    # Named as submit names the models served (it said "model 'no-such-model' is not configured").
    known = ", ".join(sorted(m.name for m in stack.config.models))
    assert err == (
        "asyncinfer: error: NOT_FOUND MODEL_NOT_FOUND: unknown model 'no-such-model'; the models this scheduler "
        f"knows are: {known}\n"
    )
    code, out, err = await cli("queue", "drain", "--wait", "5", "--json")
    assert code == 0, err
    # The answer names the scheduler reached (behind a Service: the one it picked).
    name = stack.scheduler.instance_name
    assert json.loads(out) == {"state": "draining", "drained": True, "in_flight": 0, "scheduler": name}

    # Drained: new jobs wait, saying why; stats show it; undrain lets them run.
    code, out, err = await cli("submit", "demo", "--input", "x=[[1,2,3,4]]")
    assert code == 0, err
    held = out.strip()
    code, out, err = await cli("stats", "--once", "--json")
    assert code == 0, err
    (demo,) = [m for m in json.loads(out)["models"] if m["model_name"] == "demo"]
    assert (demo["draining"], demo["state"], demo["desired_batchers"]) == (True, "draining", 0)
    assert demo["submitted_per_second"] > 0
    code, out, err = await cli("stats", "--once")
    assert "demo (draining)" in out, out
    async with AsyncClient(stack.address) as client:
        for _ in range(10):  # the gateway hears of the drain with the scheduler's next snapshot
            job = await client.get(held)
            if job.queue is not None and job.queue.waiting_reason == WaitingReason.DRAINING:
                break
            await client_wait_snapshot(stack)
        assert job.queue is not None
        assert job.queue.waiting_reason == WaitingReason.DRAINING
    code, out, err = await cli("queue", "undrain")
    assert (code, out.strip()) == (0, f"{name}: dispatching"), err
    code, out, err = await cli("watch", held, "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["state"] == "SUCCEEDED"
    code, out, err = await cli("queue", "undrain", "--json")
    assert json.loads(out) == {"state": "dispatching", "was_draining": False, "scheduler": name}
    # Every scheduler, by an order through NATS (here the one there is), or the one named: a line each.
    code, out, err = await cli("queue", "drain", "--all", "--wait", "5")
    assert (code, out.strip()) == (
        0,
        f"{name}: draining: nothing in flight; nothing is dispatched until `queue undrain`",
    )
    code, out, err = await cli("queue", "undrain", "--instance", name, "--json")
    assert code == 0, err
    assert json.loads(out)["schedulers"] == [{"scheduler": name, "answered": True, "was_draining": True}]
    code, out, err = await cli("queue", "drain", "--instance", "no-such-scheduler")
    assert code == 3, err
    assert "NOT_FOUND SCHEDULER_NOT_FOUND" in err, err
    assert name in err, err


async def client_wait_snapshot(stack: Stack) -> None:
    """Waits for the scheduler's next queue snapshot to reach the gateway (a KV watch, not a sleep)."""
    queues = await stack.nc.jetstream().key_value(stack.config.nats.queues_bucket)
    watcher = await queues.watch("demo")
    initial = True
    try:
        async for entry in watcher:
            if entry is None:  # the end of the values written before
                initial = False
            elif not initial:
                return
    finally:
        await watcher.stop()


# -- models -------------------------------------------------------------------------------------


async def test_models_lists_the_gateways_and_submit_types_inputs_from_them(
    config: Config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A model the local default configuration does not know: the CLI can type its inputs only from
    # what the gateway says. Guessed from the JSON, [[1, 2, 3, 4]] would be INT64 and refused.
    demo = config.models[0]
    served = config.replace(models=[demo.model_copy(update={"name": "remote-only"})])
    stack = Stack(served)
    await stack.start(batcher=False)
    try:
        cli = Cli(stack, monkeypatch)
        code, out, err = await cli("models", "--json")
        assert code == 0, err
        (model,) = json.loads(out)
        assert model["name"] == "remote-only"
        assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
        assert model["max_batch_size"] == demo.max_batch_size
        code, out, err = await cli("models")
        assert code == 0, err
        assert "remote-only" in out
        assert "x FP32[-1,4]" in out

        code, out, err = await cli("submit", "remote-only", "--input", "x=[[1,2,3,4]]", "--json")
        assert code == 0, err
        job = json.loads(out)
        assert job["model_name"] == "remote-only"
        assert job["state"] == "QUEUED"
        # With a local configuration that does not know the model, the CLI guesses INT64 from the
        # JSON; the SDK then types the array by the gateway's signature (FP32): accepted as well.
        local = tmp_path / "local.toml"
        local.write_text(render_default_config(Config()))
        code, out, err = await cli("submit", "remote-only", "--input", "x=[[1,2,3,4]]", "--config", str(local))
        assert code == 0, err
        # What no typing makes a number stays refused by the gateway.
        code, out, err = await cli("submit", "remote-only", "--input", 'x=[["a","b","c","d"]]', "--config", str(local))
        assert code != 0
        assert "BYTES" in err, err
    finally:
        await stack.stop()


async def test_submit_with_a_version_types_its_inputs_by_that_versions_signature(
    config: Config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A [[models.versions]] entry may take other inputs than the model's default, and the gateway
    validates a pinned submit against the pinned version's; the CLI typed `--input` (and a request
    file's inputs) by the default's, so `submit demo --version 2 -i 'x=[[1,2,3,4]]'` for a version
    taking INT64 sent FP32, refused "input 'x' must be INT64, got 'FP32'" (exit 2)."""
    demo = config.models[0]
    versioned = demo.model_copy(
        update={
            "default_version": "1",
            "versions": (
                ModelVersionConfig(version="2", inputs=(TensorSpecConfig(name="x", datatype="INT64", shape=(-1, 4)),)),
            ),
        }
    )
    stack = Stack(config.replace(models=[versioned.model_dump()]))
    await stack.start(batcher=False)
    try:
        cli = Cli(stack, monkeypatch)
        code, out, err = await cli("submit", "demo", "--version", "2", "--input", "x=[[1,2,3,4]]", "--json")
        assert code == 0, err
        assert json.loads(out)["model_version"] == "2"
        code, out, err = await cli("submit", "demo", "--input", "x=[[1,2,3,4]]", "--json")  # the default: FP32
        assert code == 0, err
        # A request file pinning it, and one whose version --version gives.
        pinned = tmp_path / "pinned.json"
        pinned.write_text(json.dumps({"model": "demo", "model_version": "2", "inputs": {"x": [[1, 2, 3, 4]]}}))
        unpinned = tmp_path / "unpinned.json"
        unpinned.write_text(json.dumps({"model": "demo", "inputs": {"x": [[1, 2, 3, 4]]}}))
        for argv in (("--request", str(pinned)), ("--request", str(unpinned), "--version", "2")):
            code, out, err = await cli("submit", *argv, "--json")
            assert code == 0, (argv, err)
            assert json.loads(out)["model_version"] == "2"
        # With --config, its versions' signatures (not the gateway's).
        local = tmp_path / "local.toml"
        local.write_text(
            "[[models]]\n"
            'name = "demo"\n'
            f"loader = {json.dumps(demo.loader)}\n"
            'inputs = [{name = "x", datatype = "FP32", shape = [-1, 4]}]\n'
            'outputs = [{name = "y", datatype = "FP32", shape = [-1, 4]}]\n'
            "[[models.versions]]\n"
            'version = "2"\n'
            'inputs = [{name = "x", datatype = "INT64", shape = [-1, 4]}]\n'
        )
        code, out, err = await cli(
            "submit", "demo", "--version", "2", "--input", "x=[[1,2,3,4]]", "--config", str(local), "--json"
        )
        assert code == 0, err
        assert json.loads(out)["model_version"] == "2"
    finally:
        await stack.stop()


async def test_a_value_the_inputs_datatype_would_change_is_refused_before_anything_is_sent(
    config: Config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The CLI typed `-i` values with numpy's cast, which changes what the datatype cannot hold:
    `-i 'x=[[1.5,2,3,4]]'` for an INT64 input was queued as [[1, 2, 3, 4]] (exit 0), and so was a
    request file's and a bulk line's. Each is refused now before anything is sent: exit 2 for
    submit, naming the input, the value and what the model takes, and an invalid line for bulk,
    with the same words. A whole float (2.0) for the integer input was queued (exit 0), where the SDK
    and a JSONL batch line refuse it: refused alike now, naming the value and how to write it."""
    demo = config.models[0]
    ints = demo.model_copy(update={"inputs": (TensorSpecConfig(name="x", datatype="INT64", shape=(-1, 4)),)})
    stack = Stack(config.replace(models=[ints.model_dump()]))
    await stack.start(batcher=False)
    try:
        cli = Cli(stack, monkeypatch)
        why = "input 'x' has 1.5, not a whole number: INT64 takes whole numbers; the model takes x: INT64 of shape [-1, 4]"
        code, out, err = await cli("submit", "demo", "--input", "x=[[1.5,2,3,4]]", "--json")
        assert (code, out) == (2, ""), (code, out, err)
        assert why in err, err
        request = tmp_path / "request.json"
        request.write_text(json.dumps({"model": "demo", "inputs": {"x": [[1.5, 2, 3, 4]]}}))
        code, out, err = await cli("submit", "--request", str(request), "--json")
        assert (code, out) == (2, ""), (code, out, err)
        assert why in err, err
        assert await count_jobs(stack) == 0

        lines = tmp_path / "lines.jsonl"
        lines.write_text(
            json.dumps({"inputs": {"x": [[1.5, 2, 3, 4]]}})
            + "\n"
            + json.dumps({"inputs": {"x": [[2.0, 2, 3, 4]]}})
            + "\n"
            + json.dumps({"inputs": {"x": [[2, 2, 3, 4]]}})
            + "\n"
        )
        code, out, err = await cli("bulk", str(lines), "--model", "demo", "--no-wait", "--json")
        summary = json.loads(out)
        assert (summary["invalid"], summary["submitted"]) == (2, 1), (summary, err)
        refused, whole = json_lines((tmp_path / "lines.results.jsonl").read_text())
        assert (refused["line"], whole["line"]) == (1, 2), (refused, whole)
        assert why in refused["error"]["message"], refused
        why_whole = "input 'x' has 2.0, a float: INT64 takes integers (write 2, not 2.0); the model takes x: INT64 of shape [-1, 4]"
        assert why_whole in whole["error"]["message"], whole
        code, out, err = await cli("submit", "demo", "--input", "x=[[2.0,2,3,4]]", "--json")
        assert (code, out) == (2, ""), (code, out, err)
        assert why_whole in err, err
        code, out, err = await cli("submit", "demo", "--input", "x=[[2,2,3,4]]", "--json")
        assert code == 0, err
        assert await count_jobs(stack) == 2
    finally:
        await stack.stop()


async def test_a_bulk_stopped_by_its_timeout_says_how_to_go_on(
    idle_stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A helper's CLI pass, session 24: an interrupted or timed-out bulk said nothing of what was kept
    or how to go on (its journal resumes it)."""
    cli = Cli(idle_stack, monkeypatch)
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps({"inputs": {"x": [[1, 2, 3, 4]]}}) + "\n" for _ in range(3)))
    code, _, err = await cli("bulk", str(source), "--model", "demo", "--timeout", "1")  # no batcher: none ends
    assert code == 5, err
    assert "stopped with 0 of 3 lines finished; the run is kept in " in err
    assert "run the same command again to go on" in err


async def test_models_says_why_a_version_does_not_serve(config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose loader failed (README "Adding a model" with the package not on PYTHONPATH):
    the table said "1 (unavailable)" and nothing more, and a job for it waited NO_WORKER."""
    demo = config.models[0]
    broken = demo.model_copy(update={"name": "broken", "loader": "services.batcher.models.demo:build_nothing"})
    stack = Stack(config.replace(models=[demo, broken]))
    await stack.start()
    try:
        cli = Cli(stack, monkeypatch)
        async with asyncio.timeout(20):
            # The batcher's report reaches the gateway through its scheduler's registry: until it
            # has, the version is "(unavailable)" for want of a batcher (CI: "no batcher serves it").
            while True:
                code, out, err = await cli("models")
                assert code == 0, err
                if "broken 1: unavailable: batcher " in out:
                    break
                await asyncio.sleep(0.05)
        lines = out.splitlines()
        (reason,) = [line for line in lines if line.startswith("broken 1: ")]
        assert reason.startswith("broken 1: unavailable: batcher "), reason
        assert "could not load it" in reason
        assert "build_nothing" in reason
        assert not any(line.startswith("demo 1: ") for line in lines)  # a version that serves has no line
        # A job for it is accepted and waits MODEL_LOAD_FAILED (a batcher runs: it could not load it); `get`
        # says why.
        code, out, err = await cli("submit", "broken", "--input", "x=[[1,2,3,4]]")
        assert code == 0, err
        job_id = out.strip()
        async with asyncio.timeout(20):
            while True:
                code, out, err = await cli("get", job_id)
                assert code == 0, err
                if "waiting: MODEL_LOAD_FAILED" in out:
                    break
                await asyncio.sleep(0.05)
        (why,) = [line for line in out.splitlines() if line.startswith("why ")]
        assert "could not load it" in why
        assert "build_nothing" in why
    finally:
        await stack.stop()
