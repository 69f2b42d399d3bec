"""What `up` adds to the configuration it was given (services/up/defaults.py), decided on the file as
written even after `up --dev-tls` replaced settings (Config.replace keeps what was set)."""

from __future__ import annotations

import contextvars
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from asyncinfer.config import FLAKY_MODEL, Config, load_config
from asyncinfer.errors import ConfigError
from services.dev_ca import DevTls, with_dev_tls
from services.up.banner import banner
from services.up.defaults import with_up_defaults
from services.up.stack import InContext

pytestmark = pytest.mark.unit


def load_config_file(tmp_path: Path, extra: str = "") -> Config:
    path = tmp_path / "asyncinfer.toml"
    path.write_text(f'[embedded_nats]\nstore_dir = "{tmp_path / "data" / "nats"}"\n{extra}')
    return load_config(path, environ={})


def test_up_batcher_moves_claim_checked_bytes_unless_the_file_says_otherwise(tmp_path: Path) -> None:
    config = load_config_file(tmp_path)
    assert not config.batcher.claim_check_io  # off by default elsewhere
    assert with_up_defaults(config).batcher.claim_check_io
    chosen = load_config_file(tmp_path, "[batcher]\nclaim_check_io = false\n")
    assert not with_up_defaults(chosen).batcher.claim_check_io


def test_up_batcher_does_not_exit_for_a_hung_model_unless_the_file_says_so(tmp_path: Path) -> None:
    # Its exit would stop every service of `up`, and nothing restarts `up`.
    config = load_config_file(tmp_path)
    assert config.batcher.exit_after_overrun_s == 120.0
    assert with_up_defaults(config).batcher.exit_after_overrun_s == 0.0
    chosen = load_config_file(tmp_path, "[batcher]\nexit_after_overrun_s = 30\n")
    assert with_up_defaults(chosen).batcher.exit_after_overrun_s == 30.0


def test_up_services_give_up_at_once_on_a_nats_they_cannot_reach_unless_the_file_says_otherwise(
    tmp_path: Path,
) -> None:
    # `up` starts its own nats-server before them: one they cannot reach is not coming, and `up`
    # said so after 3 tries before the default's wait (60 s, for a NATS started apart) came.
    config = load_config_file(tmp_path)
    assert config.nats.first_connect_wait_s == 60.0
    assert with_up_defaults(config).nats.first_connect_wait_s == 0.0
    chosen = load_config_file(tmp_path, "[nats]\nfirst_connect_wait_s = 15\n")
    assert with_up_defaults(chosen).nats.first_connect_wait_s == 15.0


def test_up_keeps_objects_bytes_in_a_directory_beside_its_store_unless_the_file_says_otherwise(
    tmp_path: Path,
) -> None:
    config = load_config_file(tmp_path)
    assert config.nats.objects_directory is None  # off by default elsewhere
    chosen = with_up_defaults(config).nats.objects_directory
    assert chosen == str(tmp_path / "data" / "objects")
    assert Path(chosen).is_dir()  # made: the services check that it exists
    own = tmp_path / "own"
    assert with_up_defaults(
        load_config_file(tmp_path, f'[nats]\nobjects_directory = "{own}"\n')
    ).nats.objects_directory == str(own)
    in_the_stream = load_config_file(tmp_path, '[nats]\nobjects_directory = ""\n')
    assert in_the_stream.nats.objects_directory is None
    assert with_up_defaults(in_the_stream).nats.objects_directory is None


def test_replace_keeps_what_the_file_set_plus_what_it_replaces(tmp_path: Path) -> None:
    config = load_config_file(tmp_path, "[batcher]\nport = 9999\n")
    copy = config.replace(gateway={"port": 1}, batcher={"claim_check_io": False})
    assert "models" not in copy.model_fields_set
    assert {"embedded_nats", "gateway", "batcher"} <= copy.model_fields_set
    assert copy.gateway.model_fields_set == {"port"}
    assert copy.batcher.model_fields_set == {"port", "claim_check_io"}
    assert (copy.gateway.port, copy.batcher.port, copy.batcher.claim_check_io) == (1, 9999, False)


def test_defaults_are_decided_on_the_file_as_written_after_dev_tls(tmp_path: Path) -> None:
    config = load_config_file(tmp_path)
    tls = DevTls(tmp_path / "tls")
    with_tls = with_dev_tls(config, tls)
    assert "models" not in with_tls.model_fields_set  # the TLS settings do not look like declared models
    upped = with_up_defaults(with_tls)
    assert FLAKY_MODEL.name in {model.name for model in upped.models}
    assert upped.batcher.claim_check_io
    assert upped.gateway.tls_cert_file == str(tls.cert_file)


