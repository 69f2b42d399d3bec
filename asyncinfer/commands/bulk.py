"""`asyncinfer bulk FILE.jsonl`: many jobs from a JSON-lines file, resumable.

(`asyncinfer bulk - --out RESULTS`: the lines from stdin; a re-run with the same --out resumes.)
Each non-blank line is a request as `submit --request` takes it (`{"model": "demo", "inputs":
{"x": [[1, 2, 3, 4]]}}`; `--model` names the model for lines without one). Two phases, each with a
progress bar on stderr when it is a terminal:

1. submit: the lines stream through SubmitJobs (a bounded window in flight);
2. wait: the accepted jobs are watched on WatchJobs streams (10,000 jobs each) until they end.

Every line ends with one line in the results file (--out; by default beside FILE, its .jsonl
turned into .results.jsonl: requests.jsonl -> requests.results.jsonl), in the order lines finish:
{"line": N, "job_id", "state", "outputs"} for a job, {"line": N, "error": {"code", "reason",
"message", "violations"}} for a line that is not valid JSON or that the gateway refused (with
"state" and "error" for a job that failed).

Resuming. Beside the results file, a state file (RESULTS.state) records each accepted line's job
ID as soon as the gateway answers. A re-run skips lines that already have a result, waits for the
jobs of lines the state file knows, and submits the rest. Every line is submitted with an
idempotency key derived from the input file's path, the line number and the line's text, so a
line accepted before an interruption that the state file missed (or a deleted state file) is
answered with its first job again (deduplicated), never queued twice. Editing a line makes it a
new request: it gets a new job.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from asyncinfer.client import (
    AsyncClient,
    AsyncInferClientError,
    BulkResult,
    DeadlineExceededError,
    Job,
    JobRequest,
    NotFoundError,
    UnavailableError,
)
from asyncinfer.commands.bulk_failures import failure_lines
from asyncinfer.commands.inputs import Signatures, request_from_json, text_argument
from asyncinfer.commands.options import Options
from asyncinfer.commands.output import (
    EXIT_JOB_NOT_SUCCEEDED,
    EXIT_OK,
    ProgressBar,
    UsageError,
    error_json,
    print_json,
    to_json,
)
from asyncinfer.commands.stdin import read_stdin
from asyncinfer.output_paths import descriptor_or_file, is_special

AddOptions = Callable[[argparse.ArgumentParser], None]


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser], add_options: AddOptions) -> None:
    bulk = commands.add_parser(
        "bulk",
        help="submit every line of a JSONL file, wait, write results (resumable)",
        description=(__doc__ or "").split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bulk.add_argument("file", type=Path, help="JSON lines, one request each; - reads them from stdin (with --out)")
    bulk.add_argument("--out", type=Path, help="results file (default: requests.jsonl -> requests.results.jsonl)")
    bulk.add_argument("--model", default="", type=text_argument, help="the model of lines that name none")
    bulk.add_argument("--window", type=int, default=256, help="requests in flight on the stream (default 256)")
    bulk.add_argument("--concurrency", type=int, default=64, help="large results read at once (default 64)")
    bulk.add_argument("--no-wait", action="store_true", help="only submit; a later run waits and writes results")
    bulk.add_argument(
        "--config", type=Path, help="configuration file whose models' signatures to use (default: the gateway's)"
    )
    add_options(bulk)
    bulk.set_defaults(handler=bulk_command)


def default_out(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl") + ".results.jsonl")


def state_path(out: Path) -> Path:
    return out.with_name(out.name + ".state")


def line_key(input_id: str, number: int, text: str) -> str:
    """The idempotency key of one line: stable across runs, different for an edited line."""
    content = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"bulk-{input_id}-{number}-{content}"


def line_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_json_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The objects of a JSON-lines file we wrote; a torn last line (an interrupted write) is skipped."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as stream:
        for raw in stream:
            try:
                entry = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("line"), int):
                yield entry


# How a line ended, as its entry in the results file says.
SUCCEEDED, NOT_SUCCEEDED, INVALID, REFUSED = "succeeded", "not_succeeded", "invalid", "refused"
INVALID_LINE = "INVALID_LINE"


def outcome_of(entry: dict[str, Any]) -> str:
    """SUCCEEDED, NOT_SUCCEEDED (a job that did not succeed, or whose result is gone), INVALID (not a
    request: not JSON here, or INVALID_ARGUMENT from the gateway) or REFUSED (the gateway did not
    take a valid request: a quota, a permission, the gateway unavailable past the retries)."""
    if entry.get("state") == "SUCCEEDED":
        return SUCCEEDED
    if "job_id" in entry or "state" in entry:
        return NOT_SUCCEEDED
    error = entry.get("error")
    if isinstance(error, dict) and (error.get("reason") == INVALID_LINE or error.get("code") == "INVALID_ARGUMENT"):
        return INVALID
    return REFUSED


@dataclass
class Journal:
    """The results file and the state file: what is finished (and how), what is accepted and by
    which job. Both cover every run so far, so a resumed run's summary counts what earlier runs did."""

    out: Path
    results: TextIO
    state: TextIO
    finished: dict[int, str] = field(default_factory=dict)  # line -> outcome_of its entry
    accepted: dict[int, tuple[str, str]] = field(default_factory=dict)  # line -> (job_id, digest)

    @classmethod
    def open(cls, out: Path) -> Journal:
        finished = {e["line"]: outcome_of(e) for e in _read_json_lines(out)}
        accepted = {
            e["line"]: (str(e["job_id"]), str(e.get("digest", "")))
            for e in _read_json_lines(state_path(out))
            if e.get("job_id")
        }
        # Rewrite the results without a torn last line, so that appends start on a fresh line.
        kept = [json.dumps(e, separators=(",", ":"), ensure_ascii=False) for e in _read_json_lines(out)]
        out.parent.mkdir(parents=True, exist_ok=True)
        real = Path(os.path.realpath(out))  # a link's file is rewritten, the link kept (a file: _results_file)
        temporary = real.with_name(real.name + ".tmp")
        temporary.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(temporary, real)
        state = state_path(out)
        if state.exists() and state.read_bytes()[-1:] not in (b"", b"\n"):
            with state.open("a", encoding="utf-8") as torn:
                torn.write("\n")
        return cls(
            out=out,
            results=out.open("a", encoding="utf-8"),
            state=state.open("a", encoding="utf-8"),
            finished=finished,
            accepted=accepted,
        )

    def close(self) -> None:
        self.results.close()
        self.state.close()

    def record_accepted(self, line: int, job_id: str, digest: str) -> None:
        self.accepted[line] = (job_id, digest)
        self.state.write(json.dumps({"line": line, "job_id": job_id, "digest": digest}) + "\n")
        self.state.flush()

    def record_result(self, entry: dict[str, Any]) -> None:
        self.finished[entry["line"]] = outcome_of(entry)
        self.results.write(json.dumps(entry, separators=(",", ":"), ensure_ascii=False) + "\n")
        self.results.flush()


