"""The JobService pages: the models served, a tenant's jobs (filters, paging) and one job's page
(record, attempts, timings, waiting reason, outputs kept inline, batch, webhook deliveries, timeline),
live while it runs, with a cancel button where the console may act, and a retry button on a
dead-lettered job's (it replays the job's letter)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import numpy as np
import numpy.typing as npt
from aiohttp import web

from asyncinfer.client import CallbackDeliveryState, Job, JobState, why_not_served
from asyncinfer.client.errors import AsyncInferClientError, NotFoundError
from asyncinfer.commands.output import attempt_text
from asyncinfer.job_errors import MAX_ATTEMPTS, gave_up_said
from asyncinfer.jobs import BATCH_LABEL, CHUNK_LABEL
from asyncinfer.tensors import datatype_of
from services.console import html as ui
from services.console.context import Context, count_param, fragment_or_page, live_page, status_of
from services.console.pages_ops import MAX_SEQUENCE

PAGE_SIZES = (20, 50, 100, 200)
JOBS_REFRESH_MS = 5000  # the Jobs list's refresh
MAX_PAGE_SIZE = 1000  # ListJobs' own most
TIMELINE_COLORS = {"queued": "#f0b429", "running": "#0b57d0"}
END_COLORS = {JobState.SUCCEEDED: "#137333", JobState.FAILED: "#b3261e", JobState.TIMED_OUT: "#b3261e"}
VALUES_SHOWN = 8  # of each output tensor, on a job's page
BYTES_SHOWN = 40  # of each BYTES element shown


async def models_page(ctx: Context, request: web.Request) -> web.Response:
    try:
        models = await ctx.backend.models()
    except AsyncInferClientError as error:
        return fragment_or_page(request, "Models", ui.error_box(error), status=status_of(error))
    rows = [
        [
            ui.h(m.name),
            ui.h(m.version or "-"),
            ui.h(m.versions_summary or "-"),
            ui.h(", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in m.inputs)),
            ui.h(", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in m.outputs)),
            ui.h(m.max_batch_size),
            ui.h(f"{m.default_max_attempts} (at most {m.max_attempts_limit})"),
            ui.seconds(m.default_execution_timeout_s),
            f'<a href="{ui.url("/jobs", model=m.name)}">jobs</a>',
        ]
        for m in models
    ]
    headers = ("model", "default", "versions", "inputs", "outputs", "max rows", "attempts", "execution timeout", "")
    return fragment_or_page(request, "Models", ui.table(headers, rows, numeric=(5,), id_="models"))


def _labels(text: str) -> dict[str, str] | None:
    """`key=value, key2=value2` from the filter box; None when a part is not `key=value` (it was
    ignored, and an unfiltered list looked filtered)."""
    pairs = [part.partition("=") for part in text.split(",") if part.strip()]
    if any(not sep or not key.strip() for key, sep, _value in pairs):
        return None
    return {key.strip(): value.strip() for key, _sep, value in pairs}


async def jobs_page(ctx: Context, request: web.Request) -> web.Response:
    query = request.query
    state, model, label = query.get("state", ""), query.get("model", ""), query.get("label", "")
    token = query.get("page_token", "")
    size = count_param(query.get("page_size", ""), default=50, most=MAX_PAGE_SIZE)
    known = {s.value: s for s in JobState}
    labels = _labels(label)
    if size is None or size == 0 or (state and state.upper() not in known) or labels is None:
        wrong = (
            "page_size is a number of jobs, 1 to 1,000"
            if not size
            else f"unknown state {state!r}"
            if state and state.upper() not in known
            else f"labels are key=value, separated by commas: {label[:100]!r}"
        )
        return fragment_or_page(request, "Jobs", _filters(ctx, query) + ui.error_box(wrong), status=400)
    states = (known[state.upper()],) if state else ()
    try:
        found = await ctx.backend.list_jobs(states=states, model=model, labels=labels, page_size=size, page_token=token)
    except AsyncInferClientError as error:
        body = _filters(ctx, query) + ui.error_box(error)
        if token:
            filters = {"state": state, "model": model, "label": label, "page_size": str(size) if size != 50 else ""}
            body += ui.first_page(ui.url("/jobs", **filters), error)
        return fragment_or_page(request, "Jobs", body, status=status_of(error))
    now = time.time()
    # A trace column once a job on the page is traced (tracing.enabled): none of dashes while it is off.
    traced = any(job.trace_id for job in found.jobs)
    rows = [_job_row(job, now, trace_url=ctx.trace_url if traced else None) for job in found.jobs]
    headers: tuple[str, ...] = ("job", "state", "model", "priority", "attempt", "labels", "created", "queued", "ran")
    headers += ("trace",) if traced else ()
    # An empty list says why: nothing matches the filters, this page is past the last, or no jobs at all.
    empty = (
        "no job matches these filters"
        if state or model or label
        else "no more jobs"
        if token
        else "no jobs yet: the jobs submitted (asyncinfer submit, the SDK) show here"
    )
    listing = ui.table(headers, rows, numeric=(4, 7, 8), id_="jobs", empty=empty)
    links = []
    filters = {"state": state, "model": model, "label": label, "page_size": str(size) if size != 50 else ""}
    if token:
        links.append(f'<a href="{ui.h(ui.url("/jobs", **filters))}">first page</a>')
    if found.next_page_token:
        more = ui.url("/jobs", **filters, page_token=found.next_page_token)
        links.append(f'<a id="next-page" href="{ui.h(more)}">next page</a>')
        if len(found.jobs) < size:  # ListJobs ends a page at its size limit in bytes, too
            links.append(f"{len(found.jobs)} of the {size} asked fit in one answer; the rest follow")
    body = listing + " · ".join(links)
    # The first page follows new jobs; later pages stay put (their token is a position). Every 5 s,
    # not 2: each refresh is a ListJobs, which with tens of thousands of jobs in a tenant cost the
    # gateway ~0.4 s of its event loop when it scanned every key each time (a tab left open on
    # this page held the gateway's loop a fifth of the time); a job's own page follows it closely.
    return live_page(
        request,
        "Jobs",
        body,
        element_id="jobs-live",
        refresh=None if token else ui.url("/jobs", **filters),
        every_ms=JOBS_REFRESH_MS,
        above=_filters(ctx, query),
    )


def _filters(ctx: Context, query: Mapping[str, str]) -> str:
    state = query.get("state", "")
    options = "".join(
        f'<option value="{s.value}"{" selected" if s.value == state.upper() else ""}>{s.value}</option>'
        for s in JobState
    )
    # The size in use is always an option (a link may carry one the list does not offer).
    used = count_param(query.get("page_size", ""), default=50, most=MAX_PAGE_SIZE)
    offered = sorted({*PAGE_SIZES, used}) if used else PAGE_SIZES
    sizes = "".join(f"<option{' selected' if n == used else ''}>{n}</option>" for n in offered)
    whose = f"Tenant {ui.h(ctx.tenant)}'s jobs" if ctx.tenant else "The jobs the console's key reaches"
    return (
        f'<p>{whose}, newest first.</p><form method="get" action="/jobs">'
        f'state <select name="state"><option value="">any</option>{options}</select> '
        f'model <input name="model" size="12" value="{ui.h(query.get("model", ""))}"> '
        f'labels <input name="label" size="24" placeholder="key=value, key2=value2" value="{ui.h(query.get("label", ""))}"> '
        f'per page <select name="page_size">{sizes}</select> <button type="submit">filter</button></form>'
    )


def _job_row(job: Job, now: float, *, trace_url: str | None = None) -> list[str]:
    """A job's row; with its trace column unless `trace_url` is None (console.trace_url, or "")."""
    labels = ", ".join(f"{k}={v}" for k, v in sorted(job.labels.items()))
    row = [
        f'<a href="/jobs/{ui.h(job.job_id)}">{ui.h(job.job_id)}</a>',
        ui.state(job.state.value),
        ui.h(job.model_name),
        ui.h(job.priority.value),
        ui.h(attempt_text(job)),
        ui.text(labels) if labels else "-",
        ui.when(job.create_time),
        ui.seconds(_queued_so_far(job, now)),
        ui.seconds(job.run_duration_s),
    ]
    return (
        row if trace_url is None else [*row, ui.trace(job.trace_id, trace_url, short=True, sampled=job.trace_sampled)]
    )


