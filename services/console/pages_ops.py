"""The OpsService pages: the queues (live, with their throughput and depth over the last minutes)
and the dead letters (inspect; replay, purge, pause and resume when the console may act)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from asyncinfer.client.errors import AsyncInferClientError, NotFoundError
from asyncinfer.commands.ops import attempts_text
from asyncinfer.jobs import BATCH_LABEL, CHUNK_LABEL
from services.console import html as ui
from services.console.backend import ModelQueues
from services.console.context import Context, count_param, fragment_or_page, live_page, status_of

# A stream sequence is a uint64; past this it is no sequence a dead letter has.
MAX_SEQUENCE = 2**63 - 1


async def queues_page(ctx: Context, request: web.Request) -> web.Response:
    try:
        queues = await ctx.backend.queues()
    except AsyncInferClientError as error:
        return fragment_or_page(request, "Queues", ui.error_box(error), status=status_of(error))
    body = _queues(ctx, queues)
    every = max(int(ctx.stats_interval_s * 1000), 500)
    return live_page(request, "Queues", body, element_id="queues", refresh="/queues", every_ms=every)


def _schedulers(q: ModelQueues) -> str:
    """How many schedulers report the model and drain ("-": a scheduler of a release before)."""
    if not q.schedulers:
        return "-"
    return f"{q.schedulers} ({q.draining_schedulers} draining)" if q.draining_schedulers else str(q.schedulers)


def _queues(ctx: Context, queues: list[ModelQueues]) -> str:
    models = []
    for q in queues:
        oldest = max((p.oldest_age_s for p in q.priorities), default=0.0)
        actions = ""
        if ctx.writable:
            paused = q.state == "paused"
            verb = "resume" if paused else "pause"
            actions = ui.post_button(f"/queues/{verb}", verb, ctx.csrf, {"model": q.model_name})
        models.append(
            [
                ui.h(q.model_name),
                ui.h(q.state),
                ui.h(q.depth),
                ui.seconds(oldest) if q.depth else "-",
                ui.h(q.in_flight),
                ui.h(f"{q.submitted_per_second:.1f}"),
                ui.h(f"{q.completed_per_second:.1f}"),
                ui.h(q.connected_batchers),
                ui.h(q.free_credits),
                ui.h(q.desired_batchers),
                ui.h(_schedulers(q)),
                actions,
            ]
        )
    headers = (
        "model",
        "state",
        "queued",
        "oldest",
        "in flight",
        "submitted/s",
        "completed/s",
        "batchers",
        "free capacity",
        "desired batchers",
        "schedulers",
        "",
    )
    per_priority = [
        [ui.h(q.model_name), ui.h(p.priority), ui.h(p.depth), ui.seconds(p.oldest_age_s) if p.depth else "-"]
        for q in queues
        for p in q.priorities
    ]
    history = ctx.history
    now = time.time()
    depth = {m: [(s.at, float(s.depth)) for s in samples] for m, samples in history.models.items()}
    done = {m: [(s.at, s.completed_per_second) for s in samples] for m, samples in history.models.items()}
    # The answer this page was drawn from ends each series (drawn, not kept: the sampler keeps its
    # own). The plots drew the sampler's samples alone, taken on a clock of their own: a burst the
    # table showed reached the plot only at the sampler's next round, up to stats_interval_s later
    # (2 s; measured 0.6 to 2.0 s), and a page refreshed just before it drew the plot one refresh
    # behind its own table.
    for q in queues:
        depth.setdefault(q.model_name, []).append((now, float(q.depth)))
        done.setdefault(q.model_name, []).append((now, q.completed_per_second))
    # The span grows with the samples, from a minute up to the history kept.
    oldest = min((samples[0].at for samples in history.models.values() if samples), default=now)
    span_s = min(history.keep_s, max(60.0, now - oldest))
    charts = (
        '<div class="charts">'
        + ui.line_chart("completed jobs per second", done, now=now, span_s=span_s, unit="jobs/s")
        + ui.line_chart("queued jobs", depth, now=now, span_s=span_s, unit="jobs")
        + "".join(
            ui.bar_chart(
                f"{q.model_name}: batch sizes, last minute",
                [(str(size), float(batches)) for size, batches, _ in q.batch_sizes],
                unit="batches",
                x_label="jobs per batch",
            )
            for q in queues
        )
        + "</div>"
    )
    stale = ui.error_box(f"sampling failed: {history.error}") if history.error else ""
    sampled = ui.when(datetime.fromtimestamp(now, UTC), clock=True)
    return (
        ui.table(headers, models, numeric=range(2, 10), id_="queue-models")
        + "<h2>Per priority</h2>"
        + ui.table(("model", "priority", "queued", "oldest"), per_priority, numeric=(2, 3), id_="queue-priorities")
        + f"<h2>The last minutes</h2>{stale}{charts}<p>as of {sampled}</p>"
    )


async def dead_letters_page(ctx: Context, request: web.Request) -> web.Response:
    model, token = request.query.get("model", ""), request.query.get("page_token", "")
    try:
        found = await ctx.backend.dead_letters(model=model, page_token=token)
    except AsyncInferClientError as error:
        box = _dead_letter_filter(model) + ui.error_box(error)  # the filter stays, to correct it
        if token:
            box += ui.first_page(ui.url("/dead-letters", model=model), error)
        return fragment_or_page(request, "Dead letters", box, status=status_of(error))
    rows = []
    for letter in found.letters:
        last = letter["last_error"]
        rows.append(
            [
                f'<a href="/dead-letters/{ui.h(letter["sequence"])}">{ui.h(letter["sequence"])}</a>',
                _job_link(ctx, letter),
                ui.h(letter["tenant"]),
                ui.h(letter["model_name"]),
                ui.h(letter["reason"]),
                ui.h(attempts_text(letter)),
                ui.h(f"{last['code']} {last['reason']}: {last['message']}" if last else "-"),
                _dead_since(letter),
            ]
        )
    headers = ("sequence", "job", "tenant", "model", "reason", "attempts", "last error", "dead since")
    total = f"{found.total} in all" if found.total is not None else ""
    scope = f" of {model}" if model else ""
    actions = ""
    if ctx.writable and found.letters:
        every = {"all": "true", "model": model}
        actions = (
            ui.post_button(
                "/dead-letters/replay",
                f"replay every dead letter{scope}",
                ctx.csrf,
                every,
                confirm=f"Run every dead letter{scope} again, every tenant's (a file batch's chunks are skipped)?",
            )
            + " "
            + ui.post_button(
                "/dead-letters/purge",
                f"purge every dead letter{scope}",
                ctx.csrf,
                every,
                confirm=f"Delete every dead letter{scope}? This cannot be undone.",
            )
        )
    links = []
    if token:
        links.append(f'<a href="{ui.h(ui.url("/dead-letters", model=model))}">first page</a>')
    if found.next_page_token:
        links.append(
            f'<a id="next-page" href="{ui.h(ui.url("/dead-letters", model=model, page_token=found.next_page_token))}">'
            "next page</a>"
        )
    more = " · ".join(links)
    body = (
        _dead_letter_filter(model)
        + f"<p>{ui.h(total)}</p>"
        + ui.table(
            headers,
            rows,
            numeric=(0, 5),
            id_="dead-letters",
            empty=(
                f"no dead letters{scope}: a job that failed on its last attempt lands here, to inspect, replay or purge"
            ),
        )
        + more
        + f"<p>{actions}</p>"
    )
    return fragment_or_page(request, "Dead letters", body)


def _job_link(ctx: Context, letter: dict[str, Any]) -> str:
    """The job's page, where this console's tenant key reaches it; another tenant's job is named,
    not linked (its page would say NOT_FOUND, as if the job were gone)."""
    job_id = ui.h(letter["job_id"])
    if letter["tenant"] != ctx.tenant:
        return f'{job_id} <span class="muted">(tenant {ui.h(letter["tenant"])}: not this console\'s)</span>'
    return f'<a href="/jobs/{job_id}">{job_id}</a>'


def _batch_of(letter: dict[str, Any]) -> str | None:
    """The file batch whose chunk job this was (its failures went to the batch's error file)."""
    labels = letter.get("original_request", {}).get("labels", {})
    return labels.get(BATCH_LABEL) if CHUNK_LABEL in labels else None


def _dead_since(letter: dict[str, Any]) -> str:
    """When it died, as every page shows a time."""
    dead = letter["dead_time"]
    return ui.when(datetime.fromisoformat(dead)) if dead else "-"


def _dead_letter_filter(model: str) -> str:
    return (
        f'<form method="get" action="/dead-letters">model <input name="model" value="{ui.h(model)}"> '
        f'<button type="submit">filter</button></form>'
    )


async def dead_letter_page(ctx: Context, request: web.Request) -> web.Response:
    raw = request.match_info["sequence"]
    title = f"Dead letter {raw}"
    sequence = count_param(raw, default=0, most=MAX_SEQUENCE)
    if not sequence:
        return fragment_or_page(request, title, ui.error_box("a dead letter's sequence is a number"), status=404)
    try:
        letter = await ctx.backend.dead_letter(sequence)
    except NotFoundError as error:
        return fragment_or_page(request, title, ui.error_box(error), status=404)
    except AsyncInferClientError as error:
        return fragment_or_page(request, title, ui.error_box(error), status=status_of(error))
    last = letter["last_error"]
    batch_id = _batch_of(letter)
    record = [
        ("job", _job_link(ctx, letter)),
        ("tenant", ui.h(letter["tenant"])),
        ("model", ui.h(letter["model_name"])),
        ("reason", ui.h(letter["reason"])),
        ("attempts", ui.h(attempts_text(letter))),
        ("last error", ui.h(f"{last['code']} {last['reason']}: {last['message']}" if last else "-")),
        ("dead since", _dead_since(letter)),
    ]
    request_json = json.dumps(letter.get("original_request", {}), indent=2, ensure_ascii=False)
    if batch_id is not None:
        record.insert(1, ("file batch", f'<a href="/batches/{ui.h(batch_id)}">{ui.h(batch_id)}</a>'))
    actions = ""
    if ctx.writable:
        one = {"sequence": str(letter["sequence"])}
        # A chunk's records are in its batch's error file: it is not run again (BATCH_CHUNK_NOT_REPLAYABLE).
        replay = "" if batch_id is not None else ui.post_button("/dead-letters/replay", "replay", ctx.csrf, one) + " "
        actions = replay + ui.post_button(
            "/dead-letters/purge", "purge", ctx.csrf, one, confirm="Delete this dead letter?"
        )
    else:
        actions = f'<span class="note">read-only: {ui.h(ctx.read_only_because)}</span>'
    if batch_id is not None:
        actions = (
            '<p class="note">A chunk of a file batch: its failed records are in the batch\'s error file (make a '
            "new batch of them to run them again); it is not replayed.</p>" + actions
        )
    body = ui.fields(record) + f"<h2>The original request</h2><pre>{ui.h(request_json)}</pre><p>{actions}</p>"
    return fragment_or_page(request, title, body)


async def dead_letter_action(ctx: Context, request: web.Request) -> web.Response:
    form = {k: str(v) for k, v in (await request.post()).items()}
    refused = ctx.check_form(form)
    if refused is not None:
        return refused
    given = [count_param(s.strip(), default=0, most=MAX_SEQUENCE) for s in form.get("sequence", "").split(",")]
    sequences = [s for s in given if s]
    every, model = form.get("all") == "true", form.get("model", "")
    try:
        if request.match_info["action"] == "replay":
            said = await ctx.backend.replay(sequences, every=every, model=model)
        else:
            said = await ctx.backend.purge(sequences, every=every, model=model)
    except AsyncInferClientError as error:
        said = f"refused: {error}"
    raise web.HTTPSeeOther(ctx.outcome("/dead-letters", said, model=model))  # back to the view it came from


async def queue_action(ctx: Context, request: web.Request) -> web.Response:
    form = {k: str(v) for k, v in (await request.post()).items()}
    refused = ctx.check_form(form)
    if refused is not None:
        return refused
    try:
        said = await ctx.backend.pause(form.get("model", ""), paused=request.match_info["action"] == "pause")
    except AsyncInferClientError as error:
        said = f"refused: {error}"
    raise web.HTTPSeeOther(ctx.outcome("/queues", said))
