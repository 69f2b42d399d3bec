"""deploy/ (issue 17): the keys, certificates, NATS TLS and per-service NATS users are wired as
mounted Secrets, never in a ConfigMap. For every overlay: every file a service is pointed at lies
in a Secret volume; every Secret a workload needs is made by the overlay, issued by a cert-manager
Certificate, or one of the few the README says to create; no ConfigMap holds a private key, an
NKey seed, a webhook secret or a password; each service mounts only its own certificate and NATS
seed (the console has no NATS user, nor do batchers but in an overlay whose batchers move
claim-checked bytes themselves); cert-manager's Certificates validate and
name what the others dial; the NATS users are asyncinfer.nats_users' (the file is fresh); the
local overlay's NKey seeds match the public keys NATS is given; the exec health check speaks TLS."""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from asyncinfer.grpc_server import GrpcServer
from asyncinfer.nats_users import INBOX_PREFIXES
from tests.certs import TestCA
from tests.test_deploy import (
    CLAIM_CHECK_BATCHERS,
    K8S,
    OVERLAYS,
    SECRET_DIR,
    SECRET_ENV,
    config_map,
    container,
    load_healthcheck,
    load_toml,
    mounted_config,
    nats_conf,
    of_kind,
    pool_config,
    render,
    service_of,
)

# What an operator creates before applying a production overlay (deploy/README.md); a local
# overlay makes them itself.
EXPECTED_SECRETS = {
    "asyncinfer-secrets",
    "asyncinfer-batcher-key",
    "nats-gateway-nkey",
    "nats-scheduler-nkey",
    "nats-users",
    "nats-batcher-nkey",  # with components/batcher-claim-checks
}
NATS_TLS_DIR = "/etc/nats-tls"
# What must never appear in a ConfigMap: private keys, NKey seeds, webhook secrets, passwords.
SECRET_PATTERNS = (
    re.compile(r"PRIVATE KEY"),
    re.compile(r"\bS[UACNO][A-Z2-7]{50,}\b"),  # an NKey seed (user, account, cluster, operator)
    re.compile(r"whsec_[A-Za-z0-9+/=]{16,}"),  # a webhook secret (the descriptions say "whsec_...")
    re.compile(r"(?im)^\s*(password|token)\s*[=:]\s*\S"),
    re.compile(r"asyncinfer-local-(demo|batcher)-key"),
)
NATS_SERVICES = {"gateway", "scheduler"}


def nats_services(overlay: str) -> set[str]:
    """The services that connect to NATS in the overlay (each as its own user)."""
    return NATS_SERVICES | ({"batcher"} if overlay in CLAIM_CHECK_BATCHERS else set())


