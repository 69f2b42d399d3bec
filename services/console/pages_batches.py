"""The BatchService pages: the tenant's batches (newest first, paged, live on the first page), one
batch's page (everything GetBatch gives, its progress live while it runs, a cancel button when the
console may act) and its output and error files streamed to the browser as downloads."""

from __future__ import annotations

import re
from urllib.parse import quote

from aiohttp import web

from asyncinfer.client import Batch
from asyncinfer.client.errors import AsyncInferClientError, NotFoundError
from asyncinfer.jobs import BATCH_LABEL
from services.console import html as ui
from services.console.context import Context, fragment_or_page, live_page, status_of

PAGE_SIZE = 20
# Batch IDs are UUIDv7s; anything else is not one (and must not reach a header or a file name).
BATCH_ID = re.compile(r"^[0-9a-fA-F-]{1,64}$")
# The files a batch's page offers: name in the URL -> (file name's stem and extension, content type).
FILE_NAMES = {
    "output": ("output.jsonl", "application/jsonl"),
    "errors": ("errors.jsonl", "application/jsonl"),
    "npz": ("output.npz", "application/octet-stream"),
}


async def batches_page(ctx: Context, request: web.Request) -> web.Response:
    token = request.query.get("page_token", "")
    whose = f"Tenant {ui.h(ctx.tenant)}'s batches" if ctx.tenant else "The batches the console's key reaches"
    intro = f"<p>{whose}, newest first.</p>"
    try:
        found = await ctx.backend.list_batches(page_size=PAGE_SIZE, page_token=token)
    except AsyncInferClientError as error:
        body = intro + ui.error_box(error) + (ui.first_page("/batches", error) if token else "")
        return fragment_or_page(request, "Batches", body, status=status_of(error))
    headers: tuple[str, ...] = (
        "batch",
        "state",
        "model",
        "done",
        "failed",
        "total",
        "progress",
        "records/s",
        "created",
        "finish",
    )
    # A trace column (each batch's CreateBatch trace) once a batch on the page is traced.
    traced = any(b.trace_id for b in found.batches)
    headers += ("trace",) if traced else ()
    rows = [_batch_row(b, trace_url=ctx.trace_url if traced else None) for b in found.batches]
    empty = (
        "no more batches"
        if token
        else "no batches yet: the batches created (asyncinfer batch create, the SDK) show here"
    )
    listing = ui.table(headers, rows, numeric=(3, 4, 5, 7), id_="batches", empty=empty)
    links = []
    if token:
        links.append('<a href="/batches">first page</a>')
    if found.next_page_token:
        more = ui.url("/batches", page_token=found.next_page_token)
        links.append(f'<a id="next-page" href="{ui.h(more)}">next page</a>')
    body = listing + " · ".join(links)
    # The first page follows new batches and their progress; later pages stay put.
    refresh = None if token else "/batches"
    return live_page(request, "Batches", body, element_id="batches-live", refresh=refresh, every_ms=2000, above=intro)


def _batch_row(batch: Batch, *, trace_url: str | None = None) -> list[str]:
    """A batch's row; with its trace column unless `trace_url` is None (console.trace_url, or "")."""
    row = [
        f'<a href="/batches/{ui.h(batch.batch_id)}">{ui.h(batch.batch_id)}</a>',
        ui.state(batch.state),
        ui.h(batch.model_name),
        ui.h(batch.completed),
        ui.h(batch.failed),
        ui.h(batch.total or "-"),
        ui.progress(batch.completed, batch.failed, batch.total),
        _rate(batch),
        ui.when(batch.create_time),
        _finish(batch),
    ]
    return (
        row
        if trace_url is None
        else [*row, ui.trace(batch.trace_id, trace_url, short=True, sampled=batch.trace_sampled)]
    )


def _rate(batch: Batch) -> str:
    return ui.h(f"{batch.records_per_second:.1f}") if batch.records_per_second else "-"


