"""The built-in `minilm-l6-doc` model: a long-document embedder on minilm-l6 (the same weights and
tokenizer, services.batcher.backends.minilm) that reports its progress.

UTF-8 documents (BYTES [-1]) -> FP32 [N, 384]. A document is tokenized whole (no truncation) and
split into windows of WINDOW_TOKENS tokens (the last one shorter), each embedded as its own text
— `[CLS] window [SEP]`, BERT, mean-pooled over the tokens and L2-normalised, as minilm-l6 embeds a
sentence — and the document's embedding is the mean of its windows' embeddings, L2-normalised. An
empty document is one empty window.

While it runs it reports, per document and per window done: the fraction of its windows done, a
message ("window 3 of 7"), and the partial output `window_embeddings` (FP32 [windows done, 384],
every window so far, so any report a watcher gets is whole). The windows of a batch's documents
run together, window index by window index, so each document advances on its own. A document whose
job was cancelled while the batch runs (`progress.cancelled`) gets no more windows embedded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.nn import functional

from asyncinfer.config import MINILM_DOC_MODEL
from asyncinfer.errors import ModelError
from services.batcher.backends import Arrays, check_outputs
from services.batcher.backends.minilm import EMBEDDING_DIM, MAX_TOKENS, MiniLMBackend, _texts
from services.batcher.progress import ProgressReporter

# Tokens of a window, less [CLS] and [SEP]: a window is one full minilm-l6 input.
WINDOW_TOKENS = MAX_TOKENS - 2
WINDOWS_OUTPUT = "window_embeddings"
__all__ = ["MINILM_DOC_MODEL", "MiniLMDocBackend"]


class MiniLMDocBackend(MiniLMBackend):
    """Embeds documents window by window, reporting each document's progress."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tokenizer.no_truncation()
        self._cls = int(self._tokenizer.token_to_id("[CLS]"))
        self._sep = int(self._tokenizer.token_to_id("[SEP]"))

    @property
    def reports_progress(self) -> bool:
        return True

    def windows(self, text: str) -> list[list[int]]:
        """The document's windows: token IDs without [CLS] and [SEP], WINDOW_TOKENS at most each."""
        ids = list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        return [ids[start : start + WINDOW_TOKENS] for start in range(0, len(ids), WINDOW_TOKENS)] or [[]]

    def token_lengths(self, inputs: Arrays) -> list[int]:
        # Every window's tokens with its [CLS] and [SEP]: what the model computes.
        lengths = []
        for text in _texts(inputs[self._input]):
            windows = self.windows(text)
            lengths.append(sum(len(window) + 2 for window in windows))
        return lengths

    def infer_batch(self, inputs: Arrays) -> Arrays:
        return self.infer_batch_reporting(inputs, ProgressReporter([(None, 1)] * len(inputs[self._input])))

    def infer_batch_reporting(self, inputs: Arrays, progress: ProgressReporter) -> Arrays:
        try:
            documents = [self.windows(text) for text in _texts(inputs[self._input])]
            done = [np.zeros((len(windows), EMBEDDING_DIM), dtype=np.float32) for windows in documents]
            for index in range(max(len(windows) for windows in documents)):
                rows = [
                    row for row, windows in enumerate(documents) if len(windows) > index and not progress.cancelled(row)
                ]
                if not rows:
                    break  # every document with more windows was cancelled
                embedded = self._embed([documents[row][index] for row in rows])
                for row, embedding in zip(rows, embedded, strict=True):
                    done[row][index] = embedding
                    total = len(documents[row])
                    progress.report(
                        row,
                        fraction=(index + 1) / total,
                        message=f"window {index + 1} of {total}",
                        outputs={WINDOWS_OUTPUT: done[row][: index + 1]},
                    )
            pooled = torch.from_numpy(np.stack([windows.mean(axis=0) for windows in done]))
            result = functional.normalize(pooled, p=2.0, dim=1).numpy()
        except Exception as exc:
            raise ModelError(f"model {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        outputs: Arrays = {self._output: result}
        check_outputs(self.name, outputs, self._signature)
        return outputs

    def _embed(self, windows: list[list[int]]) -> np.ndarray[Any, Any]:
        """Each window's minilm-l6 embedding, the windows padded to the longest."""
        longest = max(len(window) for window in windows) + 2
        ids = np.zeros((len(windows), longest), dtype=np.int64)
        attention = np.zeros((len(windows), longest), dtype=np.int64)
        for row, window in enumerate(windows):
            tokens = [self._cls, *window, self._sep]
            ids[row, : len(tokens)] = tokens
            attention[row, : len(tokens)] = 1
        with torch.inference_mode(), self._own_stream():
            embeddings = self.forward({"ids": self.to_device(ids), "attention": self.to_device(attention)})
            return embeddings.to("cpu").numpy()  # type: ignore[no-any-return]