@dataclass
class Counts:
    """This run's counts (the journal has the totals)."""

    lines: int = 0
    already_done: int = 0  # lines with a result before this run
    accepted_before: int = 0  # lines accepted before this run, without a result yet: waited for now
    submitted: int = 0
    deduplicated: int = 0
    refused: int = 0
    invalid: int = 0
    waited: int = 0


def _usage_error_entry(line: int, message: str) -> dict[str, Any]:
    return {
        "line": line,
        "error": {"code": "INVALID_ARGUMENT", "reason": INVALID_LINE, "message": message, "violations": []},
    }


def _count_lines(path: Path) -> int:
    with path.open(encoding="utf-8") as stream:
        return sum(1 for raw in stream if raw.strip())


async def bulk_command(args: argparse.Namespace, options: Options) -> int:
    path: Path = args.file
    if args.window < 1 or args.concurrency < 1:
        raise UsageError("--window and --concurrency must be at least 1")
    spooled: Path | None = None
    if str(path) == "-":
        # Piped lines (`jq ... | asyncinfer bulk - --out r.jsonl`): kept in a file beside the
        # results while the run lasts, as the submit phase reads its input twice (a count for the
        # progress bar, then the lines). The run is named by its results file, so piping the same
        # lines again resumes it, as a file's path does.
        if args.out is None:
            raise UsageError("bulk - (lines from stdin) needs --out: the results file, which a re-run resumes")
        out: Path = _results_file(args.out)
        try:
            spooled = path = await read_stdin(lambda: _spool_stdin(out))
        except BaseException:  # Ctrl-C while the lines come: the partial copy goes too
            _spool_path(out).unlink(missing_ok=True)
            raise
        input_name = f"stdin:{await asyncio.to_thread(out.resolve)}"
    else:
        if not await asyncio.to_thread(path.is_file):
            raise UsageError(f"no such file: {path}")
        out = _results_file(args.out or default_out(path))
        input_name = str(await asyncio.to_thread(path.resolve))
    try:
        return await _bulk(args, options, path, out, hashlib.sha256(input_name.encode()).hexdigest()[:16])
    finally:
        if spooled is not None:
            spooled.unlink(missing_ok=True)


