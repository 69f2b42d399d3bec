"""The torch threads a batcher sets (services.batcher.backends.loading.torch_threads_for): torch's
default, unless its torch models compute several batches at once, when the batches share the cores,
or all compute on a GPU, when one thread does the host's side."""

from __future__ import annotations

import pytest

from asyncinfer.config import DEMO_MODEL, BatcherConfig, ModelConfig, ModelVersionConfig
from services.batcher.backends import loading

pytestmark = pytest.mark.unit


def torch_threads_for(batcher: BatcherConfig, models: list[ModelConfig], cores: int, *, gpu: bool = False) -> int:
    """loading.torch_threads_for on a machine with or without a CUDA device (for device = "auto")."""
    return loading.torch_threads_for(batcher, models, cores, cuda_available=lambda: gpu)


def model(name: str, at_once: int, **fields: object) -> ModelConfig:
    return DEMO_MODEL.model_copy(update={"name": name, "max_inflight_batches": at_once, **fields})


def test_one_batch_at_a_time_keeps_torchs_default() -> None:
    assert torch_threads_for(BatcherConfig(), [model("a", 1), model("b", 1)], cores=8) == 0


def test_several_batches_at_once_share_the_cores() -> None:
    assert torch_threads_for(BatcherConfig(), [model("a", 2)], cores=2) == 1
    assert torch_threads_for(BatcherConfig(), [model("a", 2), model("b", 4)], cores=16) == 4
    assert torch_threads_for(BatcherConfig(), [model("a", 3)], cores=2) == 1  # at least one


def test_a_configured_count_wins() -> None:
    assert torch_threads_for(BatcherConfig(torch_threads=3), [model("a", 2)], cores=2) == 3


def test_triton_models_do_not_count() -> None:
    remote = model("r", 4, backend="triton", triton_url="127.0.0.1:8001")
    assert torch_threads_for(BatcherConfig(), [remote, model("a", 1)], cores=8) == 0


def test_a_versions_own_setting_counts() -> None:
    versioned = model("a", 1, versions=(ModelVersionConfig(version="2", max_inflight_batches=2),))
    assert torch_threads_for(BatcherConfig(), [versioned], cores=4) == 2


def test_models_that_all_compute_on_a_gpu_leave_one_thread_to_the_host_side() -> None:
    assert torch_threads_for(BatcherConfig(), [model("a", 2, device="cuda")], cores=16) == 1
    assert torch_threads_for(BatcherConfig(), [model("a", 1), model("b", 2)], cores=16, gpu=True) == 1  # auto
    assert torch_threads_for(BatcherConfig(), [model("a", 2)], cores=16, gpu=False) == 8  # auto, no GPU here
    # A model on the CPU beside them needs the cores: the rule for CPU models applies.
    mixed = [model("a", 2, device="cuda:0"), model("b", 2, device="cpu")]
    assert torch_threads_for(BatcherConfig(), mixed, cores=16, gpu=True) == 8
    assert torch_threads_for(BatcherConfig(torch_threads=4), [model("a", 1, device="cuda")], cores=16) == 4
