"""The dynamic-batching engine with real torch models: batches fill, close on delay, count rows,
keep shapes apart, fail per batch, drop cancelled items, bound the queue, and stop cleanly."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import structlog
import torch
from structlog.testing import capture_logs

from asyncinfer.config import DEMO_MODEL, TensorSpecConfig
from asyncinfer.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidArgument,
    ModelError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from asyncinfer.logs import service_context
from asyncinfer.tensors import Tensor
from services.batcher.backends.torch_backend import TorchBackend
from services.batcher.batch_compute import RunTimedOut
from services.batcher.models.demo import FAILING_MODEL_MESSAGE, build_demo_model, build_failing_model

pytestmark = pytest.mark.unit


class RecordingAffine(torch.nn.Module):
    """y = 2x + 1, remembering every batch it saw; optionally held at a gate until released."""

    def __init__(self, gate: threading.Event | None = None, poison: float | None = None) -> None:
        super().__init__()
        self.batches: list[np.ndarray[Any, Any]] = []
        self.gate = gate
        self.poison = poison
        self.entered = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(timeout=10)
        self.batches.append(x.numpy().copy())
        if self.poison is not None and bool((x == self.poison).any()):
            raise ValueError("poisoned input in this batch")
        return 2.0 * x + 1.0

    @property
    def rows_seen(self) -> list[int]:
        return [len(b) for b in self.batches]

    def values_seen(self) -> set[float]:
        return {float(v) for batch in self.batches for v in batch.reshape(-1)}


def rows(value: float, count: int = 1, width: int = 4) -> list[Tensor]:
    return [Tensor.from_numpy("x", np.full((count, width), value, dtype=np.float32))]


def expected_y(x: Tensor) -> np.ndarray[Any, Any]:
    return np.asarray(x.to_numpy(), dtype=np.float32) * 2 + 1


async def wait_entered(model: RecordingAffine) -> None:
    assert await asyncio.to_thread(model.entered.wait, 5.0)


async def test_concurrent_items_fill_batches_up_to_max_batch_size(make_engine: Callable[..., Any]) -> None:
    model = RecordingAffine()
    engine = await make_engine(model, max_batch_size=8, max_queue_delay_ms=300.0)
    values = [float(i) for i in range(20)]
    outcomes = await asyncio.gather(*(engine.infer("demo", rows(v)) for v in values))
    assert sorted(o.batch_size for o in outcomes) == [4] * 4 + [8] * 16
    assert sorted(model.rows_seen) == [4, 8, 8]
    for value, outcome in zip(values, outcomes, strict=True):
        (y,) = outcome.outputs
        assert y.name == "y"
        assert y.datatype == "FP32"
        assert y.shape == (1, 4)
        np.testing.assert_array_equal(y.to_numpy(), np.full((1, 4), 2 * value + 1, dtype=np.float32))


async def test_an_idle_model_starts_a_batch_at_once(make_engine: Callable[..., Any]) -> None:
    model = RecordingAffine()
    engine = await make_engine(model, max_batch_size=32, max_queue_delay_ms=60_000.0)
    outcome = await asyncio.wait_for(engine.infer("demo", rows(1.0)), timeout=5)
    assert outcome.batch_size == 1
    assert model.rows_seen == [1]


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.002)


async def test_delay_closes_a_partial_batch_while_another_computes(make_engine: Callable[..., Any]) -> None:
    gate = threading.Event()
    model = RecordingAffine(gate=gate)
    engine = await make_engine(model, max_batch_size=32, max_queue_delay_ms=40.0, max_inflight_batches=2)
    first = asyncio.create_task(engine.infer("demo", rows(0.0)))
    await wait_entered(model)  # the model is busy: the next batch waits to fill
    started = time.monotonic()
    rest = [asyncio.create_task(engine.infer("demo", rows(float(v)))) for v in range(1, 4)]
    await asyncio.sleep(0)
    assert engine.queue_depth("demo") == 3
    await wait_until(lambda: engine.queue_depth("demo") == 0)
    assert time.monotonic() - started >= 0.035
    gate.set()
    outcomes = await asyncio.gather(*rest)
    assert (await first).batch_size == 1
    assert [o.batch_size for o in outcomes] == [3, 3, 3]
    assert [o.batch_items for o in outcomes] == [3, 3, 3]
    assert sorted(model.rows_seen) == [1, 3]


async def test_batches_count_rows_and_never_exceed_the_limit(make_engine: Callable[..., Any]) -> None:
    model = RecordingAffine()
    engine = await make_engine(model, max_batch_size=8, max_queue_delay_ms=50.0)
    items = [rows(1.0, 5), rows(2.0, 4), rows(3.0, 4), rows(4.0, 4)]
    outcomes = await asyncio.gather(*(engine.infer("demo", item) for item in items))
    assert all(rows_ <= 8 for rows_ in model.rows_seen)
    assert sum(model.rows_seen) == 17
    assert all(o.batch_size <= 8 for o in outcomes)
    assert outcomes[0].batch_size == 5  # 5 + 4 would overflow: the 4-row items wait for the next batch
    for item, outcome in zip(items, outcomes, strict=True):
        np.testing.assert_array_equal(outcome.outputs[0].to_numpy(), expected_y(item[0]))


async def test_items_of_different_shapes_are_batched_apart(make_engine: Callable[..., Any]) -> None:
    model = RecordingAffine()
    any_width = (TensorSpecConfig(name="x", datatype="FP32", shape=(-1, -1)),)
    engine = await make_engine(
        model,
        max_batch_size=8,
        max_queue_delay_ms=50.0,
        inputs=any_width,
        outputs=(TensorSpecConfig(name="y", datatype="FP32", shape=(-1, -1)),),
    )
    items = [rows(float(i), 1, width=3 if i % 2 else 5) for i in range(6)]
    outcomes = await asyncio.gather(*(engine.infer("demo", item) for item in items))
    assert sorted(model.rows_seen) == [3, 3]
    assert sorted(b.shape[1] for b in model.batches) == [3, 5]
    for item, outcome in zip(items, outcomes, strict=True):
        assert outcome.batch_size == 3
        np.testing.assert_array_equal(outcome.outputs[0].to_numpy(), expected_y(item[0]))


async def test_a_failing_batch_is_bisected_so_only_the_poisoned_item_fails(
    make_engine: Callable[..., Any],
) -> None:
    gate = threading.Event()
    model = RecordingAffine(gate=gate, poison=-1.0)
    engine = await make_engine(model, max_batch_size=4, max_queue_delay_ms=60_000.0, max_inflight_batches=1)
    blocker = asyncio.create_task(engine.infer("demo", rows(0.0)))
    await wait_entered(model)  # the model is held: the next four items form one full batch
    values = (1.0, -1.0, 2.0, 3.0)
    batch = [asyncio.create_task(engine.infer("demo", rows(v))) for v in values]
    await wait_until(lambda: engine.queue_depth("demo") == 4)
    gate.set()
    await blocker
    results = await asyncio.gather(*batch, return_exceptions=True)
    assert isinstance(results[1], ModelError)
    assert "poisoned input in this batch" in str(results[1])
    for value, result in zip(values, results, strict=True):
        if value == -1.0:
            continue
        assert not isinstance(result, BaseException), result
        np.testing.assert_array_equal(result.outputs[0].to_numpy(), np.full((1, 4), 2 * value + 1, dtype=np.float32))
    # The whole batch, then halves: [1, -1] fails and is split again; [2, 3] runs as one.
    assert model.rows_seen == [1, 4, 2, 1, 1, 2]
    assert [r.batch_size for r in results if not isinstance(r, BaseException)] == [1, 2, 2]
    after = await asyncio.gather(*(engine.infer("demo", rows(v)) for v in (5.0, 6.0)))
    assert [o.outputs[0].to_numpy()[0, 0] for o in after] == [11.0, 13.0]


async def test_the_failing_demo_model_reports_its_message(make_engine: Callable[..., Any]) -> None:
    engine = await make_engine(build_failing_model(), max_queue_delay_ms=0.0)
    with pytest.raises(ModelError, match=FAILING_MODEL_MESSAGE):
        await engine.infer("demo", rows(1.0))


async def test_demo_model_computes_2x_plus_1(make_engine: Callable[..., Any]) -> None:
    engine = await make_engine(build_demo_model(), max_queue_delay_ms=0.0)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    outcome = await engine.infer("demo", [Tensor.from_numpy("x", x)])
    np.testing.assert_array_equal(outcome.outputs[0].to_numpy(), 2 * x + 1)
    assert outcome.compute_s >= 0


async def test_a_cancelled_waiting_item_is_dropped_before_it_runs(make_engine: Callable[..., Any]) -> None:
    gate = threading.Event()
    model = RecordingAffine(gate=gate)
    engine = await make_engine(model, max_batch_size=1, max_inflight_batches=1, max_queue_delay_ms=0.0)
    running = asyncio.create_task(engine.infer("demo", rows(1.0)))
    await wait_entered(model)
    cancelled = asyncio.create_task(engine.infer("demo", rows(2.0)))
    later = asyncio.create_task(engine.infer("demo", rows(3.0)))
    await asyncio.sleep(0)  # let both submit
    assert engine.queue_depth("demo") == 2
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    gate.set()
    assert (await running).outputs[0].to_numpy()[0, 0] == 3.0
    assert (await later).outputs[0].to_numpy()[0, 0] == 7.0
    assert model.values_seen() == {1.0, 3.0}
    assert engine.free_slots("demo") == DEMO_MODEL.max_queue_size


async def test_a_full_queue_rejects_with_resource_exhausted(make_engine: Callable[..., Any]) -> None:
    gate = threading.Event()
    model = RecordingAffine(gate=gate)
    engine = await make_engine(
        model, max_batch_size=1, max_inflight_batches=1, max_queue_size=2, max_queue_delay_ms=0.0
    )
    freed: list[str] = []
    both_freed = asyncio.Event()

    def on_freed(model_name: str) -> None:
        freed.append(model_name)
        if len(freed) == 2:
            both_freed.set()

    engine.add_slot_listener(on_freed)
    first = asyncio.create_task(engine.infer("demo", rows(1.0)))
    second = asyncio.create_task(engine.infer("demo", rows(2.0)))
    await wait_entered(model)
    assert engine.free_slots("demo") == 0
    with pytest.raises(ResourceExhausted) as info:
        engine.submit("demo", rows(3.0))
    assert info.value.retry_after_s > 0
    gate.set()
    await asyncio.gather(first, second)
    await asyncio.wait_for(both_freed.wait(), timeout=5)  # slots free in done-callbacks, after the results
    assert engine.free_slots("demo") == 2
    assert freed == ["demo", "demo"]


async def test_invalid_inputs_and_unknown_models_are_rejected_before_queueing(
    make_engine: Callable[..., Any],
) -> None:
    engine = await make_engine(RecordingAffine(), max_batch_size=4)
    with pytest.raises(InvalidArgument) as info:
        engine.submit("demo", rows(1.0, width=3))
    assert [v.field for v in info.value.violations] == ["inputs[0].shape"]
    with pytest.raises(InvalidArgument, match="max_batch_size 4"):
        engine.submit("demo", rows(1.0, count=5))
    with pytest.raises(NotFound):
        engine.submit("nope", rows(1.0))
    assert engine.queue_depth("demo") == 0


async def test_an_item_whose_deadline_passes_while_queued_expires(make_engine: Callable[..., Any]) -> None:
    gate = threading.Event()
    model = RecordingAffine(gate=gate)
    engine = await make_engine(model, max_batch_size=1, max_inflight_batches=1, max_queue_delay_ms=0.0)
    running = asyncio.create_task(engine.infer("demo", rows(1.0)))
    await wait_entered(model)
    expiring = asyncio.create_task(engine.infer("demo", rows(2.0), timeout_s=0.05))
    with pytest.raises(DeadlineExceeded):  # while the model is still busy: its timer fails it at once
        await asyncio.wait_for(expiring, timeout=5)
    assert not running.done()
    gate.set()
    await running
    after = await asyncio.wait_for(engine.infer("demo", rows(3.0)), timeout=5)  # ran after the expired one
    assert after.outputs[0].to_numpy()[0, 0] == 7.0
    assert model.values_seen() == {1.0, 3.0}


async def test_stop_fails_queued_items_and_lets_the_running_batch_finish(
    make_engine: Callable[..., Any],
) -> None:
    gate = threading.Event()
    model = RecordingAffine(gate=gate)
    engine = await make_engine(model, max_batch_size=1, max_inflight_batches=1, max_queue_delay_ms=0.0)
    running = asyncio.create_task(engine.infer("demo", rows(1.0)))
    await wait_entered(model)
    queued = [asyncio.create_task(engine.infer("demo", rows(float(v)))) for v in (2.0, 3.0)]
    await asyncio.sleep(0)
    stopping = asyncio.create_task(engine.stop(grace_s=5.0))
    for task in queued:
        with pytest.raises(Unavailable, match="batcher shutting down"):
            await task
    assert not running.done()
    gate.set()
    assert (await running).outputs[0].to_numpy()[0, 0] == 3.0
    await asyncio.wait_for(stopping, timeout=5)
    with pytest.raises(Unavailable):
        engine.submit("demo", rows(4.0))


async def test_stop_abandons_a_batch_that_outlives_the_grace_period(make_engine: Callable[..., Any]) -> None:
    gate = threading.Event()
    model = RecordingAffine(gate=gate)
    engine = await make_engine(model, max_batch_size=1, max_inflight_batches=1, max_queue_delay_ms=0.0)
    running = asyncio.create_task(engine.infer("demo", rows(1.0)))
    await wait_entered(model)
    try:
        await asyncio.wait_for(engine.stop(grace_s=0.05), timeout=5)
        with pytest.raises(Unavailable, match="batcher shutting down"):
            await running
    finally:
        gate.set()  # let the abandoned thread finish


class PairModel(torch.nn.Module):
    """Two inputs by keyword, two outputs by name."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"total": a + b, "count": (b > 0).sum(dim=1)}


