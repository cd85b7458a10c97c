"""Split a mini-batch into per-rank shares: local first, tokens balanced.

Why: a rank that reads from the unit on its own node moves bytes through memory, not the network; but a rank
with more tokens than the others makes every rank wait for it at the step's collective. So locality is a
preference that yields whenever it would push a rank past the balance bound.

Algorithm (deterministic): longest-processing-time first. Items go in decreasing token order (ties by id). Each
goes to the least-loaded rank on its own node if that keeps the rank within ``(1 + slack) * ideal`` tokens
(``ideal = total / ranks``), otherwise to the least-loaded rank anywhere. With ``equal_counts`` a rank takes at
most ``ceil(n / ranks)`` items (DP ranks that step on equal sample counts). Bound: every rank ends at most
``max((1 + slack) * ideal, LPT bound)``, where the LPT bound is ``ideal + largest item``.

Since session 38 a second split is tried first (``contiguous_shares``): consecutive segments of ``items`` (local
first), evened out by swaps. It is taken only when it is at least as balanced (its most loaded rank no heavier than
LPT's) and at least as local as LPT's split: then it wins on what LPT ignores -- a rank packs its share one copy per
run of consecutive stored rows, and LPT, dealing items by length, cuts a share of n trajectories into ~n runs per
field (116-140 per 4-7 MB text share), the segments into a few plus two per swap. Measured on the text table's
batch (``scripts/rawprof.py``, two A/B pairs): the drain's pack 1.43-1.49 -> 1.11-1.13 ms per share, its get
0.22-0.24 -> 0.25-0.29 of memcpy.

    >>> items = [ShareItem(0, 10, "a"), ShareItem(1, 10, "b"), ShareItem(2, 1, "a"), ShareItem(3, 1, "b")]
    >>> assign_shares(items, rank_nodes=("a", "b"))
    ((0, 2), (1, 3))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, slots=True)
class ShareItem:
    """A trajectory to place: its id, its token count, the node of the unit that holds it."""

    traj_id: int
    tokens: int
    node: str


def assign_shares(items: Sequence[ShareItem], rank_nodes: Sequence[str], slack: float = 0.05,
                  equal_counts: bool = True) -> tuple[tuple[int, ...], ...]:
    """Per-rank trajectory ids (each rank's ids in the order of ``items``); every item exactly once."""
    nranks = len(rank_nodes)
    if nranks == 0:
        raise ValueError("assign_shares: no ranks")
    if slack < 0:
        raise ValueError(f"assign_shares: slack must be >= 0, got {slack}")
    cap = math.ceil(len(items) / nranks) if equal_counts else len(items)
    ideal = sum(i.tokens for i in items) / nranks
    bound = (1.0 + slack) * ideal
    lpt = _lpt(items, rank_nodes, cap, bound)
    runs = contiguous_shares(items, rank_nodes, bound, equal_counts)
    if runs is None:
        return lpt
    by_id = {i.traj_id: i for i in items}

    def heaviest_and_remote(shares: tuple[tuple[int, ...], ...]) -> tuple[int, int]:
        return (max(sum(by_id[t].tokens for t in s) for s in shares),
                sum(by_id[t].node != rank_nodes[r] for r, s in enumerate(shares) for t in s))

    (heavy, remote), (lpt_heavy, lpt_remote) = heaviest_and_remote(runs), heaviest_and_remote(lpt)
    # as balanced and as local as LPT's, in fewer runs
    return runs if heavy <= lpt_heavy and remote <= lpt_remote else lpt


def _lpt(items: Sequence[ShareItem], rank_nodes: Sequence[str], cap: int,
         bound: float) -> tuple[tuple[int, ...], ...]:
    """Longest-processing-time first, local first (the module docstring)."""
    nranks = len(rank_nodes)
    load = [0] * nranks
    count = [0] * nranks
    owner: dict[int, int] = {}
    on_node: dict[str, list[int]] = {}
    for r, n in enumerate(rank_nodes):
        on_node.setdefault(n, []).append(r)
    for it in sorted(items, key=lambda i: (-i.tokens, i.traj_id)):
        best_any = best_local = -1  # the least loaded open rank (ties: the lowest index), anywhere and on it.node
        for r in range(nranks):
            if count[r] < cap and (best_any < 0 or load[r] < load[best_any]):
                best_any = r
        for r in on_node.get(it.node, ()):
            if count[r] < cap and (best_local < 0 or load[r] < load[best_local]):
                best_local = r
        assert best_any >= 0  # cap * nranks >= len(items)
        r = best_any
        if best_local >= 0 and (load[best_local] + it.tokens <= bound or load[best_local] == load[best_any]):
            r = best_local
        owner[it.traj_id] = r
        load[r] += it.tokens
        count[r] += 1
    shares: list[list[int]] = [[] for _ in range(nranks)]
    for it in items:
        shares[owner[it.traj_id]].append(it.traj_id)
    return tuple(tuple(s) for s in shares)


def contiguous_shares(items: Sequence[ShareItem], rank_nodes: Sequence[str], bound: float,
                      equal_counts: bool = True) -> tuple[tuple[int, ...], ...] | None:
    """Shares as consecutive segments of ``items`` (the order the units store them in), local first: each rank's
    quota is an equal count (or, with ``equal_counts`` False, the ideal token load); a node's items, in order, fill
    its local ranks one after another up to their quotas, what is left of them fills the ranks still short, in
    order; then, as long as one brings them closer, the one swap (or, without equal counts, move) of an item between
    the most and the least loaded rank that brings them closest together. None when the result leaves a rank past
    ``bound`` (``assign_shares`` then keeps LPT's split, as it does whenever this one is less balanced or less
    local)."""
    n, nranks = len(items), len(rank_nodes)
    t = np.fromiter((int(i.tokens) for i in items), np.int64, n)
    if equal_counts:
        base, extra = divmod(n, nranks)
        quota = [float(base + (1 if r < extra else 0)) for r in range(nranks)]
        size = np.ones(n)
    else:
        quota = [float(t.sum()) / nranks] * nranks
        size = t.astype(float)
    owner = [-1] * n
    filled = [0.0] * nranks

    def fill(ks: list[int], ranks: list[int]) -> list[int]:
        """Give ``ks`` (in order) to ``ranks`` one after another up to their quotas; return what is left."""
        left, it = [], iter(ranks)
        r = next(it, None)
        for k in ks:
            while r is not None and filled[r] + (size[k] if equal_counts else size[k] / 2) > quota[r] + 1e-9:
                r = next(it, None)
            if r is None:
                left.append(k)
                continue
            owner[k] = r
            filled[r] += size[k]
        return left

    by_node: dict[str, list[int]] = {}
    for k, i in enumerate(items):
        by_node.setdefault(i.node, []).append(k)
    rest: list[int] = []
    for node, ks in by_node.items():
        rest += fill(ks, [r for r in range(nranks) if rank_nodes[r] == node])
    rest.sort()
    rest = fill(rest, list(range(nranks)))
    for k in rest:  # rounding left a few: the least filled rank takes each
        r = min(range(nranks), key=lambda r: (filled[r] - quota[r], r))
        owner[k] = r
        filled[r] += size[k]
    if equal_counts and max(filled) > math.ceil(n / nranks):
        return None
    load = [0] * nranks
    for k in range(n):
        load[owner[k]] += int(t[k])
    for _ in range(n + 1):
        hi = max(range(nranks), key=lambda r: (load[r], -r))
        lo = min(range(nranks), key=lambda r: (load[r], r))
        gap = load[hi] - load[lo]
        own = np.asarray(owner)
        his, los = np.flatnonzero(own == hi), np.flatnonzero(own == lo)
        tb = t[los] if equal_counts else np.append(t[los], 0)  # without equal counts an item may just move
        d = t[his][:, None] - tb[None, :]
        err = np.where((d > 0) & (d < gap), np.abs(gap - 2 * d), np.inf)
        if not np.isfinite(err).any():  # no swap brings the two closer: as balanced as swaps make it
            break
        ia, ib = np.unravel_index(int(np.argmin(err)), err.shape)
        moved = int(d[ia, ib])
        owner[int(his[ia])] = lo
        if ib < len(los):
            owner[int(los[ib])] = hi
        load[hi] -= moved
        load[lo] += moved
    if max(load) > bound:
        return None
    shares: list[list[int]] = [[] for _ in range(nranks)]
    for k, it in enumerate(items):
        shares[owner[k]].append(it.traj_id)
    return tuple(tuple(s) for s in shares)
