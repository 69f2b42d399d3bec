"""The steps around minilm-l6 that make the `minilm-l6-doc-pipeline` pipeline a long-document
embedder (asyncinfer.config.MINILM_DOC_PIPELINE): `chunk` -> minilm-l6 -> `pool`.

`chunk` cuts each document where minilm-l6-doc cuts it (windows of WINDOW_TOKENS tokens of the
model's tokenizer), each window as the document's own text between its first and last token, so
that minilm-l6 embeds the windows of many documents, of many jobs, in its own batches. `pool`
averages each document's window embeddings and L2-normalises them, as minilm-l6-doc does. The
two agree to a cosine of about 0.999 or better: a window that starts inside a word is tokenized
again by minilm-l6 as a word of its own.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from services.batcher.backends.minilm import model_dir
from services.batcher.backends.minilm_doc import WINDOW_TOKENS


@functools.cache
def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def chunk(arrays: dict[str, Any]) -> dict[str, Any]:
    """`text` BYTES [N] documents -> `windows` BYTES [W] and `document` INT64 [W] (the index of
    each window's document); an empty document is one empty window."""
    windows: list[bytes] = []
    documents: list[int] = []
    for index, value in enumerate(np.asarray(arrays["text"]).reshape(-1).tolist()):
        text = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
        offsets = _tokenizer().encode(text, add_special_tokens=False).offsets
        starts = range(0, len(offsets), WINDOW_TOKENS)
        pieces = [text[offsets[s][0] : offsets[min(s + WINDOW_TOKENS, len(offsets)) - 1][1]] for s in starts] or [""]
        windows += [piece.encode("utf-8") for piece in pieces]
        documents += [index] * len(pieces)
    return {"windows": np.array(windows, dtype=np.object_), "document": np.array(documents, dtype=np.int64)}


def pool(arrays: dict[str, Any]) -> dict[str, Any]:
    """`embeddings` FP32 [W, D] and `document` INT64 [W] -> `embedding` FP32 [N, D]: each
    document's windows' mean, L2-normalised."""
    embeddings = np.asarray(arrays["embeddings"], dtype=np.float32)
    documents = np.asarray(arrays["document"], dtype=np.int64)
    count = int(documents.max()) + 1
    sums = np.zeros((count, embeddings.shape[1]), dtype=np.float32)
    np.add.at(sums, documents, embeddings)
    means = sums / np.bincount(documents, minlength=count)[:, None]
    norms = np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)
    return {"embedding": (means / norms).astype(np.float32)}
