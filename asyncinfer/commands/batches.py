"""batch create|get|watch|cancel|list|download: batch jobs over files, against the gateway's
BatchService (docs/BATCHES.md). `batch create FILE --model M --wait --out results.jsonl` uploads
the file (a progress bar of the bytes sent), creates the batch, follows it (a progress bar of the
records done) and downloads its output and error files."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import math
import os
import shlex
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, TextIO, cast

from asyncinfer.client import AsyncClient, Batch, BatchState, BlobRef
from asyncinfer.client.batches import BatchError
from asyncinfer.client.errors import FailedPreconditionError
from asyncinfer.commands.inputs import (
    LABEL_HELP,
    Signatures,
    any_case_of,
    idempotency_key_argument,
    label_argument,
    parse_key_values,
    text_argument,
)
from asyncinfer.commands.options import Options
from asyncinfer.commands.output import (
    EXIT_JOB_NOT_SUCCEEDED,
    EXIT_OK,
    ProgressBar,
    UsageError,
    local_time,
    more_than_these,
    print_json,
    print_table,
    say_unreadable_skipped,
    to_json,
)
from asyncinfer.duration_text import duration_text
from asyncinfer.output_paths import descriptor_or_file

AddOptions = Callable[[argparse.ArgumentParser], None]
PROGRESS_LINE_EVERY_S = 10.0
GROUPED_ERRORS = 3  # consecutive failed lines saying the same, shown as one line
MAX_LIST_PAGE = 100  # the most a ListBatches page holds (the gateway's MAX_PAGE_SIZE)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser], add_options: AddOptions) -> None:
    batch = commands.add_parser("batch", help="batch jobs over files (create, get, watch, cancel, list, download)")
    verbs = batch.add_subparsers(dest="batch_command", metavar="COMMAND", required=True)

    create = verbs.add_parser(
        "create",
        help="upload a file of records and run it as a batch",
        description='Upload FILE (JSONL: one {"custom_id": ..., "inputs": {...}} a line; or NPY/NPZ arrays whose '
        "first dimension is the record) and create a batch over it. Prints the batch ID, or with --wait follows it "
        "to the end (exit 1 unless COMPLETED) and writes --out and --errors.",
    )
    create.add_argument("file", type=Path)
    create.add_argument("--model", required=True, type=text_argument)
    create.add_argument("--version", default="", type=text_argument, help="the model version (default: the one served)")
    create.add_argument("--format", choices=["jsonl", "npy", "npz"], help="the file's format (default: detected)")
    priorities = ["HIGH", "NORMAL", "LOW"]
    create.add_argument("--priority", choices=priorities, type=any_case_of(priorities), help="default LOW")
    create.add_argument("--window", type=_positive_seconds, metavar="SECONDS", help="completion window (default 24 h)")
    create.add_argument("--max-attempts", type=int, default=0, metavar="N", help="attempts per chunk")
    create.add_argument(
        "--label", action="append", default=[], type=label_argument, metavar="KEY=VALUE", help=LABEL_HELP
    )
    create.add_argument(
        "--idempotency-key",
        default=None,  # not "": argparse would pass a str default through the type, which refuses it
        type=idempotency_key_argument,
        metavar="KEY",
        help="creating the same batch again with it runs nothing new (another file or settings under it: refused)",
    )
    create.add_argument("--wait", action="store_true", help="follow the batch to its end")
    create.add_argument(
        "--out", type=Path, help="with --wait: write the output file here (a name ending .npz: the output as arrays)"
    )
    create.add_argument("--errors", type=Path, help="with --wait: write the error file here")
    add_options(create)
    create.set_defaults(handler=create_command)

    for name, handler, text in (
        ("get", get_command, "show a batch"),
        ("watch", watch_command, "follow a batch's progress to its end"),
        ("cancel", cancel_command, "cancel a batch (what finished is kept)"),
    ):
        verb = verbs.add_parser(name, help=text)
        verb.add_argument("batch_id", type=text_argument)
        add_options(verb)
        verb.set_defaults(handler=handler)

    listing = verbs.add_parser("list", help="the caller's batches, newest first")
    listing.add_argument("--limit", type=int, default=20, metavar="N", help="at most this many (default 20; 0: all)")
    add_options(listing)
    listing.set_defaults(handler=list_command)

    download = verbs.add_parser("download", help="write a batch's output (and error) file")
    download.add_argument("batch_id", type=text_argument)
    download.add_argument(
        "--out",
        type=Path,
        help="the output file (default: stdout, unless --errors alone is given); a name ending .npz gets the output as arrays (NPY or NPZ input)",
    )
    download.add_argument("--errors", type=Path, help="also write the error file here")
    add_options(download)
    download.set_defaults(handler=download_command)


def batch_summary(batch: Batch) -> str:
    rate = f"  {batch.records_per_second:.0f} records/s" if batch.records_per_second else ""
    failed = f"  {batch.failed} failed" if batch.failed else ""
    if batch.not_run:  # cancelled or out of its window: neither done nor failed (OpenAI's counts)
        failed += f"  {batch.not_run} not run"
    note = f"  {batch.failure_message}" if batch.failure_message else ""
    if batch.total == 0 and not batch.done:  # its records not counted yet: `0/0 done` read as nothing to do
        return f"{batch.batch_id}  {batch.state}  reading its input{_read_so_far(batch)}{note}"
    if batch.total == 0 and batch.state in (BatchState.CANCELLED, BatchState.EXPIRED):
        # Cancelled (or out of time) while VALIDATING: `CANCELLED  0/0 done` read as an empty file.
        return f"{batch.batch_id}  {batch.state}  before its input was read{note}"
    return f"{batch.batch_id}  {batch.state}  {batch.completed}/{batch.total} done{failed}{rate}{note}"


def _read_so_far(batch: Batch) -> str:
    """How far a large input's reading has come (`  12.6/48.0 MB (26%)  210000 records  1200
    records/s  about 1m 35s left`), as the gateway last reported it; nothing before its first report."""
    read = batch.read_progress
    if read is None:
        return ""
    from rich.filesize import decimal

    share = f" ({100 * read.bytes_read // read.bytes_total}%)" if read.bytes_total else ""
    text = f"  {decimal(read.bytes_read)}/{decimal(read.bytes_total)}{share}  {read.records_read} records"
    if read.records_per_second:
        text += f"  {read.records_per_second:.0f} records/s"
    if read.estimated_end_time is not None:
        left = (read.estimated_end_time - datetime.now(UTC)).total_seconds()
        text += f"  about {duration_text(left, estimate=True)} left"
    return text


def _print(batch: Batch, options: Options) -> None:
    if options.json:
        print_json(to_json(batch))
    else:
        print(batch_summary(batch), flush=True)


class _CountingReader(io.RawIOBase):
    """A file whose reads advance a progress bar (the upload's)."""

    def __init__(self, inner: BinaryIO, bar: ProgressBar) -> None:
        self._inner = inner
        self._bar = bar

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(size)
        self._bar.advance(len(data))
        return data


class _ProgressLines:
    """Where the bar would be silent (stderr is a log or a pipe, not a terminal): one timestamped
    line per state change and at most one every PROGRESS_LINE_EVERY_S while it runs, so that a
    long batch in a CI log shows it is alive. `end_said_elsewhere`: the command's summary of the
    ended batch goes to the same file (stdout and stderr one pipe, `2>&1`), so its end is not a
    line here too (it was, the same status twice)."""

    def __init__(
        self, stream: TextIO, clock: Callable[[], float] = time.monotonic, *, end_said_elsewhere: bool = False
    ) -> None:
        self._stream = stream
        self._clock = clock
        self._end_said_elsewhere = end_said_elsewhere
        self._state: BatchState | None = None
        self._shown_at = -math.inf

    def show(self, batch: Batch) -> None:
        now = self._clock()
        if batch.state == self._state and now - self._shown_at < PROGRESS_LINE_EVERY_S:
            return
        if batch.done and self._end_said_elsewhere:
            return
        self._state, self._shown_at = batch.state, now
        print(f"{datetime.now().strftime('%H:%M:%S')}  {batch_summary(batch)}", file=self._stream, flush=True)


async def _follow(client: AsyncClient, batch: Batch, options: Options) -> Batch:
    bar: ProgressBar | None = None
    reading: ProgressBar | None = None  # while VALIDATING, in bytes of the input read
    lines = None
    if not sys.stderr.isatty():
        lines = _ProgressLines(sys.stderr, end_said_elsewhere=_same_file(sys.stdout, sys.stderr))
    try:
        async for update in client.watch_batch(batch, timeout_s=options.timeout_s):
            batch = update
            if options.json:
                print_json(to_json(update))
                continue
            if lines is not None:
                lines.show(update)
                continue
            read = update.read_progress
            if read is not None:
                note = f"{read.records_read} records read"
                if reading is None:  # what was read before its first report is not in its rate
                    reading = ProgressBar("reading", read.bytes_total, in_bytes=True)
                    reading.skip(read.bytes_read)
                reading.advance(read.bytes_read - reading.done, note=note)
            elif reading is not None:
                reading.close()
                reading = None
            if bar is None and update.total:
                bar = ProgressBar("records", update.total)
            if bar is not None:
                # Records done: those that failed (or were given up at the end of a window) are in
                # the note and the summary, not the bar, whose rate would count them as computed.
                bar.advance(update.completed - bar.done, note=_note(update))
    finally:
        if reading is not None:
            reading.close()
        if bar is not None:
            bar.close()
    return batch


def _same_file(one: TextIO, other: TextIO) -> bool:
    """Whether two streams write to one file or pipe (`2>&1`)."""
    try:
        first, second = os.fstat(one.fileno()), os.fstat(other.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # not a file (a test's StringIO), or closed
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _note(batch: Batch) -> str:
    note = f"{batch.state.value}, {batch.failed} failed" if batch.failed else batch.state.value
    return f"{note}, {batch.not_run} not run" if batch.not_run else note


def _positive_seconds(text: str) -> float:
    """--window: a positive, finite number of seconds (nan and inf were tracebacks)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"give a positive number of seconds, not {text!r}")
    return value


def _output_file(out: Path) -> str:
    """The output file a path asks for: a name ending .npz, the arrays (a batch over an NPY or NPZ
    file), not JSONL lines."""
    return "npz" if out.suffix.lower() == ".npz" else "output"


async def _download(
    client: AsyncClient, batch: Batch | str, out: Path | None, errors: Path | None, timeout_s: float | None
) -> int | None:
    """The output to --out, or to stdout when neither file is named (asking for the error file
    alone writes that file alone), and the error file to --errors; each within --timeout when given
    (a gateway that stalled mid-file kept the command waiting for ever). The output's bytes (None:
    not asked for)."""
    written: int | None = None
    if out is not None:
        written = await client.download(batch, out, file=_output_file(out), timeout_s=timeout_s)
    elif errors is None:
        written = await client.download(batch, cast(BinaryIO, sys.stdout.buffer), timeout_s=timeout_s)
    if errors is not None:
        await client.download(batch, errors, file="errors", timeout_s=timeout_s)
    return written


def _check_writable(files: dict[str, Path | None]) -> None:
    """--out and --errors can be written: a file in a folder that is there (or a device, a pipe, a
    descriptor), said before anything is sent. A folder not there was found once the batch had run
    (`create --wait`): its files were refused as "[Errno 2] No such file or directory:
    '.../results.jsonl.part'", a name the user never gave, and a folder given as --out as
    "[Errno 21] Is a directory"."""
    for flag, path in files.items():
        if path is None:
            continue
        where = descriptor_or_file(path)
        if isinstance(where, int):
            continue
        if where.is_dir():
            raise UsageError(f"{flag} {path} is a folder: give the path of a file in it ({path / 'results.jsonl'})")
        if not where.parent.is_dir():
            raise UsageError(
                f"{flag} {path}: no such folder {where.parent} (make it first: mkdir -p {shlex.quote(str(where.parent))})"
            )


def _holds_arrays(args: argparse.Namespace) -> bool:
    """Whether the batch's input is NPY or NPZ: --format, else the file's first bytes (NPY's magic
    number, or a ZIP archive's, which an NPZ is), as the gateway detects it."""
    if args.format is not None:
        return bool(args.format in ("npy", "npz"))
    path: Path = args.file
    with path.open("rb") as file:
        head = file.read(6)
    return head.startswith((b"\x93NUMPY", b"PK\x03\x04"))


async def create_command(args: argparse.Namespace, options: Options) -> int:
    labels = parse_key_values(args.label, "--label")
    if not args.wait and (args.out is not None or args.errors is not None):
        raise UsageError("--out and --errors are written once the batch ends: add --wait, or use `batch download`")
    if not await asyncio.to_thread(args.file.is_file):
        what = "a directory, not a file" if await asyncio.to_thread(args.file.is_dir) else "no such file"
        raise UsageError(f"{what}: {args.file}")
    await asyncio.to_thread(_check_writable, {"--out": args.out, "--errors": args.errors})
    named = args.file.suffix.lower()
    if args.format is None and named in (".npy", ".npz") and not await asyncio.to_thread(_holds_arrays, args):
        # Detected by its first bytes, it was read as JSONL: "line 1: INVALID_ARGUMENT not a JSON line:
        # Expecting value at column 1" for a file its user took for an array file.
        raise UsageError(
            f"{args.file} is named {named} but does not start as an {named[1:].upper()} file does (numpy's magic "
            "bytes): another kind of file under that name, or a damaged one? (a JSONL file: --format jsonl)"
        )
    if args.out is not None and _output_file(args.out) == "npz" and not await asyncio.to_thread(_holds_arrays, args):
        # Refused after the whole batch had run (NPZ_OUTPUT_NEEDS_ARRAY_INPUT): said before the upload.
        raise UsageError(
            f"--out {args.out} asks for the output as arrays (.npz), which a batch over NPY or NPZ input has; "
            "this file is JSONL: give --out a .jsonl name"
        )
    size = args.file.stat().st_size
    # Made here, not left to the SDK (which makes the same, a UUID4): a Ctrl-C before the create's
    # answer can then name the key that finds the batch, so a rerun answers it rather than making a
    # second one.
    generated_key = args.idempotency_key is None
    key: str = args.idempotency_key or str(uuid.uuid4())
    async with options.client() as client:
        # A model the gateway does not serve, said before the file goes up: the create's refusal
        # (NOT_FOUND MODEL_NOT_FOUND) came once the whole file had been uploaded, minutes for a
        # large one, to be deleted again.
        (await Signatures.fetch(options.config, client)).require(args.model)
        uploaded: list[BlobRef] = []
        try:
            bar = ProgressBar("upload", size, in_bytes=True)
            with args.file.open("rb") as raw, contextlib.closing(_CountingReader(raw, bar)) as reader:
                try:
                    batch = await client.create_batch(
                        cast(BinaryIO, reader),
                        args.model,
                        version=args.version,
                        input_format=args.format,
                        priority=args.priority,
                        completion_window_s=args.window,
                        max_attempts=args.max_attempts,
                        labels=labels,
                        idempotency_key=key,
                        on_uploaded=uploaded.append,
                    )
                finally:
                    bar.close()
        except (asyncio.CancelledError, KeyboardInterrupt):  # Ctrl-C: what was made, if anything
            print(_interrupted_create(args, options, uploaded, key), file=sys.stderr, flush=True)
            raise
        if batch.deduplicated and not generated_key:  # a key of its own: the SDK's retry found its first create
            print(
                f"asyncinfer: batch {batch.batch_id} was made earlier under this idempotency key (it is "
                f"{batch.state}); nothing new was queued",
                file=sys.stderr,
            )
        if not args.wait:
            if options.json:
                print_json(to_json(batch))
            else:
                print(batch.batch_id)
            return EXIT_OK
        try:
            batch = await _follow(client, batch, options)
        except BaseException:  # Ctrl-C, --timeout, a gateway gone for good: the batch goes on
            print(_goes_on(batch.batch_id), file=sys.stderr, flush=True)
            raise
        if not options.json:
            print(batch_summary(batch), flush=True)
            _print_errors(batch, out_file=args.out, errors_file=args.errors)
        await _write_ended(client, batch, args.out, args.errors, options.timeout_s)
    return EXIT_OK if batch.state is BatchState.COMPLETED else EXIT_JOB_NOT_SUCCEEDED


async def _write_ended(
    client: AsyncClient, batch: Batch, out: Path | None, errors: Path | None, timeout_s: float | None
) -> None:
    """`create --wait`'s files, once the batch ended: the error file first (it says why records
    failed, whatever becomes of the output's download), then the output. A batch that FAILED before
    any record ran has no arrays: its `--out x.npz` was refused (FAILED_PRECONDITION BATCH_FAILED,
    exit 4, where a JSONL --out is an empty file and the exit 1) and --errors, asked after it, was
    never written; now that is said in a line and the exit is the batch's own."""
    if errors is not None:
        await client.download(batch, errors, file="errors", timeout_s=timeout_s)
    if out is None:
        return
    try:
        await client.download(batch, out, file=_output_file(out), timeout_s=timeout_s)
    except FailedPreconditionError as refused:
        if refused.reason != "BATCH_FAILED":
            raise
        print(
            f"asyncinfer: --out {out} not written: batch {batch.batch_id} failed before any record ran, so it "
            "has no outputs (its summary says why)",
            file=sys.stderr,
            flush=True,
        )


def _goes_on(batch_id: str) -> str:
    """What a `create --wait` cut short says: the batch runs on, and the commands that come back to it."""
    return (
        f"asyncinfer: batch {batch_id} goes on; follow it with `asyncinfer batch watch {batch_id}`, then "
        f"`asyncinfer batch download {batch_id}` for its output (or stop it with `asyncinfer batch cancel {batch_id}`)"
    )


def _interrupted_create(args: argparse.Namespace, options: Options, uploaded: list[BlobRef], key: str) -> str:
    """What a Ctrl-C before the create was answered leaves: during the upload nothing (the gateway
    purges an upload cut short, tests/test_batch_clients.py); after it, perhaps a batch, which the
    command run again under the same key answers (deduplicated) rather than making a second."""
    if not uploaded:
        return (
            "asyncinfer: interrupted during the upload: no batch was created, and the gateway discards the part of "
            f"{args.file} it was sent"
        )
    api_key = " (and your --api-key)" if getattr(args, "api_key", None) else ""
    return (
        "asyncinfer: interrupted as the batch was being created: it may exist (`asyncinfer batch list` shows it). "
        f"To find it rather than make a second, run it again under its idempotency key: `{_rerun(args, options, key)}`"
        f"{api_key}; the key finds the batch until its completion window and the gateway's result retention have "
        f"passed (24 h + 24 h by default), and if no batch was made it makes it. Otherwise the upload "
        f"{uploaded[0].ref} is deleted when its retention ends"
    )


def _rerun(args: argparse.Namespace, options: Options, key: str) -> str:
    """The create command as given, under `key`: the batch's settings (a setting changed under the
    key is refused, IDEMPOTENCY_KEY_REUSED), --wait and its files, and the client options given as
    flags but the API key (not echoed to a terminal or a log)."""
    argv = ["asyncinfer", "batch", "create", str(args.file), "--model", args.model]
    for flag, value in (
        ("--version", args.version or None),
        ("--format", args.format),
        ("--priority", args.priority),
        ("--window", None if args.window is None else f"{args.window:g}"),
        ("--max-attempts", str(args.max_attempts) if args.max_attempts else None),
    ):
        if value is not None:
            argv += [flag, value]
    for label in args.label:
        argv += ["--label", label]
    argv += ["--idempotency-key", key]
    if args.wait:
        argv.append("--wait")
    for flag, path in (("--out", args.out), ("--errors", args.errors)):
        if path is not None:
            argv += [flag, str(path)]
    for flag, name in (
        ("--gateway", "gateway"),
        ("--tls-ca", "tls_ca"),
        ("--tls-cert", "tls_cert"),
        ("--tls-key", "tls_key"),
    ):
        if given := getattr(args, name, None):
            argv += [flag, given]
    if getattr(args, "timeout", None) is not None:
        argv += ["--timeout", f"{args.timeout:g}"]
    if options.json:
        argv.append("--json")
    return shlex.join(argv)


async def get_command(args: argparse.Namespace, options: Options) -> int:
    async with options.client() as client:
        batch = await client.get_batch(args.batch_id)
    _print(batch, options)
    if not options.json and not batch.done and batch.chunks_total:
        finish = batch.estimated_finish_time
        eta = f", finishing about {finish.astimezone().strftime('%H:%M:%S')}" if finish is not None else ""
        print(f"  chunks {batch.chunks_done}/{batch.chunks_total} done{eta}")
    if not options.json:
        _print_errors(batch)
    return EXIT_OK


def _print_errors(batch: Batch, *, out_file: Path | None = None, errors_file: Path | None = None) -> None:
    """Under a batch's summary: its first failed lines, and, once it ended, how to get its output
    (unless --out writes it) and, with failures, every failed line (unless --errors writes them). A
    batch that failed validation said `see the error file` and no more: neither its lines nor where
    that file is."""
    for run in _runs(batch.first_errors):
        first, last = run[0], run[-1]
        if len(run) < GROUPED_ERRORS:
            for error in run:
                named = f" {error.custom_id!r}" if error.custom_id else ""  # a line not JSON has none ('' before)
                print(f"  line {error.line}{named}: {error.code} {error.message}")
            continue
        named = f" ({first.custom_id!r} to {last.custom_id!r})" if first.custom_id and last.custom_id else ""
        print(f"  lines {first.line}-{last.line}{named}: {first.code} {first.message}")
    # The error file's lines: the failed records, and those a cancel or the window's end skipped.
    error_lines = batch.failed + batch.not_run
    if batch.done and error_lines > len(batch.first_errors) and batch.first_errors:
        print(f"  and {error_lines - len(batch.first_errors)} more")
    if batch.done and batch.completed and out_file is None:
        # Where the results are: a batch that ended said its counts and not how to read them (OpenAI's
        # batch names its output_file_id).
        arrays = " (or results.jsonl)" if batch.input_format in ("NPY", "NPZ") else ""
        name = "results.npz" if arrays else "results.jsonl"
        print(f"  the output file: asyncinfer batch download {batch.batch_id} --out {name}{arrays}")
    if batch.done and error_lines and errors_file is None:
        print(f"  the error file, every failed line: asyncinfer batch download {batch.batch_id} --errors errors.jsonl")


def _runs(errors: tuple[BatchError, ...]) -> list[list[BatchError]]:
    """The errors as runs of consecutive lines with one code and message: a cancelled batch's ten
    first errors were ten lines of "CANCELLED the batch was cancelled before this record ran", a
    file with one mistake throughout ten of the same message."""
    runs: list[list[BatchError]] = []
    for error in errors:
        previous = runs[-1][-1] if runs else None
        if (
            previous is not None
            and error.line == previous.line + 1
            and (error.code, error.message) == (previous.code, previous.message)
        ):
            runs[-1].append(error)
        else:
            runs.append([error])
    return runs


async def watch_command(args: argparse.Namespace, options: Options) -> int:
    async with options.client() as client:
        batch = await _follow(client, await client.get_batch(args.batch_id), options)
    if not options.json:
        print(batch_summary(batch), flush=True)
        _print_errors(batch)
    return EXIT_OK if batch.state is BatchState.COMPLETED else EXIT_JOB_NOT_SUCCEEDED


async def cancel_command(args: argparse.Namespace, options: Options) -> int:
    async with options.client() as client:
        _print(await client.cancel_batch(args.batch_id), options)
    return EXIT_OK


async def list_command(args: argparse.Namespace, options: Options) -> int:
    if args.limit < 0:
        raise UsageError("--limit must be 0 (all) or more")
    limit = args.limit or None
    batches: list[Batch] = []
    token = ""
    unreadable = 0
    async with options.client() as client:
        # Page after page, as `list` does: a page may be short with a token (ListBatches reads past
        # withdrawals), and one page was all there was (--limit 0 showed 1 batch, past 100 none).
        # One batch past the limit is asked for, to say that more are left out.
        while True:
            wanted = limit + 1 - len(batches) if limit is not None else MAX_LIST_PAGE
            page = await client.list_batches_page(page_size=min(wanted, MAX_LIST_PAGE), page_token=token)
            batches += page.batches
            token = page.next_page_token
            unreadable += page.unreadable_skipped
            if not token or (limit is not None and len(batches) > limit):
                break
    more = limit is not None and len(batches) > limit
    batches = batches[:limit]
    if more:  # said beside the list, not in it (a script reads stdout)
        print(
            f"asyncinfer: {more_than_these(len(batches), 'batches')} (newest first); --limit N shows more, "
            "--limit 0 all",
            file=sys.stderr,
        )
    say_unreadable_skipped(unreadable, "batch(es)", "batch_unreadable")
    if options.json:
        for batch in batches:
            print_json(to_json(batch))
        return EXIT_OK
    # When each was created and its labels, as `list` shows a job's: batches of the same model and
    # size could not be told apart (which is last night's?) without `batch get --json` on each.
    rows: list[list[Any]] = [
        [
            b.batch_id,
            b.state,
            b.model_name,
            f"{b.completed}/{b.total}",
            str(b.failed),
            f"{b.records_per_second:.0f}",
            local_time(b.create_time),
            ",".join(f"{k}={v}" for k, v in sorted(b.labels.items())),
        ]
        for b in batches
    ]
    if not rows:  # said plainly: the table's header alone read as a listing that failed
        print("no batches", flush=True)
        return EXIT_OK
    print_table(["BATCH", "STATE", "MODEL", "DONE", "FAILED", "RECORDS/S", "CREATED", "LABELS"], rows)
    return EXIT_OK


async def download_command(args: argparse.Namespace, options: Options) -> int:
    await asyncio.to_thread(_check_writable, {"--out": args.out, "--errors": args.errors})
    async with options.client() as client:
        written = await _download(client, args.batch_id, args.out, args.errors, options.timeout_s)
    if written == 0 and args.errors is None:
        # A batch that failed validation, or was cancelled before a record ran, has an empty output:
        # the command printed nothing and exited 0, its records' errors left unsaid.
        print(
            f"asyncinfer: batch {args.batch_id} has no output: none of its records succeeded; why, line by "
            f"line: asyncinfer batch download {args.batch_id} --errors errors.jsonl",
            file=sys.stderr,
        )
    return EXIT_OK
