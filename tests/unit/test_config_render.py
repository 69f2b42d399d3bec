"""The configuration as a file: `asyncinfer config`'s TOML (every line valid uncommented, read back
unchanged), its problems as read (a whole-file problem without an empty location), a model's version."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from asyncinfer.config import DEMO_MODEL, Config, ModelConfig, load_config, render_default_config
from asyncinfer.errors import ConfigError

pytestmark = pytest.mark.unit

KEY_LINE = re.compile(r"^# ([a-z_]+ = .*)$")


def test_every_commented_key_parses_uncommented_and_means_unset() -> None:
    rendered = render_default_config()
    uncommented = "\n".join(
        match.group(1) if (match := KEY_LINE.match(line)) else line for line in rendered.splitlines()
    )
    assert uncommented != rendered, "the render has commented keys (unset ones)"
    assert "# tls_ca_file = " in rendered
    again = Config.model_validate(tomllib.loads(uncommented))
    assert unset_as_none(again.model_dump()) == unset_as_none(Config().model_dump()), "an empty value is unset"


def unset_as_none(value: object) -> object:
    if isinstance(value, dict):
        return {key: unset_as_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [unset_as_none(item) for item in value] or None
    return None if value == "" else value


def test_a_problem_of_the_whole_file_reads_without_an_empty_location(tmp_path: Path) -> None:
    path = tmp_path / "asyncinfer.toml"
    path.write_text(
        '[[models]]\nname = "twice"\ninputs = [{ name = "x", datatype = "FP32", shape = [-1, 4] }]\n'
        'outputs = [{ name = "y", datatype = "FP32", shape = [-1, 4] }]\n'
        'steps = [{ model = "demo", inputs = { x = "x" }, outputs = { y = "y" } }]\n'
    )
    with pytest.raises(ConfigError) as refused:
        load_config(path, environ={})
    assert str(refused.value).startswith("invalid configuration: pipeline 'twice' step 1 (demo): no model 'demo'")
    assert "Value error" not in str(refused.value)


@pytest.mark.parametrize("version", ["v 3", "1.0", "*", ""])
def test_a_models_own_version_is_checked_as_its_versions_entries_are(version: str) -> None:
    # A version is a token of NATS subjects and registry keys: "v 3" loaded, then failed every
    # registry write (the gateway never learnt it).
    with pytest.raises(ValidationError, match="versions are 1-64 letters"):
        ModelConfig.model_validate({**DEMO_MODEL.model_dump(), "version": version})


def test_a_key_unset_against_a_set_default_reads_back_unset(tmp_path: Path) -> None:
    # A standalone batcher's file (scheduler_address unset, the tests' own config too) was written
    # with the key commented out, and read back as its default, 127.0.0.1:50052: the batcher took
    # work from whatever scheduler listened there (a real `up`'s, on a machine running one).
    path = tmp_path / "batcher.toml"
    path.write_text(render_default_config(Config().replace(batcher={"scheduler_address": None})))
    assert not load_config(path, environ={}).batcher.scheduler_address
    path.write_text(render_default_config())
    assert load_config(path, environ={}).batcher.scheduler_address == "127.0.0.1:50052"