async def job_page(ctx: Context, request: web.Request) -> web.Response:
    job_id = request.match_info["job_id"]
    title = f"Job {job_id}"
    try:
        job = await ctx.backend.job(job_id)
    except NotFoundError as error:
        return fragment_or_page(request, title, ui.error_box(error), status=404, final=True)
    except AsyncInferClientError as error:
        return fragment_or_page(request, title, ui.error_box(error), status=status_of(error))
    body = job_details(
        job,
        time.time(),
        why_waiting=await _why_not_served(ctx, job),
        trace_url=ctx.trace_url,
        dead_letter=await _dead_letter(ctx, job),
    )
    body += _cancel(ctx, job)
    # Ended, with no webhook delivery still being tried: nothing on the page changes any more.
    settled = job.done and not any(d.state is CallbackDeliveryState.PENDING for d in job.callback_deliveries)
    every = 5000 if job.done else 1000  # after its end, only its webhooks' next attempts change
    refresh = None if settled else f"/jobs/{job_id}"
    return live_page(request, title, body, element_id="job", refresh=refresh, every_ms=every, final=settled)


CANCEL_REASON = "from the web console"
# The pages of its model's dead letters (oldest first, 500 a page) the page of a job dead-lettered by
# a scheduler of the release before (its record names no letter) reads for its letter; past them (a
# queue of dead letters thousands long) it names the listing instead.
DEAD_LETTER_PAGES_READ = 4
DEAD_LETTER_PAGE_SIZE = 500


