"""The benchmark's models, built the same way in every process (fixed seed)."""

from __future__ import annotations

import os

import torch

from asyncinfer.config import ModelConfig, TensorSpecConfig


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(512, 2048),
            torch.nn.ReLU(),
            torch.nn.Linear(2048, 2048),
            torch.nn.ReLU(),
            torch.nn.Linear(2048, 512),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def build_mlp() -> torch.nn.Module:
    return MLP().eval()


class Light(torch.nn.Module):
    """The MLP's signature (512 in, 512 out) at almost no compute: a batch through the whole system
    with it measures what the services cost per record, the ceiling a fast accelerator would meet."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def build_light() -> torch.nn.Module:
    return Light().eval()


def bench_device() -> str:
    """The device every server and direct run of the benchmark uses: $BENCH_DEVICE (bench/gpu.sh
    sets cuda), else the batcher's default (auto: CUDA when present)."""
    return os.environ.get("BENCH_DEVICE", "auto")


def torch_device() -> torch.device:
    """bench_device() as torch names it (auto resolved)."""
    device = bench_device()
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def mlp_config(max_batch_size: int, delay_ms: float) -> ModelConfig:
    return ModelConfig(
        name="mlp",
        loader="bench.batcher_models:build_mlp",
        max_batch_size=max_batch_size,
        max_queue_delay_ms=delay_ms,
        max_queue_size=1024,
        # One batch at a time, like the single model instance Triton gets: on a small CPU machine
        # a second batch computing beside the first only splits the cores, and closes small.
        max_inflight_batches=1,
        device=bench_device(),
        inputs=(TensorSpecConfig(name="x", datatype="FP32", shape=(-1, 512)),),
        outputs=(TensorSpecConfig(name="y", datatype="FP32", shape=(-1, 512)),),
    )


def minilm_config(max_batch_size: int, delay_ms: float) -> ModelConfig:
    from services.batcher.backends.minilm import MINILM_MODEL

    return MINILM_MODEL.model_copy(
        update={
            "max_batch_size": max_batch_size,
            "max_queue_delay_ms": delay_ms,
            "max_queue_size": 1024,
            "max_inflight_batches": 1,
            "device": bench_device(),
        }
    )
