"""The collector settings a service applies once started (asyncinfer.gc_tuning)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from asyncinfer.gc_tuning import YOUNG_THRESHOLD, tune_for_serving

pytestmark = pytest.mark.unit


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_start_up_heap_is_frozen_and_young_collections_are_rarer(restored_gc: None) -> None:
    kept = [{"start-up": i} for i in range(1000)]  # containers alive when the service has started
    tune_for_serving()
    assert gc.get_freeze_count() >= len(kept)
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    assert not any(obj is kept[0] for obj in gc.get_objects())  # frozen: no collection walks it


def test_cyclic_garbage_is_still_collected_automatically(restored_gc: None) -> None:
    tune_for_serving()

    class Node:
        def __init__(self) -> None:
            self.other: Node | None = None

    collected: list[bool] = []
    a, b = Node(), Node()
    a.other, b.other = b, a
    weakref.finalize(a, lambda: collected.append(True))
    del a, b
    assert collected == []  # a cycle: reference counting alone never frees it
    # No explicit gc.collect(): allocating past the young threshold must trigger a collection.
    alive = [[] for _ in range(YOUNG_THRESHOLD * 2)]
    assert collected == [True]
    assert len(alive) == YOUNG_THRESHOLD * 2
