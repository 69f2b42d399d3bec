"""`asyncinfer config`'s TOML: every line is valid TOML uncommented, and reads back unchanged."""

from __future__ import annotations

import re
import tomllib

import pytest

from asyncinfer.config import Config, render_default_config

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
