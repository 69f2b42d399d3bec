"""submit, get, watch, cancel, list: one job at a time, against the gateway's JobService."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from asyncinfer.client import (
    AsyncClient,
    AsyncInferClientError,
    Callback,
    DeadlineExceededError,
    Job,
    JobRequest,
    JobState,
    Priority,
    TensorSpec,
    why_not_served,
)
from asyncinfer.commands.inputs import (
    LABEL_HELP,
    Signatures,
    any_case_of,
    idempotency_key_argument,
    input_argument,
    inputs_from_arguments,
    label_argument,
    parse_key_values,
    read_json,
    request_from_json,
    text_argument,
)
from asyncinfer.commands.options import Options
from asyncinfer.commands.output import (
    EXIT_JOB_NOT_SUCCEEDED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    StatusLine,
    UsageError,
    job_json,
    job_summary,
    job_text,
    local_time,
    more_than_these,
    print_json,
    print_table,
    report_error,
    say_unreadable_skipped,
)
from asyncinfer.commands.stdin import read_stdin
from asyncinfer.duration_text import duration_text

AddOptions = Callable[[argparse.ArgumentParser], None]


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser], add_options: AddOptions) -> None:
    submit = commands.add_parser(
        "submit",
        help="queue a job (inline values, a JSON request file, or stdin)",
        description="Queue a job. Prints its ID (or, with --wait, the finished job). Values: --input x=[[1,2,3,4]] "
        "(JSON), x=@file.npy, x=@file.json, x=@- (stdin), for a text (BYTES) input also text=hello and text=@doc.txt (the file, whole); or a whole JSON request with --request FILE (- : stdin), "
        'e.g. {"model": "demo", "inputs": {"x": [[1, 2, 3, 4]]}}. Datatypes and shapes come from the model\'s '
        "signature (as the gateway's ListModels gives it, or --config's) where it is known, else from --datatype or "
        "the values.",
    )
    submit.add_argument(
        "model", nargs="?", default="", type=text_argument, help="the model (or give it in the request file)"
    )
    submit.add_argument(
        "-i", "--input", action="append", default=[], type=input_argument, metavar="NAME=VALUE", help="an input"
    )
    submit.add_argument("-f", "--request", metavar="FILE", help="a JSON request file; - reads stdin")
    submit.add_argument(
        "--datatype",
        action="append",
        default=[],
        type=text_argument,
        metavar="[NAME=]TYPE",
        help="datatype of an input (FP32, ...)",
    )
    submit.add_argument(
        "--shape", action="append", default=[], type=text_argument, metavar="NAME=D1,D2", help="reshape an input"
    )
    submit.add_argument(
        "--version",
        default="",
        type=text_argument,
        metavar="V",
        help="run on this model version (default: the model's default)",
    )
    priorities = [p.value for p in Priority]
    submit.add_argument("--priority", choices=priorities, type=any_case_of(priorities))
    submit.add_argument(
        "--label", action="append", default=[], type=label_argument, metavar="KEY=VALUE", help=LABEL_HELP
    )
    submit.add_argument(
        "--idempotency-key",
        default=None,  # not "": argparse would pass a str default through the type, which refuses it
        type=idempotency_key_argument,
        metavar="KEY",
        help="resubmitting with it queues nothing new",
    )
    submit.add_argument("--queue-ttl", type=float, metavar="SECONDS", help="expire unless started within")
    submit.add_argument("--execution-timeout", type=float, metavar="SECONDS", help="longest one run may take")
    submit.add_argument("--retention", type=float, metavar="SECONDS", help="keep the result this long")
    submit.add_argument("--max-attempts", type=int, default=0, metavar="N")
    submit.add_argument("--callback", type=text_argument, metavar="URL", help="webhook called when the job ends")
    submit.add_argument("--upload", action="store_true", help="send the inputs through UploadInput (large inputs)")
    submit.add_argument("--wait", action="store_true", help="wait for the end; exit 1 unless SUCCEEDED")
    submit.add_argument(
        "--config", type=Path, help="configuration file whose models' signatures to use (default: the gateway's)"
    )
    add_options(submit)
    submit.set_defaults(handler=submit_command)

    get = commands.add_parser("get", help="show a job (with its outputs)")
    get.add_argument("job_id", type=text_argument)
    get.add_argument("--no-outputs", action="store_true", help="do not fetch or print outputs")
    add_options(get)
    get.set_defaults(handler=get_command)

    watch = commands.add_parser(
        "watch", help="follow a job until it ends (exit 1 unless SUCCEEDED)", description="Follow a job's changes."
    )
    watch.add_argument("job_id", type=text_argument)
    add_options(watch)
    watch.set_defaults(handler=watch_command)

    cancel = commands.add_parser("cancel", help="cancel jobs")
    cancel.add_argument("job_ids", nargs="+", type=text_argument, metavar="job_id")
    cancel.add_argument("--reason", default="", type=text_argument, help="kept in the job's error message")
    add_options(cancel)
    cancel.set_defaults(handler=cancel_command)

    models = commands.add_parser("models", help="the models the gateway serves, with their inputs and outputs")
    add_options(models)
    models.set_defaults(handler=models_command)

    listing = commands.add_parser("list", help="your jobs, newest first")
    listing.add_argument(
        "--state",
        action="append",
        default=[],
        type=text_argument,
        help="only these states (repeatable, or comma-separated)",
    )
    listing.add_argument("--model", default="", type=text_argument, help="only this model's jobs")
    listing.add_argument(
        "--label",
        action="append",
        default=[],
        type=label_argument,
        metavar="KEY=VALUE",
        help="only jobs with this label (repeatable: all of them)",
    )
    listing.add_argument("--limit", type=int, default=50, help="at most this many jobs (default 50; 0: all)")
    add_options(listing)
    listing.set_defaults(handler=list_command)


# -- submit -------------------------------------------------------------------------------------


def build_request(args: argparse.Namespace, signatures: Signatures, stdin_text: str = "") -> JobRequest:
    """The request the submit arguments describe: the request file (if any; `stdin_text` for -),
    then the flags."""
    if args.request:
        text = stdin_text if args.request == "-" else _read_text(Path(args.request))
        data = read_json(text, "stdin" if args.request == "-" else args.request)
        if args.version and isinstance(data, dict):  # its inputs typed by the version the job pins
            data = {**data, "model_version": args.version}
        request = request_from_json(data, signatures=signatures, default_model=args.model)
    elif args.model:
        request = JobRequest(model=args.model)
    else:
        raise UsageError("name the MODEL, or give a request file with --request FILE")
    if args.model:
        request = dataclasses.replace(request, model=args.model)
    changes: dict[str, Any] = {}
    if args.input:
        signatures.require(request.model)
        arrays = inputs_from_arguments(
            request.model,
            args.input,
            signatures=signatures,
            datatypes=args.datatype,
            shapes=args.shape,
            version=args.version or request.model_version,
        )
        existing = dict(request.inputs) if isinstance(request.inputs, dict) else {}
        changes["inputs"] = {**existing, **arrays}
    if args.label:
        changes["labels"] = {**request.labels, **parse_key_values(args.label, "--label")}
    if args.priority:
        changes["priority"] = Priority(args.priority)
    for flag, field in (
        ("version", "model_version"),
        ("idempotency_key", "idempotency_key"),
        ("queue_ttl", "queue_ttl_s"),
        ("execution_timeout", "execution_timeout_s"),
        ("retention", "retention_s"),
        ("max_attempts", "max_attempts"),
    ):
        value = getattr(args, flag)
        if value:
            changes[field] = value
    if args.callback:
        changes["callback"] = Callback(args.callback)
    request = dataclasses.replace(request, **changes)
    if request.inputs is None and not request.input_ref:
        signatures.require(request.model)  # a model the gateway does not serve is said as such first
        raise UsageError(_no_inputs(signatures, request))
    return request


def _no_inputs(signatures: Signatures, request: JobRequest) -> str:
    """A submit without inputs, with what the model takes where its signature is known: it said
    only 'no inputs: give --input NAME=VALUE (or "inputs" in the request file)' (`submit demo`)."""
    signature = signatures.by_version.get((request.model, request.model_version)) or signatures.by_model.get(
        request.model
    )
    if signature is None or not signature.inputs:
        return 'no inputs: give --input NAME=VALUE (or "inputs" in the request file)'
    takes = ", ".join(spec.summary() for spec in signature.inputs)
    each = " ".join(f"-i '{spec.name}=JSON'" for spec in signature.inputs)
    return (
        f"no inputs: model {request.model!r} takes {takes} (-1: any size); give {each} "
        f'(or NAME=@file.npy), or "inputs" in a request file (--request FILE)'
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None


async def submit_command(args: argparse.Namespace, options: Options) -> int:
    async with options.client() as client:
        stdin_text = await read_stdin(sys.stdin.read) if args.request == "-" else ""
        request = build_request(args, await Signatures.fetch(options.config, client), stdin_text)
        if args.upload and request.inputs is not None:
            ref = await client.upload_inputs(request.inputs, retention_s=request.retention_s)
            request = dataclasses.replace(request, inputs=None, input_ref=ref.ref)
        started = time.monotonic()  # --timeout bounds the whole wait
        try:
            # Not the gateway's held answer (SubmitJob's wait): the job's ID must reach the user
            # however the wait ends (Ctrl-C, --timeout), and a held call that is interrupted has
            # no answer to print. A process's start costs far more than the second call.
            job = await client.submit_request(request)
        except ValueError as exc:  # contradictory fields the SDK refuses before sending
            raise UsageError(str(exc)) from None
        if not args.wait:
            if options.json:
                print_json(job_json(job))
            else:
                print(job.job_id, flush=True)
            return EXIT_OK
        left_s = None if options.timeout_s is None else max(options.timeout_s - (time.monotonic() - started), 0.001)
        last = job  # the state the wait last heard, for the line a --timeout ends it with
        try:
            if not job.done:
                async with contextlib.aclosing(client.watch(job, timeout_s=left_s)) as updates:
                    async for update in updates:
                        last = update
                if not last.done:  # the gateway ended the watch: a terminal state newer than this CLI
                    done = await client.wait(last, timeout_s=options.timeout_s)
                    last = done
        except DeadlineExceededError:
            if options.timeout_s is None:  # not our --timeout (a deadline of the gateway's): as any error
                _goes_on(job)
                raise
            # One line, where two said it (this one and the watch's DEADLINE_EXCEEDED error): the
            # job, where it stands, and how to go on. Exit 5, as before.
            print(
                f"asyncinfer: job {job.job_id} is {last.state.value} after --timeout {options.timeout_s:g} s and goes "
                f"on; follow it with `asyncinfer watch {job.job_id}`",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_UNAVAILABLE
        except BaseException:
            _goes_on(job)
            raise
        return await _show_finished(client, last, options)


def _goes_on(job: Job) -> None:
    """A wait that ended otherwise than with the job's end (Ctrl-C, an error): the job was queued."""
    print(
        f"asyncinfer: job {job.job_id} was queued and goes on; follow it with `asyncinfer watch {job.job_id}`",
        file=sys.stderr,
        flush=True,
    )


