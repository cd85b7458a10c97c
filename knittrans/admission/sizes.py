"""Splitting by sizes alone: count vectors over size classes, bitset subset sums, and an exact search.

Without a binding token budget, only the sizes of the admission units matter, and two units of the same size are
interchangeable. A set of units is then a *count vector* ``w`` over the batch's distinct unit sizes (its "size
classes", largest first): ``w[i]`` units of size ``sizes[i]``. The allowed mini-batch sizes are an arithmetic
progression (``Span``): ``lo, lo + step, ..., hi``, every one a multiple of ``step``.

``SizeSearch.split(w, kk, span)`` decides whether ``w`` can be split into exactly ``kk`` bins with sizes in
``span``. In order, cheapest first:

1. arithmetic: sums of kk terms of the progression are exactly the multiples of ``step`` in
   [kk * lo, kk * hi], so that range is necessary (and, with one size class, sufficient in closed form,
   ``uniform_counts``);
2. a constructive greedy: bin by bin, a target near the remaining average, hit exactly by a bounded subset sum
   over the size classes (Python ints as bitsets; binary splitting of each class's count), largest sizes first so
   the small, flexible units are left for the last bins. A split it builds is a proof (exact "yes");
3. an exact memoized search over count vectors (the first bin holds a unit of the largest class left: bins are
   unlabeled), bounded by ``node_limit`` candidate bins; out of nodes is ``None`` (UNKNOWN).

Answers are memoized per ``SizeSearch`` (one per batch): between two commits the multiset of remaining units does
not change (an arrival only moves a unit from pending to ready), so consecutive decisions ask about the same rests.

``SizeSearch.first_bins`` answers the admission question by sizes: which count vectors ``v <= r`` (``r``: the
ready units) have an allowed total and leave a rest ``u - v`` that splits into ``k - 1`` bins. It yields the
caller's preferred candidates first, then every other ``v``, pruned by suffix-reach bitsets, so it is complete
whenever it runs to the end within its candidate budget and every split answer was exact (``complete``).

Example::

    >>> s = SizeSearch([4, 3, 2], node_limit=1000)
    >>> span = Span(6, 6, 1)                       # mini-batches of exactly 6
    >>> s.split((1, 0, 1), 1, span), s.split((2, 0, 2), 2, span), s.split((0, 2, 3), 2, span)
    (True, True, True)
    >>> s.split((1, 2, 0), 2, span)                # 4 + 3 + 3 = 10: not two sixes
    False
    >>> [v for v in s.first_bins(r=(1, 0, 1), u=(2, 0, 2), k=2, first=span, rest=span)]
    [(1, 0, 1)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence


@dataclass(frozen=True, slots=True)
class Span:
    """Allowed mini-batch sizes ``lo, lo + step, ..., hi`` (``BatchConstraints.allowed_sizes()`` and its prefix
    ``robust_sizes()`` are such progressions; every allowed size is a multiple of ``step``)."""

    lo: int
    hi: int
    step: int

    @classmethod
    def of(cls, sizes: Sequence[int]) -> "Span":
        step = sizes[1] - sizes[0] if len(sizes) > 1 else 1
        if any(b - a != step for a, b in zip(sizes, sizes[1:])):  # pragma: no cover - constraints guarantee it
            raise AssertionError(f"allowed sizes {list(sizes)} are not an arithmetic progression")
        return cls(sizes[0], sizes[-1], step)

    def __contains__(self, size: int) -> bool:
        return self.lo <= size <= self.hi and (size - self.lo) % self.step == 0

    def sizes(self) -> list[int]:
        return list(range(self.lo, self.hi + 1, self.step))

    def mask(self) -> int:
        """Bitset of the allowed sizes."""
        m = 0
        for s in range(self.lo, self.hi + 1, self.step):
            m |= 1 << s
        return m

    def splits(self, total: int, kk: int) -> bool:
        """Whether ``total`` is a sum of exactly ``kk`` allowed sizes (arithmetic only)."""
        if kk == 0:
            return total == 0
        return kk * self.lo <= total <= kk * self.hi and (total - kk * self.lo) % self.step == 0


def uniform_counts(total_units: int, g: int, k: int, sizes: list[int]) -> list[int] | None:
    """Units per bin for k bins of ``total_units`` units of one size g with bin sizes in ``sizes`` (an arithmetic
    progression), or None. Closed form: per-bin unit counts form a progression too, and sums of k terms of a
    progression cover every step in [k * smallest, k * largest]."""
    per_bin = sorted({s // g for s in sizes if s % g == 0})
    if not per_bin:
        return None
    step = per_bin[1] - per_bin[0] if len(per_bin) > 1 else 1
    a, b = per_bin[0], per_bin[-1]
    if len(per_bin) > 1 and any(y - x != step for x, y in zip(per_bin, per_bin[1:])):  # pragma: no cover
        raise AssertionError("allowed sizes are not an arithmetic progression")
    if not (k * a <= total_units <= k * b):
        return None
    extra = total_units - k * a
    if len(per_bin) == 1:
        return [a] * k if extra == 0 else None
    if extra % step:
        return None
    counts, extra = [a] * k, extra // step
    for i in range(k):  # spread evenly: bins differ by at most one step
        add = extra // (k - i)
        counts[i] += add * step
        extra -= add
    return counts


class _OutOfNodes(Exception):
    pass


Vector = tuple[int, ...]


class SizeSearch:
    """Split questions over count vectors of one batch's size classes, memoized (see the module docstring)."""

    def __init__(self, sizes: Iterable[int], node_limit: int = 20_000, candidate_limit: int = 4096) -> None:
        self.sizes: tuple[int, ...] = tuple(sorted(set(sizes), reverse=True))
        self.index = {s: i for i, s in enumerate(self.sizes)}
        self.node_limit = node_limit
        self.candidate_limit = candidate_limit
        self._memo: dict[tuple[Vector, int, Span], bool | None] = {}
        self.complete = True  # the last first_bins run was exhaustive and every split answer exact
        self.unknown = 0  # split questions that ran out of nodes

    # -- vectors ------------------------------------------------------------------------------------------------

    def vector(self, counts: dict[int, int]) -> Vector:
        """The count vector of a size -> count mapping (sizes must be classes of this search)."""
        w = [0] * len(self.sizes)
        for s, n in counts.items():
            if n:
                w[self.index[s]] += n
        return tuple(w)

    def total(self, w: Vector) -> int:
        return sum(n * s for n, s in zip(w, self.sizes))

    def _reach(self, w: Sequence[int], cap: int) -> list[int]:
        """reach[i]: bitset of the sums (<= cap) that classes i.. can make with at most w[j] units each."""
        n = len(w)
        mask = (2 << cap) - 1
        reach = [0] * (n + 1)
        reach[n] = r = 1
        for i in range(n - 1, -1, -1):
            s, c, p = self.sizes[i], w[i], 1
            while c > 0:  # binary splitting: parts 1, 2, 4, ..., rest make every count 0..w[i]
                take = p if p < c else c
                r = (r | (r << (take * s))) & mask
                c -= take
                p <<= 1
            reach[i] = r
        return reach

    def _take(self, reach: list[int], w: Sequence[int], target: int) -> list[int]:
        """A count vector <= w summing to ``target`` (reach[0] must have it), as many large units as possible."""
        out, rem = [0] * len(w), target
        for i, s in enumerate(self.sizes):
            x = min(w[i], rem // s)
            while not (reach[i + 1] >> (rem - x * s)) & 1:
                x -= 1
            out[i] = x
            rem -= x * s
        return out

    # -- split ----------------------------------------------------------------------------------------------------

    def split(self, w: Vector, kk: int, span: Span) -> bool | None:
        """Can ``w`` be split into exactly ``kk`` bins with sizes in ``span``? None: undecided (out of nodes)."""
        key = (w, kk, span)
        if key in self._memo:
            return self._memo[key]
        ans = self._arith(w, kk, span)
        if ans is None:
            ans = True if self.greedy(w, kk, span) is not None else None
        if ans is None:
            try:
                ans = self._exact(w, kk, span, [0])
            except _OutOfNodes:
                self.unknown += 1
        self._memo[key] = ans
        return ans

    def _arith(self, w: Vector, kk: int, span: Span) -> bool | None:
        """The answer when arithmetic (or the one-class closed form) decides it, else None."""
        total = self.total(w)
        if not span.splits(total, kk):
            return False
        if kk <= 1:
            return True
        classes = [i for i, n in enumerate(w) if n]
        if any(self.sizes[i] > span.hi for i in classes):
            return False
        if sum(w[i] for i in classes if 2 * self.sizes[i] > span.hi) > kk:  # no two of these share a bin
            return False
        if len(classes) == 1:
            i = classes[0]
            return uniform_counts(w[i], self.sizes[i], kk, span.sizes()) is not None
        return None

    def greedy(self, w: Vector, kk: int, span: Span) -> list[list[int]] | None:
        """A split of ``w`` into kk bins (count vectors), built bin by bin; None when the greedy gets stuck."""
        if not span.splits(self.total(w), kk):
            return None
        left_w, total, bins = list(w), self.total(w), []
        for left in range(kk, 1, -1):
            lo_t = max(span.lo, total - (left - 1) * span.hi)
            hi_t = min(span.hi, total - (left - 1) * span.lo)
            reach = self._reach(left_w, hi_t)
            avg = total / left
            best = None
            for t in range(lo_t + (span.lo - lo_t) % span.step, hi_t + 1, span.step):
                if (reach[0] >> t) & 1 and (best is None or abs(t - avg) < abs(best - avg)):
                    best = t
            if best is None:
                return None
            take = self._take(reach, left_w, best)
            bins.append(take)
            left_w = [a - b for a, b in zip(left_w, take)]
            total -= best
        if total not in span:
            return None
        bins.append(left_w)
        return bins

    def _exact(self, w: Vector, kk: int, span: Span, nodes: list[int]) -> bool:
        key = (w, kk, span)
        if key in self._memo and self._memo[key] is not None:
            return bool(self._memo[key])
        ans = self._arith(w, kk, span)
        if ans is None:
            ans = False
            total = self.total(w)
            first = next(i for i, n in enumerate(w) if n)
            lo_t = max(span.lo, total - (kk - 1) * span.hi)
            hi_t = min(span.hi, total - (kk - 1) * span.lo)
            for v in self._vectors(w, first, lo_t, hi_t, span):
                nodes[0] += 1
                if nodes[0] > self.node_limit:
                    raise _OutOfNodes
                if self._exact(tuple(a - b for a, b in zip(w, v)), kk - 1, span, nodes):
                    ans = True
                    break
        self._memo[key] = ans  # a search that returned explored its whole subtree: exact
        return ans

    def _vectors(self, w: Sequence[int], first: int, lo_t: int, hi_t: int, span: Span,
                 reach: list[int] | None = None) -> Iterator[Vector]:
        """Vectors v <= w with v[first] >= 1 (when first >= 0) and a total in ``span`` within [lo_t, hi_t], larger
        counts of larger sizes first; partial vectors that cannot reach such a total are pruned."""
        if reach is None:
            reach = self._reach(w, hi_t)
        targets = 0
        for t in range(lo_t + (span.lo - lo_t) % span.step, hi_t + 1, span.step):
            targets |= 1 << t
        n, v = len(w), [0] * len(w)

        def rec(i: int, p: int) -> Iterator[Vector]:
            if not ((reach[i] << p) & targets):
                return
            if i == n:
                yield tuple(v)
                return
            s = self.sizes[i]
            lo = 1 if i == first else 0
            for x in range(min(w[i], (hi_t - p) // s), lo - 1, -1):
                v[i] = x
                yield from rec(i + 1, p + x * s)
            v[i] = 0

        yield from rec(0, 0)

    # -- the admission question by sizes ---------------------------------------------------------------------

    def first_bins(self, r: Vector, u: Vector, k: int, first: Span, rest: Span,
                   preferred: Iterable[Vector] = ()) -> Iterator[Vector]:
        """Count vectors ``v <= r`` with a total in ``first`` whose rest ``u - v`` splits into ``k - 1`` bins of
        ``rest`` sizes: ``preferred`` ones first (each must be <= r with a total in ``first``), then the others.
        ``self.complete`` says, once the iterator is exhausted, whether the answer was exact."""
        self.complete = True
        total = self.total(u)
        seen: set[Vector] = set()
        budget = [self.candidate_limit]

        def ok(v: Vector) -> bool:
            budget[0] -= 1
            ans = self.split(tuple(a - b for a, b in zip(u, v)), k - 1, rest)
            if ans is None:
                self.complete = False
            return bool(ans)

        for v in preferred:
            if v not in seen:
                seen.add(v)
                if ok(v):
                    yield v
        lo_t = max(first.lo, total - (k - 1) * rest.hi)
        hi_t = min(first.hi, total - (k - 1) * rest.lo)
        for v in self._vectors(r, -1, lo_t, hi_t, first):
            if budget[0] <= 0:
                self.complete = False
                return
            if v in seen or not rest.splits(total - self.total(v), k - 1):
                budget[0] -= 1
                continue
            seen.add(v)
            if ok(v):
                yield v
