"""deploy/: the Kubernetes overlays render (real kustomize, from kubectl) and validate against the
Kubernetes schemas (kubernetes-validate, offline) and, for KEDA's ScaledObjects, against a schema
of KEDA's documented fields; the configuration they mount loads; the NATS configuration is one
nats-server accepts; the Dockerfiles, the compose file and the Grafana dashboard agree with the
code; and scale-to-zero works as KEDA sees it: with no batcher, jobs queue (NO_WORKER), the
consumer's lag on NATS's monitoring endpoint and asyncinfer_desired_batchers rise, and a batcher
started afterwards drains them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from referencing import Registry, Resource

from asyncinfer.access import KeyRing, bearer_metadata
from asyncinfer.config import Config, load_config
from asyncinfer.declarations import work_consumer_name
from asyncinfer.embedded_nats import NatsServerProcess, find_nats_server, free_port
from asyncinfer.grpc_server import LIVENESS_SERVICE, GrpcServer
from asyncinfer.jobs import Priority
from asyncinfer.v1 import job_pb2, job_service_pb2, tensor_pb2
from services.scheduler.queue_stats import desired_batchers
from services.scheduler.store_usage import ServerUsage, read_server_usage
from tests.stack import Stack, StartStack
from tests.waits import START_S

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("local", "production", "production-prometheus", "production-triton", "production-gpu-batches")
# Overlays whose batchers move their orders' claim-checked bytes themselves, as NATS users of their
# own (components/batcher-claim-checks).
CLAIM_CHECK_BATCHERS = ("production-gpu-batches",)
# The oldest Kubernetes the manifests target (native gRPC probes are GA since 1.27) and the newest
# the installed kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.27", kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version()))
SERVICES = {"gateway": 50051, "scheduler": 50052, "batcher": 50053}
METRICS_PORTS = {"gateway": 9101, "scheduler": 9102, "batcher": 9103}
SECRET_DIR = "/var/run/secrets/asyncinfer"  # where the services mount their Secrets
SECRET_ENV = {
    "ASYNCINFER_GATEWAY__API_KEYS": json.dumps([{"tenant": "acme", "sha256": "0" * 64}]),
    "ASYNCINFER_WEBHOOKS__SECRETS": json.dumps([{"tenant": "acme", "secret": "whsec_" + "A" * 44}]),
}


# --- rendering -----------------------------------------------------------------------------------


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@functools.cache
def rendered_overlays() -> dict[str, tuple[dict[str, Any], ...]]:
    """Every overlay, rendered by kustomize processes run side by side (each takes seconds)."""
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl (which embeds kustomize) is installed")
    processes = {
        overlay: subprocess.Popen(
            [*command, str(K8S / "overlays" / overlay)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for overlay in OVERLAYS
    }
    rendered = {}
    for overlay, process in processes.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, f"kustomize could not render {overlay}: {err}"
        rendered[overlay] = tuple(doc for doc in yaml.safe_load_all(out) if doc)
    return rendered


def render(overlay: str) -> tuple[dict[str, Any], ...]:
    return rendered_overlays()[overlay]


def of_kind(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def config_map(docs: tuple[dict[str, Any], ...]) -> dict[str, str]:
    """The services' ConfigMap (asyncinfer-config and its content hash)."""
    (data,) = [
        d["data"]
        for name, d in of_kind(docs, "ConfigMap").items()
        if re.fullmatch(r"asyncinfer-config-[a-z0-9]+", name)
    ]
    return data


