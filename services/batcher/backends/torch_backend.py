"""The local torch backend: a `module:factory` loader, device placement, and numpy <-> torch."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from asyncinfer.config import ModelConfig
from asyncinfer.errors import ConfigError, ModelError
from asyncinfer.tensors import ModelSignature
from services.batcher.backends import Arrays, check_outputs


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}") from None


def import_factory(loader: str) -> Any:
    module_name, _, attr = loader.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"model loader {loader!r}: cannot import {module_name!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"model loader {loader!r}: module {module_name!r} has no {attr!r}") from None


class TorchBackend:
    """Runs an nn.Module in eval mode under torch.inference_mode.

    A module with one input is called as module(x); with several, by keyword (input names). Its
    result may be a tensor (the single declared output), a mapping by output name, or a
    tuple/list in declared order. BYTES inputs are passed as numpy object arrays (text models
    tokenize them themselves)."""

    def __init__(self, name: str, module: torch.nn.Module, signature: ModelSignature, device: torch.device) -> None:
        self.name = name
        self._signature = signature
        self.device = device
        self._module = module.to(device).eval()

    @classmethod
    def load(cls, model: ModelConfig, *, torch_threads: int = 0) -> TorchBackend:
        if torch_threads > 0:
            # Process-wide in torch; the batcher serves all its models from one pool.
            torch.set_num_threads(torch_threads)
        factory = import_factory(model.loader)
        if not callable(factory):
            raise ConfigError(f"model loader {model.loader!r} is not callable")
        try:
            module = factory()
        except Exception as exc:
            raise ConfigError(f"model loader {model.loader!r} failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"model loader {model.loader!r} returned {type(module).__name__}, not a torch.nn.Module")
        return cls(model.name, module, model.signature, resolve_device(model.device))

    @property
    def signature(self) -> ModelSignature:
        return self._signature

    def infer_batch(self, inputs: Arrays) -> Arrays:
        try:
            with torch.inference_mode():
                args = {name: self._to_torch(array) for name, array in inputs.items()}
                if len(self._signature.inputs) == 1:
                    result = self._module(args[self._signature.inputs[0].name])
                else:
                    result = self._module(**args)
                outputs = self._map_outputs(result)
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(f"model {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        check_outputs(self.name, outputs, self._signature)
        return outputs

    def close(self) -> None:
        # Drop the module so its (device) memory can be freed.
        del self._module

    def _to_torch(self, array: np.ndarray[Any, Any]) -> Any:
        if array.dtype.kind in ("O", "S", "U"):
            return array
        if not array.flags.writeable:
            # torch warns on read-only numpy buffers (and could write through them).
            array = array.copy()
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _map_outputs(self, result: Any) -> Arrays:
        names = [spec.name for spec in self._signature.outputs]
        if isinstance(result, Mapping):
            pairs = dict(result.items())
        elif isinstance(result, Sequence) and not isinstance(result, str | bytes):
            if len(result) != len(names):
                raise ModelError(
                    f"model {self.name!r} returned {len(result)} outputs, but its signature declares {len(names)}"
                )
            pairs = dict(zip(names, result, strict=True))
        elif len(names) == 1:
            pairs = {names[0]: result}
        else:
            raise ModelError(
                f"model {self.name!r} returned one {type(result).__name__}, but its signature declares "
                f"{len(names)} outputs; return a dict or a tuple"
            )
        return {str(name): _to_numpy(self.name, str(name), value) for name, value in pairs.items()}


def _to_numpy(model: str, name: str, value: Any) -> np.ndarray[Any, Any]:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").numpy()
    if isinstance(value, np.ndarray):
        return value
    raise ModelError(f"model {model!r} output {name!r} is a {type(value).__name__}, not a tensor")