class WrongDtype(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


async def test_multi_input_models_get_keywords_and_outputs_map_by_name(make_engine: Callable[..., Any]) -> None:
    engine = await make_engine(
        PairModel(),
        max_queue_delay_ms=0.0,
        inputs=(
            TensorSpecConfig(name="a", datatype="FP32", shape=(-1, 2)),
            TensorSpecConfig(name="b", datatype="FP32", shape=(-1, 2)),
        ),
        outputs=(
            TensorSpecConfig(name="total", datatype="FP32", shape=(-1, 2)),
            TensorSpecConfig(name="count", datatype="INT64", shape=(-1,)),
        ),
    )
    a = np.array([[1, 2], [3, 4]], dtype=np.float32)
    b = np.array([[1, 0], [1, 1]], dtype=np.float32)
    outcome = await engine.infer("demo", [Tensor.from_numpy("b", b), Tensor.from_numpy("a", a)])
    total, count = outcome.outputs
    np.testing.assert_array_equal(total.to_numpy(), a + b)
    assert (count.name, count.datatype, count.to_numpy().tolist()) == ("count", "INT64", [1, 2])


async def test_outputs_off_signature_are_model_errors(make_engine: Callable[..., Any]) -> None:
    engine = await make_engine(WrongDtype(), max_queue_delay_ms=0.0)
    with pytest.raises(ModelError, match="output 'y' is FP64, but its signature says FP32"):
        await engine.infer("demo", rows(1.0))


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        ("services.batcher.models.nowhere:build", "cannot import"),
        ("services.batcher.models.demo:build_nothing", "has no 'build_nothing'"),
        ("services.batcher.models.demo:FAILING_MODEL_MESSAGE", "is not callable"),
        ("numpy:zeros", "failed"),
        ("builtins:object", "not a torch.nn.Module"),
    ],
)
def test_bad_loaders_are_config_errors(loader: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TorchBackend.load(DEMO_MODEL.model_copy(update={"loader": loader}))


def test_the_configured_demo_model_loads_on_the_auto_device() -> None:
    backend = TorchBackend.load(DEMO_MODEL)
    assert backend.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    y = backend.infer_batch({"x": np.ones((2, 4), dtype=np.float32)})["y"]
    np.testing.assert_array_equal(y, np.full((2, 4), 3.0, dtype=np.float32))
    backend.close()


async def test_a_batch_whose_answering_fails_still_answers_every_item(
    make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug past the model's call (answering, metrics, tracing) left the batch's items waiting for
    ever (until their execution timeout, through the scheduler) with nothing logged."""
    from services.batcher import batch_compute
    from services.batcher.batch_compute import BatchRunner

    real_run = BatchRunner.run

    async def broken_run(self: BatchRunner, batch: Any, computing: Any, started: float) -> None:
        def broken_trace(*args: Any) -> None:
            raise KeyError("a bug after the compute")

        monkeypatch.setattr(self, "_tracing", type("Tracing", (), {"enabled": True})())
        monkeypatch.setattr(batch_compute, "trace_batch", broken_trace)
        await real_run(self, batch, computing, started)

    monkeypatch.setattr(BatchRunner, "run", broken_run)
    engine = await make_engine(build_demo_model(), max_queue_delay_ms=0.0)
    with pytest.raises(ModelError, match="the batcher failed to answer the batch: KeyError"):
        await asyncio.wait_for(engine.infer("demo", rows(1.0)), 5.0)
    # The slot came back: the model still computes.
    with pytest.raises(ModelError):
        await asyncio.wait_for(engine.infer("demo", rows(2.0)), 5.0)


async def test_a_model_whose_batch_hangs_past_its_timeouts_takes_no_work_until_it_returns(
    make_engine: Callable[..., Any],
) -> None:
    """A model call that hangs kept the model's only slot while the scheduler went on sending it
    work (its credits unchanged), each job timing out here unstarted, and nothing was logged. Past
    the longest execution timeout of its items, a batch has overrun: said once, with its thread's
    stack; with every slot overrun the model is stuck: what waits is given back (answered
    dropped, its attempt refunded), it takes no work, and its credits come back when it returns.
    The hung item itself is answered TIMED_OUT at its timeout, from its batch's start."""
    gate = threading.Event()
    model = RecordingAffine(gate)
    engine = await make_engine(model, max_queue_delay_ms=0.0, max_inflight_batches=1)
    with capture_logs() as logs:
        hung = engine.submit("demo", rows(1.0), run_timeout_s=0.2, credited=True)
        await wait_entered(model)
        waiting = [engine.submit("demo", rows(2.0), run_timeout_s=30.0, credited=True) for _ in range(2)]
        assert engine.free_slots("demo") > 0
        for item in waiting:
            with pytest.raises(Unavailable) as given_back:
                await asyncio.wait_for(item.future, 5.0)
            assert given_back.value.reason == "MODEL_STUCK"
        assert engine.free_slots("demo") == 0  # no credits while it hangs
        with pytest.raises(Unavailable, match="is stuck"):
            engine.submit("demo", rows(3.0))
        with pytest.raises(RunTimedOut):
            await asyncio.wait_for(hung.future, 5.0)
        gate.set()
        deadline = time.monotonic() + 5.0
        while engine.free_slots("demo") == 0:  # until the call returns
            assert time.monotonic() < deadline, "the model stayed stuck after its call returned"
            await asyncio.sleep(0.01)
        outcome = await asyncio.wait_for(engine.infer("demo", rows(4.0)), 5.0)
        np.testing.assert_array_equal(outcome.outputs[0].to_numpy(), np.full((1, 4), 9.0, np.float32))
    events = [entry["event"] for entry in logs]
    for event in ("batch_overran", "model_stuck", "batch_overrun_ended", "model_unstuck"):
        assert event in events, events
    (overran,) = [entry for entry in logs if entry["event"] == "batch_overran"]
    assert "in forward" in overran["stack"]  # where the model's thread waits


async def test_an_execution_timeout_counts_from_the_items_batch_start_not_its_wait(
    make_engine: Callable[..., Any],
) -> None:
    """An item's execution timeout bounds its model's run: one whose batch computes past it is
    answered TIMED_OUT (reason EXECUTION_TIMEOUT) while the call goes on; one that waited longer
    than its own timeout behind that batch starts afterwards with all of it (the scheduler timed
    it out from dispatch, with the batch before it, though it never ran)."""
    gate = threading.Event()
    model = RecordingAffine(gate)
    engine = await make_engine(model, max_queue_delay_ms=0.0, max_inflight_batches=1)
    loop = asyncio.get_running_loop()
    # Its own run must end within it (0.1 s asked a loaded machine's thread and loop to answer
    # within 100 ms); still less than its wait below.
    behind_timeout_s = 0.3
    with capture_logs() as logs:
        short = engine.submit("demo", rows(1.0), run_timeout_s=0.4, credited=True)
        long = engine.submit("demo", rows(2.0), run_timeout_s=30.0, credited=True)  # the same batch
        await wait_entered(model)
        behind = engine.submit("demo", rows(3.0), run_timeout_s=behind_timeout_s, credited=True)
        with pytest.raises(RunTimedOut) as timed_out:
            await asyncio.wait_for(short.future, 5.0)
        assert timed_out.value.reason == "EXECUTION_TIMEOUT"
        assert timed_out.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # Submitted as the batch started, it has waited about 0.4 s by now; on a loaded machine
        # the loop may hear of the start late (its wait was 0.39 s, and 0.4 was asserted). The
        # batch is held until it has waited its own timeout, by the loop's clock it was queued on.
        await asyncio.sleep(max(behind.submitted_at + behind_timeout_s - loop.time(), 0.0))
        waited_s = loop.time() - behind.submitted_at
        assert waited_s >= behind_timeout_s
        assert not behind.future.done()
        gate.set()
        assert (await asyncio.wait_for(long.future, 5.0)).outputs[0].to_numpy()[0, 0] == 5.0
        ran = await asyncio.wait_for(behind.future, 5.0)
        assert ran.outputs[0].to_numpy()[0, 0] == 7.0
        assert ran.queue_s >= waited_s  # it started after that wait, with all of its timeout
    (line,) = [entry for entry in logs if entry["event"] == "batch_timed_out"]
    assert line["items"] == 1
    assert not [entry for entry in logs if entry["event"] == "batch_overran"]


async def test_a_chunk_is_timed_out_from_its_arrival_and_its_parts_not_started_are_dropped(
    make_engine: Callable[..., Any],
) -> None:
    """A batch's chunk computes in several batches: its execution timeout counts from its arrival."""
    gate = threading.Event()
    model = RecordingAffine(gate)
    engine = await make_engine(model, max_batch_size=2, max_queue_delay_ms=0.0, max_inflight_batches=1)
    chunk = engine.submit_chunk("demo", rows(1.0, count=6), run_timeout_s=0.2)
    with pytest.raises(RunTimedOut, match="after it arrived"):
        await asyncio.wait_for(chunk.future, 5.0)
    gate.set()
    for part in chunk.parts[1:]:  # the first computes, unanswered; the others never start
        assert part.future.cancelled()
    assert (await asyncio.wait_for(engine.infer("demo", rows(2.0)), 5.0)).outputs[0].to_numpy()[0, 0] == 5.0
    assert model.rows_seen == [2, 1]


async def test_a_batch_computing_long_past_its_timeouts_is_reported_once_and_counted_as_overrun() -> None:
    """batcher.exit_after_overrun_s: the batcher app is told of a batch still computing that long
    past its items' longest timeout (it then stops the process); the overrun gauge counts it."""
    from prometheus_client import CollectorRegistry

    from services.batcher.batch_timeouts import HungBatch, HungWatch
    from services.batcher.engine import BatchingEngine
    from services.batcher.metrics import BatcherMetrics

    hung: list[HungBatch] = []
    told = asyncio.Event()

    def on_hung(batch: HungBatch) -> None:
        hung.append(batch)
        told.set()

    registry = CollectorRegistry()
    gate = threading.Event()
    model = RecordingAffine(gate)
    config = DEMO_MODEL.model_copy(update={"max_queue_delay_ms": 0.0, "max_inflight_batches": 1})
    engine = BatchingEngine(metrics=BatcherMetrics(registry), hung=HungWatch(after_s=0.8, on_hung=on_hung))
    engine.add_model(config, TorchBackend(config.name, model, config.signature, torch.device("cpu")))
    await engine.start()
    try:
        overrun = {"model": "demo"}
        assert registry.get_sample_value("asyncinfer_batcher_overrun_batches", overrun) == 0
        started = time.monotonic()
        item = engine.submit("demo", rows(1.0), run_timeout_s=0.2, credited=True)
        with pytest.raises(RunTimedOut):
            await asyncio.wait_for(item.future, 5.0)
        await asyncio.wait_for(told.wait(), 5.0)
        assert time.monotonic() - started >= 0.2 + 0.8
        (batch,) = hung
        assert (batch.model, batch.items) == ("demo", 1)
        assert batch.past_timeout_s >= 0.8
        assert "in forward" in batch.stack
        assert registry.get_sample_value("asyncinfer_batcher_overrun_batches", overrun) == 1
        gate.set()
        deadline = time.monotonic() + 5.0
        while engine.free_slots("demo") == 0:  # until the call returns
            assert time.monotonic() < deadline, "the model stayed stuck after its call returned"
            await asyncio.sleep(0.01)
        assert registry.get_sample_value("asyncinfer_batcher_overrun_batches", overrun) == 0
        assert len(hung) == 1
    finally:
        gate.set()
        await engine.stop(grace_s=1.0)


async def test_an_item_to_run_alone_is_computed_in_a_batch_of_its_own(make_engine: Callable[..., Any]) -> None:
    """A job whose previous attempt was lost with its batcher (a crash: it may be what crashed)
    runs alone, so that a job that crashes the process takes no other job with it (three good jobs
    were dead-lettered WORKER_LOST with one poison, batched together on every attempt)."""
    gate = threading.Event()
    model = RecordingAffine(gate)
    engine = await make_engine(model, max_queue_delay_ms=0.0, max_inflight_batches=1)
    first = engine.submit("demo", rows(1.0))
    await wait_entered(model)  # the model is busy: the rest wait and are batched together
    suspects = [engine.submit("demo", rows(2.0), run_alone=True) for _ in range(2)]
    others = [engine.submit("demo", rows(3.0)) for _ in range(3)]
    gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in [first, *suspects, *others])), 10.0)
    assert sorted(model.rows_seen) == [1, 1, 1, 3]
    assert {float(batch[0, 0]) for batch in model.batches if len(batch) == 1} >= {2.0}