def mounted_config(docs: tuple[dict[str, Any], ...], workload: dict[str, Any]) -> tuple[str, str]:
    """The file a workload's `--config` names and its text, read from the ConfigMap its pod mounts
    there (as the kubelet would: a ConfigMap the overlay does not make fails here)."""
    c = container(workload)
    path = Path(c["args"][c["args"].index("--config") + 1])
    (volume_name,) = [m["name"] for m in c["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == volume_name]
    source = volume["configMap"]
    config_maps = of_kind(docs, "ConfigMap")
    assert source["name"] in config_maps, f"{workload['metadata']['name']} mounts a missing ConfigMap {source['name']}"
    keys = {item["path"]: item["key"] for item in source.get("items", [])}
    key = keys.get(path.name, path.name)
    return key, config_maps[source["name"]]["data"][key]


def load_toml(text: str, tmp_path: Path, environ: dict[str, str] | None = None) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return load_config(path, environ=environ or {})


def container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def service_of(name: str) -> str:
    """gateway, scheduler or batcher, from a Deployment's name."""
    return "batcher" if name.startswith("batcher-") else name


# --- Kubernetes and KEDA schemas -------------------------------------------------------------------


@functools.cache
def kubernetes_validator(kind: str, api_version: str, version: str) -> jsonschema.Draft202012Validator:
    """kubernetes_validate.validate's strict validator for one kind, built once: the package reads
    and indexes its (large) definitions file on every call, which made this module take minutes."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{version}.0-local-strict"
    try:
        schema = kubernetes_validate.utils.schema_contents(f"{folder}/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        pytest.fail(f"kubernetes-validate has no schema for {kind} {api_version} in Kubernetes {version}")
    registry: Registry[Any] = Resource.from_contents(schema) @ definitions_registry(folder, version)
    return jsonschema.Draft202012Validator(schema, registry=registry)


@functools.cache
def definitions_registry(folder: str, version: str) -> Registry[Any]:
    definitions = kubernetes_validate.utils.schema_contents(f"{folder}/_definitions.json", version)
    registry: Registry[Any] = Resource.from_contents(definitions) @ Registry()
    return registry


def kubernetes_errors(doc: dict[str, Any], version: str) -> list[str]:
    validator = kubernetes_validator(doc["kind"], doc["apiVersion"], version)
    return [f"{'.'.join(str(p) for p in e.path)}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    docs = render(overlay)
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith(("keda.sh/", "cert-manager.io/")):
            continue  # CRDs: checked against KEDA's and cert-manager's schemas below
        for version in KUBERNETES_VERSIONS:
            errors = kubernetes_errors(doc, version)
            assert not errors, f"{overlay}: {doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {errors}"
        checked += 1
    assert checked >= 18


def test_the_cached_validator_agrees_with_kubernetes_validate() -> None:
    deployment = of_kind(render("production"), "Deployment")["gateway"]
    assert kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
    assert kubernetes_errors(deployment, KUBERNETES_VERSIONS[-1]) == []


def test_a_broken_manifest_fails_validation() -> None:
    """The validator is strict: a misspelt field and a wrong type are both caught."""
    deployment = of_kind(render("production"), "Deployment")["gateway"]
    misspelt = json.loads(json.dumps(deployment))
    container(misspelt)["readinesProbe"] = container(misspelt).pop("readinessProbe")
    wrong_type = json.loads(json.dumps(deployment))
    wrong_type["spec"]["replicas"] = "two"
    for broken in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)
        assert kubernetes_errors(broken, KUBERNETES_VERSIONS[-1])


@functools.cache
def keda_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((K8S / "schemas/keda-scaledobject.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_batcher_pool_has_a_valid_scaled_object_on_its_own_consumers(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    scaled = of_kind(docs, "ScaledObject")
    deployments = of_kind(docs, "Deployment")
    pools = {name for name in deployments if name.startswith("batcher-")}
    assert pools
    assert {so["spec"]["scaleTargetRef"]["name"] for so in scaled.values()} == pools
    main = load_toml(config_map(docs)["asyncinfer.toml"], tmp_path)
    headless = of_kind(docs, "Service")["nats-headless"]
    monitor_port = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "monitor")
    namespace = headless["metadata"]["namespace"]
    for so in scaled.values():
        jsonschema.validate(so, keda_schema())
        spec = so["spec"]
        assert spec["minReplicaCount"] == 0
        assert spec["maxReplicaCount"] >= 1
        assert spec["cooldownPeriod"] > 0
        target = deployments[spec["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"], "KEDA owns the replica count; a fixed one fights it on apply"
        (model,) = pool_config(docs, target, tmp_path).models
        triggers = spec["triggers"]
        if triggers[0]["type"] == "prometheus":
            (trigger,) = triggers
            assert f'asyncinfer_desired_batchers{{model="{model.name}"}}' in trigger["metadata"]["query"]
            continue
        assert {t["metadata"]["consumer"] for t in triggers} == {
            work_consumer_name(model.name, priority) for priority in Priority
        }
        for trigger in triggers:
            meta = trigger["metadata"]
            assert meta["stream"] == main.nats.work_stream
            assert meta["account"] == "$G"
            assert meta["natsServerMonitoringEndpoint"] == f"nats-headless.{namespace}.svc.cluster.local:{monitor_port}"
            assert int(meta["lagThreshold"]) >= 1
            assert meta["activationLagThreshold"] == "0"


def test_the_keda_schema_rejects_what_keda_would() -> None:
    so = next(iter(of_kind(render("production"), "ScaledObject").values()))
    bad_metadata = json.loads(json.dumps(so))
    bad_metadata["spec"]["triggers"][0]["metadata"]["lagTreshold"] = "10"  # misspelt
    not_a_string = json.loads(json.dumps(so))
    not_a_string["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 10
    no_consumer = json.loads(json.dumps(so))
    del no_consumer["spec"]["triggers"][0]["metadata"]["consumer"]
    for broken in (bad_metadata, not_a_string, no_consumer):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, keda_schema())


# docs/BATCHES.md, "On a GPU": about four batchers per GPU run a file batch 2.8-3.2x as fast as one.
BATCHERS_PER_GPU_FOR_BATCHES = 4


def replicas_a_lone_batch_asks(trigger: dict[str, Any], main: Config) -> int:
    """What KEDA asks of a pool for one file batch alone, long enough to outlast the scheduler's
    drain target several times over. A batch keeps at most batches.chunks_in_flight chunk jobs
    queued or running, so that is all the lag a NATS trigger reads of it; the scheduler's signal
    also counts the chunks still in the batch's plan (measured here at one chunk a second per
    batcher, one batcher connected)."""
    meta = trigger["metadata"]
    window = main.batches.chunks_in_flight
    if trigger["type"] == "nats-jetstream":
        return math.ceil(window / int(meta["lagThreshold"]))
    assert trigger["type"] == "prometheus", trigger
    assert trigger["metricType"] == "AverageValue"  # replicas = the value / threshold, not per pod
    target_s = main.scheduler.autoscale_target_drain_s
    desired = desired_batchers(
        waiting=window,
        in_flight=0,
        connected=1,
        completed_per_s=1.0,
        target_drain_s=target_s,
        planned=math.ceil(10 * target_s),
        planned_batches=1,
        chunks_in_flight=window,
    )
    return math.ceil(desired / float(meta["threshold"]))


@pytest.mark.parametrize("overlay", CLAIM_CHECK_BATCHERS)
def test_a_file_batch_alone_scales_the_gpu_pool_to_several_batchers_and_back_to_zero(
    overlay: str, tmp_path: Path
) -> None:
    """The overlay for file batches on GPUs exists to run several batchers per GPU; its pools'
    lag triggers (20 and 50 jobs a batcher) read a batch's window of 8 chunk jobs as one batcher."""
    docs = render(overlay)
    main = load_toml(config_map(docs)["asyncinfer.toml"], tmp_path)
    deployments = of_kind(docs, "Deployment")
    gpu_pools = {
        name
        for name, d in deployments.items()
        if name.startswith("batcher-") and "nvidia.com/gpu" in container(d)["resources"].get("limits", {})
    }
    assert gpu_pools
    for name, so in of_kind(docs, "ScaledObject").items():
        jsonschema.validate(so, keda_schema())
        spec = so["spec"]
        asked = max(replicas_a_lone_batch_asks(t, main) for t in spec["triggers"])
        replicas = min(asked, spec["maxReplicaCount"])
        if spec["scaleTargetRef"]["name"] in gpu_pools:
            assert replicas >= BATCHERS_PER_GPU_FOR_BATCHES, f"{overlay}: a batch alone runs on {replicas} of {name}"
        assert spec["minReplicaCount"] == 0
        for trigger in spec["triggers"]:
            if trigger["type"] != "prometheus":
                continue
            meta = trigger["metadata"]
            activation = float(meta["activationThreshold"])
            signal = functools.partial(desired_batchers, target_drain_s=main.scheduler.autoscale_target_drain_s)
            # From zero: the batch's first chunks queued, no batcher yet, nothing measured.
            assert signal(waiting=1, in_flight=0, connected=0, completed_per_s=0.0) > activation
            # Between two windows (nothing queued, chunks still planned), and while the last chunk
            # computes: never zero, so the cooldown (scale to zero) does not start under a batch.
            planned = {"planned": 1, "planned_batches": 1, "chunks_in_flight": main.batches.chunks_in_flight}
            assert signal(waiting=0, in_flight=0, connected=1, completed_per_s=1.0, **planned) > activation
            assert signal(waiting=0, in_flight=1, connected=1, completed_per_s=1.0) > activation
            # Once the batch ended: zero, so the pool goes back to zero after cooldownPeriod.
            assert signal(waiting=0, in_flight=0, connected=1, completed_per_s=1.0) <= activation


# --- configuration ---------------------------------------------------------------------------------


def pool_config(docs: tuple[dict[str, Any], ...], deployment: dict[str, Any], tmp_path: Path) -> Config:
    return load_toml(mounted_config(docs, deployment)[1], tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_config_map_and_volume_claim_a_workload_names_exists(overlay: str) -> None:
    """A pod whose ConfigMap or PersistentVolumeClaim does not exist never starts (it stays in
    ContainerCreating: "configmap ... not found"). The Secrets: tests/test_deploy_secrets.py."""
    docs = render(overlay)
    config_maps = of_kind(docs, "ConfigMap")
    claims = of_kind(docs, "PersistentVolumeClaim")
    for name, workload in {**of_kind(docs, "Deployment"), **of_kind(docs, "StatefulSet")}.items():
        pod = workload["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                source = volume["configMap"]
                assert source["name"] in config_maps, f"{overlay}: {name} mounts ConfigMap {source['name']}"
                for item in source.get("items", []):
                    assert item["key"] in config_maps[source["name"]]["data"], (overlay, name, item)
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert claim in claims, f"{overlay}: {name} mounts PersistentVolumeClaim {claim}"
        for c in (*pod["containers"], *pod.get("initContainers", [])):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["name"] in config_maps, (overlay, name, env["name"])
            for source in c.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in config_maps, (overlay, name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_mounted_configuration_loads_and_matches_the_cluster(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    main = load_toml(config_map(docs)["asyncinfer.toml"], tmp_path, SECRET_ENV)
    assert main.gateway.api_keys
    assert main.webhooks.secret_for("acme")
    nats = of_kind(docs, "StatefulSet")["nats"]
    assert main.nats.replicas == 3 == nats["spec"]["replicas"]
    assert main.nats.url.split(",") == [f"nats://nats-{i}.nats-headless:4222" for i in range(3)]
    assert nats["spec"]["serviceName"] == "nats-headless"
    services = of_kind(docs, "Service")
    scheduler_port = services["scheduler"]["spec"]["ports"][0]["port"]
    deployments = of_kind(docs, "Deployment")
    for name, deployment in deployments.items():
        if name == "triton":
            continue
        if name == "console":
            check_console(main, services, deployment)
            continue
        service = service_of(name)
        cfg = main if service != "batcher" else pool_config(docs, deployment, tmp_path)
        section = getattr(cfg, service)
        assert section.host == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        assert ports == {"grpc": section.port, "metrics": section.metrics_port}
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(section.metrics_port)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # grpc.health.v1 over TLS (Kubernetes' own gRPC probes speak no TLS): the image's check.
            command = container(deployment)[probe]["exec"]["command"]
            assert command[:2] == ["python", "/opt/asyncinfer/healthcheck.py"], (name, probe)
            # Startup and liveness ask for the service only a stop changes (a full store, a model
            # that failed to load: NOT_SERVING to readiness, no reason to restart).
            address_and_service = [f"localhost:{section.port}"]
            if probe != "readinessProbe":
                address_and_service.append(LIVENESS_SERVICE)
            assert command[-len(address_and_service) :] == address_and_service, (name, probe)
            assert command[command.index("--ca") + 1] == f"{SECRET_DIR}/tls/ca.crt", (name, probe)
            if service == "scheduler":  # it requires client certificates: its probe presents its own
                assert command[command.index("--cert") + 1] == f"{SECRET_DIR}/tls/tls.crt", (name, probe)
        if service in ("gateway", "scheduler"):
            # They serve once connected to NATS: their startup probe outlasts the wait for it (with
            # a minute to start in), or a pod started before NATS answers is killed while it waits.
            startup = container(deployment)["startupProbe"]
            window_s = startup["periodSeconds"] * startup["failureThreshold"]
            assert cfg.nats.first_connect_wait_s > 0, name
            assert window_s >= cfg.nats.first_connect_wait_s + 60, (name, window_s)
        if service == "batcher":
            assert cfg.batcher.scheduler_address == f"scheduler:{scheduler_port}"
            for model in cfg.models:  # the pool's model is the one the gateway validates against
                assert main.model(model.name) == model
    pooled = {
        m.name
        for d in deployments.values()
        if d["metadata"]["name"].startswith("batcher-")
        for m in pool_config(docs, d, tmp_path).models
    }
    assert pooled == {m.name for m in main.models}, "every model needs a batcher pool, and only configured ones"


def check_console(main: Config, services: dict[str, dict[str, Any]], deployment: dict[str, Any]) -> None:
    """The console: the gateway image running `console`, on its HTTP port (probes on /healthz: a
    console that cannot reach its services stays in its Service to say so on its pages),
    pointed at the gateway's and the scheduler's Services, its keys from the Secret."""
    console = container(deployment)
    assert console["image"].rsplit(":", 1)[0].endswith("asyncinfer/gateway")  # the server extra, no torch
    assert console["args"][0] == "console"
    assert main.console.host == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in console["ports"]} == {"http": main.console.port}
    assert console["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert console["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    for service, address in (("gateway", main.console.gateway_address), ("scheduler", main.console.scheduler_address)):
        assert address == f"{service}:{services[service]['spec']['ports'][0]['port']}"
    assert services["console"]["spec"]["ports"][0]["port"] == main.console.port
    assert services["console"]["spec"]["type"] == "ClusterIP"
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in console["env"] if "valueFrom" in e}
    assert set(env) == {"ASYNCINFER_CONSOLE__TENANT_KEY", "ASYNCINFER_CONSOLE__OPS_KEY"}
    assert all(ref["name"] == "asyncinfer-secrets" and ref["key"] == name for name, ref in env.items())


def test_the_local_secret_holds_valid_keys_and_webhook_secrets(tmp_path: Path) -> None:
    docs = render("local")
    secret = of_kind(docs, "Secret")["asyncinfer-secrets"]
    environ = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    cfg = load_toml(config_map(docs)["asyncinfer.toml"], tmp_path, environ)
    from asyncinfer.api_keys import hash_key

    assert [k.sha256 for k in cfg.gateway.api_keys if k.role == "tenant"] == [hash_key("asyncinfer-local-demo-key")]
    # The batchers' key (mounted from its own Secret) is the list's batcher key.
    batcher_key = base64.b64decode(of_kind(docs, "Secret")["asyncinfer-batcher-key"]["data"]["key"]).decode()
    assert [k.sha256 for k in cfg.gateway.api_keys if k.role == "batcher"] == [hash_key(batcher_key)]
    assert cfg.webhooks.secret_for("demo") is not None
    # The console's key is the demo tenant's (and it has no ops key: read-only).
    assert cfg.console.tenant_key is not None
    (console_key,) = [k for k in cfg.gateway.api_keys if k.sha256 == hash_key(cfg.console.tenant_key)]
    assert console_key.tenant == "demo"
    assert cfg.console.ops_key is None
    deployments = of_kind(docs, "Deployment")
    gateway_env = {e["name"]: e for e in container(deployments["gateway"])["env"] if "valueFrom" in e}
    console_env = {e["name"]: e for e in container(deployments["console"])["env"] if "valueFrom" in e}
    assert set(gateway_env) == {k for k in environ if not k.startswith("ASYNCINFER_CONSOLE__")}
    assert set(environ) - set(gateway_env) <= set(console_env)
    for env in (*gateway_env.values(), *console_env.values()):
        assert env["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


def test_production_expects_the_secret_instead_of_committing_one() -> None:
    docs = render("production")
    assert not of_kind(docs, "Secret")
    env = container(of_kind(docs, "Deployment")["gateway"])["env"]
    keys = next(e for e in env if e["name"] == "ASYNCINFER_GATEWAY__API_KEYS")
    assert keys["valueFrom"]["secretKeyRef"] == {"name": "asyncinfer-secrets", "key": "ASYNCINFER_GATEWAY__API_KEYS"}


def nats_conf(docs: tuple[dict[str, Any], ...]) -> str:
    (conf,) = [d["data"]["nats.conf"] for d in of_kind(docs, "ConfigMap").values() if "nats.conf" in d.get("data", {})]
    return conf


@pytest.mark.parametrize("overlay", ["production", *CLAIM_CHECK_BATCHERS])
def test_nats_server_accepts_the_cluster_configuration(overlay: str, tmp_path: Path) -> None:
    from asyncinfer.nats_users import new_user_nkey
    from tests.certs import TestCA

    nats = of_kind(render(overlay), "StatefulSet")["nats"]
    conf = nats_conf(render(overlay))
    # The certificate files the pods mount (nats-tls), made here; the NKeys the Secret gives.
    ca = TestCA(tmp_path / "pki")
    pem = ca.issue("nats")
    tls = tmp_path / "nats-tls"
    tls.mkdir()
    for name, source in (("tls.crt", pem.cert_file), ("tls.key", pem.key_file), ("ca.crt", ca.ca_file)):
        (tls / name).write_bytes(Path(source).read_bytes())
    path = tmp_path / "nats.conf"
    path.write_text(conf.replace("/etc/nats-tls/", f"{tls}/"))
    binary = find_nats_server()
    env = {
        **os.environ,
        "SERVER_NAME": "nats-0",
        "GATEWAY_NKEY": new_user_nkey()[1],
        "SCHEDULER_NKEY": new_user_nkey()[1],
        **({"BATCHER_NKEY": new_user_nkey()[1]} if overlay in CLAIM_CHECK_BATCHERS else {}),
    }
    out = subprocess.run(
        [binary, "-t", "-c", str(path)], capture_output=True, text=True, env=env, timeout=30, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "valid" in out.stdout + out.stderr
    # The server name is the pod's name (KEDA finds a consumer's leader node by it).
    env_var = {e["name"]: e for e in container(nats)["env"]}["SERVER_NAME"]
    assert env_var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    routes = re.findall(r"nats://(nats-\d)\.nats-headless:6222", conf)
    assert routes == [f"nats-{i}" for i in range(nats["spec"]["replicas"])]

    # The schedulers read each server's own store limit on its monitoring port (/jsz): the users
    # are in the global account, which JetStream's API reports no limit for. Every pod is named,
    # at the port the conf serves it on, and the NetworkPolicy lets the schedulers in.
    docs = render(overlay)
    http_port = int(re.search(r"^http_port: (\d+)$", conf, re.M)[1])  # type: ignore[index]
    scheduler = load_toml(config_map(docs)["asyncinfer.toml"], tmp_path, SECRET_ENV)
    assert scheduler.scheduler.nats_monitor_urls == [
        f"http://nats-{i}.nats-headless:{http_port}" for i in range(nats["spec"]["replicas"])
    ]
    (monitor_rule,) = [
        rule
        for rule in of_kind(docs, "NetworkPolicy")["nats"]["spec"]["ingress"]
        if {"port": http_port} in rule["ports"]
    ]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "scheduler"}}} in monitor_rule["from"]
    # What a scheduler reads there is the server's own max_file_store: this server, on the file
    # (its store, pid file and ports moved here; no peers to route to), answers 9 GB.
    monitor = free_port()
    path.write_text(
        conf.replace("/etc/nats-tls/", f"{tls}/")
        .replace('store_dir: "/data"', f'store_dir: "{tmp_path / "data"}"')
        .replace('"/var/run/nats/nats.pid"', f'"{tmp_path / "nats.pid"}"')
    )
    log = tmp_path / "nats.log"
    cluster = f"nats://127.0.0.1:{free_port()}"  # its route port (no peer answers: none is needed)
    with log.open("wb") as out:
        server = subprocess.Popen(
            [binary, "-c", str(path), "-p", str(free_port()), "-m", str(monitor), "--cluster_listen", cluster],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        usage = asyncio.run(read_until_answered(f"http://127.0.0.1:{monitor}"))
    except TimeoutError:
        raise AssertionError(log.read_text()) from None
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert re.search(r"^  max_file_store: 9GB$", conf, re.M)
    assert usage.file_limit_bytes == 9 * 1024**3
    assert usage.memory_limit_bytes == 256 * 1024**2


async def read_until_answered(url: str, timeout_s: float = 20.0) -> ServerUsage:
    """The scheduler's reading of a server's /jsz, once its monitoring port answers."""
    async with asyncio.timeout(timeout_s), aiohttp.ClientSession() as session:
        while True:
            try:
                return await read_server_usage(session, url)
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)  # the server is starting; nothing to wait on but its port


# --- workloads and policies ------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workloads_are_hardened_and_highly_available(overlay: str) -> None:
    docs = render(overlay)
    workloads = {**of_kind(docs, "Deployment"), **of_kind(docs, "StatefulSet")}
    for name, workload in workloads.items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert c["resources"]["requests"]["cpu"], name
            assert c["resources"]["limits"]["memory"], name
            if name != "triton":
                assert sc["readOnlyRootFilesystem"] is True, name
    pdbs = of_kind(docs, "PodDisruptionBudget")
    for name in ("gateway", "scheduler"):
        assert workloads[name]["spec"]["replicas"] == 2
        assert pdbs[name]["spec"]["selector"] == workloads[name]["spec"]["selector"]
        assert pdbs[name]["spec"]["minAvailable"] == 1
    assert pdbs["nats"]["spec"]["maxUnavailable"] == 1
    gpu_pool = container(workloads["batcher-minilm-l6"])["resources"]
    if overlay == "local":
        assert "nvidia.com/gpu" not in gpu_pool["limits"]
        assert "nodeSelector" not in workloads["batcher-minilm-l6"]["spec"]["template"]["spec"]
    else:
        assert gpu_pool["requests"]["nvidia.com/gpu"] == gpu_pool["limits"]["nvidia.com/gpu"] == 1
        pod = workloads["batcher-minilm-l6"]["spec"]["template"]["spec"]
        assert pod["nodeSelector"]
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert "nvidia.com/gpu" not in container(workloads["batcher-demo"])["resources"]["limits"]
        assert of_kind(docs, "Service")["gateway"]["spec"]["type"] == "LoadBalancer"
    if overlay == "local":
        assert of_kind(docs, "Service")["gateway"]["spec"]["type"] == "ClusterIP"


def hostname_anti_affinity(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """The required anti-affinity terms on hostname that keep two of the workload's pods apart."""
    template = workload["spec"]["template"]
    terms = template["spec"].get("affinity", {}).get("podAntiAffinity", {})
    return [
        term
        for term in terms.get("requiredDuringSchedulingIgnoredDuringExecution", [])
        if term["topologyKey"] == "kubernetes.io/hostname"
        and _selects(term["labelSelector"], template["metadata"]["labels"])
    ]


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("production")])
def test_production_never_runs_both_schedulers_on_one_node(overlay: str) -> None:
    """A node's loss taking both schedulers stops all dispatch until they are rescheduled: the
    second replica exists for that, and a soft spread (ScheduleAnyway) may still stack them. The
    hard rule costs a node: a rolling update's extra pod needs one without a scheduler, which the
    three nodes NATS already requires (one NATS pod each, no node selector) give."""
    docs = render(overlay)
    scheduler = of_kind(docs, "Deployment")["scheduler"]
    assert hostname_anti_affinity(scheduler), f"{overlay}: two schedulers may share a node"
    nats = of_kind(docs, "StatefulSet")["nats"]
    assert hostname_anti_affinity(nats)
    assert "nodeSelector" not in nats["spec"]["template"]["spec"]
    assert "nodeSelector" not in scheduler["spec"]["template"]["spec"]
    surge = scheduler["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    assert scheduler["spec"]["replicas"] + surge <= nats["spec"]["replicas"]


# The gateway is what clients dial, through its Service (a LoadBalancer in production, with
# externalTrafficPolicy Local: the cloud balancer drops a node after its health checks fail, 10 s
# and more). It closes its port at SIGTERM, so it must keep serving while the endpoints let go.
PRE_STOP_SLEEP_S = {"gateway": 10}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_stopping_pod_leaves_its_service_first_and_finishes_its_stop_before_sigkill(
    overlay: str, tmp_path: Path
) -> None:
    """A pod being deleted gets preStop, then SIGTERM, then SIGKILL terminationGracePeriodSeconds
    after the start: the gateway sleeps in preStop while its Service and load balancer stop sending
    it connections (otherwise a rolling update refuses new ones: UNAVAILABLE to clients), and every
    service's grace covers that sleep, its own ordered stop and the wait for its threads."""
    from services.batcher.app import ANSWERS_AFTER_GRACE_S
    from services.cli import THREADS_END_WAIT_S
    from services.up.stack import SHUTDOWN_GRACE_S

    docs = render(overlay)
    for name, deployment in of_kind(docs, "Deployment").items():
        if name in ("triton", "console"):
            continue
        service = service_of(name)
        c = container(deployment)
        pre_stop_s = 0
        if service in PRE_STOP_SLEEP_S:
            assert "lifecycle" in c, f"{overlay}: {name} has no preStop: it refuses connections while endpoints drop it"
            command = c["lifecycle"]["preStop"]["exec"]["command"]
            assert command[0] == "sleep", (name, command)
            pre_stop_s = int(command[1])
            assert pre_stop_s >= PRE_STOP_SLEEP_S[service], (name, command)
        if service == "batcher":
            stop_s = pool_config(docs, deployment, tmp_path).batcher.shutdown_grace_s + ANSWERS_AFTER_GRACE_S
        else:
            stop_s = SHUTDOWN_GRACE_S
        grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace_s >= pre_stop_s + stop_s + THREADS_END_WAIT_S, (overlay, name, grace_s)


def cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def container_environ(c: dict[str, Any]) -> dict[str, str]:
    """The container's plain and Downward API resource values (resourceFieldRef, as the kubelet
    gives them: rounded up to the divisor)."""
    environ = {}
    for env in c.get("env", []):
        if "value" in env:
            environ[env["name"]] = env["value"]
        field = env.get("valueFrom", {}).get("resourceFieldRef")
        if field:
            kind, _, resource = field["resource"].partition(".")
            assert resource == "cpu", field
            divisor = cpu_cores(str(field.get("divisor", "1")))
            environ[env["name"]] = str(math.ceil(cpu_cores(str(c["resources"][kind][resource])) / divisor))
    return environ


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_batcher_on_cpu_runs_as_many_torch_threads_as_the_cores_it_requests(overlay: str, tmp_path: Path) -> None:
    """torch_threads 0 is torch's default: one thread per core the process may run on, which in a
    pod is every core of the node (a CPU request or limit does not change the affinity). A pool
    requesting 2 cores on a 64-core node would spin 64 threads at every op's barrier on a
    2-core share (throttled to a crawl under a CPU limit). The batcher's own rule decides."""
    from services.batcher.backends.loading import torch_threads_for

    node_cores = 64
    docs = render(overlay)
    for name, deployment in of_kind(docs, "Deployment").items():
        if not name.startswith("batcher-"):
            continue
        c = container(deployment)
        on_gpu = "nvidia.com/gpu" in c["resources"].get("limits", {})
        environ = {**SECRET_ENV, **container_environ(c)}
        cfg = load_toml(mounted_config(docs, deployment)[1], tmp_path, environ)
        if not any(v.backend == "torch" for m in cfg.models for v in m.version_configs()):
            continue  # no torch model (a Triton pool): no torch threads
        threads = torch_threads_for(cfg.batcher, cfg.models, node_cores, cuda_available=lambda gpu=on_gpu: gpu)
        requested = math.ceil(cpu_cores(str(c["resources"]["requests"]["cpu"])))
        assert threads != 0, f"{overlay}: {name} runs torch's default threads, one per core of its node"
        assert threads <= requested, (overlay, name, threads, requested)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("overlay", ["local", "production-triton", *CLAIM_CHECK_BATCHERS])
def test_network_policies_open_only_the_gateway_to_everyone(overlay: str) -> None:
    docs = render(overlay)
    policies = of_kind(docs, "NetworkPolicy")
    assert policies["default-deny-ingress"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    pods = {
        name: w["spec"]["template"]["metadata"]["labels"]
        for name, w in {**of_kind(docs, "Deployment"), **of_kind(docs, "StatefulSet")}.items()
    }

    def allowed_from(target: str, port: int) -> list[dict[str, Any] | None]:
        """The `from` peers allowed to the port (None: everyone)."""
        peers: list[dict[str, Any] | None] = []
        for policy in policies.values():
            if not _selects(policy["spec"]["podSelector"], pods[target]) or not policy["spec"]["podSelector"]:
                continue
            for rule in policy["spec"].get("ingress", []):
                if any(p["port"] == port for p in rule.get("ports", [])):
                    peers.extend(rule.get("from", [None]))
        return peers

    assert allowed_from("gateway", 50051) == [None]
    for name in pods:
        for port in (4222, 6222, 50052, 50053, 8001, 8070):
            assert None not in allowed_from(name, port), (name, port)
    # Only the services reach NATS's client port; batchers only the scheduler (unless they move
    # claim-checked bytes themselves).
    nats_peers = [p["podSelector"] for p in allowed_from("nats", 4222) if p and "podSelector" in p]
    nats_clients = [n for n in pods if any(_selects(selector, pods[n]) for selector in nats_peers)]
    batchers = sorted(n for n in pods if n.startswith("batcher-")) if overlay in CLAIM_CHECK_BATCHERS else []
    assert sorted(nats_clients) == sorted(["gateway", "nats", "scheduler", *batchers])
    scheduler_peers = [p["podSelector"] for p in allowed_from("scheduler", 50052) if p and "podSelector" in p]
    scheduler_clients = [n for n in pods if any(_selects(selector, pods[n]) for selector in scheduler_peers)]
    assert all(n.startswith("batcher-") or n == "console" for n in scheduler_clients)
    assert "console" in scheduler_clients  # it reads the OpsService
    assert scheduler_clients
    # The console (no login of its own) only to ops.
    console_peers = allowed_from("console", 8070)
    assert console_peers
    assert all(p and ("podSelector" in p or "namespaceSelector" in p) for p in console_peers)
    # Prometheus may scrape every metrics port; KEDA may read NATS's monitoring port.
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    for name, _labels in pods.items():
        if name in ("nats", "console"):  # the console has no metrics port
            continue
        port = int(
            of_kind(docs, "Deployment")[name]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]
        )
        assert monitoring in allowed_from(name, port), name
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} in allowed_from("nats", 8222)


# --- images and compose ----------------------------------------------------------------------------


def dockerfile(service: str) -> str:
    return (DEPLOY / "docker" / f"{service}.Dockerfile").read_text()


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_dockerfile_runs_unprivileged_and_checks_grpc_health(service: str) -> None:
    text = dockerfile(service)
    lines = [line.strip() for line in text.replace("\\\n", " ").splitlines()]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users
    assert users[-1].split(":")[0] not in ("0", "root"), "the last USER must not be root"
    (expose,) = [line.split()[1:] for line in lines if line.startswith("EXPOSE ")]
    assert expose == [str(SERVICES[service]), str(METRICS_PORTS[service])]
    default = getattr(Config(), service)
    assert (default.port, default.metrics_port) == (SERVICES[service], METRICS_PORTS[service])
    (healthcheck,) = [line for line in lines if line.startswith("HEALTHCHECK ")]
    assert f'healthcheck.py", "127.0.0.1:{SERVICES[service]}"' in healthcheck
    for line in lines:
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
    assert (DEPLOY / "docker" / f"{service}.Dockerfile.dockerignore").read_text() == (
        DEPLOY / "docker/gateway.Dockerfile.dockerignore"
    ).read_text()
    if service == "batcher":
        assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", text, re.M)
        assert "ARG TORCH_INDEX_URL=" in text
        assert '".[batcher]"' in text
    else:
        assert "FROM ${PYTHON_IMAGE}" in text
        assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
        assert "torch" not in text
        assert "[batcher]" not in text


COMPOSE = DEPLOY / "compose/docker-compose.yml"
COMPOSE_SECRETS = "/run/secrets/asyncinfer"  # where each service mounts its own volume of secrets
# What each volume the `secrets` step fills holds after it ran (by the folder the step mounts it at):
# a service's own certificate, key, NKey seed and API key files, and nothing of another's.
COMPOSE_VOLUME_FILES = {
    "nats": {"nats/nats.conf", "nats/nats-users.conf", "tls/nats.pem", "tls/nats.key"},
    "gateway": {"tls/ca.pem", "tls/gateway.pem", "tls/gateway.key", "nats/seeds/gateway.nk", "gateway__api_keys"},
    "scheduler": {
        "tls/ca.pem", "tls/scheduler.pem", "tls/scheduler.key", "nats/seeds/scheduler.nk", "gateway__api_keys",
    },
    "batcher": {"tls/ca.pem", "tls/batcher.pem", "tls/batcher.key", "gateway__api_keys", "batcher__api_key"},
    "operator": {"ca.pem", "ops.pem", "ops.key", "api-keys.env"},
}  # fmt: skip


def compose_file() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def secrets_step_dir() -> str:
    """The folder the `secrets` step is given (its command's first argument): it mounts each of its
    volumes at a folder of it."""
    return str(compose_file()["services"]["secrets"]["command"][0])


def secret_volumes(secrets: Path) -> dict[str, Path]:
    """The named volumes the `secrets` step mounts, each -> where it lies here: the folder of
    `secrets` (the step's DIR) the step mounts it at."""
    step = secrets_step_dir()
    volumes: dict[str, Path] = {}
    for volume in compose_file()["services"]["secrets"]["volumes"]:
        source, target = volume.split(":")[:2]
        if not source.startswith("."):
            assert Path(target).parent == Path(step), volume
            volumes[source] = secrets / Path(target).name
    return volumes


def compose_mounts(service: dict[str, Any], secrets: Path) -> dict[str, Path]:
    """A compose service's mounts, container path -> the path here: a bind mount's file, a volume of
    secrets as make-secrets.sh made it (under `secrets`); other named volumes are left out."""
    volumes = secret_volumes(secrets)
    mounts: dict[str, Path] = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if source in volumes:
            mounts[target] = volumes[source]
        elif source.startswith("."):
            mounts[target] = (COMPOSE.parent / source).resolve()
    return mounts


def on_host(path: str, mounts: dict[str, Path]) -> Path | None:
    """Where a path a container is told to read lies here, or None if no mount holds it."""
    for target, host in mounts.items():
        if path == target:
            return host
        if path.startswith(target + "/"):
            return host / path[len(target) + 1 :]
    return None


def make_compose_secrets(secrets: Path) -> subprocess.CompletedProcess[str]:
    """Runs the one-shot service `secrets` as compose would (its entrypoint and command, each path
    through its mounts), leaving ownership as it is (SECRETS_OWNER: this test need not be root)."""
    service = compose_file()["services"]["secrets"]
    mounts = {**compose_mounts(service, secrets), secrets_step_dir(): secrets}
    argv = [str(on_host(arg, mounts) or arg) for arg in [*service["entrypoint"], *service["command"]]]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "SECRETS_OWNER": ""}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def compose_config(service: dict[str, Any], mounts: dict[str, Path]) -> Config:
    """The configuration a compose service loads: its mounted file, its environment, and the
    secrets directory ASYNCINFER_SECRETS_DIR names, read through its mounts (load_config refuses
    an unknown key)."""
    environ = {k: str(v) for k, v in service["environment"].items()}
    (config_file,) = [host for target, host in mounts.items() if target.startswith("/etc/asyncinfer/")]
    secrets_dir = on_host(environ["ASYNCINFER_SECRETS_DIR"], mounts)
    assert secrets_dir is not None, "ASYNCINFER_SECRETS_DIR: no mount gives it"
    return load_config(config_file, environ=environ, secrets_dir=secrets_dir)


def operator_keys(secrets: Path) -> dict[str, str]:
    """The tenant's and the operator's API keys, as deploy/README.md has a user read them: its
    copy of the operator's api-keys.env, sourced by sh."""
    shown = subprocess.run(
        ["sh", "-c", '. "$1" && printf "%s\\n%s\\n" "$ASYNCINFER_API_KEY" "$ASYNCINFER_OPS_KEY"', "sh",
         str(secrets / "operator/api-keys.env")],
        capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    tenant, ops = shown.stdout.splitlines()
    return {"tenant": tenant, "ops": ops}


def file_settings(config: Config) -> dict[str, str]:
    """Every `*_file` setting a configuration gives a value: `section.key` -> the path."""
    found: dict[str, str] = {}
    for section in type(config).model_fields:
        values = getattr(config, section)
        for key in getattr(type(values), "model_fields", {}):
            if key.endswith("_file") and getattr(values, key):
                found[f"{section}.{key}"] = str(getattr(values, key))
    return found


def test_compose_file_builds_from_the_dockerfiles_with_health_ordering(tmp_path: Path) -> None:
    compose = compose_file()
    services = compose["services"]
    assert set(services) == {"secrets", "nats", "gateway", "scheduler", "batcher"}
    secrets = tmp_path / "secrets"
    make_compose_secrets(secrets)
    for name in SERVICES:
        svc = services[name]
        build = svc["build"]
        assert (
            COMPOSE.parent / build["context"] / build["dockerfile"]
        ).resolve() == DEPLOY / f"docker/{name}.Dockerfile"
        assert f"localhost:{SERVICES[name]}" in " ".join(svc["healthcheck"]["test"])
        assert all(
            dep["condition"] == ("service_completed_successfully" if dep_name == "secrets" else "service_healthy")
            for dep_name, dep in svc["depends_on"].items()
        )
        (config_target,) = [t for t in compose_mounts(svc, secrets) if t.startswith("/etc/asyncinfer/")]
        host = compose_mounts(svc, secrets)[config_target]
        assert host.is_file(), host
        # No key in the compose file: each service's come from its own volume (the secrets directory).
        assert not any("API_KEY" in key for key in svc["environment"]), name
        cfg = compose_config(svc, compose_mounts(svc, secrets))
        # Each binds 0.0.0.0 (the network between containers): keys are required to start.
        assert cfg.gateway.api_keys, name
        assert getattr(cfg, name).host == "0.0.0.0"
        if name == "batcher":  # its own key, of role batcher, for the scheduler's WorkerService
            assert cfg.batcher.api_key is not None
            own = KeyRing(cfg.gateway.api_keys).identify(bearer_metadata(cfg.batcher.api_key))
            assert own.role == "batcher"
        if name != "batcher":
            assert cfg.nats.url == "tls://nats:4222"
            assert cfg.nats.replicas == 1
        if name == "scheduler":  # its one nats-server's monitoring port (not the cluster's pods)
            assert cfg.scheduler.nats_monitor_urls == ["http://nats:8222"]
        else:
            assert cfg.batcher.scheduler_address == f"scheduler:{SERVICES['scheduler']}"
    assert services["batcher"]["depends_on"]["scheduler"] == {"condition": "service_healthy"}
    assert services["nats"]["depends_on"] == {"secrets": {"condition": "service_completed_successfully"}}
    assert services["nats"]["volumes"][0].split(":")[0] in compose["volumes"]
    # The one-shot step: root for the files' ownership alone (CHOWN), nothing else. It mounts every
    # volume of secrets, writable: its own `secrets` (the CA's key, every key and seed), which no other
    # service mounts, and one per service, which that service alone mounts, read-only; the
    # operator's, which no service mounts (deploy/README.md copies it out).
    step = services["secrets"]
    assert (step["user"], step["cap_drop"], step["cap_add"], step["read_only"]) == ("0:0", ["ALL"], ["CHOWN"], True)
    assert step["security_opt"] == ["no-new-privileges:true"]
    assert step["restart"] == "no"
    volumes = secret_volumes(secrets)
    assert {volume: path.name for volume, path in volumes.items()} == {
        "secrets": "all",
        **{f"secrets-{folder}": folder for folder in COMPOSE_VOLUME_FILES},
    }
    assert set(volumes) <= set(compose["volumes"])
    for name in ("nats", *SERVICES):
        mounted = [v for v in services[name]["volumes"] if v.split(":")[0] in volumes]
        assert mounted == [f"secrets-{name}:{COMPOSE_SECRETS}:ro"], name


def test_compose_runs_every_service_on_tls_with_the_files_it_mounts(tmp_path: Path) -> None:
    """The compose stack on TLS, as deploy/README.md's "By hand" section runs it, checked without
    Docker: its one-shot service `secrets` (make-secrets.sh, run here as compose runs it) makes the
    files; each service's ASYNCINFER_* variables are settings its configuration file takes
    (load_config refuses an unknown key); every file a setting or its health check names is one a
    mount gives it, and exists; the servers' certificates name what their clients dial; and a
    second run keeps every file (clients keep trusting the same CA, and the same keys)."""
    from cryptography import x509

    services = compose_file()["services"]
    secrets = tmp_path / "secrets"
    made = make_compose_secrets(secrets)
    assert "issued tls/gateway.pem" in made.stdout
    assert "made the API key api-keys/tenant-demo" in made.stdout
    ca = x509.load_pem_x509_certificate((secrets / "all/tls/ca.pem").read_bytes())

    def names_of(cert_file: Path) -> list[str]:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return [*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress))]

    for name in SERVICES:
        svc = services[name]
        mounts = compose_mounts(svc, secrets)
        assert all(key.startswith("ASYNCINFER_") for key in svc["environment"]), name
        assert svc["environment"]["ASYNCINFER_SECRETS_DIR"] == COMPOSE_SECRETS, name
        cfg = compose_config(svc, mounts)  # an unknown key is a ConfigError
        files = file_settings(cfg)
        for setting, path in files.items():
            host = on_host(path, mounts)
            assert host is not None, f"{name}: {setting} = {path}: no mount gives it"
            assert host.is_file(), f"{name}: {setting} = {path}: not made"
        health = svc["healthcheck"]["test"]
        for flag in ("--ca", "--cert", "--key"):
            if flag in health:
                host = on_host(health[health.index(flag) + 1], mounts)
                assert host is not None, f"{name}: the health check's {flag}: no mount gives it"
                assert host.is_file(), f"{name}: the health check's {flag}: not made"
        served = getattr(cfg, name)
        assert served.tls_cert_file, f"{name} serves plaintext"
        assert served.tls_key_file, name
        assert set(names_of(on_host(served.tls_cert_file, mounts))) >= {name, "localhost"}  # type: ignore[arg-type]
        # The generated keys: the tenant's and the operator's (its copy out) and the batchers'.
        ring = KeyRing(cfg.gateway.api_keys)
        keys = operator_keys(secrets)
        assert ring.identify(bearer_metadata(keys["tenant"])).tenant == "demo"
        assert ring.identify(bearer_metadata(keys["ops"])).role == "ops"
        assert {key.role for key in cfg.gateway.api_keys} == {"tenant", "ops", "batcher"}
        if name == "batcher":  # NATS-less; to its scheduler over mutual TLS
            assert cfg.batcher.scheduler_ca_file == f"{COMPOSE_SECRETS}/tls/ca.pem"
            assert cfg.batcher.scheduler_cert_file == f"{COMPOSE_SECRETS}/tls/batcher.pem"
            assert cfg.batcher.scheduler_key_file == f"{COMPOSE_SECRETS}/tls/batcher.key"
        else:
            assert cfg.nats.url.startswith("tls://"), name
            assert cfg.nats.tls_ca_file == f"{COMPOSE_SECRETS}/tls/ca.pem", name
            assert cfg.nats.nkey_seed_file == f"{COMPOSE_SECRETS}/nats/seeds/{name}.nk"
            assert cfg.nats.inbox_prefix == f"_INBOX_{name}"
        if name == "scheduler":
            assert cfg.scheduler.tls_client_ca_file == f"{COMPOSE_SECRETS}/tls/ca.pem"  # mutual TLS
            assert "--cert" in health
    nats = services["nats"]
    command = nats["command"]
    nats_mounts = compose_mounts(nats, secrets)
    conf = on_host(command[command.index("-c") + 1], nats_mounts)
    assert conf is not None
    text = conf.read_text()
    assert "tls {" in text
    assert "include ./nats-users.conf" in text
    assert (conf.parent / "nats-users.conf").is_file()
    for path in re.findall(r'_file: "([^"]+)"', text):
        host = on_host(path, nats_mounts)  # a path in the nats container: its own volume holds it
        assert host is not None, path
        assert host.is_file(), path
    assert set(names_of(secrets / "nats/tls/nats.pem")) >= {"nats", "localhost"}

    before = {p: p.read_bytes() for p in secrets.rglob("*") if p.is_file()}
    again = make_compose_secrets(secrets)
    assert "issued" not in again.stdout, again.stdout
    assert "made" not in again.stdout, again.stdout
    assert {p: p.read_bytes() for p in secrets.rglob("*") if p.is_file()} == before


