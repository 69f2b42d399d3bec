"""A batch's chunk in the batching engine (services/batcher/chunk_items.py): more rows than
max_batch_size, computed as parts of at most max_batch_size rows, answered as one outcome in input
order; a text model's rows sorted by length first and put back; a failing part fails the chunk."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest
import torch

from asyncinfer.config import DEMO_MODEL
from asyncinfer.errors import ModelError
from asyncinfer.jobs import Priority
from asyncinfer.tensors import Tensor
from services.batcher.backends import Arrays
from services.batcher.backends.torch_backend import TorchBackend
from services.batcher.engine import BatchingEngine
from services.batcher.models.demo import AffineDemo, FailingDemo


def rows(count: int) -> list[Tensor]:
    return [Tensor.from_numpy("x", np.arange(count * 4, dtype=np.float32).reshape(count, 4))]


async def test_a_chunk_runs_as_parts_of_max_batch_size_and_answers_in_order(make_engine: Any) -> None:
    engine = await make_engine(AffineDemo(), max_batch_size=8)
    item = engine.submit_chunk("demo", rows(30), priority=Priority.LOW)
    assert [part.rows for part in item.parts] == [8, 8, 8, 6]
    outcome = await item.future
    x = rows(30)[0].to_numpy()
    assert np.array_equal(outcome.outputs[0].to_numpy(), 2 * x + 1)
    assert outcome.batch_size <= 8


class ByLength(TorchBackend):
    """The demo model as a 'text' model whose token lengths fall with x's first value."""

    def token_lengths(self, inputs: Arrays) -> list[int] | None:
        return [int(1000 - v) for v in inputs["x"][:, 0]]


async def test_a_text_chunk_is_sorted_by_length_and_put_back_in_input_order() -> None:
    config = DEMO_MODEL.model_copy(update={"max_batch_size": 4})
    engine = BatchingEngine()
    engine.add_model(config, ByLength(config.name, AffineDemo(), config.signature, torch.device("cpu")))
    await engine.start()
    try:
        item = engine.submit_chunk("demo", rows(10))
        assert item.parts[0].inputs["x"].to_numpy()[0, 0] == 36.0  # the longest-first row went last
        outcome = await item.future
        assert np.array_equal(outcome.outputs[0].to_numpy(), 2 * rows(10)[0].to_numpy() + 1)
    finally:
        await engine.stop(grace_s=1.0)


async def test_a_failing_part_fails_the_chunk_and_a_dropped_chunk_runs_nothing(make_engine: Any) -> None:
    engine = await make_engine(FailingDemo(), max_batch_size=8)
    with pytest.raises(ModelError):
        await engine.submit_chunk("demo", rows(20)).future
    queued = await make_engine(AffineDemo(), max_batch_size=8, max_inflight_batches=1, max_queue_delay_ms=1000.0)
    blocker = queued.submit("demo", rows(1))
    chunk = queued.submit_chunk("demo", rows(20))
    assert chunk.cancel()  # its parts wait behind the blocker's batch (at most one of them beside it)
    assert chunk.future.cancelled()
    await blocker.future


async def test_chunks_of_one_deadline_are_computed_one_after_the_other_in_arrival_order(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's chunks share its expiry; turned into the engine's clock at different moments it
    differs by microseconds, which must not interleave their parts (every chunk would then end
    near the last one, and the batch's window would refill in bursts)."""
    engine = await make_engine(AffineDemo(), max_batch_size=4, max_inflight_batches=1)
    loop = asyncio.get_running_loop()
    # One absolute deadline, well inside a millisecond of the engine's clock, seen a little earlier by each
    # later chunk (as reading two clocks at different moments does): 10 us apart. The loop's clock stands
    # still while they are submitted (no await in between), so that the test's reading and the engine's
    # are one: on a loaded machine the two were once 0.3 ms apart, which moved chunk 0 to the next
    # millisecond, a difference the chunks of one batch do not have (CI: ended [1, 2, 3, 4, 0]).
    now = loop.time()
    deadline = math.floor((now + 3600) * 1000) / 1000 + 0.0002
    ended: list[int] = []
    items = []
    with monkeypatch.context() as frozen:
        frozen.setattr(loop, "time", lambda: now)
        for index in range(5):
            item = engine.submit_chunk("demo", rows(16), timeout_s=deadline - now - index * 1e-5)
            item.future.add_done_callback(lambda _f, index=index: ended.append(index))
            items.append(item)
            assert len({part.expires_at for part in item.parts}) == 1  # cutting the parts takes a while
    await asyncio.gather(*(item.future for item in items))
    assert ended == [0, 1, 2, 3, 4]


def test_parts_whose_outputs_differ_in_shape_fail_the_chunk_as_a_model_error() -> None:
    from services.batcher.chunk_items import _concatenated

    parts = [Tensor.from_numpy("y", np.ones((2, 4), np.float32)), Tensor.from_numpy("y", np.ones((3, 5), np.float32))]
    with pytest.raises(ModelError, match="different shapes"):
        _concatenated("y", parts)
    joined = _concatenated("y", [parts[0], Tensor.from_numpy("y", np.zeros((3, 4), np.float32))])
    assert joined.shape == (5, 4)
    assert np.array_equal(joined.to_numpy(), np.vstack([np.ones((2, 4)), np.zeros((3, 4))]))
