"""What the client commands print: exit codes, errors on stderr, jobs as text or JSON, tables,
progress bars and live lines. On a terminal tables, bars and live lines are drawn by rich; on a
pipe or a file the output is plain, aligned text (tables) or nothing (bars).

Exit codes (stable; scripts may rely on them):

    0  ok
    1  a job ended in a state other than SUCCEEDED (watch, submit --wait; bulk: any line did not succeed)
    2  usage error: bad arguments, an unreadable or malformed input file
    3  not found (NOT_FOUND: no such job, model or dead letter)
    4  invalid argument (INVALID_ARGUMENT, OUT_OF_RANGE, ALREADY_EXISTS, FAILED_PRECONDITION)
    5  unavailable or too slow (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED): try again later
    6  any other error (INTERNAL, UNKNOWN, UNIMPLEMENTED, ...)
    7  not allowed (UNAUTHENTICATED, PERMISSION_DENIED)
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import math
import re
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, TextIO

import grpc
import numpy as np

from asyncinfer.client import AsyncInferClientError, CallbackDelivery, Job, JobError
from asyncinfer.client.errors import code_and_reason, unsaid_violations
from asyncinfer.duration_text import duration_text
from asyncinfer.errors import FieldViolation
from asyncinfer.jobs import CHUNK_LABEL
from asyncinfer.tensors import datatype_of

if TYPE_CHECKING:  # rich is imported where a terminal is drawn on: the CLI's start-up does not pay for it
    from rich.console import Console
    from rich.progress import Progress, Task
    from rich.table import Table

EXIT_OK = 0
EXIT_JOB_NOT_SUCCEEDED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INVALID = 4
EXIT_UNAVAILABLE = 5
EXIT_OTHER = 6
EXIT_NOT_ALLOWED = 7
EXIT_INTERRUPTED = 130

_EXIT_BY_CODE: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT: EXIT_INVALID,
    grpc.StatusCode.OUT_OF_RANGE: EXIT_INVALID,
    grpc.StatusCode.ALREADY_EXISTS: EXIT_INVALID,
    grpc.StatusCode.FAILED_PRECONDITION: EXIT_INVALID,
    grpc.StatusCode.UNAVAILABLE: EXIT_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: EXIT_UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED: EXIT_NOT_ALLOWED,
    grpc.StatusCode.PERMISSION_DENIED: EXIT_NOT_ALLOWED,
}


class UsageError(Exception):
    """A mistake in the command line or in a file it names: exit 2, nothing was sent."""


def exit_code_for(code: grpc.StatusCode) -> int:
    return _EXIT_BY_CODE.get(code, EXIT_OTHER)


def report_error(error: AsyncInferClientError, stream: TextIO | None = None) -> int:
    """The error on stderr (code and reason, then one line per field violation); its exit code."""
    out = stream or sys.stderr
    print(f"asyncinfer: error: {code_and_reason(error.code.name, error.reason)}: {error.message}", file=out)
    for violation in unsaid_violations(error.message, error.violations):  # said once, not twice
        print(f"asyncinfer:   {violation.field}: {violation.description}", file=out)
    if error.retry_after_s is not None:
        print(f"asyncinfer:   retry after {error.retry_after_s:g} s", file=out)
    return exit_code_for(error.code)


# -- JSON ---------------------------------------------------------------------------------------


def array_json(array: np.ndarray[Any, Any]) -> dict[str, Any]:
    """A tensor as {"datatype", "shape", "data" (nested lists)}; BYTES elements as UTF-8 text,
    or {"b64": ...} when they are not text."""
    try:
        datatype = datatype_of(array)
    except ValueError:
        datatype = str(array.dtype)
    if datatype == "BYTES":
        data: Any = np.vectorize(_bytes_json, otypes=[object])(array).tolist() if array.size else []
    elif array.dtype.kind == "f":
        data = [_float_json(v) for v in array.ravel().tolist()]
        data = np.array(data, dtype=object).reshape(array.shape).tolist() if array.ndim else data[0]
    else:
        data = array.tolist()
    return {"datatype": datatype, "shape": list(array.shape), "data": data}


def _float_json(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no NaN or infinity


def _bytes_json(value: Any) -> Any:
    raw = value if isinstance(value, bytes) else str(value).encode()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(raw).decode("ascii")}


def to_json(value: Any) -> Any:
    """The SDK's dataclasses, enums, datetimes and arrays as plain JSON values."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return _float_json(value)
    if isinstance(value, grpc.StatusCode):
        return value.name
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, np.ndarray):
        return array_json(value)
    if isinstance(value, np.generic):
        return to_json(value.item())
    if isinstance(value, bytes):
        return _bytes_json(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return str(value)


def job_json(job: Job) -> dict[str, Any]:
    data: dict[str, Any] = to_json(job)
    if job.progress is None:
        data.pop("progress", None)
    return data


def error_json(error: JobError | AsyncInferClientError) -> dict[str, Any]:
    return {
        "code": error.code.name,
        "reason": error.reason,
        "message": error.message,
        "violations": [{"field": v.field, "description": v.description} for v in error.violations],
    }


def print_json(value: Any, stream: TextIO | None = None) -> None:
    out = stream or sys.stdout
    out.write(json.dumps(value, separators=(",", ":"), ensure_ascii=False) + "\n")
    out.flush()


# -- text ---------------------------------------------------------------------------------------


# The one format of a date and time in the CLI's text (tables, `get`, `dlq show`): the local time
# to the second, as `list` printed it; `get` printed ISO 8601 with milliseconds and the offset
# (2026-12-07T14:03:21.042+01:00) and `dlq list` ISO 8601 in UTC. A live line (watch, batch watch,
# stats) or an estimate (starts about, finishing about) shows the time of day of the same clock
# (watch's lines to the millisecond); --json, ISO 8601 in UTC.
def more_than_these(shown: int, things: str) -> str:
    """What a list cut at --limit says of those left out: "more jobs than these 20", or "than this
    one" (it said "than these 1" under --limit 1)."""
    return f"more {things} than this one" if shown == 1 else f"more {things} than these {shown}"


def say_unreadable_skipped(count: int, things: str, event: str) -> None:
    """A list's one line on stderr (beside the list: a script reads stdout) when the gateway left
    out `count` of the `things` because it cannot decode their record; nothing when none."""
    if count:
        print(
            f"asyncinfer: warning: the gateway left out {count} {things} it cannot read (a newer release's "
            f"record, or a corrupted one): its log names each ({event})",
            file=sys.stderr,
        )


TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def local_time(value: datetime | None) -> str:
    """A date and time as the CLI's text shows one: local, to the second ("-" for none)."""
    return value.astimezone().strftime(TIME_FORMAT) if value is not None else "-"


def _time(value: datetime | None) -> str:
    return local_time(value)


def _violations(violations: tuple[FieldViolation, ...]) -> list[str]:
    return [f"            {v.field}: {v.description}" for v in violations]


def attempts_counted_text(spent: int, allowed: int, given_back: int) -> str:
    """Attempts as a person counts them, the same for a job and its dead letter: "2 of 2", and
    those given back apart, "2 of 2 (4 given back)". `allowed` 0 (not known: a dead letter written
    before it was kept) leaves the "of" out: "6"."""
    counted = f"{spent} of {allowed}" if allowed else str(spent)
    return f"{counted} ({given_back} given back)" if given_back else counted


def attempt_text(job: Job) -> str:
    """The attempt as a person counts it: "2 of 2 (4 given back)" where `attempt`/`max_attempts`
    say 6/6 (each attempt given back raises both)."""
    return attempts_counted_text(job.spent_attempts, job.allowed_attempts, job.given_back_attempts)


def jobs_ahead_text(position: int) -> str:
    """A queued job's place as the jobs ahead of it: `position 0` (0-based, as the proto's field)
    read as a place in a line, where the first is 1."""
    return "nothing ahead" if position == 0 else f"{position} job{'s' if position != 1 else ''} ahead"


def job_summary(job: Job) -> str:
    """One line: what a watcher or a list wants to see of a job now."""
    parts = [job.job_id, job.state.value]
    if job.queue is not None and not job.done:
        parts.append(jobs_ahead_text(job.queue.position))
        if job.queue.waiting_reason is not None:
            parts.append(f"waiting: {job.queue.waiting_reason.value}")
    if job.attempt > 1 or (job.attempt and job.state.value == "RUNNING"):
        parts.append(f"attempt {attempt_text(job)}")
    if job.progress is not None:
        if job.progress.fraction is not None:
            parts.append(f"{job.progress.fraction:.0%}")
        if job.progress.message:
            parts.append(job.progress.message)
    if job.error is not None:
        parts.append(f"{job.error.reason}: {job.error.message}")
    return "  ".join(parts)


def job_text(
    job: Job, outputs: Mapping[str, np.ndarray[Any, Any]] | None = None, *, why_waiting: str | None = None
) -> str:
    """A job as a few aligned lines, outputs included (long arrays abbreviated); `why_waiting`, what
    keeps its model from being served (ListModels' reason), under its queue line."""
    lines = [
        f"job         {job.job_id}",
        f"model       {job.model_name}" + (f" (version {job.model_version})" if job.model_version else ""),
        f"state       {job.state.value}",
        f"priority    {job.priority.value}",
        f"attempt     {attempt_text(job)}",
        f"created     {_time(job.create_time)}",
    ]
    if job.end_time is not None:
        lines.append(f"ended       {_time(job.end_time)}")
    if job.queue_duration_s is not None or job.run_duration_s is not None:
        lines.append(
            f"durations   queued {duration_text(job.queue_duration_s)}, ran {duration_text(job.run_duration_s)}"
        )
    if job.batcher_id:
        lines.append(f"{'runs on' if job.state.value == 'RUNNING' else 'ran on':<12}{job.batcher_id}")
    if job.trace_id:  # to find the job's trace in Jaeger or any OpenTelemetry backend
        lines.append(f"trace       {job.trace_id}")
    if job.queue is not None and not job.done:
        reason = job.queue.waiting_reason.value if job.queue.waiting_reason else "-"
        start = job.queue.estimated_start_time
        expected = f", starts about {start.astimezone().strftime('%H:%M:%S')}" if start is not None else ""
        lines.append(f"queue       {jobs_ahead_text(job.queue.position)}{expected}, waiting: {reason}")
        if why_waiting:
            lines.append(f"why         {why_waiting}")
    if job.progress is not None and not job.done:
        done = f"{job.progress.fraction:.0%}" if job.progress.fraction is not None else ""
        lines.append(f"progress    {'  '.join(part for part in (done, job.progress.message) if part) or '-'}")
    if job.labels:
        lines.append("labels      " + ", ".join(f"{k}={v}" for k, v in sorted(job.labels.items())))
    if job.error is not None:
        lines.append(f"error       {code_and_reason(job.error.code.name, job.error.reason)}: {job.error.message}")
        lines += _violations(unsaid_violations(job.error.message, job.error.violations))
        if job.dead_letter_sequence:  # its letter, straight to the command that shows or replays it
            sequence = job.dead_letter_sequence
            # A file batch's chunk is not replayed (BATCH_CHUNK_NOT_REPLAYABLE), as its console page says.
            again = (
                "a file batch's chunk: not replayed, its records are in the batch's error file"
                if CHUNK_LABEL in job.labels
                else f"dlq replay {sequence} runs it again"
            )
            lines.append(f"dead letter {sequence} (asyncinfer dlq show {sequence}; {again})")
    elif job.last_error is not None:
        last = job.last_error
        lines.append(f"last error  {code_and_reason(last.code.name, last.reason)}: {last.message}")
    if job.result_ref is not None:
        lines.append(f"result      {job.result_ref.ref} ({job.result_ref.size_bytes} bytes)")
    if job.callback is not None:
        lines.append(f"callback    {job.callback.url}")
        lines += [f"  webhook   {_delivery(d)}" for d in job.callback_deliveries]
    for name, array in (outputs if outputs is not None else job.outputs).items():
        body = np.array2string(array, threshold=64, separator=", ")
        lines.append(f"output      {name} {array_json(array)['datatype']} {list(array.shape)}: {body}")
    return "\n".join(lines)


def _delivery(delivery: CallbackDelivery) -> str:
    """`COMPLETED DELIVERED (HTTP 200, 1 attempt)`; a failing one says why and when it tries next."""
    event = delivery.event.value if delivery.event else "?"
    state = delivery.state.value if delivery.state else "?"
    attempts = f"{delivery.attempts} attempt{'s' if delivery.attempts != 1 else ''}"
    outcome = delivery.last_error or (f"HTTP {delivery.last_status_code}" if delivery.last_status_code else "")
    details = [outcome, attempts] if outcome else [attempts]
    if delivery.next_attempt_time is not None:
        details.append(f"next {_time(delivery.next_attempt_time)}")
    return f"{event} {state} ({', '.join(details)})"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Aligned plain columns: what a pipe, a file or a script gets (the same on every version)."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


# Cells a column is right-aligned for on a terminal when all of its cells look like them: counts,
# rates, durations ("1.5s"), or nothing ("-").
_NUMERIC = re.compile(r"^(-|[0-9][0-9.,]*\s?[a-z/%]{0,3})$")


def console(stream: TextIO) -> Console:
    """A rich Console on `stream` (which is a terminal: the callers check), highlighting nothing
    but what they style themselves; it honours NO_COLOR, TERM=dumb and COLUMNS."""
    from rich.console import Console

    return Console(file=stream, highlight=False)


def rich_table(headers: list[str], rows: list[list[str]]) -> Table:
    """The same table for a terminal: a bold header rule, numbers right-aligned, cells not
    wrapped but in the last column (labels, an error message), which wraps within its width
    (print_table uses it only where every other column fits whole)."""
    from rich import box
    from rich.table import Table

    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for i, header in enumerate(headers):
        numeric = bool(rows) and all(_NUMERIC.match(row[i]) for row in rows)
        last = i == len(headers) - 1
        grid.add_column(
            header, justify="right" if numeric else "left", no_wrap=not last, overflow="fold" if last else "ellipsis"
        )
    for row in rows:
        grid.add_row(*row)
    return grid


def print_table(headers: list[str], rows: list[list[str]], stream: TextIO | None = None) -> None:
    """`table` on a pipe or a file, exactly; a rich table on a terminal wide enough for every
    column but the last (which folds), else `table` too: a rich table squeezed into a narrow
    terminal cut job IDs with an ellipsis (the one thing a user copies) and broke headers (RECOR /
    DS/S); the plain table keeps every cell whole and lets the terminal wrap its lines."""
    out = stream or sys.stdout
    if out.isatty():
        screen = console(out)
        if _fixed_width(headers, rows) <= screen.width:
            screen.print(rich_table(headers, rows))
            out.flush()
            return
    out.write(table(headers, rows) + "\n")
    out.flush()


def _fixed_width(headers: list[str], rows: list[list[str]]) -> int:
    """The characters every column but the last needs whole, with the gaps between columns."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers[:-1])]
    return sum(widths) + 2 * len(widths) + len(headers[-1])


# -- progress -----------------------------------------------------------------------------------


class ProgressBar:
    """`label ━━━━━━━━━━━━━━━━━╺━━━━━━━━━━━━ 120/200  60% 35/s ETA 3s`, a rich Progress redrawn in
    place on stderr, at most 10 times a second; silent unless stderr is a terminal (so logs and
    pipes stay clean). It is drawn at once (a wait on a paused queue shows 0/N, not nothing), and
    the rate counts only the work done now: `skip` advances past what an earlier run did without
    counting it (rich's own speed column would count it: the rate and ETA columns are ours)."""

    WIDTH = 30

    def __init__(
        self,
        label: str,
        total: int | None,
        stream: TextIO | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        in_bytes: bool = False,
    ) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.skipped = 0
        self.note = ""
        self._stream = stream or sys.stderr
        self.enabled = self._stream.isatty()
        self._clock = clock
        self._started = clock()
        self._drawn = 0.0
        self._progress: Progress | None = None
        if self.enabled:
            self._progress = _progress(self._stream, clock, self.WIDTH, in_bytes=in_bytes)
            self._task = self._progress.add_task(label, total=total, skipped=0, note="")
            self._progress.start()
        self._draw(self._started)

    def advance(self, count: int = 1, note: str | None = None) -> None:
        self.done += count
        if note is not None:
            self.note = note
        now = self._clock()
        if now - self._drawn >= 0.1 or (self.total is not None and self.done >= self.total):
            self._draw(now)

    def skip(self, count: int = 1) -> None:
        """Past `count` items done before (a resumed run's): shown as done, not in the rate."""
        self.skipped += count
        self.advance(count)

    def _draw(self, now: float) -> None:
        if self._progress is None:
            return
        self._drawn = now
        self._progress.update(self._task, completed=self.done, skipped=self.skipped, note=self.note, refresh=True)

    def close(self) -> None:
        if self._progress is not None:
            self._draw(self._clock())
            self._progress.stop()  # leaves the last frame, and a newline after it
            self._progress = None


def _rate(task: Task) -> float:
    """Items a second done by this run: a resumed run's skipped items are not its work."""
    done = task.completed - float(task.fields.get("skipped", 0))
    return done / max(task.elapsed or 0.0, 1e-6)


def _progress(stream: TextIO, clock: Callable[[], float], width: int, *, in_bytes: bool = False) -> Progress:
    """A rich Progress drawn only when told (`refresh=True`): no refresh thread writing to the
    stream behind the command's back, and a clock the tests can hold still. `in_bytes`: counts and
    rate in bytes (`12.6/48.0 MB 3.1 MB/s`, an upload's), not bare numbers of items."""
    from rich.filesize import decimal
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TaskProgressColumn,
        TextColumn,
    )
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            return Text(f"{decimal(int(_rate(task)))}/s" if in_bytes else f"{_rate(task):.0f}/s")

    class Eta(ProgressColumn):
        def render(self, task: Task) -> Text:
            rate = _rate(task)
            if task.total is None or rate <= 0 or task.completed >= task.total:
                return Text("")
            return Text(f"ETA {duration_text((task.total - task.completed) / rate, estimate=True)}")

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=width),
        DownloadColumn() if in_bytes else MofNCompleteColumn(),
        TaskProgressColumn(),
        Rate(),
        Eta(),
        TextColumn("{task.fields[note]}"),
        console=console(stream),
        auto_refresh=False,
        get_time=clock,
        redirect_stdout=False,
        redirect_stderr=False,
    )


class StatusLine:
    """One status rewritten in place on a terminal (watch's live state): a rich Live, which
    rewrites it whole even where it is wider than the terminal and wraps."""

    def __init__(self, stream: TextIO) -> None:
        from rich.live import Live

        self._live = Live(console=console(stream), auto_refresh=False, redirect_stdout=False, redirect_stderr=False)
        self._live.start()

    def show(self, text: str) -> None:
        from rich.text import Text

        self._live.update(Text(text), refresh=True)

    def close(self) -> None:
        self._live.stop()  # the last status stays, with a newline after it