def docs_copy_out_commands() -> list[tuple[str, list[str], str, str]]:
    """Each command of deploy/README.md and of the compose file's header that copies the operator's
    files out of the stack: (where, the files, the service it runs, the folder it reads them from)."""
    found = []
    for where, text in (("deploy/README.md", (DEPLOY / "README.md").read_text()), ("compose", COMPOSE.read_text())):
        loops = re.findall(
            r"for f in ([^;\n]+); do\s*(?:#\s*)?docker compose -f deploy/compose/docker-compose.yml "
            r"run --rm --no-deps -T --entrypoint cat (\S+) (\S+)/\$f > compose-tls/\$f",
            text,
        )
        assert loops, f"{where}: no copy-out command"
        found += [(where, files.split(), service, folder) for files, service, folder in loops]
    return found


def test_each_compose_service_gets_only_its_own_secrets_and_keys_are_random(tmp_path: Path) -> None:
    """make-secrets.sh gives each service's volume its own files alone (listed): no service can read
    another's private key, NKey seed or API key, the CA's key is in none of them, and the operator's
    files are in a volume no service mounts; its API keys are random (two fresh runs make different
    ones; a rerun keeps them: the test above); and deploy/README.md's copy-out commands name files
    the operator's volume holds, whose api-keys.env gives the keys the services accept."""
    first, second = tmp_path / "first", tmp_path / "second"
    make_compose_secrets(first)
    make_compose_secrets(second)
    volumes = {folder: first / folder for folder in COMPOSE_VOLUME_FILES}
    for folder, files in COMPOSE_VOLUME_FILES.items():
        held = {str(p.relative_to(volumes[folder])) for p in volumes[folder].rglob("*") if p.is_file()}
        assert held == files, folder
    # What is secret, whose it is: the private keys, the seeds, the API keys.
    made = first / "all"
    owners = {"ca": [made / "ca/ca.key"], "operator": [made / "api-keys/tenant-demo", made / "api-keys/ops"]}
    for name in ("nats", "gateway", "scheduler", "batcher"):
        owners[name] = [made / f"tls/{name}.key"]
    owners["operator"].append(made / "tls/ops.key")
    owners["gateway"].append(made / "nats/seeds/gateway.nk")
    owners["scheduler"].append(made / "nats/seeds/scheduler.nk")
    owners["batcher"].append(made / "api-keys/batcher")
    secret_texts = {owner: [path.read_text().strip() for path in paths] for owner, paths in owners.items()}
    for folder, volume in volumes.items():
        text = "\n".join(p.read_text() for p in volume.rglob("*") if p.is_file())
        for owner, texts in secret_texts.items():
            for secret in texts:
                assert (secret in text) == (owner == folder), f"{folder}'s volume and {owner}'s secret"
    for folder, volume in volumes.items():  # keys 0640 for the services' group; the operator's 0600
        for path in volume.rglob("*"):
            if path.is_file() and (path.suffix in (".key", ".nk", ".env") or "api_key" in path.name):
                assert path.stat().st_mode & 0o777 == (0o600 if folder == "operator" else 0o640), path
    assert all(path.stat().st_mode & 0o077 == 0 for path in made.rglob("*")), "the step's own volume is its alone"

    # Random: the keys, and so their SHA-256s the services read, differ between two stacks.
    keys = operator_keys(first)
    assert keys.keys() == operator_keys(second).keys()
    assert all(keys[who] != operator_keys(second)[who] for who in keys)
    assert (first / "batcher/batcher__api_key").read_text() != (second / "batcher/batcher__api_key").read_text()
    assert (first / "gateway/gateway__api_keys").read_text() != (second / "gateway/gateway__api_keys").read_text()
    assert len(set(keys.values())) == 2
    assert all(re.fullmatch(r"[0-9a-f]{48}", key) for key in keys.values())

    step = compose_file()["services"]["secrets"]
    step_mounts = {**compose_mounts(step, first), secrets_step_dir(): first}
    for where, files, service, folder in docs_copy_out_commands():
        assert service == "secrets", where  # the step's image and volumes: no running service holds them
        host = on_host(folder, step_mounts)
        assert host == first / "operator", f"{where}: {folder}"
        assert set(files) == COMPOSE_VOLUME_FILES["operator"], where
        assert all((host / f).is_file() for f in files), where
    readme = (DEPLOY / "README.md").read_text()
    assert ". compose-tls/api-keys.env" in readme
    assert "asyncinfer-local-" not in COMPOSE.read_text()


