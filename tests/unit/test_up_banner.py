"""`up`'s banner names the models that did not load: a stack whose own factory could not be
imported printed "asyncinfer is up" with every model listed, and its jobs waited for ever."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from asyncinfer.config import DEMO_MODEL, Config
from services.up.banner import banner

pytestmark = pytest.mark.unit


def apps(**batcher: Any) -> dict[str, Any]:
    served = {name: SimpleNamespace(port=1, metrics_port=0) for name in ("gateway", "scheduler", "console")}
    return {**served, "batcher": SimpleNamespace(port=1, metrics_port=0, **batcher)}


def test_the_banner_names_the_models_that_did_not_load() -> None:
    mine = DEMO_MODEL.model_copy(update={"name": "mine", "loader": "mypkg.models:build"})
    config = Config().replace(models=[DEMO_MODEL, mine])
    failure = "model loader 'mypkg.models:build': cannot import 'mypkg.models': No module named 'mypkg'"
    lines = banner(config, apps(load_failures={"mine": failure}), "nats://127.0.0.1:4222").splitlines()
    assert any(line.split() == ["models", "demo"] for line in lines)
    (not_loaded,) = [line for line in lines if "NOT LOADED" in line]
    assert not_loaded.split()[:3] == ["NOT", "LOADED:", "mine"]
    assert "No module named 'mypkg'" in not_loaded

    every = banner(config, apps(load_failures={}), "nats://127.0.0.1:4222")
    assert "NOT LOADED" not in every


def test_a_gateway_on_every_address_with_keys_is_shown_reachable_with_its_key() -> None:
    from asyncinfer.api_keys import hash_key

    keys = [{"tenant": "acme", "sha256": hash_key("k")}]
    config = Config().replace(gateway={"host": "0.0.0.0", "api_keys": keys})
    text = banner(config, apps(load_failures={}), "nats://127.0.0.1:4222", ca_file="ca.pem")
    submit = next(line for line in text.splitlines() if "JobService/SubmitJob" in line)
    assert " 127.0.0.1:1 " in submit, "0.0.0.0 is no address to dial"
    assert "-cacert ca.pem -H 'authorization: Bearer YOUR_KEY'" in submit


def test_with_tracing_on_the_banner_says_where_spans_go_and_how_the_console_links_them() -> None:
    """`up` with tracing.enabled said nothing of it (its tracing_on lines are not shown on a terminal),
    and the console showed trace IDs as text with no word of console.trace_url: `up` sets none of its
    own (an OTLP endpoint names a collector, not the viewer a person opens), so the banner says how."""
    off = banner(Config(), apps(load_failures={}), "nats://127.0.0.1:4222", environ={})
    assert "traces" not in off

    on = Config().replace(tracing={"enabled": True})
    lines = banner(on, apps(load_failures={}), "nats://127.0.0.1:4222", environ={}).splitlines()
    assert (
        "  traces (OpenTelemetry)         made, not exported: set tracing.otlp_endpoint or $OTEL_EXPORTER_OTLP_ENDPOINT"
        in lines
    )
    assert (
        "  trace links (console)          none (trace IDs as text): set console.trace_url, for Jaeger "
        "ASYNCINFER_CONSOLE__TRACE_URL='http://localhost:16686/trace/{trace_id}'"
    ) in lines
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4317"}
    lines = banner(on, apps(load_failures={}), "nats://127.0.0.1:4222", environ=environ).splitlines()
    assert "  traces (OpenTelemetry)         exported to http://localhost:4317 (OTLP/gRPC)" in lines
    linked = on.replace(
        tracing={"enabled": True, "otlp_endpoint": "http://collector:4317"},
        console={"trace_url": "http://jaeger:16686/trace/{trace_id}"},
    )
    lines = banner(linked, apps(load_failures={}), "nats://127.0.0.1:4222", environ=environ).splitlines()
    assert "  traces (OpenTelemetry)         exported to http://collector:4317 (OTLP/gRPC)" in lines
    assert "  trace links (console)          http://jaeger:16686/trace/{trace_id}" in lines


def test_the_banner_shows_how_to_submit_with_the_cli() -> None:
    """A first-hour pass (session 33): the banner showed only grpcurl with a base64 body to submit a
    job, where README's first command is the CLI's `submit demo -i 'x=[[1,2,3,4]]' --wait`."""
    lines = banner(Config(), apps(load_failures={}), "nats://127.0.0.1:4222", environ={}).splitlines()
    (submit,) = [line for line in lines if " submit " in line]
    assert submit.startswith("  "), submit
    assert submit.endswith("asyncinfer submit demo -i 'x=[[1,2,3,4]]' --wait"), submit
    assert lines[lines.index(submit) - 1].startswith("Or with the CLI")
    from asyncinfer.api_keys import hash_key
    from asyncinfer.config import MINILM_MODEL

    guarded = Config().replace(
        models=[MINILM_MODEL],
        gateway={"api_keys": [{"tenant": "acme", "sha256": hash_key("k")}]},
    )
    text = banner(guarded, apps(load_failures={}), "nats://127.0.0.1:4222", ca_file="ca.pem", environ={})
    (submit,) = [line for line in text.splitlines() if " submit " in line]
    assert submit.endswith(
        "asyncinfer submit minilm-l6 -i 'text=The quick brown fox jumps over the lazy dog.' --wait "
        "--tls-ca ca.pem --api-key YOUR_KEY"
    ), submit
