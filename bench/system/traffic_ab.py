"""Where a change's cost goes, two revisions side by side: NATS messages per job by connection
(from nats-server's /connz, counted, not timed, so a busy machine does not blur them) and the
gateway's and scheduler's CPU per job by function (py-spy samples of one burst each).

    .venv/bin/python -m bench.system.traffic_ab REV_A REV_B [--burst 2000] [--top 25]

Prints the tables and writes bench/results/traffic_<A>_<B>.md. Figures are per job of a unary
burst (SubmitJob, then GetJob per job) on the no-op model, after 20 warm-up jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import nats
import uvloop
from nats.aio.msg import Msg

from asyncinfer.embedded_nats import free_port
from asyncinfer.v1 import job_service_pb2_grpc
from bench.system.ab import worktrees
from bench.system.common import ROOT, ProcessGroup, log
from bench.system.e2e import Stack, burst, run_one

PROFILED = ("gateway", "scheduler")
RATE_HZ = 200  # py-spy's --rate in ProcessGroup.command


def connz(port: int) -> dict[str, dict[str, int]]:
    """Messages and bytes in/out by connection name (the services name theirs)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/connz?limit=1024", timeout=10) as reply:
        found = json.load(reply)
    counts: dict[str, dict[str, int]] = {}
    for conn in found.get("connections", []):
        name = conn.get("name") or "(unnamed)"
        mine = counts.setdefault(name, {"in_msgs": 0, "out_msgs": 0, "in_bytes": 0, "out_bytes": 0})
        for key in mine:
            mine[key] += int(conn.get(key, 0))
    return counts


def per_function_ms(raw_profile: Path, count: int) -> dict[str, float]:
    """Self CPU ms per job by function, from a py-spy raw profile (idle samples excluded by
    py-spy's default; start-up imports left out)."""
    own: dict[str, int] = {}
    for line in raw_profile.read_text(errors="replace").splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit() or "importlib._bootstrap" in stack:
            continue
        frame = stack.split(";")[-1]
        name, _, where = frame.partition(" (")
        where = where.rstrip(")").rsplit(":", 1)[0]
        where = re.sub(r".*/tree-\d/", "", where.split("site-packages/", 1)[-1].replace(str(ROOT) + "/", ""))
        key = f"{name} ({where})"
        own[key] = own.get(key, 0) + int(samples)
    return {k: n / RATE_HZ * 1e3 / count for k, n in own.items()}


def subject_kind(subject: str) -> str:
    """A subject with its ids, sequences and inboxes folded: what kind of message it is."""
    tokens = subject.split(".")
    if tokens[0] == "_INBOX":
        return "_INBOX.*"
    if tokens[:2] == ["$JS", "ACK"]:
        return "$JS.ACK.<stream>.<consumer>.*"
    if tokens[:2] == ["$JS", "API"]:
        return ".".join(tokens[:4]) + (".*" if len(tokens) > 4 else "")
    if tokens[0] == "$KV":
        return ".".join(tokens[:2]) + ".*"
    return ".".join(tokens[:3]) + (".*" if len(tokens) > 3 else "")


async def run(stack: Stack, count: int) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]], Counter[str]]:
    tap = await nats.connect(stack.nats.url, name="traffic-tap")
    kinds: Counter[str] = Counter()
    counting = False

    async def count_kind(msg: Msg) -> None:
        if counting:
            kinds[subject_kind(msg.subject)] += 1

    await tap.subscribe(">", cb=count_kind)
    try:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            for _ in range(20):
                await run_one(stub, timeout_s=120)
            await tap.flush()
            counting = True
            before = connz(stack.nats.monitor_port)
            await burst(stub, stack, count)
            after = connz(stack.nats.monitor_port)
            await tap.flush()
            counting = False
    finally:
        await tap.close()
    return before, after, kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revisions", nargs=2)
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    count = args.burst
    lines: list[str] = [f"# NATS messages and CPU per job: {args.revisions[0]} (A) vs {args.revisions[1]} (B)", ""]
    traffic: dict[str, dict[str, dict[str, float]]] = {}
    functions: dict[str, dict[str, dict[str, float]]] = {}
    by_kind: dict[str, Counter[str]] = {}
    with (
        worktrees(args.revisions) as trees,
        ProcessGroup() as group,
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        for ab, tree in zip("AB", trees, strict=True):
            stack = Stack(group, profile_dir=group.tmp / ab, profiled=PROFILED, source=tree, monitor_port=free_port())
            (group.tmp / ab).mkdir(exist_ok=True)
            before, after, by_kind[ab] = runner.run(run(stack, count))
            stack.stop_services()
            traffic[ab] = {
                name: {k: (after[name][k] - before.get(name, {}).get(k, 0)) / count for k in after[name]}
                for name in after
                if name != "traffic-tap"
            }
            functions[ab] = {}
            for service in PROFILED:
                path = group.tmp / ab / f"{service}.txt"
                functions[ab][service] = per_function_ms(path, count) if path.exists() else {}
            log(f"{ab}: done")
    lines += [
        "| connection | A msgs in/job | B msgs in/job | A msgs out/job | B msgs out/job | A KB in/job | B KB in/job |"
    ]
    lines += ["|---|---:|---:|---:|---:|---:|---:|"]
    for name in sorted(set(traffic["A"]) | set(traffic["B"])):
        a, b = traffic["A"].get(name, {}), traffic["B"].get(name, {})
        lines.append(
            f"| {name} | {a.get('in_msgs', 0):.2f} | {b.get('in_msgs', 0):.2f} | {a.get('out_msgs', 0):.2f} | "
            f"{b.get('out_msgs', 0):.2f} | {a.get('in_bytes', 0) / 1e3:.2f} | {b.get('in_bytes', 0) / 1e3:.2f} |"
        )
    lines += ["", "## Messages per job by subject (a tap on `>`)", "", "| subject | A | B | B - A |"]
    lines += ["|---|---:|---:|---:|"]
    kinds = sorted(set(by_kind["A"]) | set(by_kind["B"]), key=lambda k: -(by_kind["A"][k] + by_kind["B"][k]))
    for kind in kinds:
        a_n, b_n = by_kind["A"][kind] / count, by_kind["B"][kind] / count
        lines.append(f"| `{kind}` | {a_n:.2f} | {b_n:.2f} | {b_n - a_n:+.2f} |")
    for service in PROFILED:
        a, b = functions["A"][service], functions["B"][service]
        lines += ["", f"## {service}: self CPU ms per job, A {sum(a.values()):.3f}, B {sum(b.values()):.3f}", ""]
        lines += ["| function | A | B | B - A |", "|---|---:|---:|---:|"]
        keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))
        for key in keys[: args.top]:
            lines.append(
                f"| {key} | {a.get(key, 0):.4f} | {b.get(key, 0):.4f} | {b.get(key, 0) - a.get(key, 0):+.4f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "bench" / "results" / f"traffic_{args.revisions[0][:10]}_{args.revisions[1][:10]}.md"
    out.write_text(text)
    log(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
