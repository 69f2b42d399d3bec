"""A/B of how the services run an MLP file batch (issue 15's MLP target), variants alternated round
by round in one run (taking turns going first), each round a fresh stack (bench.system.batch_files.measure).

    .venv/bin/python -m bench.system.batch_files_ab [--records N] [--rounds N] [--warmup-rounds N] [--variants a,b,...]

Variants (bench.system.batch_files.ServiceVariant):
- base: the services of another revision (--base-tree, a worktree: `git worktree add /tmp/wt-base
  REV`), as they start there;
- this: the services of this tree, as they start, one batch at a time;
- two-streams: this tree's batcher computing two batches at once (max_inflight_batches 2), torch's
  threads split between them by the batcher (services/batcher/backends/loading.py);
- base-two-streams: the base revision's services computing two batches at once (its batcher must
  split torch's threads too: b00ce92 or later);
- modifiers after a '+' (variant()): claim-check-io, the batcher reading the chunks' rows and
  storing their outputs itself (`batcher.claim_check_io`; otherwise the scheduler does, as it
  ships); light, a model of the MLP's signature at almost no compute (what the services cost per
  record); N-batchers, N batchers serving the model; switch-Nus, the batcher's GIL switch interval
  (sys.setswitchinterval; Python's default is 5,000 us); batch-N, the model's max_batch_size N (and
  direct torch's batch: MODELS' otherwise); nats-NAME=VALUE, set in nats-server's environment (Go's
  GOGC or GODEBUG); objects-dir, the objects' bytes in files of a directory the services share, their
  metadata in NATS (the product option nats.objects_directory, set for every service; it replaced
  session 33's bench-only dir-store prototype; a base revision before it knows no such setting; the
  batch's outputs are read back and checked against the model's). E.g.
  two-streams+claim-check-io+4-batchers, this+nats-GOGC=400, two-streams+objects-dir.

Writes bench/results/batch_files_ab.json and .md: per variant the median (min, max) of records/s,
the ratio to direct torch (both references), each process's CPU seconds and page faults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bench.system.batch_files import ServiceVariant, measure
from bench.system.common import RESULTS, log, machine_facts


def variant(name: str, base_tree: Path | None) -> ServiceVariant:
    """The variant a name says: a stem (base, this, two-streams, base-two-streams) and modifiers
    after it, each introduced by '+': claim-check-io, light (bench.batcher_models:build_light, the
    services' own cost per record), <N>-batchers (N batchers serving the model), e.g.
    two-streams+claim-check-io+4-batchers. The older name two-streams-claim-check-io still works."""
    name = name.replace("two-streams-claim-check-io", "two-streams+claim-check-io")
    stem, *modifiers = name.split("+")
    stems = {
        "base": {"inflight_batches": 1, "source": base_tree},
        "this": {"inflight_batches": 1},
        # torch's threads left to the batcher: two batches at once get one thread each on 2 cores.
        "two-streams": {"inflight_batches": 2},
        "base-two-streams": {"inflight_batches": 2, "source": base_tree},
    }
    if stem not in stems:
        raise SystemExit(f"unknown variant {name!r}: its stem is one of {sorted(stems)}")
    settings: dict[str, Any] = {"label": name, **stems[stem]}
    for modifier in modifiers:
        if modifier == "claim-check-io":
            settings["claim_check_io"] = True
        elif modifier == "objects-dir":
            settings["objects_dir"] = True
        elif modifier == "light":
            settings["loader"] = "bench.batcher_models:build_light"
        elif (count := re.fullmatch(r"(\d+)-batchers", modifier)) is not None:
            settings["batchers"] = int(count.group(1))
        elif (size := re.fullmatch(r"batch-(\d+)", modifier)) is not None:
            settings["max_batch"] = int(size.group(1))
        elif (interval := re.fullmatch(r"switch-(\d+)us", modifier)) is not None:
            settings["switch_interval_s"] = int(interval.group(1)) / 1e6
        elif (setting := re.fullmatch(r"nats-([A-Z_]+)=(.+)", modifier)) is not None:
            settings["nats_env"] = (*settings.get("nats_env", ()), (setting.group(1), setting.group(2)))
        else:
            raise SystemExit(f"unknown modifier {modifier!r} in variant {name!r}")
    return ServiceVariant(**settings)


def base_revision(tree: Path | None) -> str:
    if tree is None:
        return "this tree"
    done = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h"], capture_output=True, text=True)
    return done.stdout.strip() or str(tree)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.2f} ({min(values):,.2f}-{max(values):,.2f})"


def markdown(
    rows: dict[str, list[dict[str, Any]]], facts: dict[str, Any], records: int, base: str, warmup_rounds: int = 0
) -> str:
    lines = [
        "# A/B: how the services run an MLP file batch (bench/system/batch_files_ab.py)",
        "",
        f"{records:,} NPY records per round, variants alternated round by round (in the order listed in odd rounds, "
        "reversed in even ones), a fresh stack each"
        + (f", after {warmup_rounds} uncounted warm-up round(s) of each" if warmup_rounds else "")
        + f"; base: {base}.",
        f"Machine: {facts}",
        "",
        "| variant | rounds | records/s | / direct torch (default threads) | / direct torch (two streams of one thread) "
        "| CPU s gateway / scheduler / batcher / nats-server | page faults gateway / scheduler / batcher "
        "| interactive jobs: count, p50 s, max s (one chunk's compute s) |",
        "|---|---:|---|---|---|---|---|---|",
    ]
    for label, results in rows.items():
        cpu = {n: statistics.median(r["cpu_s"][n] for r in results) for n in results[0]["cpu_s"]}
        faults = {n: statistics.median(r["page_faults"][n] for r in results) for n in results[0]["page_faults"]}
        lines.append(
            f"| {label} | {len(results)} | {spread([r['records_per_s'] for r in results])} "
            f"| {spread([r['ratio'] for r in results])} "
            f"| {spread([r['records_per_s'] / r.get('direct_two_streams_records_per_s', math.nan) for r in results])} "
            f"| {' / '.join(f'{cpu[n]:.2f}' for n in ('gateway', 'scheduler', 'batcher', 'nats-server'))} "
            f"| {' / '.join(f'{faults[n]:,.0f}' for n in ('gateway', 'scheduler', 'batcher'))} "
            f"| {interactive_summary(results)} |"
        )
    return "\n".join(lines) + "\n"


def interactive_summary(results: list[dict[str, Any]]) -> str:
    """The interactive jobs sent during the rounds' batches (one at a time, 0.5 s apart): how many,
    their median and worst wait, beside the median of one chunk's compute (the target's bound)."""
    waits = [s for r in results for s in r["interactive_s"]]
    if not waits:
        return "none"
    chunk_s = statistics.median(r["chunk_compute_s"] for r in results)
    return f"{len(waits)}, {statistics.median(waits):.2f}, {max(waits):.2f} ({chunk_s:.2f})"


async def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in args.variants.split(",")}
    # Uncounted rounds first: a run's first minute is its slowest (session 21: a first round at
    # 44,000-45,000 light-model records/s against 58,000-72,000 after), which would count against
    # whichever variant goes first.
    for round_number in range(args.warmup_rounds):
        for name in rows:
            log(f"warm-up round {round_number + 1}/{args.warmup_rounds} (not counted): {name}")
            result = await measure("mlp", args.records, variant(name, args.base_tree))
            log(json.dumps({k: result[k] for k in ("records_per_s", "ratio")}))
    for round_number in range(args.rounds):
        # The variants take turns going first (their order in odd rounds, reversed in even ones): the
        # second stack of a round runs on a warmer, busier machine (an A/A of bench/system/ab.py read
        # B/A 0.91 in A-then-B order and 1.03 alternated, session 32, bench/results/ab_session32_aa*.md).
        for name in list(rows) if round_number % 2 == 0 else list(rows)[::-1]:
            log(f"round {round_number + 1}/{args.rounds}: {name}")
            result = await measure("mlp", args.records, variant(name, args.base_tree))
            rows[name].append(result)
            log(json.dumps({k: result[k] for k in ("records_per_s", "ratio", "cpu_s", "page_faults")}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds of every variant run first, not counted")
    parser.add_argument("--variants", default="base,this,two-streams")
    parser.add_argument("--base-tree", type=Path, help="the worktree the base variant runs")
    parser.add_argument("--name", default="batch_files_ab", help="the results' file name, without suffix")
    args = parser.parse_args()
    rows = asyncio.run(run(args))
    facts = machine_facts()
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"machine": facts, "rows": rows}, indent=2) + "\n")
    Path(RESULTS / f"{args.name}.md").write_text(
        markdown(rows, facts, args.records, base_revision(args.base_tree), args.warmup_rounds)
    )
    print(markdown(rows, facts, args.records, base_revision(args.base_tree), args.warmup_rounds))


if __name__ == "__main__":
    main()