async def _dead_letter(ctx: Context, job: Job) -> str:
    """A dead-lettered job's letter (its error is a give-up's: attempts spent): a link to its page
    on the console and the CLI command that runs it again; where the letter cannot be read (no ops
    key, purged, or past the pages read), its model's dead letters and the CLI commands that find
    and replay it. "" for any other job."""
    if not job.done or job.error is None or not gave_up_said(job.error.message):
        return ""
    chunk = CHUNK_LABEL in job.labels  # its records are in its batch's error file: not replayed
    letter = await _find_dead_letter(ctx, job)
    if letter is not None:
        sequence = ui.h(letter["sequence"])
        reason = ui.h(letter["reason"])
        link = f'<a id="dead-letter" href="/dead-letters/{sequence}">{sequence}</a> ({reason}: attempts spent)'
        if chunk:
            return link + " — a file batch's chunk: not replayed (its records are in the batch's error file)"
        return f"{link} {_retry(ctx, job, letter)}"
    model = ui.h(job.model_name)
    listing = (
        f'<a id="dead-letters" href="{ui.h(ui.url("/dead-letters", model=job.model_name))}">{model}\'s dead letters</a>'
    )
    said = f"{ui.h(MAX_ATTEMPTS)}: attempts spent; among {listing}"
    if chunk:
        return said
    if job.dead_letter_sequence:  # named by its record: the commands need not look for it
        sequence = ui.h(job.dead_letter_sequence)
        return (
            f"{said}: <code>asyncinfer dlq show {sequence}</code> shows it, "
            f"<code>asyncinfer dlq replay {sequence}</code> runs it again"
        )
    return (
        f"{said}: <code>asyncinfer dlq list --model {model}</code> names its sequence, "
        "<code>asyncinfer dlq replay SEQUENCE</code> runs it again"
    )


async def _find_dead_letter(ctx: Context, job: Job) -> dict[str, Any] | None:
    """The job's dead letter: the one its record names (the scheduler writes the letter's sequence
    on the record that ends the job); for a record from a scheduler of the release before, which
    names none, its model's first pages of letters searched for the job. None: not there (purged,
    past its retention, or past the pages read), or the scheduler would not say (a console without
    the ops key)."""
    if job.dead_letter_sequence:
        try:
            letter = await ctx.backend.dead_letter(job.dead_letter_sequence)
        except AsyncInferClientError:  # NOT_FOUND (purged, expired) or no ops key
            return None
        # The sequence came with the record, the letter from the scheduler: both name the job.
        return letter if letter["job_id"] == job.job_id and letter["tenant"] == ctx.tenant else None
    token = ""
    for _ in range(DEAD_LETTER_PAGES_READ):
        try:
            found = await ctx.backend.dead_letters(
                model=job.model_name, page_size=DEAD_LETTER_PAGE_SIZE, page_token=token
            )
        except AsyncInferClientError:
            return None
        for letter in found.letters:
            if letter["job_id"] == job.job_id and letter["tenant"] == ctx.tenant:
                return letter
        token = found.next_page_token
        if not token:
            return None
    return None


