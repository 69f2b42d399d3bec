"""The local torch backend: loaders (`module:factory`, TorchScript files), device placement, and numpy <-> torch.

On CUDA, inputs go through pinned host memory with non-blocking copies and outputs come back
the same way, synchronised once per batch; everything runs under torch.inference_mode. Each
thread that computes batches (max_inflight_batches of them) does so on a CUDA stream of its own,
so a batch waits for its own copies and kernels only: on one shared stream, two batches at once
each waited for the other's too, and ran at 0.36x of one thread's direct torch calls on an H200
(bench/results/backend_overhead_gpu.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncinfer.config import ModelConfig
from asyncinfer.errors import ConfigError, ModelError
from asyncinfer.tensors import ModelSignature
from services.batcher.backends import Arrays, ModelBackend, check_outputs
from services.batcher.progress import ProgressReporter

TORCHSCRIPT_PREFIX = "torchscript:"


def resolve_device(device: str, *, cuda_available: bool | None = None) -> torch.device:
    """auto: CUDA when present, else CPU. Asking for CUDA where there is none is a ConfigError
    (rather than a failure at the first batch)."""
    has_cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if device == "auto":
        return torch.device("cuda" if has_cuda else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}") from None
    if resolved.type == "cuda" and not has_cuda:
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available here")
    return resolved


def import_factory(loader: str) -> Any:
    module_name, _, attr = loader.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"model loader {loader!r}: cannot import {module_name!r}: {exc}{_import_hint(exc, module_name)}"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"model loader {loader!r}: module {module_name!r} has no {attr!r}") from None


def _import_hint(exc: ImportError, module_name: str) -> str:
    """What to do about a module the batcher's Python does not find: `No module named 'mypkg'` (README
    "Adding a model", the package not on PYTHONPATH) said nothing of where it was looked for."""
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if not missing:
        return ""
    if module_name == missing or module_name.startswith(f"{missing}."):  # the loader's own package
        what = f"install {missing!r} there (pip install -e) or put the folder holding it on PYTHONPATH"
    else:  # a module the loader's package imports
        what = f"install {missing!r} there"
    return f" (the batcher imports with {sys.executable}: {what})"


def torch_device_for(model: ModelConfig, *, torch_threads: int = 0) -> torch.device:
    """The device the model runs on; sets torch's thread count first when one is configured."""
    if torch_threads > 0:
        # Process-wide in torch; the batcher serves all its models from one pool.
        torch.set_num_threads(torch_threads)
    return resolve_device(model.device)


def load_torch_backend(model: ModelConfig, *, torch_threads: int = 0) -> TorchBackend:
    """Loads the model its loader names, `module:factory` or `torchscript:` (blocking). ConfigError
    when it cannot. Built-in models are services.batcher.backends.loading's."""
    device = torch_device_for(model, torch_threads=torch_threads)
    loader = model.loader
    if loader.startswith(TORCHSCRIPT_PREFIX):
        return TorchBackend(model.name, _load_torchscript(loader, device), model.signature, device)
    return TorchBackend(model.name, _load_factory(loader), model.signature, device)


def _load_torchscript(loader: str, device: torch.device) -> torch.nn.Module:
    path = Path(loader[len(TORCHSCRIPT_PREFIX) :])
    if not path.is_file():
        raise ConfigError(f"model loader {loader!r}: no such file {str(path)!r}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch deprecates TorchScript; files remain
            module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise ConfigError(f"model loader {loader!r}: not a TorchScript file: {type(exc).__name__}: {exc}") from exc
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"model loader {loader!r} holds a {type(module).__name__}, not a module")
    return module


