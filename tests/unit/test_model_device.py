"""A model's device, checked with the configuration file by every service: a mistyped one fails
at start-up (whether CUDA is there is the batcher's to find, when it loads the model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer.config import load_config
from asyncinfer.errors import ConfigError

pytestmark = pytest.mark.unit


def write(tmp_path: Path, device: str) -> Path:
    path = tmp_path / "asyncinfer.toml"
    path.write_text(
        f"""
[[models]]
name = "demo"
loader = "services.batcher.models.demo:build_demo_model"
device = "{device}"
inputs = [{{ name = "x", datatype = "FP32", shape = [-1, 4] }}]
outputs = [{{ name = "y", datatype = "FP32", shape = [-1, 4] }}]
"""
    )
    return path


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7"])
def test_a_models_device_is_one_the_batcher_knows(tmp_path: Path, device: str) -> None:
    model = load_config(write(tmp_path, device), environ={}).model("demo")
    assert model is not None
    assert model.device == device


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "tpu-ish", ""])
def test_a_mistyped_device_is_refused_with_the_file(tmp_path: Path, device: str) -> None:
    with pytest.raises(ConfigError, match=r"models\.0\.device: .* is not auto, cpu, cuda or cuda:N"):
        load_config(write(tmp_path, device), environ={})