def _reading(batch: Batch) -> str:
    """A VALIDATING batch's reading of its input, as the gateway last reported it."""
    read = batch.read_progress
    if read is None:
        return "-"
    from rich.filesize import decimal

    share = f" ({100 * read.bytes_read // read.bytes_total}%)" if read.bytes_total else ""
    text = ui.h(
        f"{decimal(read.bytes_read)} of {decimal(read.bytes_total)}{share}, {read.records_read} records, "
        f"{read.records_per_second:.0f} records/s"
    )
    return text + (", ends ~" + ui.when(read.estimated_end_time) if read.estimated_end_time is not None else "")


def _finish(batch: Batch) -> str:
    """When it ended, or when it should at its rate (`~` marks the estimate)."""
    if batch.end_time is not None:
        return "ended " + ui.when(batch.end_time)
    if batch.estimated_finish_time is not None:
        return "~" + ui.when(batch.estimated_finish_time)
    return "-"


async def batch_page(ctx: Context, request: web.Request) -> web.Response:
    batch_id = request.match_info["batch_id"]
    title = f"Batch {batch_id}"
    try:
        batch = await ctx.backend.batch(batch_id)
    except NotFoundError as error:
        return fragment_or_page(request, title, ui.error_box(error), status=404, final=True)
    except AsyncInferClientError as error:
        return fragment_or_page(request, title, ui.error_box(error), status=status_of(error))
    body = batch_details(ctx, batch)
    refresh = None if batch.done else f"/batches/{batch_id}"
    return live_page(request, title, body, element_id="batch", refresh=refresh, final=batch.done)


def _not_run(batch: Batch) -> str:
    """A cancelled or expired batch's records that never ran: neither done nor failed (OpenAI's
    counts), the rest of its total."""
    return f", {batch.not_run} not run" if batch.not_run else ""


def batch_details(ctx: Context, batch: Batch) -> str:
    labels = ", ".join(f"{k}={v}" for k, v in sorted(batch.labels.items()))
    record = [
        ("state", ui.state(batch.state) + ("" if batch.done else " (live)")),
        (
            "progress",
            ui.progress(batch.completed, batch.failed, batch.total)
            + ui.h(f" {batch.completed} done, {batch.failed} failed{_not_run(batch)} of {batch.total or '?'}"),
        ),
        ("records/s", _rate(batch)),
        *([("input read", _reading(batch))] if batch.read_progress is not None else []),
        ("chunks", _chunks(batch)),
        ("model", ui.h(f"{batch.model_name} {batch.model_version}".strip())),
        ("priority", ui.h(batch.priority or "-")),
        ("max attempts per chunk", ui.h(batch.max_attempts or "the model's default")),
        ("labels", ui.h(labels or "-")),
        ("idempotency key", ui.h(batch.idempotency_key or "-")),
        ("input", ui.h(f"{batch.input_ref} ({batch.input_format or 'format from the content'})")),
        ("output file", ui.h(batch.output_ref or "-")),
        ("error file", ui.h(batch.error_ref or "-")),
        ("webhook", ui.h(batch.callback_url or "-")),
        # Its CreateBatch's OpenTelemetry trace (tracing.enabled); each chunk job's trace links to it.
        ("trace ID", ui.trace(batch.trace_id, ctx.trace_url, sampled=batch.trace_sampled)),
        ("created", ui.when(batch.create_time)),
        ("in progress since", ui.when(batch.in_progress_time)),
        ("finalizing since", ui.when(batch.finalizing_time)),
        ("ended", ui.when(batch.end_time)),
        ("estimated finish", ui.when(batch.estimated_finish_time) if not batch.done else "-"),
        ("expires (completion window)", ui.when(batch.expires_at)),
    ]
    if batch.failure_message:
        record.append(("failure", ui.text(batch.failure_message)))
    parts = [ui.fields(record)]
    if batch.done and (batch.output_ref or batch.error_ref):
        downloads = [
            f'<a id="download-{name}" href="/batches/{ui.h(batch.batch_id)}/files/{name}" download>{label}</a>'
            for name, label, ref in (
                ("output", "output file (JSONL)", batch.output_ref),
                # A batch over an array file also gives its outputs as arrays (numpy.load).
                ("npz", "outputs as arrays (NPZ)", batch.output_ref if batch.input_format in ("NPY", "NPZ") else ""),
                ("errors", "error file (JSONL)", batch.error_ref),
            )
            if ref
        ]
        parts.append("<h2>Files</h2><p>" + " · ".join(downloads) + "</p>")
    if batch.first_errors:
        rows = [
            [ui.h(e.line), ui.text(e.custom_id or "-"), ui.h(e.code), ui.text(e.message)] for e in batch.first_errors
        ]
        parts += ["<h2>First errors</h2>", ui.table(("line", "custom id", "code", "message"), rows, id_="errors")]
    if not batch.done and batch.state != "CANCELLING":
        if ctx.writable:
            action = f"/batches/{batch.batch_id}/cancel"
            ask = "Cancel this batch? What finished is kept; the rest ends in the error file."
            parts.append("<p>" + ui.post_button(action, "cancel batch", ctx.csrf, confirm=ask) + "</p>")
        else:
            parts.append('<p class="note">read-only: cancelling needs a console that may act</p>')
    return "".join(parts)


