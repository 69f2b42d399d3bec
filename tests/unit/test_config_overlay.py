"""The configuration's overlays (asyncinfer/config_overlay.py, pydantic-settings): a key from a file
in the secrets directory, the environment on top of it and of the TOML file, and errors that name
the variable or file at fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncinfer.api_keys import hash_key
from asyncinfer.config import load_config
from asyncinfer.errors import ConfigError

pytestmark = pytest.mark.unit

ACME = {"tenant": "acme", "sha256": hash_key("acme-key"), "name": "from a secret"}


def kubernetes_secret(directory: Path, files: dict[str, str]) -> Path:
    """`files` laid out as the kubelet mounts a Secret: each a link into ..data, a link to a
    timestamped directory (hidden names, which must not be read as keys)."""
    stamped = directory / "..2026_12_01_12_00_00.000000001"
    stamped.mkdir(parents=True)
    (directory / "..data").symlink_to(stamped.name)
    for name, text in files.items():
        (stamped / name).write_text(text)
        (directory / name).symlink_to(f"..data/{name}")
    return directory


def test_keys_come_from_files_in_the_secrets_directory(tmp_path: Path) -> None:
    secrets = kubernetes_secret(
        tmp_path / "secrets",
        {
            "gateway__api_keys": json.dumps([ACME]) + "\n",
            "nats__password": "s3cret\n",  # the newline an editor leaves is not part of it
            "ASYNCINFER_NATS__USER": "svc",  # the environment's name works as a file name too
            "tls.crt": "not configuration",
        },
    )
    config = load_config(environ={"ASYNCINFER_SECRETS_DIR": str(secrets)})
    assert [(k.tenant, k.sha256, k.name) for k in config.gateway.api_keys] == [
        ("acme", ACME["sha256"], "from a secret")
    ]
    assert (config.nats.user, config.nats.password) == ("svc", "s3cret")
    # The argument names the directory as well as the environment.
    assert load_config(environ={}, secrets_dir=secrets) == config


def test_the_environment_wins_over_a_secret_which_wins_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "asyncinfer.toml"
    path.write_text('[nats]\nurl = "nats://file:4222"\npassword = "from-file"\nuser = "file-user"\n')
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "nats__password").write_text("from-secret")
    (secrets / "nats__user").write_text("secret-user")

    config = load_config(path, environ={"ASYNCINFER_SECRETS_DIR": str(secrets)})
    assert (config.nats.url, config.nats.user, config.nats.password) == (
        "nats://file:4222",
        "secret-user",
        "from-secret",
    )

    environ = {"ASYNCINFER_SECRETS_DIR": str(secrets), "ASYNCINFER_NATS__PASSWORD": "from-env"}
    config = load_config(path, environ=environ)
    # Key by key: the environment's password, the secret's user, the file's URL.
    assert (config.nats.url, config.nats.user, config.nats.password) == ("nats://file:4222", "secret-user", "from-env")


def test_environment_values_are_read_by_the_keys_type() -> None:
    config = load_config(
        environ={
            "ASYNCINFER_GATEWAY__PORT": "6001",
            "asyncinfer_scheduler__hold_pulls_open": "false",  # names are not case-sensitive
            "ASYNCINFER_BATCHER__SCHEDULER_ADDRESS": "null",
            "ASYNCINFER_NATS__TOKEN": "123456",  # a string key keeps a number-like value as text
            "ASYNCINFER_WEBHOOKS__ALLOWED_NETWORKS": '["10.0.0.0/8"]',
            "ASYNCINFER_GATEWAY__API_KEYS": json.dumps([ACME]),
            "ASYNCINFER_GATEWAY_ADDRESS": "not configuration: the client CLI's",
            "ASYNCINFER_NATS_FASTPATH": "0",
        }
    )
    assert config.gateway.port == 6001
    assert config.scheduler.hold_pulls_open is False
    assert config.batcher.scheduler_address is None
    assert config.nats.token == "123456"
    assert config.webhooks.allowed_networks == ("10.0.0.0/8",)
    assert config.gateway.api_keys[0].tenant == "acme"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"ASYNCINFER_GATEWAY__PORT": "-3"}, r"gateway\.port: Input should be greater than or equal to 0"),
        ({"ASYNCINFER_GATEWAY__PORT": "six"}, r"gateway\.port: Input should be a valid integer"),
        ({"ASYNCINFER_GATEWAY__PROT": "1"}, r"gateway\.prot: unknown key; did you mean 'port'\?"),
        ({"ASYNCINFER_GATEWAY__API_KEYS": "acme"}, r"gateway\.api_keys: Input should be a valid tuple: the value"),
        (  # a TOML table pasted where JSON goes: said "Input should be a valid tuple" alone
            {"ASYNCINFER_GATEWAY__API_KEYS": '[[gateway.api_keys]]\ntenant = "acme"\nsha256 = "..."'},
            r"gateway\.api_keys: Input should be a valid tuple: the value given is text that is not JSON; .* "
            r'a list or table is JSON, e\.g\. \[\{"tenant": "acme", "sha256": "\.\.\."\}\]',
        ),
        ({"ASYNCINFER_WEBHOOKS__ALLOWED_NETWORKS": "10.0.0.0/8"}, r"allowed_networks: .*text that is not JSON"),
        ({"ASYNCINFER_GATEWAY__API_KEYS": '[{"tenant": "a"}]'}, r"gateway\.api_keys\.0\.sha256: Field required"),
        ({"ASYNCINFER_GATEWAYS__PORT": "1"}, r"ASYNCINFER_GATEWAYS__PORT names no section; the sections are nats,"),
        ({"ASYNCINFER_MODELS__NAME": "x"}, r"ASYNCINFER_MODELS__NAME overrides a key of \[models\], which is not a"),
        ({"ASYNCINFER_SECRETS_DIR": "/no/such/dir"}, r"secrets directory /no/such/dir: .*does not exist"),
    ],
)
def test_a_bad_override_names_its_key(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(environ=environ)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[gateway]\nportt = 6000\n", r"^invalid configuration: gateway\.portt: unknown key; did you mean 'port'\?"),
        ("[gatway]\nport = 6000\n", r"^invalid configuration: gatway: unknown section; did you mean 'gateway'\?"),
        (
            '[[models]]\nname = "m"\nloader = "a.b:c"\nmax_batch_sise = 4\n',
            r"models\.0\.max_batch_sise: unknown key; did you mean 'max_batch_size'\?",
        ),
        (
            '[[gateway.api_keys]]\nsha256 = "%s"\nrol = "ops"\n' % ("0" * 64),
            r"api_keys\.0\.rol: .*did you mean 'role'\?",
        ),
        ("[gateway]\nzzz = 1\n", r"gateway\.zzz: unknown key \(`asyncinfer config` prints every one, commented\)$"),
    ],
)
def test_a_key_no_section_has_is_named_with_the_nearest_one(tmp_path: Path, text: str, message: str) -> None:
    """A typo in a file's key said pydantic's "Extra inputs are not permitted"."""
    path = tmp_path / "typo.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, environ={})


def test_a_secret_file_that_names_no_section_stops_start_up(tmp_path: Path) -> None:
    (tmp_path / "nat__password").write_text("typo")
    with pytest.raises(ConfigError, match=r"nat__password names no section"):
        load_config(environ={}, secrets_dir=tmp_path)
    (tmp_path / "nat__password").unlink()
    (tmp_path / "gateway__port").write_text("0x10")
    with pytest.raises(ConfigError, match=r"gateway\.port: Input should be a valid integer"):
        load_config(environ={}, secrets_dir=tmp_path)


def test_the_overlay_reads_the_configurations_prefix() -> None:
    from asyncinfer import config, config_overlay

    assert config_overlay.ENV_PREFIX == config.ENV_PREFIX