def test_up_on_loopback_lets_webhooks_reach_a_receiver_on_this_machine(tmp_path: Path) -> None:
    config = load_config_file(tmp_path)
    assert config.webhooks.allowed_networks == ()  # elsewhere loopback URLs are refused
    assert with_up_defaults(config).webhooks.allowed_networks == ("127.0.0.0/8", "::1/128")
    chosen = load_config_file(tmp_path, '[webhooks]\nallowed_networks = ["10.0.0.0/8"]\n')
    assert with_up_defaults(chosen).webhooks.allowed_networks == ("10.0.0.0/8",)
    keyed = load_config_file(
        tmp_path, '[[gateway.api_keys]]\nsha256 = "' + "a" * 64 + '"\nname = "k"\ntenant = "acme"\n'
    )
    assert with_up_defaults(keyed).webhooks.allowed_networks == ()  # callers are not all on this machine


def up_apps(failures: dict[str, str]) -> dict[str, Any]:
    """Stand-ins for `up`'s apps as the banner reads them, wrapped as `up` wraps them (InContext)."""
    apps: dict[str, Any] = {}
    for name, port in (("gateway", 1), ("scheduler", 2), ("batcher", 3), ("console", 4)):
        app = SimpleNamespace(port=port, metrics_port=9100 + port, supervisor=None, load_failures={})
        if name == "batcher":
            app.load_failures = failures
        apps[name] = InContext(app, contextvars.copy_context())  # type: ignore[arg-type]
        apps[name].port, apps[name].metrics_port = port, 9100 + port
    return apps


def test_the_banner_names_a_model_that_did_not_load_and_lines_up_its_columns(tmp_path: Path) -> None:
    """`up` wraps each app (InContext): the banner read the wrapper's load_failures, always none,
    so a model that failed to load was listed among those served (a first-hour pass, session 25)."""
    config = with_up_defaults(load_config_file(tmp_path))
    failing = config.models[0].name
    apps = up_apps({failing: "ModuleNotFoundError: No module named 'mypkg'"})
    printed = banner(config, apps, "nats://127.0.0.1:4222").splitlines()
    served = next(line for line in printed if line.startswith("  models "))
    assert failing not in served.replace(",", " ").split()
    assert any(line.startswith(f"  NOT LOADED: {failing}") and "mypkg" in line for line in printed)
    columns = {line.index("http://") for line in printed if "/metrics" in line}
    assert columns == {next(line for line in printed if "JobService" in line).index("127.0.0.1")}


def test_the_banner_says_why_a_model_did_not_load_to_its_end(tmp_path: Path) -> None:
    """The first-hour pass, session 38: the reason was cut at 100 characters, "... No module named
    'mypkg' (the batch…", which left out what to do. Wrapped now, under the reason's column."""
    config = with_up_defaults(load_config_file(tmp_path))
    failing = config.models[0].name
    reason = (
        "model loader 'mypkg.models:build': cannot import 'mypkg.models': No module named 'mypkg' (the batcher "
        "imports with /work/h3/.venv/bin/python: install 'mypkg' there (pip install -e) or put the folder "
        "holding it on PYTHONPATH)"
    )
    printed = banner(config, up_apps({failing: reason}), "nats://127.0.0.1:4222").splitlines()
    at = next(i for i, line in enumerate(printed) if line.startswith(f"  NOT LOADED: {failing}"))
    column = printed[at].index("model loader")
    said = [printed[at][column:]]
    for line in printed[at + 1 :]:
        if line[:column].strip():  # the next row of the banner
            break
        said.append(line[column:])
    assert " ".join(said) == reason, printed
    assert all(len(line) <= 33 + 90 for line in printed[at : at + len(said)]), printed


def test_the_banner_shows_a_cli_submit_for_a_stack_of_the_users_own_models(tmp_path: Path) -> None:
    """A first-hour pass, session 38: `up --config my.toml` serving the model of README's "Adding a
    model" alone printed no command to try it (only demo's or minilm-l6's). The first model that
    loaded, and whose inputs are small enough to write out, gets one, its values made up."""
    models = {
        "broken": ("FP32", "[-1, 3]"),
        "images": ("FP32", "[-1, 3, 224, 224]"),  # too many values to write out
        "twice": ("FP32", "[-1, 3]"),
    }
    tables = "".join(
        f'[[models]]\nname = "{name}"\nloader = "mypkg.models:build"\n'
        f'inputs = [{{name = "x", datatype = "{datatype}", shape = {shape}}}]\n'
        f'outputs = [{{name = "y", datatype = "FP32", shape = [-1, 3]}}]\n'
        for name, (datatype, shape) in models.items()
    )
    tagger = (
        '[[models]]\nname = "tagger"\nloader = "mypkg.models:tag"\n'
        'inputs = [{name = "text", datatype = "BYTES", shape = [-1]}, {name = "on", datatype = "BOOL", shape = [-1, 2]}]\n'
        'outputs = [{name = "y", datatype = "FP32", shape = [-1, 3]}]\n'
    )

    def cli_line(extra: str) -> str:
        config = with_up_defaults(load_config_file(tmp_path, extra))
        printed = banner(config, up_apps({"broken": "ModuleNotFoundError"}), "nats://127.0.0.1:4222").splitlines()
        at = printed.index(
            "Or with the CLI, which waits and prints the finished job (asyncinfer --help: its other commands):"
        )
        return printed[at + 1].split(" submit ", 1)[1]

    assert cli_line(tables) == "twice -i 'x=[[0,0,0]]' --wait"
    assert cli_line(tagger) == "tagger -i 'text=hello' -i 'on=[[false,false]]' --wait"