async def _show_finished(client: AsyncClient, job: Job, options: Options) -> int:
    # Within --timeout when given: a read of a large result that stalled waited for ever.
    outputs = await client.outputs(job, timeout_s=options.timeout_s) if job.succeeded else {}
    if options.json:
        print_json(job_json(dataclasses.replace(job, outputs=outputs)))
    else:
        print(job_text(job, outputs), flush=True)
    return EXIT_OK if job.succeeded else EXIT_JOB_NOT_SUCCEEDED


# -- get, watch, cancel, list -------------------------------------------------------------------


async def get_command(args: argparse.Namespace, options: Options) -> int:
    async with options.client() as client:
        job = await client.get(args.job_id)
        outputs: dict[str, np.ndarray[Any, Any]] = {}
        if job.succeeded and not args.no_outputs:
            outputs = await client.outputs(job, timeout_s=options.timeout_s)
        if options.json:
            print_json(job_json(dataclasses.replace(job, outputs=outputs)))
        else:
            print(job_text(job, outputs, why_waiting=await _why_not_served(client, job)), flush=True)
    return EXIT_OK


async def _why_not_served(client: AsyncClient, job: Job) -> str | None:
    """For a job waiting MODEL_LOAD_FAILED (or NO_WORKER, NO_VERSION), why its model's versions do
    not serve, as ListModels says it ("batcher X could not load it: ..."): the job's record has no
    room for the text (README "Adding a model", the package not on PYTHONPATH)."""
    waiting = job.queue.waiting_reason if job.queue is not None and not job.done else None
    if waiting is None or not waiting.not_served:
        return None
    try:
        models = await client.models()
    except AsyncInferClientError:
        return None  # the job's own line stands; this is a hint
    return why_not_served(job, models) or None


