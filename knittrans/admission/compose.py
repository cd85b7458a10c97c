"""Building blocks of KnitTrans's composition: which ready units make the next mini-batch.

- ``fifo_subsets``: for each allowed size t, the lexicographically first subset of the ready units (in completion
  order) holding exactly t trajectories: the oldest completions that can make a mini-batch of that size. A bounded
  subset sum over suffixes (Python ints as bitsets), O(ready units) big-int operations for all targets together
  plus O(ready units) per target produced.
- ``oldest_of`` / ``lightest_of``: the units of a count vector (``sizes.SizeSearch``), oldest or fewest tokens
  first within each size class.
- ``ready_bin_search``: with a binding token budget, sizes alone do not decide. This is the exact search for the
  admission question itself: a split of *all* remaining units (ready, with exact tokens; pending, at their upper
  bounds) into k valid mini-batches whose first bin holds only ready units. It is one depth-first search over units,
  longest first (so the mini-batch it finds takes the longest ready responses the budget has room for), with the k -
  1 other bins interchangeable and failed states memoized, bounded by ``node_limit`` nodes.

Example::

    >>> from knittrans.admission.sizes import Span
    >>> us = [Unit(i, s, 1, True, i) for i, s in enumerate([4, 3, 2, 1])]
    >>> [[u.size for u in b] for b in fifo_subsets(us, Span(5, 6, 1))]
    [[4, 1], [4, 2]]
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from knittrans.admission.feasibility import Unit
from knittrans.admission.sizes import SizeSearch, Span
from knittrans.constraints import BatchConstraints


def fifo_subsets(ready: Sequence[Unit], first: Span,
                 total_ok: Callable[[int], bool] = lambda t: True) -> Iterator[list[Unit]]:
    """For each size t in ``first`` (ascending) with ``total_ok(t)``, the lexicographically first subset of
    ``ready`` (in the given order) with exactly t trajectories, when one exists."""
    n = len(ready)
    mask = (2 << first.hi) - 1
    reach = [0] * (n + 1)  # reach[i]: bitset of the sums that ready[i:] can make
    reach[n] = 1
    for i in range(n - 1, -1, -1):
        reach[i] = (reach[i + 1] | (reach[i + 1] << ready[i].size)) & mask
    for t in first.sizes():
        if not (reach[0] >> t) & 1 or not total_ok(t):
            continue
        out, rem = [], t
        for i, u in enumerate(ready):
            if rem == 0:
                break
            if u.size <= rem and (reach[i + 1] >> (rem - u.size)) & 1:
                out.append(u)
                rem -= u.size
        yield out


def oldest_of(ready: Sequence[Unit], v: Sequence[int], search: SizeSearch) -> list[Unit]:
    """The oldest ready units (``ready`` is in completion order) making up count vector ``v``."""
    need, out = list(v), []
    for u in ready:
        i = search.index[u.size]
        if need[i]:
            need[i] -= 1
            out.append(u)
    return out


def lightest_of(ready: Sequence[Unit], v: Sequence[int], search: SizeSearch) -> list[Unit]:
    """The ready units with the fewest tokens making up count vector ``v`` (the selection most likely to fit a
    token budget: if it does not, no selection with these sizes does)."""
    return oldest_of(sorted(ready, key=lambda u: (u.tokens, u.order)), v, search)


class OutOfNodes(Exception):
    """``ready_bin_search`` ran out of nodes: no answer either way."""


def ready_bin_search(ready: Sequence[Unit], pending: Sequence[Unit], k: int, c: BatchConstraints,
                     node_limit: int) -> list[Unit] | None:
    """A mini-batch of ready units after which the rest splits into k - 1 valid mini-batches, or None when there is
    none (exact). Raises ``OutOfNodes`` past ``node_limit`` nodes. Tokens of pending units are upper bounds."""
    sizes = c.allowed_sizes()
    allowed, lo, hi = set(sizes), sizes[0], sizes[-1]
    budget = c.token_budget if c.token_budget is not None else sum(u.tokens for u in ready) + sum(
        u.tokens for u in pending)
    order = sorted(list(ready) + list(pending), key=lambda u: (-u.tokens, -u.size, u.order))
    n = len(order)
    suf_size, suf_tok, suf_ready = [0] * (n + 1), [0] * (n + 1), [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        u = order[i]
        suf_size[i] = suf_size[i + 1] + u.size
        suf_tok[i] = suf_tok[i + 1] + u.tokens
        suf_ready[i] = suf_ready[i + 1] + (u.size if u.ready else 0)
    cnt, tok = [0] * k, [0] * k  # bin 0 is the mini-batch to commit: ready units only
    in_first = [False] * n
    failed: set[tuple] = set()
    nodes = [0]

    def rec(i: int) -> bool:
        if i == n:
            return all(x in allowed for x in cnt)
        state = (i, cnt[0], tok[0], tuple(sorted(zip(cnt[1:], tok[1:]))))
        if state in failed:
            return False
        nodes[0] += 1
        if nodes[0] > node_limit:
            raise OutOfNodes
        need = sum(lo - x for x in cnt if x < lo)
        room = sum(hi - x for x in cnt)
        if (need > suf_size[i] or room < suf_size[i] or k * budget - sum(tok) < suf_tok[i]
                or cnt[0] + suf_ready[i] < lo):
            failed.add(state)
            return False
        u = order[i]
        seen: set[tuple[int, int]] = set()
        for j in range(k):
            if j == 0 and not u.ready:
                continue
            if j > 0:
                if (cnt[j], tok[j]) in seen:  # the k - 1 other bins are interchangeable
                    continue
                seen.add((cnt[j], tok[j]))
            if cnt[j] + u.size > hi or tok[j] + u.tokens > budget:
                continue
            cnt[j] += u.size
            tok[j] += u.tokens
            in_first[i] = j == 0
            ok = rec(i + 1)
            cnt[j] -= u.size
            tok[j] -= u.tokens
            if ok:
                return True
        failed.add(state)
        return False

    if not rec(0):
        return None
    return sorted((u for i, u in enumerate(order) if in_first[i]), key=lambda u: u.order)
