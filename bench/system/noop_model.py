"""A no-op model for the end-to-end benchmark: returns its input, so that every figure measures
the system (gateway, NATS, scheduler, batcher) and not the model. Declared as

    ModelConfig(name="noop", loader="bench.system.noop_model:build", inputs x FP32 [-1, 4], outputs y FP32 [-1, 4])

The services import it from the repository root (they run there as `python -m services.cli`).
torch is imported only by `build`, so the benchmark driver can use `noop_model_config` without it."""

from __future__ import annotations

from typing import Any

from asyncinfer.config import ModelConfig, TensorSpecConfig


def build() -> Any:
    import torch

    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    return Identity()


def noop_model_config(**overrides: Any) -> ModelConfig:
    """The no-op model with the product's defaults for batching (max batch 32, delay 2 ms)."""
    fields: dict[str, Any] = {
        "name": "noop",
        "loader": "bench.system.noop_model:build",
        "inputs": (TensorSpecConfig(name="x", datatype="FP32", shape=(-1, 4)),),
        "outputs": (TensorSpecConfig(name="y", datatype="FP32", shape=(-1, 4)),),
        **overrides,
    }
    return ModelConfig(**fields)