def line_stamp(previous: Job | None, update: Job, last: datetime | None, now: datetime) -> datetime | None:
    """The time a watch line shows. A change of state is stamped with its record's time; anything
    else (a progress report, the record keeping it) when it is heard. Never before the line above:
    the last progress line, heard after the model finished, would otherwise be stamped after the
    SUCCEEDED printed below it."""
    moved = previous is None or (previous.state, previous.attempt) != (update.state, update.attempt)
    stamp = (update.update_time or update.create_time) if moved else now
    if stamp is not None and last is not None:
        return max(stamp, last)
    return stamp


# How often the live status line's clock is redrawn while nothing changes (a job waiting in a queue).
WATCH_TICK_S = 0.5


async def watch_command(args: argparse.Namespace, options: Options) -> int:
    """JSON lines, one per change; on a terminal, one status line rewritten in place, its clock
    ticking while the job waits; otherwise one plain line per change. Then the finished job."""
    live = StatusLine(sys.stdout) if sys.stdout.isatty() and not options.json else None
    started = time.monotonic()
    last: Job | None = None
    printed = ""  # the last line printed (a message that changes nothing shown is not repeated)
    last_stamp: datetime | None = None  # its time

    def show_live() -> None:
        if live is not None and last is not None:
            live.show(f"{job_summary(last)}  ({duration_text(time.monotonic() - started)})")

    async def tick() -> None:
        while True:
            await asyncio.sleep(WATCH_TICK_S)
            show_live()

    async with options.client() as client:
        ticker = asyncio.create_task(tick()) if live is not None else None
        try:
            async with contextlib.aclosing(client.watch(args.job_id, timeout_s=options.timeout_s)) as updates:
                async for update in updates:
                    previous, last = last, update
                    if options.json:
                        print_json(job_json(update))
                    elif live is not None:
                        show_live()
                    elif (summary := job_summary(update)) != printed:
                        stamp = line_stamp(previous, update, last_stamp, datetime.now(UTC))
                        last_stamp = stamp or last_stamp
                        prefix = stamp.astimezone().strftime("%H:%M:%S.%f")[:-3] + "  " if stamp else ""
                        print(prefix + summary, flush=True)
                        printed = summary
        finally:
            if ticker is not None:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
            if live is not None:
                live.close()
        if last is None:
            return EXIT_JOB_NOT_SUCCEEDED
        if not options.json:
            outputs = await client.outputs(last) if last.succeeded else {}
            print(job_text(last, outputs), flush=True)
    return EXIT_OK if last.succeeded else EXIT_JOB_NOT_SUCCEEDED


