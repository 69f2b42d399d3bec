"""Model backends: the built-in minilm-l6 against sentence-transformers, text length buckets,
the TorchScript loader, device selection and the CUDA transfer path's CPU fallback."""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncinfer.config import DEMO_MODEL, FLAKY_MODEL, BatcherConfig, ModelConfig
from asyncinfer.errors import ConfigError, ModelError
from asyncinfer.tensors import Tensor
from services.batcher.backends.loading import load_backend
from services.batcher.backends.minilm import MINILM_MODEL, MiniLMBackend, model_dir
from services.batcher.backends.torch_backend import TorchBackend, resolve_device
from services.batcher.engine import BatchingEngine
from services.batcher.models.demo import FLAKY_MODEL_MESSAGE, build_demo_model, build_flaky_model

TEXTS = [
    "The batcher packs queued jobs into batches.",
    "short",
    "",
    "Émilie's café serves crème brûlée — naïve façade, 東京 and emoji 🚀.",
    "A much longer sentence that goes on and on about dynamic batching, padding waste, length buckets "
    "and the many ways a text-embedding service can be made fast on a small CPU machine.",
]


@pytest.fixture(scope="module")
def minilm() -> MiniLMBackend:
    backend = load_backend(MINILM_MODEL, BatcherConfig())
    assert isinstance(backend, MiniLMBackend)
    return backend


def texts_array(texts: list[str]) -> np.ndarray[object, np.dtype[np.object_]]:
    return np.array([t.encode("utf-8") for t in texts], dtype=np.object_)


def test_minilm_matches_sentence_transformers(minilm: MiniLMBackend) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model_dir()), device="cpu", local_files_only=True)
    expected = reference.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    ours = minilm.infer_batch({"text": texts_array(TEXTS)})["embedding"]
    assert ours.shape == (len(TEXTS), 384)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)
    cosine = (ours * expected).sum(axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.999
    # Padding within a batch does not change an embedding.
    alone = minilm.infer_batch({"text": texts_array(TEXTS[:1])})["embedding"]
    assert float((alone[0] * ours[0]).sum()) >= 0.9999


async def test_texts_batch_by_token_length_bucket(minilm: MiniLMBackend) -> None:
    config = MINILM_MODEL.model_copy(update={"length_buckets": (16, 64), "max_queue_delay_ms": 0.0})
    engine = BatchingEngine()
    engine.add_model(config, minilm)
    await engine.start()
    try:
        short = ["hello", "hi there", "good morning"]
        long = [TEXTS[4], TEXTS[4] + " again"]
        # All submitted before the former runs: the first (short) group goes first, alone.
        items = [engine.submit(config.name, [Tensor.from_numpy("text", texts_array([t]))]) for t in short + long]
        outcomes = await asyncio.gather(*(item.future for item in items))
        assert [o.batch_items for o in outcomes] == [3, 3, 3, 2, 2]
        assert all(o.outputs[0].shape == (1, 384) for o in outcomes)
        assert items[0].cost == minilm.token_lengths({"text": texts_array(short[:1])})[0]
    finally:
        await engine.stop(grace_s=1.0)


def test_torchscript_files_load(tmp_path: Path) -> None:
    path = tmp_path / "affine.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated, still widely shipped
        torch.jit.script(build_demo_model()).save(str(path))
    model = DEMO_MODEL.model_copy(update={"loader": f"torchscript:{path}"})
    backend = load_backend(model, BatcherConfig())
    y = backend.infer_batch({"x": np.ones((3, 4), dtype=np.float32)})["y"]
    np.testing.assert_array_equal(y, np.full((3, 4), 3.0, dtype=np.float32))
    with pytest.raises(ConfigError, match="no such file"):
        load_backend(DEMO_MODEL.model_copy(update={"loader": f"torchscript:{tmp_path}/nope.pt"}), BatcherConfig())
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="not a TorchScript file"):
        load_backend(DEMO_MODEL.model_copy(update={"loader": f"torchscript:{tmp_path}/junk.pt"}), BatcherConfig())
    with pytest.raises(ConfigError, match="no built-in model"):
        load_backend(DEMO_MODEL.model_copy(update={"loader": "builtin:gpt-9"}), BatcherConfig())


def test_device_selection() -> None:
    assert resolve_device("auto", cuda_available=False).type == "cpu"
    assert resolve_device("auto", cuda_available=True).type == "cuda"
    assert resolve_device("cuda:1", cuda_available=True) == torch.device("cuda", 1)
    assert resolve_device("cpu", cuda_available=True).type == "cpu"
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(ConfigError, match="invalid device"):
        resolve_device("tpu-ish", cuda_available=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    backend = TorchBackend.load(DEMO_MODEL)
    assert backend.device.type == expected
    # The transfer path matches the device: read-only numpy buffers are copied, not shared.
    x = np.ones((2, 4), dtype=np.float32)
    x.flags.writeable = False
    assert backend.to_device(x).device.type == expected
    np.testing.assert_array_equal(backend.infer_batch({"x": x})["y"], np.full((2, 4), 3.0, dtype=np.float32))


def test_minilm_rejects_a_foreign_signature() -> None:
    wrong = MINILM_MODEL.model_copy(update={"inputs": DEMO_MODEL.inputs})
    with pytest.raises(ConfigError, match="minilm-l6 takes one BYTES input"):
        load_backend(wrong, BatcherConfig())


def test_model_config_rules() -> None:
    with pytest.raises(ValueError, match="needs a loader"):
        ModelConfig(name="m", inputs=DEMO_MODEL.inputs, outputs=DEMO_MODEL.outputs)
    with pytest.raises(ValueError, match="triton_url"):
        ModelConfig(name="m", backend="triton", inputs=DEMO_MODEL.inputs, outputs=DEMO_MODEL.outputs)
    with pytest.raises(ValueError, match="preferred_batch_sizes"):
        DEMO_MODEL.model_validate({**DEMO_MODEL.model_dump(), "preferred_batch_sizes": [64]})
    with pytest.raises(ValueError, match="length_buckets"):
        DEMO_MODEL.model_validate({**DEMO_MODEL.model_dump(), "length_buckets": [8, 4]})
    remote = ModelConfig(
        name="m", backend="triton", triton_url="h:1", inputs=DEMO_MODEL.inputs, outputs=DEMO_MODEL.outputs
    )
    assert remote.loader == ""


async def test_the_flaky_sample_model_fails_only_the_jobs_that_ask_to(make_engine: Callable[..., Any]) -> None:
    """`flaky` (served by `asyncinfer up`, issue 18) computes the demo's y = 2x + 1 unless a row of
    x starts below 0; then that job fails with MODEL_ERROR (retriable: its 2 attempts are spent,
    then it is dead-lettered), and the jobs beside it still succeed."""
    assert (FLAKY_MODEL.max_attempts, FLAKY_MODEL.signature) == (2, DEMO_MODEL.signature)
    engine = await make_engine(build_flaky_model(), name="flaky")
    good = [Tensor.from_numpy("x", np.array([[1, 2, 3, 4]], np.float32))]
    bad = [Tensor.from_numpy("x", np.array([[5, 6, 7, 8], [-1, 2, 3, 4]], np.float32))]
    outcomes = await asyncio.gather(engine.infer("flaky", good), engine.infer("flaky", bad), return_exceptions=True)
    assert not isinstance(outcomes[0], BaseException)
    (y,) = outcomes[0].outputs
    np.testing.assert_array_equal(y.to_numpy(), [[3, 5, 7, 9]])
    assert isinstance(outcomes[1], ModelError)
    assert FLAKY_MODEL_MESSAGE in outcomes[1].message