def workloads(docs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    found = {**of_kind(docs, "Deployment"), **of_kind(docs, "StatefulSet")}
    found.pop("triton", None)  # NVIDIA's server, not ours
    return found


def secret_volumes(pod: dict[str, Any]) -> dict[str, str]:
    """volume name -> Secret name."""
    return {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}


def mounts(c: dict[str, Any]) -> dict[str, str]:
    """mount path -> volume name."""
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def volume_of(path: str, c: dict[str, Any]) -> str | None:
    """The volume a file path lies in (the deepest mount above it)."""
    best = None
    for mount_path, volume in mounts(c).items():
        if path.startswith(mount_path.rstrip("/") + "/") and (best is None or len(mount_path) > len(best[0])):
            best = (mount_path, volume)
    return best[1] if best else None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_is_mounted_from_a_secret_and_exists(overlay: str) -> None:
    docs = render(overlay)
    made = set(of_kind(docs, "Secret"))
    issued = {c["spec"]["secretName"] for c in of_kind(docs, "Certificate").values()}
    for name, workload in workloads(docs).items():
        pod = workload["spec"]["template"]["spec"]
        secrets = secret_volumes(pod)
        c = container(workload)
        referenced = set(secrets.values())
        for env in c.get("env", []):
            value = env.get("value", "")
            if env["name"].endswith("_FILE") or value.startswith((SECRET_DIR, NATS_TLS_DIR)):
                volume = volume_of(value, c)
                assert volume in secrets, f"{overlay}: {name}: {env['name']}={value} is not in a Secret volume"
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                referenced.add(ref["name"])
            if env["name"] in SECRET_ENV or ("KEY" in env["name"] and "FILE" not in env["name"]):
                assert "value" not in env, f"{overlay}: {name}: {env['name']} inline"
        for secret in referenced:
            assert secret in made | issued | EXPECTED_SECRETS, f"{overlay}: {name} needs {secret}, which nothing makes"
            if overlay == "local":
                assert secret in made | issued, f"local must be self-contained: {secret}"
        # Each service its own certificate; NATS seeds only where NATS is used; the CA key nowhere.
        service = "nats" if name == "nats" else service_of(name)
        tls = [s for s in secrets.values() if s.endswith("-tls")]
        assert tls == [f"{service}-tls"], (overlay, name, tls)
        nkeys = sorted(s for s in referenced if s.endswith("-nkey"))
        assert nkeys == ([f"nats-{service}-nkey"] if service in nats_services(overlay) else []), (overlay, name, nkeys)
        assert "asyncinfer-ca" not in referenced
        if service not in nats_services(overlay) | {"nats"}:
            assert not any(e["name"].startswith("ASYNCINFER_NATS__") for e in c.get("env", [])), name
        for mount in c.get("volumeMounts", []):
            if mount["name"] in secrets:
                assert mount.get("readOnly") is True, (name, mount)
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] == 0o440, (name, volume)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nothing_secret_is_in_a_config_map(overlay: str) -> None:
    for name, cm in of_kind(render(overlay), "ConfigMap").items():
        for key, text in cm.get("data", {}).items():
            for pattern in SECRET_PATTERNS:
                assert not pattern.search(text), f"{overlay}: ConfigMap {name} key {key} matches {pattern.pattern}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_services_load_their_configuration_with_the_mounted_files(overlay: str, tmp_path: Path) -> None:
    """The environment the Deployments set (paths into the Secrets) is valid configuration, and
    turns on TLS everywhere and each NATS user's NKey."""
    docs = render(overlay)
    for name, workload in workloads(docs).items():
        if name == "nats":
            continue
        c = container(workload)
        environ = {
            e["name"]: e["value"] for e in c.get("env", []) if "value" in e and e["name"].startswith("ASYNCINFER_")
        }
        service = service_of(name)
        _key, text = mounted_config(docs, workload)  # the file it mounts
        cfg = load_toml(text, tmp_path, {**SECRET_ENV, **environ})
        if service in ("gateway", "scheduler", "batcher"):
            section = getattr(cfg, service)
            assert section.tls_cert_file == f"{SECRET_DIR}/tls/tls.crt", name
            assert section.tls_key_file == f"{SECRET_DIR}/tls/tls.key", name
        if service in nats_services(overlay):
            assert cfg.nats.tls_ca_file == f"{SECRET_DIR}/tls/ca.crt"
            assert cfg.nats.nkey_seed_file == f"{SECRET_DIR}/nats/seed"
            assert cfg.nats.inbox_prefix == INBOX_PREFIXES[service]  # what its NATS user may subscribe to
        if service == "batcher":
            assert cfg.batcher.scheduler_ca_file == f"{SECRET_DIR}/tls/ca.crt"
            assert cfg.batcher.scheduler_cert_file == f"{SECRET_DIR}/tls/tls.crt"  # mutual TLS
            assert cfg.batcher.scheduler_key_file == f"{SECRET_DIR}/tls/tls.key"
            assert cfg.batcher.api_key_file == f"{SECRET_DIR}/keys/key"
            assert cfg.batcher.claim_check_io is (overlay in CLAIM_CHECK_BATCHERS)
            assert cfg.gateway.api_keys, "the stack's key list: the scheduler checks the batcher's key"
        if service == "scheduler":
            assert cfg.gateway.api_keys
            assert cfg.scheduler.tls_client_ca_file == f"{SECRET_DIR}/tls/ca.crt"  # mutual TLS
        if service == "console":
            assert cfg.console.tls_ca_file == f"{SECRET_DIR}/tls/ca.crt"
            assert cfg.console.tls_cert_file == f"{SECRET_DIR}/tls/tls.crt"