def _cancel(ctx: Context, job: Job) -> str:
    """The cancel button of a job not yet ended, where the console may act (as a batch's page has)."""
    if job.done or job.state is JobState.CANCELLING:
        return ""
    if not ctx.writable:
        return '<p class="note">read-only: cancelling needs a console that may act</p>'
    ask = "Cancel this job? A queued job ends at once; a running one once its batcher hears of it."
    return (
        "<p>"
        + ui.post_button(f"/jobs/{quote(job.job_id, safe='')}/cancel", "cancel job", ctx.csrf, confirm=ask)
        + "</p>"
    )


async def job_cancel(ctx: Context, request: web.Request) -> web.Response:
    form = {k: str(v) for k, v in (await request.post()).items()}
    refused = ctx.check_form(form)
    if refused is not None:
        return refused
    job_id = request.match_info["job_id"]
    try:
        job = await ctx.backend.cancel_job(job_id, reason=CANCEL_REASON)
        said = f"asked to cancel: {job.state.value}"
    except AsyncInferClientError as error:
        said = f"refused: {error}"
    raise web.HTTPSeeOther(ctx.outcome(f"/jobs/{quote(job_id, safe='')}", said))


def _retry(ctx: Context, job: Job, letter: Mapping[str, Any]) -> str:
    """What runs a dead-lettered job (not a batch's chunk) again, after its letter's link: the retry
    button where the console may act (it replays this letter, as the letter's own page does), and
    the CLI command in any case."""
    sequence = str(letter["sequence"])
    command = f"<code>asyncinfer dlq replay {ui.h(sequence)}</code>"
    if not ctx.writable:
        return f"— {command} runs it again (read-only: {ui.h(ctx.read_only_because)})"
    ask = "Run this job again? Its dead letter is replayed: the job is queued with a fresh budget of attempts."
    button = ui.post_button(
        f"/jobs/{quote(job.job_id, safe='')}/retry", "retry job", ctx.csrf, {"sequence": sequence}, confirm=ask
    )
    return f"{button} or {command}"


async def job_retry(ctx: Context, request: web.Request) -> web.Response:
    """Replays the job's dead letter named by the form, once it is read back as this job's: the page
    then shows the job queued again, or why not (the scheduler's refusal: a letter replayed or
    purged meanwhile, a job whose record is gone)."""
    form = {k: str(v) for k, v in (await request.post()).items()}
    refused = ctx.check_form(form)
    if refused is not None:
        return refused
    job_id = request.match_info["job_id"]
    sequence = count_param(form.get("sequence", ""), default=0, most=MAX_SEQUENCE)
    try:
        if not sequence:
            said = "refused: the form names no dead letter (reload the page and try again)"
        else:
            letter = await ctx.backend.dead_letter(sequence)
            if letter["job_id"] != job_id or letter["tenant"] != ctx.tenant:
                said = f"refused: dead letter {sequence} is not this job's"
            else:
                await ctx.backend.replay([sequence])
                said = f"retried: dead letter {sequence} replayed, the job is queued again"
    except AsyncInferClientError as error:
        said = f"refused: {error}"
    raise web.HTTPSeeOther(ctx.outcome(f"/jobs/{quote(job_id, safe='')}", said))


async def _why_not_served(ctx: Context, job: Job) -> str:
    """For a queued job whose version is not served, why (ListModels' reason: "batcher X could not
    load it: ..."), which the job's record has no room for; "" otherwise or when it cannot be read."""
    waiting = job.queue.waiting_reason if job.queue is not None and job.state is JobState.QUEUED else None
    if waiting is None or not waiting.not_served:
        return ""
    try:
        models = await ctx.backend.models()
    except AsyncInferClientError:
        return ""  # the waiting reason stands; this is a hint
    return why_not_served(job, models)