def _results_file(out: Path) -> Path:
    """The results file as given, once it is known to be one: a file, or a link to one, or nothing
    yet. Not a device, a FIFO, a descriptor (/dev/stdout) or a folder: the file is read back and
    rewritten by a rename at each start, to resume a run, which replaced `--out /dev/null` itself
    (as root; and put /dev/null.state beside it) and hung on a FIFO."""
    where = descriptor_or_file(out)
    if isinstance(where, int) or is_special(where) or where.is_dir():
        raise UsageError(
            f"--out {out} is not a file: bulk keeps every line's result there (and its state in "
            f"{state_path(out).name} beside it) to resume a run stopped part way; give a file's path, "
            "and read it once the run ends (the summary names it)"
        )
    return out


def _spool_path(out: Path) -> Path:
    return out.with_name(out.name + ".stdin")


def _spool_stdin(out: Path) -> Path:
    spool = _spool_path(out)
    with spool.open("w", encoding="utf-8") as copy:
        for line in sys.stdin:
            copy.write(line)
    return spool


async def _bulk(args: argparse.Namespace, options: Options, path: Path, out: Path, input_id: str) -> int:
    counts = Counts(lines=await asyncio.to_thread(_count_lines, path))
    journal = Journal.open(out)
    try:
        async with options.client() as client:
            signatures = await Signatures.fetch(options.config, client)
            await _submit_phase(client, journal, path, input_id, args.model, signatures, args.window, counts)
            if not args.no_wait:
                await _wait_phase(client, journal, args.concurrency, options.timeout_s, counts)
    except (KeyboardInterrupt, asyncio.CancelledError, TimeoutError, DeadlineExceededError, UnavailableError):
        # Ctrl-C, --timeout, a gateway gone: what is kept, and how to go on (it said nothing)
        done = len(journal.finished)
        print(
            f"asyncinfer: stopped with {done} of {counts.lines} lines finished; the run is kept in {out}: "
            "run the same command again to go on (nothing accepted is submitted twice)",
            file=sys.stderr,
            flush=True,
        )
        raise
    finally:
        journal.close()
    summary = bulk_summary(out, counts, journal)
    if options.json:
        print_json(summary)
    else:
        print(summary_text(summary), flush=True)
        if summary["not_succeeded"]:
            failed = await asyncio.to_thread(lambda: failure_lines(_read_json_lines(out), outcome_of, SUCCEEDED))
            print("\n".join(failed), flush=True)
    if summary["not_succeeded"]:
        return EXIT_JOB_NOT_SUCCEEDED
    return EXIT_OK


def summary_text(summary: dict[str, Any]) -> str:
    """Two lines: how every line of the file stands, then what this run did. Counts of zero are left
    out, past "succeeded" and "submitted", so the common case reads at a glance."""

    def counted(*parts: tuple[int, str]) -> list[str]:
        return [f"{n:,} {label}" for n, label in parts if n]

    others = counted(
        (summary["jobs_not_succeeded"], "ended unsuccessfully"),
        (summary["invalid"], "invalid"),
        (summary["refused"], "refused"),
        (summary["pending"], "pending"),
    )
    outcome = ", ".join([f"{summary['succeeded']:,} succeeded", *others])
    submitted = f"{summary['submitted']:,} submitted"
    if summary["deduplicated"]:
        submitted += f" ({summary['deduplicated']:,} of them already queued)"
    before = counted((summary["already_done"], "done before"), (summary["accepted_before"], "accepted before"))
    this_run = ", ".join([submitted, *before])
    return f"{summary['lines']:,} lines: {outcome}.\nThis run: {this_run}. Results: {summary['out']}"


def bulk_summary(out: Path, counts: Counts, journal: Journal) -> dict[str, Any]:
    """What every run so far did (succeeded, invalid, refused, ...: from the results file) and what
    this one did (submitted, deduplicated, already_done, accepted_before)."""
    outcomes = list(journal.finished.values())
    succeeded = outcomes.count(SUCCEEDED)
    return {
        "out": str(out),
        "lines": counts.lines,
        "finished": len(outcomes),
        "succeeded": succeeded,
        "not_succeeded": len(outcomes) - succeeded,
        "pending": counts.lines - len(outcomes),
        "submitted": counts.submitted,
        "deduplicated": counts.deduplicated,
        "refused": outcomes.count(REFUSED),
        "invalid": outcomes.count(INVALID),
        "jobs_not_succeeded": outcomes.count(NOT_SUCCEEDED),  # queued, then FAILED, CANCELED, ...
        "already_done": counts.already_done,
        "accepted_before": counts.accepted_before,
    }