@contextlib.asynccontextmanager
async def compose_nats(secrets: Path, tmp_path: Path) -> AsyncIterator[int]:
    """nats-server on the file make-secrets.sh wrote (its store here, not at the container's /data;
    the files it names in its volume, here; its ports free ones): the client port, once it says it
    is ready."""
    volume = secret_volumes(secrets)["secrets-nats"]
    conf = volume / "nats/here.conf"  # beside the file, for its include
    text = (volume / "nats/nats.conf").read_text().replace('"/data"', f'"{tmp_path / "data"}"')
    conf.write_text(text.replace(f'"{COMPOSE_SECRETS}/', f'"{volume}/'))
    port = free_port()
    server = await asyncio.create_subprocess_exec(
        find_nats_server(), "-c", str(conf), "-p", str(port), "-m", str(free_port()),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert server.stderr is not None
    said: list[str] = []
    try:
        async with asyncio.timeout(30):
            while "Server is ready" not in (line := (await server.stderr.readline()).decode()):
                assert line, "nats-server exited:\n" + "".join(said)
                said.append(line)
        yield port
    finally:
        server.terminate()
        await server.wait()


async def test_the_compose_nats_server_takes_only_its_users_over_tls(tmp_path: Path) -> None:
    """The nats-server of the compose stack, on the file make-secrets.sh writes (its store and
    ports moved here): the gateway and the scheduler connect as their compose environment says
    (TLS verified against the stack's CA, each its own NKey user); a client without credentials,
    or without TLS, is refused."""
    from asyncinfer.errors import ConfigError, Unavailable
    from asyncinfer.nats.connection import connect

    services = compose_file()["services"]
    secrets = tmp_path / "secrets"
    make_compose_secrets(secrets)
    async with compose_nats(secrets, tmp_path) as port:
        for name in ("gateway", "scheduler"):
            svc = services[name]
            mounts = compose_mounts(svc, secrets)
            nats = compose_config(svc, mounts).nats
            here = nats.model_copy(
                update={
                    "url": f"tls://127.0.0.1:{port}",
                    **{key: str(on_host(getattr(nats, key), mounts)) for key in ("tls_ca_file", "nkey_seed_file")},
                }
            )
            client = await connect(here, name=name)
            try:
                assert (await client.jetstream().account_info()) is not None
            finally:
                await client.close()
        anonymous = Config().nats.model_copy(
            update={
                "url": f"tls://127.0.0.1:{port}",
                "tls_ca_file": str(secrets / "operator/ca.pem"),
                "connect_timeout_s": 1.0,
            }
        )
        with pytest.raises(ConfigError, match="refused this connection's credentials"):
            await connect(anonymous, name="anonymous")
        plaintext = anonymous.model_copy(update={"url": f"nats://127.0.0.1:{port}", "tls_ca_file": None})
        with pytest.raises((ConfigError, Unavailable)):
            await connect(plaintext, name="plaintext")


def image_command(service: str) -> list[str]:
    """The image's ENTRYPOINT and CMD (exec form), as its Dockerfile writes them."""
    lines = dockerfile(service).splitlines()
    entrypoint = json.loads(next(line for line in lines if line.startswith("ENTRYPOINT "))[len("ENTRYPOINT ") :])
    return [*entrypoint, *json.loads(next(line for line in lines if line.startswith("CMD "))[len("CMD ") :])]


@pytest.mark.timeout(300)
async def test_the_compose_services_run_together_on_tls_as_processes(tmp_path: Path) -> None:
    """The compose stack without Docker: nats-server on the file the `secrets` step writes, then the
    gateway, the scheduler and the batcher, each its image's command with its compose environment
    (every path through its mounts; each moved to a free loopback port, and NATS and the scheduler
    dialled there). Each health check, as compose runs it (TLS, the scheduler's with its own
    certificate), says SERVING; a demo job over TLS with the tenant key the `secrets` step made
    succeeds (so the batcher reached the scheduler over mutual TLS, with its generated key); the
    scheduler's OpsService answers an operator with the `ops` certificate and the generated ops key,
    and one without the certificate gets no answer. The client side uses the operator's files as
    deploy/README.md copies them out (the CA, ops.pem, api-keys.env)."""
    from asyncinfer.client import AsyncClient

    services = compose_file()["services"]
    secrets = tmp_path / "secrets"
    make_compose_secrets(secrets)
    ports = {name: free_port() for name in SERVICES}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    base_env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    started: list[asyncio.subprocess.Process] = []
    async with compose_nats(secrets, tmp_path) as nats_port:
        try:
            for name in ("gateway", "scheduler", "batcher"):
                svc = services[name]
                mounts = compose_mounts(svc, secrets)
                env = {**base_env}
                for key, value in svc["environment"].items():
                    env[key] = str(on_host(str(value), mounts) or value)
                section = name.upper()
                env.update(
                    {
                        f"ASYNCINFER_{section}__HOST": "127.0.0.1",
                        f"ASYNCINFER_{section}__PORT": str(ports[name]),
                        f"ASYNCINFER_{section}__METRICS_PORT": "0",
                        "ASYNCINFER_NATS__URL": f"tls://127.0.0.1:{nats_port}",
                        "ASYNCINFER_BATCHER__SCHEDULER_ADDRESS": f"127.0.0.1:{ports['scheduler']}",
                    }
                )
                argv = [str(on_host(arg, mounts) or arg) for arg in image_command(name)]
                with (tmp_path / f"{name}.stderr").open("wb") as stderr:
                    process = await asyncio.create_subprocess_exec(
                        *argv, env=env, cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=stderr
                    )
                started.append(process)
                assert process.stdout is not None
                async with asyncio.timeout(START_S):
                    printed = (await process.stdout.readline()).decode()
                assert printed.startswith(f"asyncinfer {name} serving on 127.0.0.1:{ports[name]}"), (
                    printed + (tmp_path / f"{name}.stderr").read_text()
                )
                test = svc["healthcheck"]["test"]
                assert test[:3] == ["CMD", "python", "/opt/asyncinfer/healthcheck.py"]
                args = [
                    f"localhost:{ports[name]}"
                    if arg == f"localhost:{SERVICES[name]}"
                    else str(on_host(arg, mounts) or arg)
                    for arg in test[3:]
                ]
                health = await asyncio.to_thread(load_healthcheck().main, args)
                assert health == 0, f"{name}'s health check: {args}"

            operator = secrets / "operator"
            keys = operator_keys(secrets)
            ca = str(operator / "ca.pem")
            async with AsyncClient(f"127.0.0.1:{ports['gateway']}", api_key=keys["tenant"], tls_ca_file=ca) as client:
                y = await client.run("demo", {"x": [[1, 2, 3, 4]]}, timeout_s=60)
            assert y["y"].tolist() == [[3.0, 5.0, 7.0, 9.0]]
            ops = [
                sys.executable, "-m", "asyncinfer", "--scheduler", f"127.0.0.1:{ports['scheduler']}", "--tls-ca", ca,
                "--ops-key", keys["ops"], "--timeout", "20",
            ]  # fmt: skip
            client_cert = ["--tls-cert", str(operator / "ops.pem"), "--tls-key", str(operator / "ops.key")]
            answered = await asyncio.to_thread(
                subprocess.run, [*ops, *client_cert, "stats", "--once"], capture_output=True, text=True, env=base_env
            )
            assert answered.returncode == 0, answered.stderr
            assert re.search(r"^demo\s", answered.stdout, re.M), answered.stdout
            refused = await asyncio.to_thread(
                subprocess.run, [*ops, "stats", "--once"], capture_output=True, text=True, env=base_env
            )
            assert refused.returncode == 5, refused.stderr  # mutual TLS: no certificate, no answer
            assert "--tls-cert" in refused.stderr, refused.stderr
        finally:
            for process in reversed(started):  # the batcher first, as compose stops them
                if process.returncode is None:
                    process.terminate()
                    await process.wait()


def load_healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_healthcheck", DEPLOY / "docker/healthcheck.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_image_healthcheck_follows_grpc_health() -> None:
    healthcheck = load_healthcheck()
    server = GrpcServer(host="127.0.0.1", port=0, add_servicers=lambda _server: None, service_names=[])
    await server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        assert await asyncio.to_thread(healthcheck.main, [address]) == 0
        await server.set_serving(False)
        serving, said = await asyncio.to_thread(healthcheck.is_serving, address)
        assert (serving, said) == (False, "NOT_SERVING")
        assert await asyncio.to_thread(healthcheck.main, [address, LIVENESS_SERVICE]) == 0  # not restarted for it
    finally:
        await server.stop(0)
    serving, said = await asyncio.to_thread(healthcheck.is_serving, address, "", 1.0)
    assert not serving
    assert said.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))


