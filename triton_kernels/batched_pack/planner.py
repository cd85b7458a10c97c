"""plan_microbatches: token-balanced placement of sequences on D ranks x M micro-batches under a token budget.

Why: data-parallel ranks step in lockstep, so a step lasts as long as the rank with the most tokens; each
micro-batch must fit the per-micro-batch token budget (activation memory). Two methods, compared in
``repro/kernels.py`` by their imbalance:

- ``"ffd"``: first-fit-decreasing bin packing of all sequences into budget-sized micro-batches (the fewest
  bins FFD finds), then the bins are dealt to ranks largest-first onto the least-loaded rank (LPT). What a
  careful user of a packing data loader does.
- ``"kk"``: Karmarkar-Karp k-way largest differencing splits the sequences across the D ranks, then within each
  rank again into M micro-batches (the smallest M for which every rank's parts fit the budget; FFD bins are the
  fallback when differencing cannot fit). verl's seqlen balancing uses the same differencing.

Imbalance = max / mean - 1 (0 is perfect), reported over ranks and over micro-batch slots.

Example::

    >>> p = plan_microbatches([4, 3, 3, 2, 2, 1], num_ranks=2, max_tokens_per_microbatch=5, method="kk")
    >>> p.rank_tokens, p.num_microbatches, p.microbatches
    ([8, 7], 2, [[[2, 4], [1]], [[0], [3, 5]]])
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from .reference import PackPlan

Method = Literal["ffd", "kk"]


@dataclass
class MicrobatchPlan:
    """A placement of every sequence: ``microbatches[r][m]`` lists sequence ids in packing order; ``pack``
    is the same placement as a PackPlan (row = r * num_microbatches + m, gapless offsets from 0)."""

    method: str
    num_ranks: int
    num_microbatches: int
    max_tokens: int
    microbatches: list[list[list[int]]]
    pack: PackPlan
    rank_tokens: list[int] = field(default_factory=list)
    microbatch_tokens: list[list[int]] = field(default_factory=list)

    @property
    def rank_imbalance(self) -> float:
        """max / mean tokens over ranks - 1 (the DP step waits for the fullest rank)."""
        return _imbalance(self.rank_tokens)

    @property
    def microbatch_imbalance(self) -> float:
        """max / mean tokens over all rank x micro-batch slots - 1."""
        return _imbalance([t for r in self.microbatch_tokens for t in r])


def _imbalance(xs: Sequence[int]) -> float:
    mean = sum(xs) / len(xs) if xs else 0.0
    return (max(xs) / mean - 1.0) if mean > 0 else 0.0


def karmarkar_karp(lengths: Sequence[int], items: Sequence[int], k: int) -> list[list[int]]:
    """k-way largest differencing: split ``items`` (ids into ``lengths``) into k parts of near-equal sums."""
    if k == 1:
        return [list(items)]
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for n, i in enumerate(sorted(items, key=lambda j: (-lengths[j], j))):
        parts = [(lengths[i], [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-lengths[i], n, parts))
    tie = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [p[1] for p in heap[0][2]] if heap else [[] for _ in range(k)]


def first_fit_decreasing(lengths: Sequence[int], items: Sequence[int], capacity: int) -> list[list[int]]:
    """Classic FFD bin packing: longest first, into the first bin with room."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(items, key=lambda j: (-lengths[j], j)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _lpt(loads: Sequence[int], k: int) -> list[list[int]]:
    """Largest-first onto the least-loaded of k parts (ids into ``loads``)."""
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, r) for r in range(k)]
    for i in sorted(range(len(loads)), key=lambda j: (-loads[j], j)):
        total, r = heapq.heappop(heap)
        parts[r].append(i)
        heapq.heappush(heap, (total + loads[i], r))
    return parts


def plan_microbatches(lengths: Sequence[int] | torch.Tensor, num_ranks: int, max_tokens_per_microbatch: int,
                      method: Method = "kk") -> MicrobatchPlan:
    """Place sequences of ``lengths`` tokens on ``num_ranks`` ranks, each running the same number of
    micro-batches of at most ``max_tokens_per_microbatch`` tokens. Raises ValueError for a negative length or
    one longer than the budget."""
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if num_ranks < 1 or max_tokens_per_microbatch < 1:
        raise ValueError(f"num_ranks and max_tokens_per_microbatch must be >= 1, got {num_ranks}, "
                         f"{max_tokens_per_microbatch}")
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"sequence {i} has a negative length {n}")
        if n > max_tokens_per_microbatch:
            raise ValueError(f"sequence {i} has {n} tokens, longer than max_tokens_per_microbatch="
                             f"{max_tokens_per_microbatch}")
    ids = list(range(len(lens)))
    if method == "ffd":
        bins = first_fit_decreasing(lens, ids, max_tokens_per_microbatch)
        by_rank = _lpt([sum(lens[i] for i in b) for b in bins], num_ranks)
        per_rank = [[bins[b] for b in sorted(r, key=lambda b: -sum(lens[i] for i in bins[b]))] for r in by_rank]
    elif method == "kk":
        per_rank = [_split_rank(lens, part, max_tokens_per_microbatch)
                    for part in karmarkar_karp(lens, ids, num_ranks)]
    else:
        raise ValueError(f"method must be 'ffd' or 'kk', got {method!r}")
    m = max(1, max(len(r) for r in per_rank))
    mbs = [r + [[] for _ in range(m - len(r))] for r in per_rank]
    return _to_plan(method, lens, mbs, max_tokens_per_microbatch)


def _split_rank(lens: list[int], items: list[int], budget: int) -> list[list[int]]:
    """Differencing into the fewest micro-batches that fit the budget (FFD's bins if differencing cannot)."""
    ffd = first_fit_decreasing(lens, items, budget)
    total = sum(lens[i] for i in items)
    for m in range(max(1, -(-total // budget)), len(ffd) + 1):
        parts = karmarkar_karp(lens, items, m)
        if all(sum(lens[i] for i in p) <= budget for p in parts):
            return parts
    return ffd if ffd else [[]]


def _to_plan(method: str, lens: list[int], mbs: list[list[list[int]]], budget: int) -> MicrobatchPlan:
    m = len(mbs[0])
    row = torch.zeros(len(lens), dtype=torch.int64)
    offset = torch.zeros(len(lens), dtype=torch.int64)
    mb_tokens = []
    for r, rank in enumerate(mbs):
        mb_tokens.append([])
        for j, mb in enumerate(rank):
            mb.sort(key=lambda i: (-lens[i], i))
            pos = 0
            for i in mb:
                row[i], offset[i] = r * m + j, pos
                pos += lens[i]
            mb_tokens[-1].append(pos)
    pack = PackPlan(row=row, offset=offset, num_rows=len(mbs) * m, row_len=budget)
    return MicrobatchPlan(method=method, num_ranks=len(mbs), num_microbatches=m, max_tokens=budget,
                          microbatches=mbs, pack=pack, rank_tokens=[sum(t) for t in mb_tokens],
                          microbatch_tokens=mb_tokens)