def test_up_scheduler_reads_its_embedded_servers_monitoring_port_unless_the_file_says_otherwise(
    tmp_path: Path,
) -> None:
    # JetStream's API has no limit for `up`'s users (the global account): the server's own is read.
    config = load_config_file(tmp_path)
    assert config.scheduler.nats_monitor_urls == []  # not read by default elsewhere
    assert with_up_defaults(config).scheduler.nats_monitor_urls == ["http://127.0.0.1:8222"]
    moved = load_config_file(tmp_path, 'host = "0.0.0.0"\nmonitor_port = 9333\n')  # under [embedded_nats]
    assert with_up_defaults(moved).scheduler.nats_monitor_urls == ["http://127.0.0.1:9333"]
    off = load_config_file(tmp_path, "monitor_port = 0\n")
    assert with_up_defaults(off).scheduler.nats_monitor_urls == []
    chosen = load_config_file(tmp_path, '[scheduler]\nnats_monitor_urls = ["http://nats.example:8222"]\n')
    assert with_up_defaults(chosen).scheduler.nats_monitor_urls == ["http://nats.example:8222"]


@pytest.mark.parametrize("left_behind", ["", "\n"], ids=["empty", "blank"])
def test_the_generated_webhook_secret_is_written_readable_by_its_owner_only(tmp_path: Path, left_behind: str) -> None:
    """A secret file that exists but holds no secret (an interrupted first start, a `touch`) is
    written again: with its own mode it would keep, say, 0644, and the secret be world-readable."""
    config = load_config_file(tmp_path)
    path = tmp_path / "data" / "webhook-secret"
    path.parent.mkdir(parents=True)
    path.write_text(left_behind)
    path.chmod(0o644)
    secret = with_up_defaults(config).webhooks.secret_for(config.gateway.default_tenant)
    assert secret is not None
    assert secret.startswith("whsec_")
    assert path.read_text() == secret + "\n"
    assert path.stat().st_mode & 0o777 == 0o600
    # Nothing else left beside it (but `up`'s objects' directory, made beside its store too).
    assert sorted(p.name for p in path.parent.iterdir()) == ["objects", "webhook-secret"]
    # And a fresh one is 0600 from the start, kept across restarts.
    path.unlink()
    first = with_up_defaults(config).webhooks.secret_for(config.gateway.default_tenant)
    assert path.stat().st_mode & 0o777 == 0o600
    assert with_up_defaults(config).webhooks.secret_for(config.gateway.default_tenant) == first


@pytest.mark.parametrize(
    ("left_behind", "why"),
    [
        ("whsec_c2hvcnQ=\n", "a webhook secret holds 24 to 64 random bytes"),
        ("my-receivers-secret\n", "webhook secrets start with 'whsec_' (Standard Webhooks)"),
        (None, "Is a directory"),
    ],
    ids=["cut-short", "edited", "a-folder"],
)
def test_a_generated_webhook_secret_file_that_holds_no_secret_is_named(
    tmp_path: Path, left_behind: str | None, why: str
) -> None:
    """`up` ended in pydantic's ValidationError traceback (with the bad value printed in it), or an
    IsADirectoryError one; it is named, and not replaced behind the back of a receiver given it."""
    config = load_config_file(tmp_path)
    path = tmp_path / "data" / "webhook-secret"
    if left_behind is None:
        path.mkdir(parents=True)
    else:
        path.parent.mkdir(parents=True)
        path.write_text(left_behind)
    with pytest.raises(ConfigError) as refused:
        with_up_defaults(config)
    message = refused.value.message
    assert message.startswith(f"{path}, the webhook secret an earlier `asyncinfer up` generated, holds no secret ("), (
        message
    )
    assert why in message
    assert "delete it for `up` to generate a new one" in message
    assert "my-receivers-secret" not in message
    assert left_behind is None or path.read_text() == left_behind