# --- dashboard -------------------------------------------------------------------------------------


def declared_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Metric name -> (type, label names), from the services' own metric classes."""
    from services.batcher.metrics import BatcherMetrics
    from services.gateway.metrics import GatewayMetrics
    from services.scheduler.metrics import SchedulerMetrics

    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for cls in (GatewayMetrics, SchedulerMetrics, BatcherMetrics):
        for value in vars(cls(CollectorRegistry())).values():
            if isinstance(value, MetricWrapperBase):
                # prometheus_client keeps these on the wrapper; there is no public accessor.
                found[value._name] = (value._type, tuple(value._labelnames))
    return found


def exported_name(name: str, kind: str) -> set[str]:
    return {"counter": {f"{name}_total"}, "histogram": {f"{name}_bucket", f"{name}_sum", f"{name}_count"}}.get(
        kind, {name}
    )


def test_dashboard_queries_only_metrics_and_labels_the_services_export() -> None:
    dashboard = json.loads((DEPLOY / "grafana/asyncinfer-dashboard.json").read_text())
    declared = declared_metrics()
    series = {exported: name for name, (kind, _) in declared.items() for exported in exported_name(name, kind)}
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    used: set[str] = set()
    for expr in exprs:
        names = set(re.findall(r"\basyncinfer_[a-z_]+", expr))
        assert names, expr
        unknown = names - set(series)
        assert not unknown, f"{expr}: {unknown} is not exported (known: {sorted(series)})"
        labels = {label for name in names for label in declared[series[name]][1]} | {"le"}
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            assert {g.strip() for g in group.split(",")} <= labels, expr
        for selector in re.findall(r"\{([^}]*)\}", expr):
            assert {m.split("=")[0].strip() for m in selector.split(",")} <= labels, expr
        if "histogram_quantile" in expr:
            assert "_bucket" in expr
            assert "le" in expr
        used |= {series[n] for n in names}
    required = {
        "asyncinfer_queue_depth",
        "asyncinfer_queue_oldest_age_seconds",
        "asyncinfer_batch_size",
        "asyncinfer_batch_fill_ratio",
        "asyncinfer_batch_compute_seconds",
        "asyncinfer_retries",
        "asyncinfer_dead_letters",
        "asyncinfer_jobs",
        "asyncinfer_desired_batchers",
    }
    assert required <= used
    # Panels do not overlap on Grafana's 24-column grid.
    cells = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))


