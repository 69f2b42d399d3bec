"""What deploy/ and the docs say about metrics, against services that run: every metric the Grafana
dashboard, the alert rules (components/prometheus-rules), the KEDA Prometheus triggers and the docs
name is on a live stack's /metrics (scraped over HTTP after jobs that succeed, fail for good, time
out and are cancelled, a webhook and a file batch), with the labels and label values their queries
use; each counter an alert takes increase() of is there at 0 before its first event (Prometheus
sees no increase in a series first scraped at 1); the queue gauges, which every scheduler reports
for the same shared queue, are never summed over schedulers; and, with promtool, each
alert fires on its condition and not otherwise."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from asyncinfer.client import AsyncClient, InvalidArgumentError, JobState
from asyncinfer.config import DEMO_MODEL, FLAKY_MODEL, Config
from asyncinfer.embedded_nats import NatsServerProcess
from asyncinfer.nats import Client as NatsClient
from services.scheduler.app import SchedulerApp
from tests.stack import StartStack
from tests.test_metrics_scrape import Samples, free_port, scrape
from tests.waits import WAIT_S
from tests.webhook_receiver import Receiver, receiver, webhook_config

__all__ = ["receiver"]  # the fixture, used by name

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "k8s/components/prometheus-rules/prometheus-rule.yaml"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SLOW_MODEL = DEMO_MODEL.model_copy(
    update={"name": "slow", "loader": "services.batcher.models.demo:build_slow_model", "max_attempts": 1}
)
FLAKY = FLAKY_MODEL.model_copy(update={"retry_backoff_base_s": 0.05, "retry_backoff_max_s": 0.1})
METRIC = re.compile(r"\basyncinfer_[a-z_]+")
# Gauges every scheduler reports for the same queue, read from NATS (not its own share of it).
SHARED_GAUGES = (
    "asyncinfer_queue_depth",
    "asyncinfer_queue_oldest_age_seconds",
    "asyncinfer_queue_paused",
    # and the JetStream store's, which every scheduler reads whole
    "asyncinfer_store_used_bytes",
    "asyncinfer_store_limit_bytes",
    "asyncinfer_stream_used_bytes",
    "asyncinfer_stream_limit_bytes",
    "asyncinfer_nats_server_store_used_bytes",
    "asyncinfer_nats_server_store_limit_bytes",
    "asyncinfer_dead_letters_stored",
)

# Series only where a certificate is configured: this stack runs without TLS, tests/test_tls.py's has them.
TLS_ONLY = {"asyncinfer_tls_certificate_expiry_timestamp_seconds"}


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServerProcess]:
    """The test's nats-server with its monitoring port on: the scheduler reads its /jsz (the
    server's own store and limit, scheduler.nats_monitor_urls) as for `up` and the cluster."""
    server = NatsServerProcess(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log", monitor_port=free_port())
    server.start()
    try:
        yield server
    finally:
        server.kill()  # as the conftest's: a graceful stop waited ~0.11 s on a store nothing reads


def alert_rules() -> list[dict[str, Any]]:
    spec = yaml.safe_load(RULES.read_text())["spec"]
    return [rule for group in spec["groups"] for rule in group["rules"]]


def promql() -> list[tuple[str, str]]:
    """(where, expression) of every PromQL query deploy/ ships."""
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
    found += [(f"alert {rule['alert']}", rule["expr"]) for rule in alert_rules()]
    assert len(found) >= 30, found  # the dashboard's, the triggers' and the rules'
    return found


def documented_names() -> dict[str, str]:
    """Metric name -> a file that names it, over the docs and every text file of deploy/."""
    files = [*DOCS, *(p for p in sorted(DEPLOY.rglob("*")) if p.is_file() and p.suffix in (".md", ".yaml", ".json"))]
    return {name: str(path.relative_to(ROOT)) for path in files for name in METRIC.findall(path.read_text())}


def labels_used(expr: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The label names an expression groups or matches by, and the (label, value) pairs it selects
    by equality."""
    names: set[str] = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        names |= {label.strip() for label in group.split(",") if label.strip()}
    values: set[tuple[str, str]] = set()
    for selector in re.findall(r"\{([^}]*)\}", expr):
        for matcher in selector.split(","):
            match = re.match(r'\s*(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matcher)
            assert match, (expr, matcher)
            names.add(match[1])
            if match[2] in ("=", "!=") and "$" not in match[3]:
                values.add((match[1], match[3]))
    return names, values


def exposed(samples: Samples) -> dict[str, set[tuple[str, str]]]:
    """Sample name -> every (label, value) it was scraped with."""
    found: dict[str, set[tuple[str, str]]] = {}
    for name, labels in samples:
        found.setdefault(name, set()).update(labels)
    return found


def base(name: str) -> str:
    return re.sub(r"_(total|bucket|sum|count|created)$", "", name)


async def declared_families(ports: list[int]) -> set[str]:
    found: set[str] = set()
    for port in ports:
        url = f"http://127.0.0.1:{port}/metrics"
        body = await asyncio.to_thread(lambda u=url: urllib.request.urlopen(u, timeout=5).read().decode())
        found |= set(re.findall(r"^# TYPE (\S+) ", body, re.M))
    return found


async def scrape_all(ports: list[int]) -> Samples:
    merged: Samples = {}
    for port in ports:
        merged.update(await scrape(port))
    return merged


async def test_every_metric_deploy_and_the_docs_name_is_exported_with_its_labels(
    config: Config, start_stack: StartStack, receiver: Receiver, nc: NatsClient, nats_server: NatsServerProcess
) -> None:
    ports = [free_port() for _ in range(3)]
    stack_config = webhook_config(
        config.replace(
            models=[DEMO_MODEL, FLAKY, SLOW_MODEL],
            gateway={"metrics_port": ports[0]},
            scheduler={
                "metrics_port": ports[1],
                "queue_stats_interval_s": 0.1,
                "store_usage_interval_s": 0.1,
                "nats_monitor_urls": [f"http://127.0.0.1:{nats_server.monitor_port}"],
            },
            batcher={"metrics_port": ports[2]},
        )
    )
    stack = await start_stack(stack_config)
    before = exposed(await scrape_all(ports))
    async with AsyncClient(stack.address) as client:
        with pytest.raises(InvalidArgumentError):
            await client.submit("demo", {"nope": [[1.0, 2.0, 3.0, 4.0]]})
        jobs = {
            JobState.SUCCEEDED: await client.submit("demo", {"x": [[1, 2, 3, 4]]}, callback=receiver.url("/hook")),
            JobState.FAILED: await client.submit("flaky", {"x": [[-1, 2, 3, 4]]}),
            JobState.TIMED_OUT: await client.submit("slow", {"x": [[1, 2, 3, 4]]}, execution_timeout_s=0.05),
        }
        canceled = await client.cancel(await client.submit("slow", {"x": [[1, 2, 3, 4]]}))
        assert canceled.state in (JobState.CANCELED, JobState.CANCELLING)
        batch = await client.create_batch(np.ones((3, 4), np.float32), "demo")
        for state, job in jobs.items():
            assert (await client.wait(job, timeout_s=30)).state is state
        assert (await client.wait(canceled, timeout_s=30)).state is JobState.CANCELED
        assert (await client.wait_batch(batch, timeout_s=30)).state.name == "COMPLETED"
    await receiver.wait_for("/hook", 1)
    # An operator gives a stream a byte limit (the stream gauges are of those that have one); the
    # scheduler reads every stream's info each 10th round.
    info = await nc.jetstream().stream_info(stack_config.nats.dead_letter_stream)
    info.config.max_bytes = 64 * 1024 * 1024
    await nc.jetstream().update_stream(info.config)
    limited = ("asyncinfer_stream_limit_bytes", frozenset({("stream", stack_config.nats.dead_letter_stream)}))
    stored = ("asyncinfer_dead_letters_stored", frozenset({("model", "flaky")}))
    async with asyncio.timeout(30):
        while limited not in (after := await scrape_all(ports)) or after.get(stored) != 1:  # noqa: ASYNC110 - HTTP endpoints, no event
            await asyncio.sleep(0.05)  # the scheduler's next store round (every 0.1 s here)
    samples = exposed(after)
    # Families, with those that have no sample now (the running batches' gauges: their TYPE line).
    families = {base(name) for name in {*samples, *await declared_families(ports)}}

    # A name in the docs or deploy/ that no service exports (a renamed metric) is a blank panel.
    for name, where in documented_names().items():
        assert base(name) in families, f"{where} names {name}, which no service exports"

    for where, expr in promql():
        names = set(METRIC.findall(expr))
        assert names, (where, expr)
        if names <= TLS_ONLY:  # declared (its TYPE line); its series: tests/test_tls.py's stack
            assert names <= families, f"{where}: {names} not declared"
            continue
        for name in names:
            assert name in samples, f"{where}: {name} has no series after the traffic ({expr})"
        label_names, label_values = labels_used(expr)
        have = set().union(*(samples[name] for name in names))
        # Prometheus adds the target's own (instance, job) to every series it scrapes.
        known = {label for label, _ in have} | {"instance", "job"}
        assert label_names <= known, f"{where}: labels {label_names} not all on {names}"
        for label, label_value in label_values - {("model", v) for _, v in label_values}:
            assert (label, label_value) in have, f"{where}: no {names} sample has {label}={label_value!r}"

    # Before any job, each counter an alert takes increase() of has its series, at 0, for every model
    # (Prometheus sees no increase in a series first scraped at 1: the first dead letters went unseen).
    for rule in alert_rules():
        for name in re.findall(r"increase\((asyncinfer_[a-z_]+)", rule["expr"]):
            assert name in before, f"{rule['alert']}: {name} is not exported before its first event"
            models = {value for label, value in before[name] if label == "model"}
            if "model" in {label for label, _ in samples[name]}:
                assert models >= {"demo", "flaky", "slow"}, (rule["alert"], name, models)
    assert after[("asyncinfer_dead_letters_total", frozenset({("model", "flaky"), ("reason", "MAX_ATTEMPTS")}))] == 1


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
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while (seen := [(await scrape(port)).get(depth) for port in ports]) != [2, 2]:
            assert asyncio.get_running_loop().time() < deadline, seen
            await asyncio.sleep(0.05)  # each scheduler's next queue snapshot (queue_stats_interval_s)
    finally:
        await other.stop(grace_s=1.0)
    for where, expr in promql():
        for name in SHARED_GAUGES:
            summed = re.search(rf"\bsum\s*(?:(?:by|without)\s*\([^)]*\)\s*)?\(\s*{name}\b", expr)
            assert not summed, f"{where} sums {name} over schedulers: {expr}"


def test_each_alert_fires_on_its_condition_and_not_otherwise(tmp_path: Path) -> None:
    """promtool's unit tests of the rules (their annotations left out: the conditions are tested),
    on series shaped as the services export them. promtool is Debian's `prometheus` package, which
    `make test` installs (it fails here rather than skip without it)."""
    assert shutil.which("promtool") is not None, "promtool is missing: sudo apt-get install -y prometheus"
    spec = yaml.safe_load(RULES.read_text())["spec"]
    checked = subprocess.run(
        ["promtool", "check", "rules", str(_write(tmp_path / "full.yml", spec))], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for group in spec["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules = _write(tmp_path / "rules.yml", spec)
    tests = _write(
        tmp_path / "tests.yml", {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": ALERT_TESTS}
    )
    assert {t["alert_rule_test"][0]["alertname"] for t in ALERT_TESTS} == {r["alert"] for r in alert_rules()}
    run = subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def _write(path: Path, content: Any) -> Path:
    path.write_text(yaml.safe_dump(content))
    return path


def _alert(
    name: str,
    series: list[tuple[str, str]],
    fires: list[tuple[str, dict[str, str] | list[dict[str, str]] | None]],
) -> dict[str, Any]:
    """One test: the input series, then at each (time, labels) the alert fires with those labels,
    or once with each of a list of them (None: it does not fire then)."""
    severity = next(r["labels"]["severity"] for r in alert_rules() if r["alert"] == name)

    def expected(labels: dict[str, str] | list[dict[str, str]] | None) -> list[dict[str, Any]]:
        each = [] if labels is None else [labels] if isinstance(labels, dict) else labels
        return [{"exp_labels": {**one, "severity": severity}} for one in each]

    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [
            {"eval_time": at, "alertname": name, "exp_alerts": expected(labels)} for at, labels in fires
        ],
    }


ALERT_TESTS = [
    _alert(
        "AsyncinferTlsCertificateExpiresSoon",
        [  # 14 days and a minute left at 0; 90 days left
            (
                'asyncinfer_tls_certificate_expiry_timestamp_seconds{certificate="gateway.tls_cert_file",instance="g1"}',
                "1209660x20",
            ),
            (
                'asyncinfer_tls_certificate_expiry_timestamp_seconds{certificate="nats.tls_cert_file",instance="g1"}',
                "7776000x20",
            ),
        ],
        [("0m", None), ("2m", {"certificate": "gateway.tls_cert_file", "instance": "g1"})],
    ),
    _alert(
        "AsyncinferJobsDeadLettered",
        [
            ('asyncinfer_dead_letters_total{model="flaky",reason="MAX_ATTEMPTS",instance="s1"}', "0 0 0 1 1"),
            ('asyncinfer_dead_letters_total{model="demo",reason="MAX_ATTEMPTS",instance="s1"}', "0x30"),
        ],
        [("2m", None), ("4m", {"model": "flaky"}), ("25m", None)],
    ),
    _alert(
        "AsyncinferQueueStalled",
        [  # two schedulers see the same queue; a paused one grows too, and is left alone
            ('asyncinfer_queue_oldest_age_seconds{model="demo",priority="LOW",instance="s1"}', "0+60x20"),
            ('asyncinfer_queue_oldest_age_seconds{model="demo",priority="LOW",instance="s2"}', "0+60x20"),
            ('asyncinfer_queue_paused{model="demo",instance="s1"}', "0x20"),
            ('asyncinfer_queue_oldest_age_seconds{model="held",priority="LOW",instance="s1"}', "0+60x20"),
            ('asyncinfer_queue_paused{model="held",instance="s1"}', "1x20"),
        ],
        [("11m", None), ("14m", {"model": "demo", "priority": "LOW"})],
    ),
    _alert(
        "AsyncinferNoBatcher",
        [
            ('asyncinfer_queue_depth{model="demo",priority="NORMAL",instance="s1"}', "3x20"),
            ('asyncinfer_connected_batchers{model="demo",instance="s1"}', "0x20"),
            ('asyncinfer_queue_paused{model="demo",instance="s1"}', "0x20"),
            ('asyncinfer_queue_depth{model="served",priority="NORMAL",instance="s1"}', "3x20"),
            ('asyncinfer_connected_batchers{model="served",instance="s1"}', "0x20"),
            ('asyncinfer_connected_batchers{model="served",instance="s2"}', "1x20"),
            ('asyncinfer_queue_paused{model="served",instance="s1"}', "0x20"),
            ('asyncinfer_queue_depth{model="idle",priority="NORMAL",instance="s1"}', "0x20"),
            ('asyncinfer_connected_batchers{model="idle",instance="s1"}', "0x20"),
            ('asyncinfer_queue_paused{model="idle",instance="s1"}', "0x20"),
        ],
        [("9m", None), ("11m", {"model": "demo"})],
    ),
    _alert(
        "AsyncinferDesiredBatchersMissing",
        [  # demo's batcher computes while its scheduler's series goes (its scrapes fail from 3m);
            # served keeps its series
            ('asyncinfer_batcher_model_ready{model="demo",version="",instance="b1"}', "1x12"),
            ('asyncinfer_batcher_model_ready{model="demo",version="1",instance="b1"}', "1x12"),
            ('asyncinfer_desired_batchers{model="demo",instance="s1"}', "1 1 1 stale"),
            ('asyncinfer_batcher_model_ready{model="served",version="",instance="b2"}', "1x12"),
            ('asyncinfer_batcher_model_ready{model="served",version="1",instance="b2"}', "1x12"),
            ('asyncinfer_desired_batchers{model="served",instance="s1"}', "2x12"),
        ],
        [("2m", None), ("4m", None), ("6m", {"model": "demo"})],
    ),
    _alert(
        "AsyncinferDesiredBatchersMissing",
        [  # jobs submitted to a pool at zero and no scheduler series; idle has no submits
            ('asyncinfer_jobs_submitted_total{model="queued",priority="NORMAL",instance="g1"}', "0 0 0 0 0 0 3x6"),
            ('asyncinfer_jobs_submitted_total{model="idle",priority="NORMAL",instance="g1"}', "0x12"),
        ],
        [("5m", None), ("7m", None), ("9m", {"model": "queued"})],
    ),
    _alert(
        "AsyncinferModelStuck",
        [
            ('asyncinfer_jobs_in_flight{model="hung",instance="s1"}', "2x30"),
            ('asyncinfer_results_total{model="hung",instance="s1"}', "5x30"),
            ('asyncinfer_jobs_in_flight{model="busy",instance="s1"}', "2x30"),
            ('asyncinfer_results_total{model="busy",instance="s1"}', "0+4x30"),
        ],
        [("5m", None), ("7m", {"model": "hung"})],
    ),
    _alert(
        "AsyncinferModelNotReady",
        [
            # broken's version 1 failed to load on b1 (the model's series, its default, says so too);
            # demo's version 2 is out of reach on b1 (its Triton), version 1 and the model serve.
            ('asyncinfer_batcher_model_ready{model="broken",version="",instance="b1"}', "0x10"),
            ('asyncinfer_batcher_model_ready{model="broken",version="1",instance="b1"}', "0x10"),
            ('asyncinfer_batcher_model_ready{model="broken",version="",instance="b2"}', "1x10"),
            ('asyncinfer_batcher_model_ready{model="broken",version="1",instance="b2"}', "1x10"),
            ('asyncinfer_batcher_model_ready{model="demo",version="",instance="b1"}', "1x10"),
            ('asyncinfer_batcher_model_ready{model="demo",version="1",instance="b1"}', "1x10"),
            ('asyncinfer_batcher_model_ready{model="demo",version="2",instance="b1"}', "0x10"),
        ],
        [
            ("4m", None),
            (
                "6m",
                [
                    {"model": "broken", "version": "1", "instance": "b1"},
                    {"model": "demo", "version": "2", "instance": "b1"},
                ],
            ),
        ],
    ),
    _alert(
        "AsyncinferModelCallHung",
        [  # a batcher restarted after its model hung comes back at 0
            ('asyncinfer_batcher_overrun_batches{model="hang",instance="b1"}', "0 1 1 1 1 0 0"),
            ('asyncinfer_batcher_overrun_batches{model="demo",instance="b1"}', "0x6"),
        ],
        [("1m", None), ("3m", {"model": "hang", "instance": "b1"}), ("6m", None)],
    ),
    _alert(
        "AsyncinferWebhookDeliveriesFailed",
        [
            ('asyncinfer_webhook_deliveries_finished_total{state="FAILED",instance="s1"}', "0 0 0 1 1"),
            ('asyncinfer_webhook_deliveries_finished_total{state="DELIVERED",instance="s1"}', "0+9x5"),
        ],
        [("2m", None), ("4m", {})],
    ),
    _alert(
        "AsyncinferWebhookAttemptsFailing",
        [
            ('asyncinfer_webhook_attempts_total{outcome="5XX",instance="s1"}', "0+10x30"),
            ('asyncinfer_webhook_attempts_total{outcome="2XX",instance="s1"}', "0+1x30"),
        ],
        [("9m", None), ("12m", {})],
    ),
    _alert(
        "AsyncinferStoreFull",
        [
            (
                'asyncinfer_submit_rejected_total{model="demo",code="RESOURCE_EXHAUSTED",reason="STORE_FULL",instance="g1"}',
                "0 0 0 2 4",
            ),
            ('asyncinfer_submit_rejected_total{model="demo",code="INVALID_ARGUMENT",reason="",instance="g1"}', "0+5x5"),
        ],
        [("2m", None), ("4m", {})],
    ),
    _alert(
        "AsyncinferStoreNearlyFull",
        [  # two schedulers read the same account; a store with no limit (0) is never "full"
            ('asyncinfer_store_used_bytes{storage="file",instance="s1"}', "500 500 850x20"),
            ('asyncinfer_store_used_bytes{storage="file",instance="s2"}', "500 500 850x20"),
            ('asyncinfer_store_limit_bytes{storage="file",instance="s1"}', "1000x22"),
            ('asyncinfer_store_limit_bytes{storage="file",instance="s2"}', "1000x22"),
            ('asyncinfer_store_used_bytes{storage="memory",instance="s1"}', "900x22"),
            ('asyncinfer_store_limit_bytes{storage="memory",instance="s1"}', "0x22"),
        ],
        [("11m", None), ("13m", {"storage": "file"})],
    ),
    _alert(
        "AsyncinferStoreNearlyFull",
        [  # a server's own store (its /jsz), read by two schedulers; another at half; one with no limit
            (
                'asyncinfer_nats_server_store_used_bytes{server="nats-0:8222",storage="file",instance="s1"}',
                "500 500 850x20",
            ),
            (
                'asyncinfer_nats_server_store_used_bytes{server="nats-0:8222",storage="file",instance="s2"}',
                "500 500 850x20",
            ),
            ('asyncinfer_nats_server_store_limit_bytes{server="nats-0:8222",storage="file",instance="s1"}', "1000x22"),
            ('asyncinfer_nats_server_store_limit_bytes{server="nats-0:8222",storage="file",instance="s2"}', "1000x22"),
            ('asyncinfer_nats_server_store_used_bytes{server="nats-1:8222",storage="file",instance="s1"}', "500x22"),
            ('asyncinfer_nats_server_store_limit_bytes{server="nats-1:8222",storage="file",instance="s1"}', "1000x22"),
            ('asyncinfer_nats_server_store_used_bytes{server="nats-2:8222",storage="memory",instance="s1"}', "900x22"),
            ('asyncinfer_nats_server_store_limit_bytes{server="nats-2:8222",storage="memory",instance="s1"}', "0x22"),
        ],
        [("11m", None), ("13m", {"server": "nats-0:8222", "storage": "file"})],
    ),
    _alert(
        "AsyncinferStreamNearlyFull",
        [
            ('asyncinfer_stream_used_bytes{stream="DEAD_LETTERS",instance="s1"}', "900x20"),
            ('asyncinfer_stream_limit_bytes{stream="DEAD_LETTERS",instance="s1"}', "1000x20"),
            ('asyncinfer_stream_used_bytes{stream="DEAD_LETTERS",instance="s2"}', "900x20"),
            ('asyncinfer_stream_limit_bytes{stream="DEAD_LETTERS",instance="s2"}', "1000x20"),
            ('asyncinfer_stream_used_bytes{stream="WORK",instance="s1"}', "100x20"),
            ('asyncinfer_stream_limit_bytes{stream="WORK",instance="s1"}', "1000x20"),
        ],
        [("9m", None), ("11m", {"stream": "DEAD_LETTERS"})],
    ),
]