async def test_a_model_that_raises_leaves_its_own_traceback_once_per_batch(make_engine: Callable[..., Any]) -> None:
    """Only the exception's message reached the logs: the model's author could not see where in
    their code it failed. Its traceback is logged once per failed batch (not per half of its
    isolation), at most once a minute per model."""
    engine = await make_engine(RecordingAffine(poison=9.0), max_queue_delay_ms=0.0)
    with capture_logs() as logs:
        for _ in range(2):
            with pytest.raises(ModelError, match="poisoned input"):
                await engine.infer("demo", rows(9.0))
    raised = [entry for entry in logs if entry["event"] == "model_raised"]
    assert len(raised) == 1  # the second within the minute is held back
    # None held back before the first: no count (it said held_back=0; the services' other
    # throttled lines say more_since_last, and only when some were).
    assert {"held_back", "more_since_last"}.isdisjoint(raised[0]), raised[0]
    error = raised[0]["exc_info"]
    assert isinstance(error, ValueError)
    assert any(frame.name == "forward" for frame in traceback.extract_tb(error.__traceback__))


class TwoBugs(torch.nn.Module):
    """y = 2x + 1, but a row of 9s fails on one line and a row of 7s on another."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == 9.0).any()):
            raise ValueError(f"nines in a batch of {len(x)}")
        if bool((x == 7.0).any()):
            raise ValueError(f"sevens in a batch of {len(x)}")
        return 2.0 * x + 1.0


async def test_a_models_traceback_names_its_service_once_per_distinct_failure(
    make_engine: Callable[..., Any],
) -> None:
    """`model_raised`, logged on the compute thread, had no `service` (run_in_executor does not
    carry the context `up` binds per service, nor a batcher's own), and the once-a-minute limit
    was per model: a second bug's traceback was held back behind the first's."""
    started = asyncio.create_task(make_engine(TwoBugs(), max_queue_delay_ms=0.0), context=service_context("batcher"))
    engine = await started
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        for value in (9.0, 9.0, 7.0):
            with pytest.raises(ModelError, match="in a batch of 1"):
                await engine.infer("demo", rows(value))
    raised = [entry for entry in logs if entry["event"] == "model_raised"]
    assert [entry.get("service") for entry in raised] == ["batcher", "batcher"]
    assert [str(entry["exc_info"]) for entry in raised] == ["nines in a batch of 1", "sevens in a batch of 1"]
    assert [entry["log_level"] for entry in raised] == ["warning", "warning"]


async def test_a_replaced_version_leaves_no_compute_threads_behind() -> None:
    """A version added while the engine runs (a hot update) computes on a thread pool of its own;
    once it is replaced and has finished what it held, that pool's threads end. They stayed for
    good: every hot update left max_inflight_batches idle threads in the batcher."""
    from services.batcher.engine import BatchingEngine

    config = DEMO_MODEL.model_copy(update={"name": "swapped", "max_inflight_batches": 2})
    engine = BatchingEngine()
    engine.add_model(config, TorchBackend(config.name, RecordingAffine(), config.signature, torch.device("cpu")))
    await engine.start()
    seen: set[threading.Thread] = set()
    threads_of_version: list[set[threading.Thread]] = []
    try:
        for value in (1.0, 2.0, 3.0):
            old = engine.withdraw("swapped", "1")
            model = RecordingAffine()
            engine.add_model(config, TorchBackend(config.name, model, config.signature, torch.device("cpu")))
            outcomes = await asyncio.gather(*(engine.infer("swapped", rows(value)) for _ in range(4)))
            assert all(float(o.outputs[0].to_numpy()[0, 0]) == 2 * value + 1 for o in outcomes)
            assert model.values_seen() == {value}  # the new version computed them
            await engine.finish_retiring(old, linger_s=0.0)
            ours = {t for t in threading.enumerate() if t.name.startswith("batcher-swapped")}
            threads_of_version.append(ours - seen)
            seen |= ours
        assert all(threads_of_version)  # each added version computed on threads of its own
        retired = set().union(*threads_of_version[:-1])
        for thread in retired:
            await asyncio.to_thread(thread.join, 5.0)  # a hang guard: they end as soon as they are told
        assert [t.name for t in retired if t.is_alive()] == []
        assert all(t.is_alive() for t in threads_of_version[-1])  # the version serving keeps its own
    finally:
        await engine.stop(grace_s=1.0)


async def test_a_retired_versions_chunk_computing_within_its_execution_timeout_finishes_past_the_grace(
    make_engine: Callable[..., Any],
) -> None:
    """A batch's chunk (two parts, both computing, its execution timeout 30 s counted from its
    arrival) on a version retired with a grace of 0.05 s: its parts go on computing past the grace
    and the chunk is answered with every row. A part has no execution timeout of its own (the
    chunk's is counted from its arrival, not a batch's start), so it was taken for an item without
    a deadline and cut off at the grace, and the chunk answered UNAVAILABLE MODEL_VERSION_RETIRED."""
    gate = threading.Event()
    model = RecordingAffine(gate)
    engine = await make_engine(model, max_batch_size=2, max_inflight_batches=2, max_queue_delay_ms=0.0)
    try:
        inputs = rows(1.0, count=4)
        chunk = engine.submit_chunk("demo", inputs, run_timeout_s=30.0)
        async with asyncio.timeout(5.0):
            while not all(part.started for part in chunk.parts):  # noqa: ASYNC110 - no event for it
                await asyncio.sleep(0.01)
        retired = engine.withdraw("demo", "1")
        retiring = asyncio.create_task(engine.finish_retiring(retired, linger_s=0.0, grace_s=0.05))
        async with asyncio.timeout(5.0):
            while engine.has_model("demo", "1"):  # noqa: ASYNC110 - it takes no orders once its grace has passed
                await asyncio.sleep(0.01)
        assert not chunk.future.done()
        gate.set()
        outcome = await asyncio.wait_for(chunk.future, 5.0)
        np.testing.assert_allclose(outcome.outputs[0].to_numpy(), expected_y(inputs[0]))
        await asyncio.wait_for(retiring, 5.0)
    finally:
        gate.set()  # the model's thread returns: make_engine stops the engine


async def test_a_retired_versions_chunk_under_way_finishes_its_waiting_parts_there_past_the_grace(
    make_engine: Callable[..., Any],
) -> None:
    """Two chunks on a version retired with a grace of 0.05 s, one batch at a time: the first (three
    parts) has a part computing and two waiting, the second (two parts) has none started. At the
    grace's end the first chunk's waiting parts were answered MODEL_VERSION_RETIRED, which failed
    the chunk: its order was handed back and computed whole again on the new version, the part
    computed here thrown away. Now they go on forming batches on the retired version, within the
    chunk's execution timeout, and the chunk is answered with every row computed there (one
    version's results); the second, nothing of it computed, is still answered RETIRED (handed back)."""
    from services.batcher.engine import VERSION_RETIRED_REASON

    gate = threading.Event()
    model = RecordingAffine(gate)
    engine = await make_engine(model, max_batch_size=2, max_inflight_batches=1, max_queue_delay_ms=0.0)
    try:
        under_way_inputs = rows(1.0, count=6)
        under_way = engine.submit_chunk("demo", under_way_inputs, run_timeout_s=30.0)
        not_begun = engine.submit_chunk("demo", rows(2.0, count=4), run_timeout_s=30.0)
        await wait_entered(model)  # the first part computes, held; the others wait
        assert [part.started for part in under_way.parts + not_begun.parts] == [True] + [False] * 4
        retired = engine.withdraw("demo", "1")
        retiring = asyncio.create_task(engine.finish_retiring(retired, linger_s=0.0, grace_s=0.05))
        with pytest.raises(Unavailable) as info:
            await asyncio.wait_for(not_begun.future, 5.0)
        assert info.value.reason == VERSION_RETIRED_REASON
        assert not engine.has_model("demo", "1")  # the grace has ended: it takes no more
        assert not under_way.future.done()
        gate.set()
        outcome = await asyncio.wait_for(under_way.future, 5.0)
        np.testing.assert_allclose(outcome.outputs[0].to_numpy(), expected_y(under_way_inputs[0]))
        assert model.rows_seen == [2, 2, 2]  # every part of it computed here, once
        assert model.values_seen() == {1.0}  # and nothing of the chunk handed back
        await asyncio.wait_for(retiring, 5.0)
    finally:
        gate.set()  # the model's thread returns: make_engine stops the engine