def _load_factory(loader: str) -> torch.nn.Module:
    factory = import_factory(loader)
    if not callable(factory):
        raise ConfigError(f"model loader {loader!r} is not callable")
    try:
        module = factory()
    except Exception as exc:
        raise ConfigError(f"model loader {loader!r} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"model loader {loader!r} returned {type(module).__name__}, not a torch.nn.Module")
    return module


class TorchBackend(ModelBackend):
    """Runs an nn.Module in eval mode under torch.inference_mode.

    A module with one input is called as module(x); with several, by keyword (input names). Its
    result may be a tensor (the single declared output), a mapping by output name, or a
    tuple/list in declared order. BYTES inputs are passed as numpy object arrays (text models
    tokenize them themselves). A module whose forward has a `progress` parameter reports
    progress: it is called with `progress=` a ProgressReporter (services.batcher.progress)."""

    def __init__(self, name: str, module: torch.nn.Module, signature: ModelSignature, device: torch.device) -> None:
        super().__init__(name, signature)
        self.device = device
        self._cuda = device.type == "cuda"
        self._module = module.to(device).eval()
        self._takes_progress = _takes_progress(module)
        self._streams = threading.local()
        if self._cuda:
            # The weights were copied on the default stream; the batches' streams do not wait for it.
            torch.cuda.synchronize(device)

    @property
    def reports_progress(self) -> bool:
        return self._takes_progress

    @classmethod
    def load(cls, model: ModelConfig, *, torch_threads: int = 0) -> TorchBackend:
        return load_torch_backend(model, torch_threads=torch_threads)

    def infer_batch(self, inputs: Arrays) -> Arrays:
        return self._infer(inputs, None)

    def infer_batch_reporting(self, inputs: Arrays, progress: ProgressReporter) -> Arrays:
        return self._infer(inputs, progress if self._takes_progress else None)

    def _infer(self, inputs: Arrays, progress: ProgressReporter | None) -> Arrays:
        try:
            with torch.inference_mode(), self._own_stream():
                args = {name: self.to_device(array) for name, array in inputs.items()}
                if progress is not None:
                    args["progress"] = progress
                result = self.forward(args)
                outputs = self._map_outputs(result)
        except ModelError:
            raise
        except (Exception, SystemExit) as exc:  # a module calling sys.exit fails its batch, not the batcher
            raise ModelError(f"model {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        check_outputs(self.name, outputs, self._signature)
        return outputs

    def forward(self, args: dict[str, Any]) -> Any:
        if len(self._signature.inputs) == 1:
            if "progress" in args:
                return self._module(args[self._signature.inputs[0].name], progress=args["progress"])
            return self._module(args[self._signature.inputs[0].name])
        return self._module(**args)

    def close(self) -> None:
        # Drop the module so its (device) memory can be freed.
        self._module = torch.nn.Module()

    @contextlib.contextmanager
    def _own_stream(self) -> Iterator[None]:
        """On CUDA, this thread's stream as the current one (made at its first batch)."""
        if not self._cuda:
            yield
            return
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            yield

    def to_device(self, array: np.ndarray[Any, Any]) -> Any:
        if array.dtype.kind in ("O", "S", "U"):
            return array
        if self._cuda:
            # Pinned memory lets the copy to the device run asynchronously to the host. A
            # read-only array (a chunk's part is a view of its order's bytes) is copied into it
            # once, rather than copied to be writable and then pinned.
            if array.flags.writeable:
                return torch.from_numpy(np.ascontiguousarray(array)).pin_memory().to(self.device, non_blocking=True)
            host = torch.empty(array.shape, dtype=_torch_dtype(array.dtype), pin_memory=True)
            host.numpy()[...] = array
            return host.to(self.device, non_blocking=True)
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
        if self._cuda:
            pinned = {str(k): _to_host_async(v) for k, v in pairs.items()}
            torch.cuda.current_stream(self.device).synchronize()  # the copies above were non-blocking
            pairs = pinned
        return {str(name): _to_numpy(self.name, str(name), value) for name, value in pairs.items()}


def _takes_progress(module: torch.nn.Module) -> bool:
    """Whether the module's forward has a `progress` parameter (TorchScript modules never do)."""
    if isinstance(module, torch.jit.ScriptModule):
        return False
    try:
        return "progress" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


@functools.cache
def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _to_host_async(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "cuda":
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        return host
    return value


def _to_numpy(model: str, name: str, value: Any) -> np.ndarray[Any, Any]:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").numpy()
    if isinstance(value, np.ndarray):
        return value
    raise ModelError(f"model {model!r} output {name!r} is a {type(value).__name__}, not a tensor")