# --- scale to zero, as KEDA sees it ----------------------------------------------------------------


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServerProcess]:
    """The conftest's server, with the monitoring endpoint KEDA's nats-jetstream scaler reads."""
    server = NatsServerProcess(store_dir=tmp_path / "nats", monitor_port=free_port(), log_file=tmp_path / "nats.log")
    server.start()
    try:
        yield server
    finally:
        server.kill()  # as the conftest's: a graceful stop waited ~0.11 s on a store nothing reads


def consumer_lag(monitor_port: int, stream: str, consumer: str) -> int:
    """What KEDA computes: num_pending + num_ack_pending of the consumer, from /jsz."""
    url = f"http://127.0.0.1:{monitor_port}/jsz?acc=$G&consumers=true&config=true"
    with urllib.request.urlopen(url, timeout=5) as response:
        jsz = json.load(response)
    for account in jsz.get("account_details", []):
        for detail in account.get("stream_detail", []):
            if detail["name"] != stream:
                continue
            for c in detail.get("consumer_detail", []):
                if c["name"] == consumer:
                    return int(c["num_pending"]) + int(c["num_ack_pending"])
    raise AssertionError(f"consumer {consumer} not in /jsz")


@pytest.fixture
async def stack_without_batchers(config: Config, start_stack: StartStack) -> Stack:
    return await start_stack(config.replace(scheduler={"queue_stats_interval_s": 0.1}), batcher=False)