async def test_a_chunks_parts_are_freed_as_it_ends_not_left_to_the_garbage_collector(
    make_engine: Callable[..., Any],
) -> None:
    """Each part of a chunk names every part (chunk_parts, for a retired version's grace): a cycle,
    so the parts, their inputs and outputs, outlived the chunk as garbage until the collector ran,
    which a serving process makes rare (asyncinfer.gc_tuning): 384 parts of 1,600 chunks were
    alive at their end in a run, against 1 before. The parts let go of each other once the chunk
    has ended, and go with it. (The collector is off here: what is freed is freed by its count.)"""
    engine = await make_engine(build_demo_model(), max_batch_size=2, max_queue_delay_ms=0.0)
    gc.disable()
    try:
        chunk = engine.submit_chunk("demo", rows(1.0, count=6), run_timeout_s=30.0)
        parts = [weakref.ref(part.future) for part in chunk.parts]
        await asyncio.wait_for(chunk.future, 5.0)
        # Another batch: the batch former no longer holds the chunk's last part as its batch.
        await asyncio.wait_for(engine.infer("demo", rows(2.0)), 5.0)
        del chunk
        assert [part() for part in parts] == [None, None, None]
    finally:
        gc.enable()


async def test_the_queue_depth_gauge_sums_the_versions_served_side_by_side() -> None:
    """Two versions of a model share its gauge: it reads the sum of their queues. Each version's
    queue replaced the reading before, so the gauge showed the last version added, and once that
    one was retired, its empty queue (0) while the other version's filled."""
    from prometheus_client import CollectorRegistry

    from services.batcher.engine import BatchingEngine
    from services.batcher.metrics import BatcherMetrics

    registry = CollectorRegistry()
    config = DEMO_MODEL.model_copy(update={"max_queue_delay_ms": 0.0, "max_inflight_batches": 1})
    engine = BatchingEngine(metrics=BatcherMetrics(registry))
    gates = {"1": threading.Event(), "2": threading.Event()}
    models = {version: RecordingAffine(gate) for version, gate in gates.items()}
    engine.add_model(config, TorchBackend(config.name, models["1"], config.signature, torch.device("cpu")))
    await engine.start()

    def depth() -> float | None:
        return registry.get_sample_value("asyncinfer_batcher_queue_depth", {"model": "demo"})

    async def fill(version: str, waiting: int) -> list[Any]:
        items = [engine.submit("demo", rows(1.0), version=version)]
        await wait_entered(models[version])  # it computes, held; the rest wait for its slot
        return items + [engine.submit("demo", rows(1.0), version=version) for _ in range(waiting)]

    try:
        first = await fill("1", 2)
        assert depth() == 2
        second_config = config.model_copy(update={"version": "2"})
        engine.add_model(second_config, TorchBackend("demo", models["2"], config.signature, torch.device("cpu")))
        second = await fill("2", 3)
        assert depth() == 2 + 3
        retired = engine.withdraw("demo", "2")
        gates["2"].set()
        await asyncio.wait_for(asyncio.gather(*(item.future for item in second)), 10.0)
        await asyncio.wait_for(engine.finish_retiring(retired, linger_s=0.0), 10.0)
        assert depth() == 2  # version 1's waiting items, not the retired queue's 0
        gates["1"].set()
        await asyncio.wait_for(asyncio.gather(*(item.future for item in first)), 10.0)
        assert depth() == 0
    finally:
        for gate in gates.values():
            gate.set()
        await engine.stop(grace_s=1.0)