@functools.cache
def cert_manager_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((K8S / "schemas/cert-manager.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def covers(names: list[str], host: str) -> bool:
    return any(fnmatch.fnmatchcase(host, pattern) and pattern.count(".") == host.count(".") for pattern in names)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cert_manager_issues_a_certificate_for_what_each_service_is_dialled_at(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    certificates = of_kind(docs, "Certificate")
    issuers = of_kind(docs, "Issuer")
    for doc in (*certificates.values(), *issuers.values()):
        jsonschema.validate(doc, cert_manager_schema())
        assert doc["metadata"]["namespace"] == "asyncinfer"
    for cert in certificates.values():
        assert cert["spec"]["issuerRef"]["name"] in issuers
    by_secret = {c["spec"]["secretName"]: c["spec"] for c in certificates.values()}
    assert by_secret["asyncinfer-ca"]["isCA"] is True
    main = load_toml(config_map(docs)["asyncinfer.toml"], tmp_path, SECRET_ENV)
    dialled = {
        "gateway-tls": [main.console.gateway_address.rsplit(":", 1)[0], "localhost"],
        "scheduler-tls": [main.console.scheduler_address.rsplit(":", 1)[0], "localhost"],
        "batcher-tls": ["localhost"],
        "nats-tls": [u.split("://")[1].rsplit(":", 1)[0] for u in main.nats.url.split(",")],
    }
    for name, workload in of_kind(docs, "Deployment").items():
        if name.startswith("batcher-"):
            address = pool_config(docs, workload, tmp_path).batcher.scheduler_address
            assert address is not None
            dialled["scheduler-tls"].append(address.rsplit(":", 1)[0])
    for secret, hosts in dialled.items():
        for host in hosts:
            assert covers(by_secret[secret]["dnsNames"], host), (overlay, secret, host)
    # Routes, and every client of the scheduler (which requires certificates), authenticate with theirs.
    for secret in ("nats-tls", "batcher-tls", "console-tls", "scheduler-tls", "ops-tls"):
        assert "client auth" in by_secret[secret]["usages"], secret


def test_the_cert_manager_schema_rejects_a_misspelt_field() -> None:
    cert = of_kind(render("production"), "Certificate")["gateway-tls"]
    broken = json.loads(json.dumps(cert))
    broken["spec"]["dnsName"] = broken["spec"].pop("dnsNames")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, cert_manager_schema())


def test_the_nats_users_are_asyncinfer_nats_users_and_the_file_is_fresh() -> None:
    spec = importlib.util.spec_from_file_location("generate_config", K8S / "generate_config.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    conf = nats_conf(render("production"))
    assert conf == module.nats_conf(), "run deploy/k8s/generate_config.py"
    assert "nkey: $GATEWAY_NKEY" in conf
    assert "nkey: $SCHEDULER_NKEY" in conf
    assert "no_auth_user" not in conf
    nats = of_kind(render("production"), "StatefulSet")["nats"]
    env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container(nats)["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert env == {k: {"name": "nats-users", "key": k} for k in ("GATEWAY_NKEY", "SCHEDULER_NKEY")}
    # With the batchers' user: the component's file, and the public key from the same Secret.
    for overlay in CLAIM_CHECK_BATCHERS:
        conf = nats_conf(render(overlay))
        assert conf == module.nats_conf(batcher=True), "run deploy/k8s/generate_config.py"
        assert "nkey: $BATCHER_NKEY" in conf
        nats = of_kind(render(overlay), "StatefulSet")["nats"]
        refs = [e["valueFrom"]["secretKeyRef"] for e in container(nats)["env"] if e["name"] == "BATCHER_NKEY"]
        assert refs == [{"name": "nats-users", "key": "BATCHER_NKEY"}]


def test_the_local_nkey_seeds_are_the_users_nats_is_given() -> None:
    import nkeys

    secrets = {
        name: {k: base64.b64decode(v).decode() for k, v in s["data"].items()}
        for name, s in of_kind(render("local"), "Secret").items()
    }
    for service in NATS_SERVICES:
        seed = secrets[f"nats-{service}-nkey"]["seed"]
        public = nkeys.from_seed(bytearray(seed.encode())).public_key.decode()
        assert secrets["nats-users"][f"{service.upper()}_NKEY"] == public


async def test_the_health_check_speaks_tls(tmp_path: Path) -> None:
    healthcheck = load_healthcheck()
    ca = TestCA(tmp_path / "pki")
    pem = ca.issue("server")
    from asyncinfer.tls import read_bytes

    credentials = grpc.ssl_server_credentials([(read_bytes(pem.key_file, "key"), read_bytes(pem.cert_file, "cert"))])
    server = GrpcServer(
        host="127.0.0.1", port=0, add_servicers=lambda _server: None, service_names=[], credentials=credentials
    )
    await server.start()
    address = f"localhost:{server.port}"
    try:
        assert await asyncio.to_thread(healthcheck.main, ["--ca", ca.ca_file, address]) == 0
        serving, said = await asyncio.to_thread(healthcheck.is_serving, address, "", 2.0)  # plaintext
        assert not serving
        other = TestCA(tmp_path / "other")
        serving, said = await asyncio.to_thread(healthcheck.is_serving, address, "", 2.0, ca_file=other.ca_file)
        assert not serving, said
    finally:
        await server.stop(0)


def test_every_generated_config_file_is_fresh() -> None:
    """The TOML files and nats.conf the manifests mount are what generate_config.py writes now (a
    new config key or NATS permission shows up here, not first in a cluster)."""
    spec = importlib.util.spec_from_file_location("generate_config", K8S / "generate_config.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    files = module.generated_files()
    assert len(files) >= 5
    stale = [str(path.relative_to(K8S)) for path, text in files.items() if path.read_text() != text]
    assert stale == [], "run: .venv/bin/python deploy/k8s/generate_config.py"