async def test_jobs_wait_for_a_batcher_scaled_from_zero(
    nats_server: NatsServerProcess, stack_without_batchers: Stack
) -> None:
    stack = stack_without_batchers
    config, scheduler = stack.config, stack.scheduler
    assert nats_server.monitor_port
    x = tensor_pb2.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    x.contents.fp32_contents.extend([1, 2, 3, 4])
    jobs = stack.jobs
    ids = [
        (await jobs.SubmitJob(job_service_pb2.SubmitJobRequest(model_name="demo", inputs=[x]))).job.job_id
        for _ in range(3)
    ]
    consumer = work_consumer_name("demo", Priority.NORMAL)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:  # the scheduler's snapshot reaches the gateway within a few stats intervals
        job = (await jobs.GetJob(job_service_pb2.GetJobRequest(job_id=ids[0]))).job
        desired = scheduler.metrics.registry.get_sample_value("asyncinfer_desired_batchers", {"model": "demo"})
        if job.queue.waiting_reason == job_pb2.WAITING_REASON_NO_WORKER and desired:
            break
        assert loop.time() < deadline, (job.queue, desired)
        await asyncio.sleep(0.05)
    assert job.state == job_pb2.JOB_STATE_QUEUED
    assert desired is not None
    assert desired >= 1
    lag = await asyncio.to_thread(consumer_lag, nats_server.monitor_port, config.nats.work_stream, consumer)
    assert lag == 3  # > activationLagThreshold (0): KEDA activates the pool

    await stack.start_batcher()
    for job_id in ids:
        watch = jobs.WatchJob(job_service_pb2.WatchJobRequest(job_id=job_id))
        last = None
        async for update in watch:
            last = update.job.state
        assert last == job_pb2.JOB_STATE_SUCCEEDED
    assert stack.batcher is not None
    await stack.batcher.stop(2.0)  # the pool scales back to zero
    assert await asyncio.to_thread(consumer_lag, nats_server.monitor_port, config.nats.work_stream, consumer) == 0
    deadline = loop.time() + 10
    while scheduler.metrics.registry.get_sample_value("asyncinfer_desired_batchers", {"model": "demo"}) != 0:
        assert loop.time() < deadline, "desired_batchers never fell back to zero"
        await asyncio.sleep(0.05)