class ExitingAffine(RecordingAffine):
    """y = 2x + 1, but calls sys.exit on a negative input (as a script's code might on bad input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(timeout=10)
        if bool((x < 0).any()):
            raise SystemExit("negative input")
        return 2.0 * x + 1.0


async def test_a_model_that_calls_sys_exit_fails_its_own_item_and_the_batcher_goes_on(
    make_engine: Callable[..., Any],
) -> None:
    """SystemExit from a model's call escaped its worker thread as it was, and the event loop
    re-raised it: one job's input stopped the batcher, every batch of every model with it. It is
    the model's error for the items that raise it (isolated like any other), nothing more."""
    gate = threading.Event()
    model = ExitingAffine(gate)
    engine = await make_engine(model, max_queue_delay_ms=0.0, max_inflight_batches=1)
    first = engine.submit("demo", rows(1.0))
    await wait_entered(model)  # the rest wait, then run in one batch
    bad = engine.submit("demo", rows(-1.0))
    good = [engine.submit("demo", rows(float(v))) for v in (2.0, 3.0, 4.0)]
    gate.set()
    results = await asyncio.wait_for(
        asyncio.gather(*(i.future for i in [first, bad, *good]), return_exceptions=True), 10.0
    )
    assert isinstance(results[1], ModelError)
    assert "SystemExit: negative input" in results[1].message
    for value, outcome in zip((1.0, 2.0, 3.0, 4.0), [results[0], *results[2:]], strict=True):
        assert not isinstance(outcome, BaseException), outcome
        np.testing.assert_array_equal(outcome.outputs[0].to_numpy(), np.full((1, 4), 2 * value + 1))
    again = await asyncio.wait_for(engine.infer("demo", rows(5.0)), 10.0)
    np.testing.assert_array_equal(again.outputs[0].to_numpy(), np.full((1, 4), 11.0))


