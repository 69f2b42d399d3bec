"""What deploy/ says about metrics, against services that run: the queue gauges, which every
scheduler reports for the same shared queue, are never summed over schedulers (two schedulers
would show every waiting job twice)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import yaml

from asyncinfer.client import AsyncClient
from asyncinfer.config import Config
from services.scheduler.app import SchedulerApp
from tests.stack import StartStack
from tests.test_metrics_scrape import free_port, scrape

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
# Gauges every scheduler reports for the same queue, read from NATS (not its own share of it).
SHARED_GAUGES = ("asyncinfer_queue_depth", "asyncinfer_queue_oldest_age_seconds", "asyncinfer_queue_paused")


def promql() -> list[tuple[str, str]]:
    """(where, expression) of every PromQL query deploy/ ships: the dashboard's and the KEDA triggers'."""
    found: list[tuple[str, str]] = []
    dashboard = json.loads((DEPLOY / "grafana/asyncinfer-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        found += [(f"dashboard: {panel['title']}", t["expr"]) for t in panel.get("targets", [])]
    found += [
        ("dashboard: variables", v["query"]["query"]) for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    for path in sorted((DEPLOY / "k8s/components/keda-prometheus").glob("triggers-*.yaml")):
        for patch in yaml.safe_load(path.read_text()):
            found += [(path.name, t["metadata"]["query"]) for t in patch["value"] if t["type"] == "prometheus"]
    assert len(found) >= 30, found
    return found


async def test_queue_gauges_every_scheduler_reports_are_never_summed_over_schedulers(
    config: Config, start_stack: StartStack
) -> None:
    """Two schedulers each report the whole queue (its depth is read from the consumer they share),
    so a sum over them counts every waiting job twice: the dashboard, the alerts and the triggers
    take the max."""
    ports = [free_port(), free_port()]
    interval = {"queue_stats_interval_s": 0.1}
    stack = await start_stack(config.replace(scheduler={"metrics_port": ports[0], **interval}), batcher=False)
    other = SchedulerApp(config.replace(scheduler={"metrics_port": ports[1], **interval}))
    await other.start()
    try:
        async with AsyncClient(stack.address) as client:
            for _ in range(2):
                await client.submit("demo", {"x": [[1, 2, 3, 4]]})
        depth = ("asyncinfer_queue_depth", frozenset({("model", "demo"), ("priority", "NORMAL")}))
        deadline = asyncio.get_running_loop().time() + 10
        while (seen := [(await scrape(port)).get(depth) for port in ports]) != [2, 2]:
            assert asyncio.get_running_loop().time() < deadline, seen
            await asyncio.sleep(0.05)  # each scheduler's next queue snapshot (queue_stats_interval_s)
    finally:
        await other.stop(grace_s=1.0)
    for where, expr in promql():
        for name in SHARED_GAUGES:
            summed = re.search(rf"\bsum\s*(?:(?:by|without)\s*\([^)]*\)\s*)?\(\s*{name}\b", expr)
            assert not summed, f"{where} sums {name} over schedulers: {expr}"