def _batch_field(job: Job) -> list[tuple[str, str]]:
    """A batch's chunk job: its batch (a link to the batch's page) and which of its records it holds
    (the chunk label's start-end, records counted from 0, end excluded); nothing for another job."""
    batch_id = job.labels.get(BATCH_LABEL)
    if not batch_id:
        return []
    start, _, end = job.labels.get(CHUNK_LABEL, "").partition("-")
    held = f"records {int(start) + 1} to {end}" if start.isdigit() and end.isdigit() else "a chunk"
    link = f'<a href="/batches/{ui.h(quote(batch_id, safe=""))}">{ui.h(batch_id)}</a>'
    return [("batch", f"{link}, {held} of its input")]


def job_details(job: Job, now: float, *, why_waiting: str = "", trace_url: str = "", dead_letter: str = "") -> str:
    record = [
        ("state", ui.state(job.state.value) + ("" if job.done else " (live)")),
        ("model", ui.h(f"{job.model_name} {job.model_version}".strip())),
        ("priority", ui.h(job.priority.value)),
        ("attempt", ui.h(attempt_text(job))),
        ("labels", ui.text(", ".join(f"{k}={v}" for k, v in sorted(job.labels.items())) or "-")),
        *_batch_field(job),
        ("idempotency key", ui.h(job.idempotency_key or "-")),
        ("batcher", ui.h(job.batcher_id or "-")),
        # The job's OpenTelemetry trace (tracing.enabled): a link to it where console.trace_url is set.
        ("trace ID", ui.trace(job.trace_id, trace_url, sampled=job.trace_sampled)),
        ("created", ui.when(job.create_time)),
        ("started (latest attempt)", ui.when(job.start_time)),
        ("ended", ui.when(job.end_time)),
        ("updated", ui.when(job.update_time)),
        ("queued for", ui.seconds(_queued_so_far(job, now))),
        ("ran for", ui.seconds(job.run_duration_s)),
        ("deadline", ui.when(job.deadline)),
        ("execution timeout", ui.seconds(job.execution_timeout_s)),
        ("kept until", ui.when(job.expire_time)),
        ("revision", ui.h(job.revision)),
    ]
    if job.queue is not None and job.state is JobState.QUEUED:
        reason = job.queue.waiting_reason.value if job.queue.waiting_reason else "-"
        record += [
            ("queue position", ui.h(f"{job.queue.position} ahead")),
            ("waiting reason", ui.h(reason) + (f" ({ui.text(why_waiting)})" if why_waiting else "")),
            ("expected start", ui.when(job.queue.estimated_start_time)),
        ]
    for name, error in (("error", job.error), ("previous attempt's error", job.last_error)):
        if error is not None:
            record.append((name, ui.text(f"{error.code.name} {error.reason}: {error.message}")))
    if dead_letter:  # HTML: its letter's link and how to run it again (_dead_letter)
        record.append(("dead letter", dead_letter))
    if job.progress is not None:  # the latest the record keeps (every few seconds while it runs)
        done = "" if job.progress.fraction is None else f"{job.progress.fraction:.0%} "
        record.append(("progress", ui.text(f"{done}{job.progress.message}".strip() or "-")))
    if job.result_ref is not None:
        record.append(("result stored apart", ui.h(f"{job.result_ref.ref} ({job.result_ref.size_bytes} bytes)")))
    if job.input_ref is not None:
        record.append(("inputs uploaded", ui.h(f"{job.input_ref.ref} ({job.input_ref.size_bytes} bytes)")))
    parts = [ui.fields(record), _outputs(job), "<h2>Timeline</h2>", _timeline(job, now)]
    if job.batch is not None and job.batch.batch_size:  # a job that never computed has an empty one
        batch = [
            ("batcher", ui.h(job.batch.batcher_id)),
            ("jobs in the batch", ui.h(job.batch.batch_size)),
            ("compute", ui.seconds(job.batch.compute_duration_s)),
        ]
        parts += ["<h2>The batch it ran in</h2>", ui.fields(batch)]
    if job.callback is not None:
        events = ", ".join(e.value for e in job.callback.events) or "the terminal ones"
        parts.append(f"<h2>Webhook</h2><p>{ui.h(job.callback.url)} ({ui.h(events)})</p>")
        rows = [
            [
                ui.h(d.webhook_id),
                ui.h(d.event.value if d.event else "-"),
                ui.h(d.state.value if d.state else "-"),
                ui.h(d.attempts),
                ui.when(d.last_attempt_time),
                ui.h(d.last_status_code or "-"),
                ui.h(d.last_error or "-"),
                ui.when(d.next_attempt_time),
            ]
            for d in job.callback_deliveries
        ]
        headers = ("webhook id", "event", "state", "attempts", "last attempt", "status", "last error", "next attempt")
        parts.append(ui.table(headers, rows, numeric=(3,), id_="deliveries"))
    return "".join(parts)