async def test_a_version_added_to_a_stopped_engine_is_refused_and_nothing_of_it_runs(
    make_engine: Callable[..., Any],
) -> None:
    """A hot load that ends after stop(): refused, nothing added. It was added and started, a batch
    former and a thread pool that nothing would stop (a batcher's supervisor, stopping, refused the
    former after the version was registered)."""
    engine = await make_engine(build_demo_model())
    await engine.infer("demo", [Tensor.from_numpy("x", np.ones((1, 4), np.float32))])
    await engine.stop(grace_s=1.0)
    v2 = DEMO_MODEL.model_copy(update={"version": "2"})
    with pytest.raises(Unavailable) as refused:
        engine.add_model(v2, TorchBackend(v2.name, build_demo_model(), v2.signature, torch.device("cpu")))
    assert refused.value.reason == "BATCHER_SHUTTING_DOWN"
    assert engine.versions("demo") == ["1"]
    assert not engine.takes_models


async def test_a_model_that_times_out_every_batch_says_so_once_not_a_line_a_batch(
    make_engine: Callable[..., Any],
) -> None:
    """Five batches of a model that hangs, computing side by side, each past its items' execution
    timeout: a `batch_timed_out` warning per batch (a model that hangs at 100 batches a second wrote
    100 a second). Now the first says it whole, and the rest within the interval are at debug."""
    gate = threading.Event()
    model = RecordingAffine(gate)
    engine = await make_engine(model, max_batch_size=1, max_queue_delay_ms=0.0, max_inflight_batches=5)
    with capture_logs() as logs:
        items = [engine.submit("demo", rows(float(n)), run_timeout_s=0.2, credited=True) for n in range(5)]
        try:
            for item in items:
                with pytest.raises(RunTimedOut):
                    await asyncio.wait_for(item.future, 5.0)
        finally:
            gate.set()  # the model's threads end
    said = [e for e in logs if e["event"] == "batch_timed_out" and e["log_level"] != "debug"]
    assert len(said) == 1, said
    assert (said[0]["log_level"], said[0]["model"], said[0]["items"]) == ("warning", "demo", 1)
    assert "more_since_last" not in said[0]
    held = [e for e in logs if e["event"] == "batch_timed_out" and e["log_level"] == "debug"]
    assert len(held) == 4, "each batch's line is still there at debug"


