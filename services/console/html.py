"""HTML for the console, written in Python (no template engine, nothing to download): the page
frame, tables, forms, and the plots as inline SVG. Every value that comes from the stack goes
through `h` (html.escape); functions here return HTML, so their results are not escaped again.

The page's one script (allowed by its hash in the Content-Security-Policy, `SCRIPT_HASH`) refreshes each element with `data-refresh` (a URL returning that element's
new inner HTML) every `data-every` milliseconds; an answer with `X-Console-Final: 1` ends it (a
job that reached its end). An answer the same as the one shown, or one that comes while the reader
selects text in the element, is not swapped in (a selected job ID was lost at every refresh); a
failed one leaves what is shown under a banner that says since when (the reader's local time, as
every time on the pages: `when`) and why (a page whose gateway had gone kept its
last numbers and said nothing). It also asks before a form with `data-confirm` is sent."""

from __future__ import annotations

import base64
import hashlib
import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from urllib.parse import urlencode

from asyncinfer.client.errors import AsyncInferClientError
from asyncinfer.config import TRACE_ID_PLACEHOLDER
from asyncinfer.duration_text import duration_text

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:8px 20px;display:flex;flex-wrap:wrap;gap:6px 18px;align-items:center}
header a{color:#cfd8e8;text-decoration:none}header a:hover{color:#fff}header b{margin-right:12px}
main{padding:16px 20px;max-width:1200px}h1{font-size:20px;margin:4px 0 12px}h2{font-size:16px;margin:18px 0 8px}
table{border-collapse:collapse;background:#fff;margin-bottom:12px}
th,td{border:1px solid #dde1e8;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5}.scroll{overflow-x:auto;max-width:100%}
.long{display:inline-block;min-width:8em;max-width:40em;overflow-wrap:anywhere}
.trace.short{display:inline-block;max-width:9ch;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;
vertical-align:bottom;font-family:ui-monospace,monospace}
td.n{text-align:right;font-variant-numeric:tabular-nums}td.empty{color:#5f6368}
.state{font-weight:600}.SUCCEEDED{color:#137333}.FAILED,.TIMED_OUT{color:#b3261e}.RUNNING{color:#0b57d0}
.QUEUED{color:#8a5a00}.CANCELED,.CANCELLING,.EXPIRED{color:#5f6368}
.COMPLETED{color:#137333}.IN_PROGRESS{color:#0b57d0}.VALIDATING,.FINALIZING{color:#8a5a00}.CANCELLED{color:#5f6368}
.progress{display:inline-flex;width:160px;height:12px;background:#e3e7ee;border-radius:6px;overflow:hidden;
vertical-align:middle}.progress .ok{background:#137333}.progress .bad{background:#b3261e}
.note{background:#e8f0fe;border:1px solid #b6ccf5;padding:6px 10px;margin:8px 0}.muted{color:#5f6368}
.error{background:#fce8e6;border:1px solid #f3b6b0;padding:6px 10px;margin:8px 0;white-space:pre-line}
form.inline{display:inline}button{cursor:pointer}pre{background:#fff;border:1px solid #dde1e8;padding:8px}
.charts{display:flex;flex-wrap:wrap;gap:16px}svg{background:#fff;border:1px solid #dde1e8;max-width:100%;height:auto}
figure.chart{margin:0;max-width:520px}.legend{font-size:12px;display:flex;flex-wrap:wrap;gap:2px 12px}
"""

SCRIPT = """
const two = (n) => String(n).padStart(2, '0');
const clock = (d) => two(d.getHours()) + ':' + two(d.getMinutes()) + ':' + two(d.getSeconds());
const day = (d) => d.getFullYear() + '-' + two(d.getMonth() + 1) + '-' + two(d.getDate());
const localize = (root) => {
  for (const t of root.querySelectorAll('time[datetime]')) {
    const d = new Date(t.dateTime);
    t.textContent = 'clock' in t.dataset ? clock(d) : day(d) + ' ' + clock(d);
  }
};
localize(document);
for (const el of document.querySelectorAll('[data-refresh]')) {
  const every = Number(el.dataset.every || 2000);
  const banner = document.createElement('div');
  banner.className = 'error';
  banner.hidden = true;
  banner.dataset.stale = '';
  el.before(banner);
  let shown = el.innerHTML, since = null;
  const stale = (why) => {
    since = since || new Date();
    banner.textContent = 'Not updated since ' + clock(since) + ': ' + why;
    banner.title = since.toISOString();
    banner.hidden = false;
  };
  const tick = async () => {
    try {
      const r = await fetch(el.dataset.refresh, {headers: {'X-Console-Fragment': '1'}});
      const text = await r.text();
      if (r.ok) {
        since = null;
        banner.hidden = true;
        const sel = document.getSelection();
        const selecting = sel && !sel.isCollapsed && el.contains(sel.anchorNode);
        if (text !== shown && !selecting) { el.innerHTML = text; shown = text; localize(el); }
        el.dataset.refreshed = String(Date.now());
      } else {
        const doc = new DOMParser().parseFromString(text, 'text/html');
        const said = (doc.querySelector('.error') || doc.body).textContent.trim();
        stale(said || 'the console answered ' + r.status);
      }
      if (r.headers.get('X-Console-Final') === '1') return;
    } catch (e) { stale('the console does not answer'); }
    setTimeout(tick, every);
  };
  setTimeout(tick, every);
}
document.addEventListener('submit', (event) => {
  const ask = event.target.dataset && event.target.dataset.confirm;
  if (ask && !window.confirm(ask)) event.preventDefault();
});
"""

SCRIPT_HASH = "sha256-" + base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
COLORS = ("#0b57d0", "#e8710a", "#137333", "#b3261e", "#7b1fa2", "#00838f", "#5f6368")
NAV = (
    ("/queues", "Queues"),
    ("/jobs", "Jobs"),
    ("/batches", "Batches"),
    ("/dead-letters", "Dead letters"),
    ("/models", "Models"),
    ("/tls", "TLS"),
)


def h(value: object) -> str:
    return html.escape(str(value), quote=True)


def url(path: str, **query: str) -> str:
    kept = {k: v for k, v in query.items() if v}
    return path + ("?" + urlencode(kept) if kept else "")


def page(title: str, body: str, *, message: str = "") -> str:
    nav = "".join(f'<a href="{href}">{h(name)}</a>' for href, name in NAV)
    note = f'<div class="note" id="message">{h(message)}</div>' if message else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{h(title)} · asyncinfer</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        f"<style>{STYLE}</style></head>"
        f"<body><header><b>asyncinfer console</b>{nav}</header><main><h1>{h(title)}</h1>{note}{body}</main>"
        f"<script>{SCRIPT}</script></body></html>"
    )


def text(value: object) -> str:
    """A caller's free text (labels, a cancel reason, an error message): escaped, isolated from
    the text around it (a right-to-left override inside reversed the rest of its cell), and
    wrapped anywhere past 40em (one 256-byte label made the jobs table 4,317 px wide)."""
    return f'<bdi class="long">{h(value)}</bdi>'


TRACE_ID = re.compile(r"[0-9a-f]{32}")


def trace(trace_id: str, url_template: str, *, short: bool = False, sampled: bool = True) -> str:
    """An OpenTelemetry trace ID: a link to it in the trace viewer when `url_template`
    (console.trace_url, checked at start-up: http or https, with {trace_id}) is set and the trace
    was `sampled`, else text; "-" when there is none (tracing off). A trace not sampled
    (tracing.sample_ratio below 1, or the caller's traceparent said so) has no spans in any viewer:
    its link led to an empty search, so it is text, "not sampled" in its tooltip (and, on a page,
    beside it). Only 32 hex digits go into a link; the whole href is escaped as an attribute (a
    Grafana template's quotes and ampersands stay what they were). `short`, for a list's column:
    its first digits on screen, the whole ID in the text (selected and copied whole) and in the
    tooltip."""
    if not trace_id:
        return "-"
    title = h(trace_id) if sampled else h(f"{trace_id} (not sampled: no trace to show)")
    shown = f' class="trace short" title="{title}"' if short else ' class="trace"'
    if not sampled:
        return (
            f"<span{shown}>{h(trace_id)}</span>" if short else f'{h(trace_id)} <span class="note">(not sampled)</span>'
        )
    if not url_template or not TRACE_ID.fullmatch(trace_id):
        return f"<span{shown}>{h(trace_id)}</span>" if short else h(trace_id)
    href = url_template.replace(TRACE_ID_PLACEHOLDER, trace_id)
    # A new tab, told nothing of the console (no window.opener; no Referer, as the page's policy says).
    return f'<a{shown} href="{h(href)}" target="_blank" rel="noopener noreferrer">{h(trace_id)}</a>'


def error_box(error: object) -> str:
    """An error as text, its lines kept (an SDK error's field violations and hint follow its
    message on lines of their own, which ran into it as one line)."""
    return f'<div class="error">{h(error)}</div>'


def first_page(href: str, error: AsyncInferClientError) -> str:
    """After a list's refusal of a page token (an edited link, or one a gateway of another make
    gave): the way back to the list's first page, which the refusal alone did not offer."""
    if error.code.name != "INVALID_ARGUMENT":
        return ""
    return f'<p><a id="first-page" href="{h(href)}">the first page</a> of this list</p>'


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    numeric: Iterable[int] = (),
    id_: str = "",
    empty: str = "none",
) -> str:
    """`rows` hold HTML already (escape the cells with `h`); columns in `numeric` align right;
    `empty` (text) the one row of a table with none."""
    right = set(numeric)
    head = "".join(f"<th>{h(name)}</th>" for name in headers)
    body = "".join(
        "<tr>" + "".join(f"<td{' class=n' if i in right else ''}>{cell}</td>" for i, cell in enumerate(row)) + "</tr>"
        for row in rows
    )
    if not body:
        body = f'<tr><td colspan="{len(headers)}" class="empty">{h(empty)}</td></tr>'
    ident = f' id="{h(id_)}"' if id_ else ""
    # In a box that scrolls sideways: a wide table on a phone scrolls, not the page.
    return f'<div class="scroll"><table{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def fields(pairs: Iterable[tuple[str, str]]) -> str:
    """A two-column table of name, HTML value."""
    return table(("field", "value"), ([h(name), value] for name, value in pairs))


def state(name: str) -> str:
    return f'<span class="state {h(name)}">{h(name)}</span>'


def post_button(action: str, label: str, csrf: str, hidden: Mapping[str, str] | None = None, confirm: str = "") -> str:
    inputs = "".join(f'<input type="hidden" name="{h(k)}" value="{h(v)}">' for k, v in (hidden or {}).items())
    ask = f' data-confirm="{h(confirm)}"' if confirm else ""
    return (
        f'<form class="inline" method="post" action="{h(action)}"{ask}><input type="hidden" name="csrf" '
        f'value="{h(csrf)}">{inputs}<button type="submit">{h(label)}</button></form>'
    )


def progress(completed: int, failed: int, total: int) -> str:
    """A bar of the records done (green) and failed (red) out of `total`, and its percent."""
    share = (completed + failed) / total if total else 0.0
    ok, bad = (100 * completed / total, 100 * failed / total) if total else (0.0, 0.0)
    return (
        f'<span style="white-space:nowrap"><span class="progress" role="progressbar" aria-valuenow="{share * 100:.0f}" aria-valuemin="0" '
        f'aria-valuemax="100"><span class="ok" style="width:{ok:.1f}%"></span>'
        f'<span class="bad" style="width:{bad:.1f}%"></span></span> {share * 100:.0f}%</span>'
    )


def when(moment: datetime | None, *, clock: bool = False) -> str:
    """A time as the CLI shows one: the reader's local time, to the second (the page's script
    writes it from `datetime`), the UTC instant to the millisecond in its tooltip. The page said UTC
    to the millisecond and the CLI local time to the second: the same job's times read differently.
    UTC, labelled, where the script does not run. `clock`: the time of day alone."""
    if moment is None:
        return "-"
    at = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    instant = at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"
    shown = at.strftime("%H:%M:%S" if clock else "%Y-%m-%d %H:%M:%S") + " UTC"
    machine = at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    mark = " data-clock" if clock else ""
    return f'<time datetime="{h(machine)}" title="{h(instant)}"{mark}>{h(shown)}</time>'


def seconds(value: float | None) -> str:
    """A duration as the CLI writes one too (asyncinfer.duration_text)."""
    return h(duration_text(value))


# -- plots -------------------------------------------------------------------------------------


def line_chart(
    title: str, series: Mapping[str, Sequence[tuple[float, float]]], *, now: float, span_s: float, unit: str
) -> str:
    """One polyline per series over the last `span_s` seconds; y from 0 to the largest value."""
    width, height, left, bottom, top = 520, 200, 44, 22, 26
    plot_w, plot_h = width - left - 10, height - top - bottom
    peak = max((v for points in series.values() for _, v in points), default=0.0)
    y_max = _nice(peak)
    parts = [
        f'<svg role="img" aria-label="{h(title)}" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f'<text x="{left}" y="16" font-size="13" font-weight="600">{h(title)}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#999"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#999"/>',
        f'<text x="{left - 4}" y="{top + 4}" font-size="11" text-anchor="end">{h(_short(y_max))}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" font-size="11" text-anchor="end">0</text>',
        f'<text x="{left}" y="{height - 6}" font-size="11">-{h(round(span_s / 60))} min</text>',
        f'<text x="{left + plot_w}" y="{height - 6}" font-size="11" text-anchor="end">now ({h(unit)})</text>',
    ]
    legend = []
    for index, (name, points) in enumerate(sorted(series.items())):
        color = COLORS[index % len(COLORS)]
        coords = " ".join(
            f"{left + plot_w * (1 - min(now - t, span_s) / span_s):.1f},{top + plot_h * (1 - v / y_max):.1f}"
            for t, v in points
        )
        if coords:
            # Its latest value, said when the line is hovered (and read by the tests).
            latest = f"{name}: {_short(round(points[-1][1], 1))} {unit}, latest"
            parts.append(
                f'<polyline class="series" data-series="{h(name)}" fill="none" stroke="{color}" '
                f'stroke-width="2" points="{coords}"><title>{h(latest)}</title></polyline>'
            )
        legend.append(f'<span style="color:{color}">&#9632; {h(name)}</span>')
    if not series:
        parts.append(f'<text x="{left + 10}" y="{top + plot_h / 2}" font-size="12" fill="#777">no samples yet</text>')
    # Below the plot, as text that wraps: in the plot, names 110 px apart overlapped when long, and
    # past four models ran off its edge.
    key = f'<div class="legend">{" ".join(legend)}</div>' if legend else ""
    return f'<figure class="chart">{"".join(parts)}</svg>{key}</figure>'


def bar_chart(title: str, bars: Sequence[tuple[str, float]], *, unit: str, x_label: str) -> str:
    """Vertical bars (label, value), in the order given; y from 0 to the largest value."""
    width, height, left, bottom, top = 520, 200, 44, 34, 26
    plot_w, plot_h = width - left - 10, height - top - bottom
    y_max = _nice(max((v for _, v in bars), default=0.0))
    parts = [
        f'<svg role="img" aria-label="{h(title)}" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f'<text x="{left}" y="16" font-size="13" font-weight="600">{h(title)}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#999"/>',
        f'<text x="{left - 4}" y="{top + 4}" font-size="11" text-anchor="end">{h(_short(y_max))}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" font-size="11" text-anchor="end">0</text>',
        f'<text x="{left + plot_w}" y="{height - 4}" font-size="11" text-anchor="end">{h(x_label)} ({h(unit)})</text>',
    ]
    slot = plot_w / max(len(bars), 1)
    bar_w = min(slot * 0.7, 36.0)
    for index, (label, value) in enumerate(bars):
        bar_h = plot_h * value / y_max
        middle = left + slot * (index + 0.5)
        parts.append(
            f'<rect class="bar" data-bar="{h(label)}" data-value="{h(_short(value))}" x="{middle - bar_w / 2:.1f}" '
            f'y="{top + plot_h - bar_h:.1f}" width="{bar_w:.1f}" height="{bar_h:.1f}" fill="{COLORS[0]}"/>'
        )
        parts.append(
            f'<text x="{middle:.1f}" y="{top + plot_h + 13}" font-size="11" text-anchor="middle">{h(label)}</text>'
        )
    if not bars:
        parts.append(
            f'<text x="{left + 10}" y="{top + plot_h / 2}" font-size="12" fill="#777">nothing ran in the last minute</text>'
        )
    return "".join(parts) + "</svg>"


def timeline(bars: Sequence[tuple[str, float, float, str]], *, total_s: float) -> str:
    """Horizontal bars (label, start s, end s, color) on one time axis from 0 to `total_s`."""
    width, row, left = 640, 26, 90
    plot_w = width - left - 70
    span = total_s if total_s > 0 else 1.0
    height = row * len(bars) + 24
    parts = [f'<svg role="img" aria-label="timeline" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    for index, (label, start, end, color) in enumerate(bars):
        y = 6 + row * index
        x = left + plot_w * start / span
        w = max(plot_w * (end - start) / span, 2.0)
        parts.append(f'<text x="6" y="{y + 14}" font-size="12">{h(label)}</text>')
        parts.append(
            f'<rect class="bar" data-bar="{h(label)}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="18" '
            f'fill="{color}" rx="3"/>'
        )
        parts.append(f'<text x="{x + w + 4:.1f}" y="{y + 14}" font-size="11">{seconds(end - start)}</text>')
    parts.append(f'<text x="{left}" y="{height - 4}" font-size="11">0</text>')
    parts.append(
        f'<text x="{left + plot_w}" y="{height - 4}" font-size="11" text-anchor="end">{seconds(total_s)}</text>'
    )
    return "".join(parts) + "</svg>"


def _nice(peak: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above `peak` (at least 1)."""
    if peak <= 1:
        return 1.0
    power = 10.0 ** math.floor(math.log10(peak))
    return next(float(m * power) for m in (1, 2, 5, 10) if m * power >= peak)


def _short(value: float) -> str:
    return f"{value:g}"