async def cancel_command(args: argparse.Namespace, options: Options) -> int:
    """Cancels each job; the first failure's exit code (the others are still tried)."""
    from asyncinfer.client import AsyncInferClientError

    status = EXIT_OK
    async with options.client() as client:
        for job_id in args.job_ids:
            try:
                job = await client.cancel(job_id, reason=args.reason)
            except AsyncInferClientError as exc:
                code = report_error(exc)
                status = status or code
                continue
            if options.json:
                print_json(job_json(job))
            else:
                print(f"{job.job_id}  {job.state.value}", flush=True)
    return status


async def list_command(args: argparse.Namespace, options: Options) -> int:
    given = [s.strip() for item in args.state for s in item.split(",") if s.strip()]
    known = {s.value for s in JobState}
    unknown = [s for s in given if s.upper() not in known]  # said as given (it said 'BOGUS' of bogus)
    states = [s.upper() for s in given]
    if unknown:
        raise UsageError(f"unknown state {unknown[0]!r}; one of {', '.join(sorted(known))}")
    if args.limit < 0:
        raise UsageError("--limit must be 0 (all) or more")
    labels = parse_key_values(args.label, "--label")
    limit = args.limit or None
    rows: list[list[str]] = []
    shown = 0
    more = False
    async with options.client() as client:
        # One job past --limit, to say that more are left out (not to show it)
        wanted = limit + 1 if limit is not None else None
        jobs = client.list(
            states=states, model=args.model, labels=labels, limit=wanted, page_size=min(wanted or 100, 1000)
        )
        async with contextlib.aclosing(jobs):
            async for job in jobs:
                if limit is not None and shown == limit:
                    more = True
                    break
                shown += 1
                if options.json:
                    print_json(job_json(job))
                    continue
                rows.append(job_row(job))
    if not options.json and not rows:
        # Said plainly: the table's header alone read as a listing that failed. --json: no lines.
        print(_no_jobs(states, args.model, labels), flush=True)
    elif not options.json:
        print_table(JOB_COLUMNS, rows)
    if more:  # said beside the list, not in it (a script reads stdout), as `batch list` does
        print(
            f"asyncinfer: {more_than_these(shown, 'jobs')} (newest first); --limit N shows more, --limit 0 all",
            file=sys.stderr,
        )
    say_unreadable_skipped(jobs.unreadable_skipped, "job(s)", "job_unreadable")
    return EXIT_OK


