"""The collector settings a service applies once started (asyncinfer.gc_tuning)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from asyncinfer.gc_tuning import YOUNG_THRESHOLD, tune_for_serving
from services.cli import _starter

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


@pytest.fixture
def full_collections() -> Iterator[list[int]]:
    """How many full collections had run, noted at each collection's start (gc.callbacks)."""
    seen: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


def test_tuning_once_serving_leaves_the_oldest_generation_unwalked(
    restored_gc: None, full_collections: list[int]
) -> None:
    # Session 29: a full collection here walked the whole start-up heap after the servers listened,
    # holding the GIL 30-390 ms while the first calls came in.
    tune_for_serving()
    assert full_collections == []


async def test_a_service_collects_its_start_up_garbage_before_it_listens(
    restored_gc: None, full_collections: list[int]
) -> None:
    made_at: list[int] = []
    started_at: list[int] = []

    class NotListening:
        port = 0

        async def start(self) -> None:  # a service's start is where it binds and listens
            started_at.append(len(full_collections))

    def make() -> Any:
        made_at.append(len(full_collections))
        return NotListening()

    await _starter("gateway", make)()
    assert started_at[0] > made_at[0], "a full collection runs between building the app and its listening"