async def _submit_phase(
    client: AsyncClient,
    journal: Journal,
    path: Path,
    input_id: str,
    default_model: str,
    signatures: Signatures,
    window: int,
    counts: Counts,
) -> None:
    bar = ProgressBar("submit", counts.lines)
    digests: dict[int, str] = {}

    def requests() -> Iterator[JobRequest]:
        with path.open(encoding="utf-8") as stream:
            for number, raw in enumerate(stream, start=1):
                text = raw.strip()
                if not text:
                    continue
                digest = line_digest(text)
                known = journal.accepted.get(number)
                if number in journal.finished:
                    counts.already_done += 1
                    bar.skip()
                    continue
                if known is not None and known[1] == digest:
                    counts.accepted_before += 1
                    bar.skip()
                    continue
                try:
                    request = request_from_json(
                        json.loads(text),
                        signatures=signatures,
                        default_model=default_model,
                        idempotency_key=line_key(input_id, number, text),
                    )
                except (UsageError, json.JSONDecodeError) as exc:
                    counts.invalid += 1
                    journal.record_result(_usage_error_entry(number, str(exc)))
                    bar.advance()
                    continue
                digests[number] = digest
                yield replace(request, correlation_id=str(number))

    try:
        results = client.bulk(requests(), window=window)
        async with contextlib.aclosing(results):
            async for result in results:
                _record_submitted(journal, result, digests, counts)
                bar.advance()
    finally:
        bar.close()


def _record_submitted(journal: Journal, result: BulkResult, digests: dict[int, str], counts: Counts) -> None:
    line = int(result.correlation_id)
    digest = digests.pop(line, "")
    if result.job is not None:
        counts.submitted += 1
        counts.deduplicated += int(result.deduplicated)
        journal.record_accepted(line, result.job.job_id, digest)
    else:
        counts.refused += 1
        error = result.error
        journal.record_result({"line": line, "error": error_json(error) if error is not None else None})


# Jobs watched on one WatchJobs stream (the gateway's limit per stream).
JOBS_PER_WATCH = 10_000


async def _wait_phase(
    client: AsyncClient, journal: Journal, concurrency: int, timeout_s: float | None, counts: Counts
) -> None:
    """Every accepted job not finished yet, watched on WatchJobs streams of up to JOBS_PER_WATCH
    jobs (not one stream per job); a finished job's line is written as soon as it ends, its large
    result read with at most `concurrency` reads at once."""
    waiting = sorted((line, job_id) for line, (job_id, _) in journal.accepted.items() if line not in journal.finished)
    line_of = {job_id: line for line, job_id in waiting}
    bar = ProgressBar("wait  ", len(waiting))
    reads = asyncio.Semaphore(max(concurrency, 1))

    def done(entry: dict[str, Any]) -> None:
        journal.record_result(entry)
        counts.waited += 1
        bar.advance()

    async def finish(job: Job) -> None:
        async with reads:
            done(await _finished_entry(client, line_of[job.job_id], job))

    started: set[str] = set()  # jobs whose line is being written or was

    async def watch(job_ids: list[str], group: asyncio.TaskGroup) -> None:
        async with contextlib.aclosing(client.watch_jobs(job_ids, timeout_s=timeout_s)) as updates:
            async for update in updates:
                if isinstance(update, Job):
                    if update.done and update.job_id not in started:
                        started.add(update.job_id)
                        group.create_task(finish(update))
                    continue
                job_id, error = update
                if job_id not in started:  # its retention passed: the result is gone
                    started.add(job_id)
                    done({"line": line_of[job_id], "job_id": job_id, "error": error_json(error)})

    ids = [job_id for _, job_id in waiting]
    try:
        async with asyncio.TaskGroup() as group:
            for first in range(0, len(ids), JOBS_PER_WATCH):
                group.create_task(watch(ids[first : first + JOBS_PER_WATCH], group))
    except* AsyncInferClientError as failures:
        raise failures.exceptions[0] from None  # the first failure, as the other commands report it
    finally:
        bar.close()


async def _finished_entry(client: AsyncClient, line: int, job: Job) -> dict[str, Any]:
    try:
        outputs = await client.outputs(job) if job.succeeded else {}
    except NotFoundError as exc:  # its retention passed: the result is gone
        return {"line": line, "job_id": job.job_id, "error": error_json(exc)}
    entry: dict[str, Any] = {"line": line, "job_id": job.job_id, "state": job.state.value}
    if job.succeeded:
        entry["outputs"] = to_json(outputs)
    if job.error is not None:
        entry["error"] = error_json(job.error)
    return entry
