"""Under `asyncinfer bulk`'s summary: its first lines that did not succeed, and why.

The summary counted them ("200 lines: 190 succeeded, 10 invalid.") and named the results file, where
each one's error is: a newcomer read `2 invalid, 1 refused` and had to search a JSON file for the
reasons. A batch over a file shows its first failed lines under its summary (`batch get`, `create
--wait`); bulk now does too, in the same form: consecutive lines saying the same are one line, and
those past the first FIRST_SHOWN are counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

FIRST_SHOWN = 10  # lines of failures shown, each one line or a run of lines saying the same
GROUPED = 3  # consecutive failed lines saying the same, shown as one line


def failure_lines(
    entries: Iterable[dict[str, Any]], outcome_of: Callable[[dict[str, Any]], str], succeeded: str
) -> list[str]:
    """The results file's entries that did not succeed (by `outcome_of`), in line order, as the
    lines printed under the summary."""
    failed = sorted(
        ((int(entry["line"]), _said(entry)) for entry in entries if outcome_of(entry) != succeeded),
        key=lambda failure: failure[0],
    )
    runs: list[list[tuple[int, str]]] = []
    for number, said in failed:
        last = runs[-1][-1] if runs else None
        if last is not None and last[1] == said and last[0] == number - 1:
            runs[-1].append((number, said))
        else:
            runs.append([(number, said)])
    printed: list[str] = []
    shown = 0
    for run in runs:
        if len(printed) >= FIRST_SHOWN:
            break
        if len(run) >= GROUPED:
            printed.append(f"  lines {run[0][0]}-{run[-1][0]}: {run[0][1]}")
            shown += len(run)
            continue
        for number, said in run:
            if len(printed) < FIRST_SHOWN:
                printed.append(f"  line {number}: {said}")
                shown += 1
    if shown < len(failed):
        printed.append(f"  and {len(failed) - shown} more")
    return printed


def _said(entry: dict[str, Any]) -> str:
    """What a results entry says of its line: `INVALID_ARGUMENT INVALID_LINE: Expecting value ...`,
    `job FAILED, INTERNAL MODEL_ERROR: model 'flaky' failed ...` (the CLI's error line's form: the
    reason left out where it repeats the code)."""
    raw = entry.get("error")
    error: dict[str, Any] = raw if isinstance(raw, dict) else {}
    code, reason, message = (str(error.get(key) or "") for key in ("code", "reason", "message"))
    head = " ".join(part for part in (code, reason if reason != code else "") if part)
    state = f"job {entry['state']}" if entry.get("state") else ""
    if not head and not message:
        return state or "no result"
    return ", ".join(part for part in (state, f"{head}: {message}" if head else message) if part)