class HangingRemoteModel(TorchBackend):
    """A remote backend (Triton's kind: its call runs on the event loop, and can be cancelled)
    whose calls never answer; counts the calls cancelled."""

    runs_async = True

    def __init__(self) -> None:
        super().__init__("demo", build_demo_model(), DEMO_MODEL.signature, torch.device("cpu"))
        self.cancelled: asyncio.Queue[None] = asyncio.Queue()

    async def infer_batch_async(self, inputs: Any, times: Any = None) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.put_nowait(None)
            raise


async def test_a_remote_model_that_hangs_every_call_says_its_cancels_once_not_a_line_a_batch() -> None:
    """Five batches of a remote model whose calls never answer, each cancelled once its item timed
    out: a `batch_call_cancelled` info line per batch. Now the first says it whole, and the rest
    within the interval are at debug."""
    from services.batcher.engine import BatchingEngine

    backend = HangingRemoteModel()
    config = DEMO_MODEL.model_copy(update={"max_batch_size": 1, "max_queue_delay_ms": 0.0, "max_inflight_batches": 5})
    engine = BatchingEngine()
    engine.add_model(config, backend)
    await engine.start()
    try:
        with capture_logs() as logs:
            items = [engine.submit("demo", rows(float(n)), run_timeout_s=0.2, credited=True) for n in range(5)]
            for item in items:
                with pytest.raises(RunTimedOut):
                    await asyncio.wait_for(item.future, 5.0)
            for _ in items:  # each call cancelled (its line is said as the cancel is asked)
                await asyncio.wait_for(backend.cancelled.get(), 5.0)
    finally:
        await engine.stop()
    said = [e for e in logs if e["event"] == "batch_call_cancelled" and e["log_level"] != "debug"]
    assert [(e["log_level"], e["model"], e["items"]) for e in said] == [("info", "demo", 1)]
    held = [e for e in logs if e["event"] == "batch_call_cancelled" and e["log_level"] == "debug"]
    assert len(held) == 4
