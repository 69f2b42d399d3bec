"""Which backend serves a configured model: Triton when `backend = "triton"`, else torch with the
model's loader, where `builtin:NAME` names one of the models shipped here (BUILTIN_MODELS).

The built-in models subclass the torch backend, so they are chosen here, above both, rather than
in torch_backend (which they import). Backends are imported when chosen: a batcher serving only
Triton models needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from asyncinfer.config import BatcherConfig, ModelConfig
from asyncinfer.errors import ConfigError
from services.batcher.backends import ModelBackend

BUILTIN_PREFIX = "builtin:"


def _minilm_l6(model: ModelConfig, torch_threads: int) -> ModelBackend:
    from services.batcher.backends.minilm import MiniLMBackend
    from services.batcher.backends.torch_backend import torch_device_for

    return MiniLMBackend.load_builtin(model, torch_device_for(model, torch_threads=torch_threads))


def _minilm_l6_doc(model: ModelConfig, torch_threads: int) -> ModelBackend:
    from services.batcher.backends.minilm_doc import MiniLMDocBackend
    from services.batcher.backends.torch_backend import torch_device_for

    return MiniLMDocBackend.load_builtin(model, torch_device_for(model, torch_threads=torch_threads))


# Built-in model name -> its loader (model, torch_threads) -> backend.
BUILTIN_MODELS: dict[str, Callable[[ModelConfig, int], ModelBackend]] = {
    "minilm-l6": _minilm_l6,
    "minilm-l6-doc": _minilm_l6_doc,
}


def load_backend(model: ModelConfig, batcher: BatcherConfig) -> ModelBackend:
    """Loads a configured model (blocking: call it in a thread), then `await backend.start()` on
    the event loop. ConfigError when it cannot load."""
    if model.backend == "triton":
        from services.batcher.backends.triton_backend import TritonBackend

        return TritonBackend(model)
    if model.loader.startswith(BUILTIN_PREFIX):
        name = model.loader.removeprefix(BUILTIN_PREFIX)
        builtin = BUILTIN_MODELS.get(name)
        if builtin is None:
            raise ConfigError(
                f"model loader {model.loader!r}: no built-in model {name!r} (built-in: {', '.join(BUILTIN_MODELS)})"
            )
        return builtin(model, batcher.torch_threads)
    from services.batcher.backends.torch_backend import load_torch_backend

    return load_torch_backend(model, torch_threads=batcher.torch_threads)


def cuda_present() -> bool:
    """Whether torch is installed here and sees a CUDA device (False without torch: a batcher
    serving only Triton models needs none)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def torch_threads_for(
    batcher: BatcherConfig,
    models: Iterable[ModelConfig],
    cores: int,
    *,
    cuda_available: Callable[[], bool] = cuda_present,
) -> int:
    """The torch intra-op threads a batcher sets for its process (0: torch's default, one per core).

    `torch_threads` when configured. Otherwise one when every torch model computes on a GPU: the
    CPU pool then has only the host's side of each batch to do (a copy in, a copy out), and its
    threads spin at every op's barrier. Measured on an H200 with 16 cores (an MLP file batch of
    100,000 records through the whole system, two batches at once, alternated, bench/results/
    batch_files_ab_gpu_threads.md): the batcher's CPU 20.1 and 22.5 s at 8 threads a batch against
    2.2 and 2.2 s at one, 45,527 and 45,380 against 51,909 and 51,458 records/s.
    Otherwise, when a torch model computes several batches at once
    (max_inflight_batches N > 1), each batch gets its share of the cores, cores // N (at least 1):
    N batches at torch's default would run N threads per core, and torch's threads spin at every
    op's barrier while the others hold the cores. Measured on 2 cores (bench/results/
    batch_files_ab.md, 3 alternated rounds): an MLP file batch with two batches at once on one thread
    each ran at 7,304 records/s against 5,007 for one batch at a time on two threads, the batcher's
    CPU 20.9 against 31.7 s.
    The number is the process's (torch has one pool): the largest N of the models declared at start."""
    if batcher.torch_threads:
        return batcher.torch_threads
    versions = [v for m in models if not m.steps for v in m.version_configs()]
    on_torch = [v for v in versions if v.backend == "torch"]
    if on_torch and all(_on_gpu(v.device, cuda_available) for v in on_torch):
        return 1
    at_once = max((v.max_inflight_batches for v in on_torch), default=1)
    return max(1, cores // at_once) if at_once > 1 else 0


def _on_gpu(device: str, cuda_available: Callable[[], bool]) -> bool:
    return device.startswith("cuda") or (device == "auto" and cuda_available())