JOB_COLUMNS = ["JOB_ID", "MODEL", "STATE", "PRIORITY", "CREATED", "LABELS"]


def job_row(job: Job) -> list[str]:
    """`list`'s row of a job (JOB_COLUMNS)."""
    labels = ",".join(f"{k}={v}" for k, v in sorted(job.labels.items()))
    return [job.job_id, job.model_name, job.state.value, job.priority.value, local_time(job.create_time), labels]


def _no_jobs(states: list[str], model: str, labels: dict[str, str]) -> str:
    """What `list` prints when nothing matched: "no jobs", with the filters that chose none."""
    filters = [
        *([f"state {', '.join(states)}"] if states else []),
        *([f"model {model}"] if model else []),
        *(f"label {key}={value}" for key, value in sorted(labels.items())),
    ]
    return f"no jobs ({'; '.join(filters)})" if filters else "no jobs"


# -- models -------------------------------------------------------------------------------------


def _specs(specs: tuple[TensorSpec, ...]) -> str:
    return ", ".join(f"{s.name} {s.datatype}[{','.join(str(d) for d in s.shape)}]" for s in specs)


async def models_command(args: argparse.Namespace, options: Options) -> int:
    async with options.client() as client:
        models = await client.models()
    if options.json:
        print_json([dataclasses.asdict(model) for model in models])
        return EXIT_OK
    rows = [
        [
            m.name,
            m.version,
            m.versions_summary,  # the columns after it describe the default version
            _specs(m.inputs),
            _specs(m.outputs),
            str(m.max_batch_size),
            str(m.default_max_attempts),
        ]
        for m in models
    ]
    print_table(["MODEL", "DEFAULT", "VERSIONS", "INPUTS", "OUTPUTS", "MAX ROWS", "ATTEMPTS"], rows)
    # Why a version does not serve (a loader that failed: "batcher X could not load it: ..."): the
    # table said "(unavailable)" alone, and a job for it waits queued with reason MODEL_LOAD_FAILED.
    reasons = [f"{m.name} {v.version}: {v.state.lower()}: {v.reason}" for m in models for v in m.versions if v.reason]
    if reasons:
        print()
        for line in reasons:
            print(line)
    return EXIT_OK
