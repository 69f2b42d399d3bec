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
