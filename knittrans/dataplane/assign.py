"""Split a mini-batch into per-rank shares: local first, tokens balanced.

Why: a rank that reads from the unit on its own node moves bytes through memory, not the network; but a rank
with more tokens than the others makes every rank wait for it at the step's collective. So locality is a
preference that yields whenever it would push a rank past the balance bound.

Algorithm (deterministic): longest-processing-time first. Items go in decreasing token order (ties by id). Each
goes to the least-loaded rank on its own node if that keeps the rank within ``(1 + slack) * ideal`` tokens
(``ideal = total / ranks``), otherwise to the least-loaded rank anywhere. With ``equal_counts`` a rank takes at
most ``ceil(n / ranks)`` items (DP ranks that step on equal sample counts). Bound: every rank ends at most
``max((1 + slack) * ideal, LPT bound)``, where the LPT bound is ``ideal + largest item``.

    >>> items = [ShareItem(0, 10, "a"), ShareItem(1, 10, "b"), ShareItem(2, 1, "a"), ShareItem(3, 1, "b")]
    >>> assign_shares(items, rank_nodes=("a", "b"))
    ((0, 2), (1, 3))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


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
    load = [0] * nranks
    count = [0] * nranks
    owner: dict[int, int] = {}
    for it in sorted(items, key=lambda i: (-i.tokens, i.traj_id)):
        open_ranks = [r for r in range(nranks) if count[r] < cap]
        best_any = min(open_ranks, key=lambda r: (load[r], r))
        local = [r for r in open_ranks if rank_nodes[r] == it.node]
        r = best_any
        if local:
            best_local = min(local, key=lambda r: (load[r], r))
            if load[best_local] + it.tokens <= bound or load[best_local] == load[best_any]:
                r = best_local
        owner[it.traj_id] = r
        load[r] += it.tokens
        count[r] += 1
    shares: list[list[int]] = [[] for _ in range(nranks)]
    for it in items:
        shares[owner[it.traj_id]].append(it.traj_id)
    return tuple(tuple(s) for s in shares)