def _chunks(batch: Batch) -> str:
    """How far its chunk jobs are: none before its plan is made, nor for a batch that failed before
    any ran (it said 0 of 0 ended)."""
    if not batch.chunks_total:
        return "-"
    return ui.h(f"{batch.chunks_done} of {batch.chunks_total} ended") + _chunk_jobs_link(batch)


def _chunk_jobs_link(batch: Batch) -> str:
    """Its chunk jobs on the jobs page: the list leaves them out unless asked for by the batch's
    label, which no page offered."""
    if not batch.chunks_total:
        return ""
    href = ui.url("/jobs", label=f"{BATCH_LABEL}={batch.batch_id}")
    return f' · <a id="chunk-jobs" href="{ui.h(href)}">their jobs</a>'


async def batch_cancel(ctx: Context, request: web.Request) -> web.Response:
    form = {k: str(v) for k, v in (await request.post()).items()}
    refused = ctx.check_form(form)
    if refused is not None:
        return refused
    batch_id = request.match_info["batch_id"]
    try:
        batch = await ctx.backend.cancel_batch(batch_id)
        said = f"cancelling: {batch.state}"
    except AsyncInferClientError as error:
        said = f"refused: {error}"
    raise web.HTTPSeeOther(ctx.outcome(f"/batches/{quote(batch_id)}", said))


async def batch_file(ctx: Context, request: web.Request) -> web.StreamResponse:
    """The file as the gateway streams it, piece by piece: memory stays one piece whatever the size.
    The first piece is read before the answer starts, so a refusal is still an error page."""
    batch_id, which = request.match_info["batch_id"], request.match_info["file"]
    title = f"Batch {batch_id}"
    if not BATCH_ID.match(batch_id):
        return fragment_or_page(request, title, ui.error_box("not a batch ID"), status=404)
    pieces = ctx.backend.batch_file(batch_id, which)
    try:
        first = await anext(pieces, b"")
    except NotFoundError as error:
        return fragment_or_page(request, title, ui.error_box(error), status=404)
    except AsyncInferClientError as error:
        return fragment_or_page(request, title, ui.error_box(error), status=status_of(error))
    file_name, content_type = FILE_NAMES[which]
    response = web.StreamResponse(
        headers={
            "Content-Type": content_type,
            "Content-Disposition": f'attachment; filename="batch-{batch_id}-{file_name}"',
            # Stricter than a page's (nothing of it runs); the console adds the other security headers.
            "Content-Security-Policy": "default-src 'none'",
        }
    )
    await response.prepare(request)
    try:
        await response.write(first)
        async for piece in pieces:
            await response.write(piece)
    except AsyncInferClientError:
        # Headers are gone already: cutting the connection short is how the browser hears of it
        # (the download shows as failed rather than as a complete, truncated file).
        if request.transport is not None:
            request.transport.close()
        return response
    finally:
        await pieces.aclose()
    await response.write_eof()
    return response
