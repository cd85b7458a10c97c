"""A set of ints stored as sorted disjoint ranges: what the controller remembers of released trajectories.

Why not a ``set``: a long run releases millions of trajectory ids, and a Python set holds ~60 B per id for ever.
Producers number trajectories in runs (a batch's ids are consecutive), so the released ids collapse into a few
ranges and memory stays flat however long the run. Hand-written (not ``portion``/``intervaltree``): the
controller only needs add-many and membership, ~40 lines, no dependency in the core.

    >>> s = IdRanges()
    >>> s.update([3, 1, 2, 7]); s.update([4, 5, 6])
    >>> 4 in s, 8 in s, s.ranges, len(s)
    (True, False, [(1, 8)], 7)
"""

from __future__ import annotations

import bisect
from typing import Iterable


class IdRanges:
    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted; range i is [_starts[i], _ends[i])
        self._ends: list[int] = []
        self._n = 0

    def __contains__(self, x: object) -> bool:
        if not isinstance(x, int):
            return False
        i = bisect.bisect_right(self._starts, x) - 1
        return i >= 0 and x < self._ends[i]

    def __len__(self) -> int:
        return self._n

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    @classmethod
    def of_ranges(cls, ranges: Iterable[tuple[int, int]]) -> "IdRanges":
        """The set of the half-open ``[lo, hi)`` ranges (as ``ranges`` lists them)."""
        out = cls()
        for lo, hi in ranges:
            out._add(lo, hi)
        return out

    def update(self, ids: Iterable[int]) -> None:
        """Add ``ids`` (consecutive runs are added one range at a time)."""
        xs = sorted(set(ids))
        i = 0
        while i < len(xs):
            j = i
            while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
                j += 1
            self._add(xs[i], xs[j] + 1)
            i = j + 1

    def _add(self, lo: int, hi: int) -> None:
        """Merge [lo, hi) with every range it overlaps or touches."""
        i = bisect.bisect_left(self._ends, lo)  # first range ending at or after lo
        j = bisect.bisect_right(self._starts, hi)  # ranges i..j-1 overlap or touch [lo, hi)
        old = sum(e - s for s, e in zip(self._starts[i:j], self._ends[i:j]))
        if i < j:
            lo, hi = min(lo, self._starts[i]), max(hi, self._ends[j - 1])
        self._starts[i:j] = [lo]
        self._ends[i:j] = [hi]
        self._n += (hi - lo) - old
