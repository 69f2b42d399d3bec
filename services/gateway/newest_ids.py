"""The newest few of many IDs, kept as they come: what a listing's page needs of a tenant's job or
batch IDs (UUIDv7, so newest sorts last), read from stream info answers of up to 100,000 subjects
each, without holding every answer's."""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class NewestIds:
    """The newest `most` (every one, when None) of the IDs added that are older than `before`
    (all when None), and whether any of those were left out (a listing has more pages)."""

    def __init__(self, *, before: str | None, most: int | None) -> None:
        self._before = before
        self._most = most
        self._kept: set[str] = set()
        self.left_out = False

    def add(self, ids: Iterable[str]) -> None:
        before = self._before
        self._kept.update(id_ for id_ in ids if before is None or id_ < before)
        if self._most is not None and len(self._kept) > self._most:
            self._kept = set(heapq.nlargest(self._most, self._kept))
            self.left_out = True

    @property
    def kept(self) -> set[str]:
        return self._kept

    def newest_first(self) -> list[str]:
        return sorted(self._kept, reverse=True)