def _outputs(job: Job) -> str:
    """The outputs kept in the record (small ones): each tensor's name, datatype, shape and first
    values; a result stored apart is only named, with what fetches it (the page never reads it)."""
    fetch = f"<code>asyncinfer get {ui.h(job.job_id)}</code> (ReadResult)"
    if job.result_ref is not None:
        return (
            f'<h2>Outputs</h2><p id="outputs">Too large to keep in the record: stored apart '
            f"({ui.h(job.result_ref.size_bytes)} bytes). {fetch} fetches them.</p>"
        )
    if not job.outputs:
        return ""
    rows = [
        [ui.h(name), ui.h(_datatype(array)), ui.h(list(array.shape)), ui.text(_first_values(array))]
        for name, array in job.outputs.items()
    ]
    table = ui.table(("output", "datatype", "shape", f"first values (at most {VALUES_SHOWN})"), rows, id_="outputs")
    if any(array.size > VALUES_SHOWN for array in job.outputs.values()):
        table += f"<p>{fetch} prints every value.</p>"
    return "<h2>Outputs</h2>" + table


def _datatype(array: npt.NDArray[Any]) -> str:
    try:
        return datatype_of(array)
    except ValueError:  # not one of the wire's: say what numpy has
        return str(array.dtype)


def _first_values(array: npt.NDArray[Any]) -> str:
    flat = np.ravel(array)
    shown = [_value(v) for v in flat[:VALUES_SHOWN]]
    more = f", … {flat.size - VALUES_SHOWN} more" if flat.size > VALUES_SHOWN else ""
    return "[" + ", ".join(shown) + more + "]"


def _value(value: Any) -> str:
    if isinstance(value, bytes | str):
        cut = value[:BYTES_SHOWN]
        return repr(cut) + ("…" if len(value) > BYTES_SHOWN else "")
    if isinstance(value, np.floating):
        return f"{float(value):.6g}"
    return str(value.item() if isinstance(value, np.generic) else value)


def _queued_so_far(job: Job, now: float) -> float | None:
    """Its queue time; while it waits, the time so far; for one that ended without starting
    (cancelled or expired in the queue), the time it waited (its record has no queue duration)."""
    if job.queue_duration_s is not None or job.create_time is None:
        return job.queue_duration_s
    if job.state is JobState.QUEUED:
        return max(now - job.create_time.timestamp(), 0.0)
    if job.start_time is None and job.end_time is not None:
        return max(job.end_time.timestamp() - job.create_time.timestamp(), 0.0)
    return None


def _timeline(job: Job, now: float) -> str:
    """Queued from creation to the latest start (earlier attempts and their backoffs included),
    running from that start to the end, or to now while it lasts."""
    if job.create_time is None:
        return "<p>-</p>"
    created = job.create_time.timestamp()
    end = job.end_time.timestamp() if job.end_time else now
    bars: list[tuple[str, float, float, str]] = []
    started = job.start_time.timestamp() if job.start_time else None
    bars.append(("queued", 0.0, (started if started is not None else end) - created, TIMELINE_COLORS["queued"]))
    if started is not None and job.state is not JobState.QUEUED:
        color = END_COLORS.get(job.state, TIMELINE_COLORS["running"]) if job.done else TIMELINE_COLORS["running"]
        bars.append(("running" if not job.done else job.state.value.lower(), started - created, end - created, color))
    return ui.timeline(bars, total_s=max(end - created, 0.0))
