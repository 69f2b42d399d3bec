"""Runs every system benchmark section, each as its own process, then writes bench/results/REPORT.md:
the machine's facts, a headline table of every ratio against its target, and each section's report.

    .venv/bin/python -m bench.system.run_all [--quick] [--sections submission,e2e] [--keep-others]

With --keep-others the sections not run this time keep their latest results from bench/results/
(the report marks them "earlier run" with the date of their files), so one section can be
measured again without running the whole suite.

`make bench` runs it (about 20 minutes on 2 cores; run it on an otherwise idle machine). A section
whose module does not exist yet is skipped, and the report says so; a section that fails does not
stop the others.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.system.common import PYTHON, RESULTS, ROOT, fmt, load_average, log, machine_facts, sigterm_raises

SECTIONS = ("submission", "e2e", "batching", "backlog", "watches", "recovery", "batch_files")
# Budgets of the full run (bench_common.md); a section gets twice its budget before it is stopped.
BUDGET_S = {
    "submission": 240,
    "e2e": 180,
    "batching": 240,
    "backlog": 240,
    "watches": 120,
    "recovery": 120,
    "batch_files": 900,
}
QUICK_TIMEOUT_S = 300


@dataclass
class Outcome:
    section: str
    status: str  # ok, failed (rc N), timed out, skipped (...)
    seconds: float = 0.0
    result: dict[str, Any] | None = None
    markdown: str = ""


def run_section(section: str, quick: bool) -> Outcome:
    if importlib.util.find_spec(f"bench.system.{section}") is None:
        log(f"{section}: skipped (bench/system/{section}.py does not exist yet)")
        return Outcome(section, f"skipped: bench/system/{section}.py does not exist yet")
    argv = [PYTHON, "-m", f"bench.system.{section}", *(["--quick"] if quick else [])]
    timeout_s = QUICK_TIMEOUT_S if quick else 2 * BUDGET_S.get(section, 240)
    log(f"{section}: {' '.join(argv[1:])}")
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=ROOT)
    try:
        rc = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        interrupt(process)
        return Outcome(section, f"timed out after {timeout_s} s", time.monotonic() - started)
    except BaseException:
        # Ctrl-C at a terminal reaches the section too: give its own clean-up a moment first.
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        interrupt(process)
        raise
    elapsed = time.monotonic() - started
    log(f"{section}: exit {rc} after {elapsed:.0f} s")
    json_path = RESULTS / f"{section}.json"
    md_path = RESULTS / f"{section}.md"
    fresh = json_path.exists() and json_path.stat().st_mtime >= time.time() - elapsed - 1
    if rc != 0 or not fresh:
        return Outcome(section, f"failed (exit {rc}{'' if fresh else ', no fresh results'})", elapsed)
    return Outcome(section, "ok", elapsed, json.loads(json_path.read_text()), md_path.read_text())


def interrupt(process: subprocess.Popen[bytes]) -> None:
    """SIGINT (KeyboardInterrupt: any section's `with`/`finally` blocks stop its servers), then
    SIGKILL if it has not ended within a minute."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def headline(outcomes: list[Outcome]) -> list[str]:
    lines = [
        "| section | ratio | value | target | met |",
        "|---|---|---:|---|---|",
    ]
    for outcome in outcomes:
        if outcome.result is None:
            lines.append(f"| {outcome.section} | — | — | — | {outcome.status} |")
            continue
        for r in outcome.result.get("ratios", []):
            value = r.get("value")
            met = {True: "yes", False: "**no**", None: "n/a"}[r.get("met")]
            shown = fmt(float("nan") if value is None else float(value), "x")
            lines.append(f"| {outcome.section} | {r['name']} | {shown} | {r['target']} | {met} |")
    return lines


def earlier_outcome(section: str) -> Outcome:
    """A section's results as its last run left them in bench/results/."""
    json_path = RESULTS / f"{section}.json"
    md_path = RESULTS / f"{section}.md"
    if not (json_path.exists() and md_path.exists()):
        return Outcome(section, "skipped: not run, and no earlier results")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(json_path.stat().st_mtime))
    return Outcome(section, f"earlier run ({when})", 0.0, json.loads(json_path.read_text()), md_path.read_text())


def write_report(outcomes: list[Outcome], quick: bool, facts: dict[str, Any], load_after: list[float]) -> None:
    versions = ", ".join(f"{k} {v}" for k, v in facts["versions"].items())
    lines = [
        "# asyncinfer system benchmarks",
        "",
        "Written by `make bench` (`python -m bench.system.run_all`). Figures are medians of several runs with min and "
        "max beside; every ratio is against a reference measured in the same run, on the same machine.",
        "",
    ]
    if quick:
        lines += ["**--quick run: tiny sizes and one run each; for checking the scripts, not for comparison.**", ""]
    lines += [
        "## Machine",
        "",
        f"- {facts['cores']} cores, {facts['memory_gib']} GiB; {facts['platform']}",
        f"- load average (1, 5, 15 min) before: {facts['load_average']}; after: {load_after}",
        f"- versions: {versions}",
        f"- started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(facts['started']))}; sections: "
        + ", ".join(f"{o.section} {o.status}" + (f" ({o.seconds:.0f} s)" if o.seconds else "") for o in outcomes),
        "",
        "## Headline: every ratio against its target",
        "",
        *headline(outcomes),
        "",
    ]
    for outcome in outcomes:
        if outcome.markdown:
            lines += [outcome.markdown.rstrip(), ""]
        else:
            lines += [f"## {outcome.section}", "", f"Not in this report: {outcome.status}.", ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "REPORT.md").write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every section with --quick (seconds each)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset, in run order")
    parser.add_argument(
        "--keep-others", action="store_true", help="report the sections not run with their latest earlier results"
    )
    args = parser.parse_args()
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    sigterm_raises()
    facts = machine_facts()
    facts["started"] = time.time()
    ran = {section: run_section(section, args.quick) for section in wanted}
    outcomes = [
        ran[section] if section in ran else earlier_outcome(section)
        for section in SECTIONS
        if section in ran or args.keep_others
    ]
    load_after = [round(v, 2) for v in load_average()]
    write_report(outcomes, args.quick, facts, load_after)
    log(f"wrote {RESULTS / 'REPORT.md'}")
    failed = [o for o in outcomes if o.status.startswith(("failed", "timed out"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
