"""Feasibility (satisfiability) of the rest of a batch: can these units still fill k mini-batches?

The admission question is a partition problem. Units are what a mini-batch is built from: whole groups when
``whole_groups`` is on, single trajectories otherwise. A unit has a size (trajectories) and tokens (known when it
has completed; for a unit still in flight, its upper bound ``remaining * max_response_len`` plus what has
completed, which is exact for robustness because token limits are monotone in lengths). ``k`` mini-batches are
feasible for a set of units iff the units can be partitioned into exactly k bins, each with a size in
``BatchConstraints.allowed_sizes()`` and tokens within ``token_budget``.

That is bin packing with cardinalities: NP-hard in general, easy in the cases that matter. ``solve`` decides:

- **exact, closed form**: no binding token budget and all units of one size g (uniform GRPO groups, or single
  trajectories): k allowed sizes sum to the total iff the total is a multiple of the step and lies in
  [k * smallest, k * largest] (sums of k terms of an arithmetic progression cover every step in that range);
- **exact, search**: otherwise, when tokens cannot bind, first a constructive greedy over size counts
  (``sizes.SizeSearch.greedy``: bin by bin, an exact bounded subset sum; a split it builds is a proof), then a
  memoized depth-first search (over size counts when tokens cannot bind, over units when they can), bounded by
  ``node_limit`` nodes;
- **sound, witness**: if the search runs out of nodes, a constructive heuristic builds a partition and checks it;
  a checked partition proves feasibility, and when none is found the answer is ``UNKNOWN``, which admission
  treats as "not provably safe" and does not admit. So the check is exact on small instances and sound (never
  admits into a dead end) on large ones; ``Solution.exact`` says which answer you got.

Example::

    >>> from knittrans.constraints import BatchConstraints
    >>> c = BatchConstraints(batch_size=12, num_minibatches=2, max_response_len=10, size_slack=0)
    >>> units = [Unit(key=i, size=s, tokens=s, ready=True, order=i) for i, s in enumerate([5, 1, 4, 2])]
    >>> solve(units, 2, c).verdict     # {5, 1} and {4, 2}
    <Verdict.FEASIBLE: 1>
    >>> solve(units[:3], 2, c).verdict  # 10 trajectories cannot make two mini-batches of 6
    <Verdict.INFEASIBLE: 2>
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

from knittrans.admission.sizes import SizeSearch, Span
from knittrans.admission.sizes import uniform_counts as _uniform_counts
from knittrans.constraints import BatchConstraints, ConstraintError
from knittrans.types import BatchPlan, GroupSpec  # noqa: F401 - GroupSpec: doctest

DEFAULT_NODE_LIMIT = 20_000
_MAX_DEPTH = 400  # the unit-level search recurses once per unit; Python's default stack allows ~1000 frames


class Verdict(enum.Enum):
    FEASIBLE = 1
    INFEASIBLE = 2
    UNKNOWN = 3  # the search ran out of nodes and no witness was found; admission treats it as infeasible


@dataclass(frozen=True, slots=True)
class Unit:
    """An admission unit: a whole group or a single trajectory.

    ``tokens`` is exact for completed units and an upper bound for units still in flight; ``ready`` means every
    trajectory of the unit has completed; ``order`` ranks readiness (smaller = completed earlier)."""

    key: int
    size: int
    tokens: int
    ready: bool
    order: float


@dataclass(frozen=True)
class Solution:
    verdict: Verdict
    exact: bool
    bins: tuple[tuple[Unit, ...], ...] | None = None  # a witness partition when one was built

    @property
    def feasible(self) -> bool:
        return self.verdict is Verdict.FEASIBLE


class _OutOfNodes(Exception):
    pass


def bin_ok(units: Iterable[Unit], c: BatchConstraints) -> bool:
    """Whether these units form one valid mini-batch."""
    size = tokens = 0
    for u in units:
        size += u.size
        tokens += u.tokens
    return c.size_ok(size) and c.tokens_ok(tokens)


def _quick_reject(units: Sequence[Unit], k: int, c: BatchConstraints, sizes: list[int]) -> bool:
    total = sum(u.size for u in units)
    if not (k * sizes[0] <= total <= k * sizes[-1]):
        return True
    if any(u.size > sizes[-1] for u in units):
        return True
    if c.token_budget is not None:
        if any(u.tokens > c.token_budget for u in units) or sum(u.tokens for u in units) > k * c.token_budget:
            return True
    return False


def _tokens_bind(units: Sequence[Unit], c: BatchConstraints, sizes: list[int]) -> bool:
    """False when no bin of allowed size can exceed the budget: the largest units up to the largest allowed
    size fit. Then only sizes matter."""
    if c.token_budget is None:
        return False
    top = sorted(units, key=lambda u: u.tokens / u.size, reverse=True)
    cap, tok = sizes[-1], 0
    for u in top:  # per-trajectory densest first bounds any bin's tokens from above
        take = min(u.size, cap)
        tok += take * (u.tokens / u.size)
        cap -= take
        if cap == 0:
            break
    # tokens per trajectory can vary inside a unit only in aggregate; a bin holds whole units, so this is an
    # upper bound on any bin's tokens (fractional knapsack relaxation).
    return tok > c.token_budget


def solve(units: Sequence[Unit], k: int, c: BatchConstraints, node_limit: int = DEFAULT_NODE_LIMIT,
          want_witness: bool = False) -> Solution:
    """Can ``units`` be split into exactly ``k`` valid mini-batches? See the module docstring."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k == 0:
        ok = len(units) == 0
        return Solution(Verdict.FEASIBLE if ok else Verdict.INFEASIBLE, True, () if ok else None)
    sizes = c.allowed_sizes()
    if _quick_reject(units, k, c, sizes):
        return Solution(Verdict.INFEASIBLE, True)
    if not _tokens_bind(units, c, sizes):
        return _solve_counts(units, k, sizes, node_limit, want_witness)
    return _solve_tokens(units, k, c, sizes, node_limit)


def check_plan(c: BatchConstraints, plan: BatchPlan) -> None:
    """Reject a batch plan that no admission could split into ``c.num_minibatches`` valid mini-batches when every
    response runs to ``max_response_len``: the arithmetic checks of ``BatchConstraints.check_plan`` and, with
    whole groups, the packing question (reject only on an exact INFEASIBLE, so a plan too large to decide is
    still accepted). Raises ``ConstraintError`` naming the batch and its group sizes.

        >>> c = BatchConstraints(batch_size=12, num_minibatches=2, max_response_len=4)
        >>> check_plan(c, BatchPlan(0, tuple(GroupSpec(g, 0, s) for g, s in enumerate([5, 5, 2]))))
        Traceback (most recent call last):
        ...
        knittrans.constraints.ConstraintError: batch 0: its groups (sizes [2, 5, 5]) cannot be split whole into num_minibatches=2 mini-batches with sizes in [6] when every response runs to max_response_len=4 (whole_groups=True)
    """
    c.check_plan(plan)
    if not c.whole_groups:
        return
    L = c.max_response_len
    units = [Unit(g.group_id, g.size, g.size * L, False, i) for i, g in enumerate(plan.groups)]
    if solve(units, c.num_minibatches, c).verdict is Verdict.INFEASIBLE:
        raise ConstraintError(
            f"batch {plan.batch_id}: its groups (sizes {sorted(g.size for g in plan.groups)}) cannot be split whole "
            f"into num_minibatches={c.num_minibatches} mini-batches with sizes in {c.robust_sizes()} when every "
            f"response runs to max_response_len={L} (whole_groups=True)")


# -- sizes only ------------------------------------------------------------------------------------------------


def _solve_counts(units: Sequence[Unit], k: int, sizes: list[int], node_limit: int,
                  want_witness: bool) -> Solution:
    by_size: dict[int, list[Unit]] = {}
    for u in units:
        by_size.setdefault(u.size, []).append(u)
    if len(by_size) == 1:
        (g, us), = by_size.items()
        counts = _uniform_counts(len(us), g, k, sizes)
        if counts is None:
            return Solution(Verdict.INFEASIBLE, True)
        bins = None
        if want_witness:
            it = iter(sorted(us, key=lambda u: u.order))
            bins = tuple(tuple(next(it) for _ in range(n)) for n in counts)
        return Solution(Verdict.FEASIBLE, True, bins)

    size_list = sorted(by_size, reverse=True)
    # A constructive greedy over count vectors first (cheap: bounded subset sums per bin): a split it builds is a
    # proof. Only when it gets stuck, the exact search below (whose node budget large instances exhaust).
    greedy = SizeSearch(size_list).greedy(tuple(len(by_size[s]) for s in size_list), k, Span.of(sizes))
    if greedy is not None:
        return Solution(Verdict.FEASIBLE, True, _materialize(greedy, by_size, size_list) if want_witness else None)
    allowed = set(sizes)
    memo: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], ...] | None] = {}
    nodes = [0]

    def bins_for(counts: tuple[int, ...], kk: int) -> tuple[tuple[int, ...], ...] | None:
        """A list of per-bin count vectors that splits ``counts`` into kk valid bins, or None."""
        key = (counts, kk)
        if key in memo:
            return memo[key]
        nodes[0] += 1
        if nodes[0] > node_limit:
            raise _OutOfNodes
        total = sum(n * s for n, s in zip(counts, size_list))
        result = None
        if kk == 0:
            result = () if total == 0 else None
        elif kk * sizes[0] <= total <= kk * sizes[-1]:
            # symmetry: the first bin holds one unit of the first nonzero size class
            first = next(i for i, n in enumerate(counts) if n)
            for vec in _subvectors(counts, size_list, first, sizes[-1]):
                s = sum(n * sz for n, sz in zip(vec, size_list))
                if s not in allowed:
                    continue
                rest = bins_for(tuple(a - b for a, b in zip(counts, vec)), kk - 1)
                if rest is not None:
                    result = (vec,) + rest
                    break
        memo[key] = result
        return result

    counts0 = tuple(len(by_size[s]) for s in size_list)
    try:
        plan = bins_for(counts0, k)
    except _OutOfNodes:
        return _counts_heuristic(by_size, size_list, k, sizes)
    if plan is None:
        return Solution(Verdict.INFEASIBLE, True)
    return Solution(Verdict.FEASIBLE, True, _materialize(plan, by_size, size_list) if want_witness else None)


def _subvectors(counts: tuple[int, ...], size_list: list[int], first: int, cap: int):
    """Count vectors v <= counts with v[first] >= 1 and sum(v * sizes) <= cap, larger bins first."""
    n = len(counts)

    def rec(i: int, room: int):
        if i == n:
            yield ()
            return
        lo = 1 if i == first else 0
        hi = min(counts[i], room // size_list[i])
        for take in range(hi, lo - 1, -1):
            for tail in rec(i + 1, room - take * size_list[i]):
                yield (take,) + tail

    yield from rec(0, cap)


def _materialize(plan, by_size: dict[int, list[Unit]], size_list: list[int]) -> tuple[tuple[Unit, ...], ...]:
    pools = {s: sorted(by_size[s], key=lambda u: u.order) for s in size_list}
    idx = {s: 0 for s in size_list}
    bins = []
    for vec in plan:
        b = []
        for n, s in zip(vec, size_list):
            b.extend(pools[s][idx[s]: idx[s] + n])
            idx[s] += n
        bins.append(tuple(b))
    return tuple(bins)


def _subset_to_target(items: Sequence[Unit], target: int) -> list[Unit] | None:
    """The lexicographically first subset (in the given order) whose sizes sum to ``target``, or None.

    Bounded subset sum by dynamic programming over suffixes: reach[i] is the set of sums items[i:] can make."""
    n = len(items)
    reach: list[int] = [0] * (n + 1)  # bitsets: bit s set iff sum s reachable
    mask = (1 << (target + 1)) - 1
    reach[n] = 1
    for i in range(n - 1, -1, -1):
        reach[i] = (reach[i + 1] | (reach[i + 1] << items[i].size)) & mask
    if not (reach[0] >> target) & 1:
        return None
    out, rem = [], target
    for i, u in enumerate(items):
        if rem == 0:
            break
        if u.size <= rem and (reach[i + 1] >> (rem - u.size)) & 1:
            out.append(u)
            rem -= u.size
    return out


def _counts_heuristic(by_size: dict[int, list[Unit]], size_list: list[int], k: int,
                      sizes: list[int]) -> Solution:
    """Greedy bin-by-bin subset sum with targets nearest the remaining average; sound (returns a witness)."""
    remaining = sorted((u for s in size_list for u in by_size[s]), key=lambda u: -u.size)
    bins = []
    for left in range(k, 0, -1):
        total = sum(u.size for u in remaining)
        avg = total / left
        chosen = None
        for t in sorted(sizes, key=lambda s: abs(s - avg)):
            if not ((left - 1) * sizes[0] <= total - t <= (left - 1) * sizes[-1]):
                continue
            chosen = _subset_to_target(remaining, t)
            if chosen is not None:
                break
        if chosen is None:
            return Solution(Verdict.UNKNOWN, False)
        ids = {id(u) for u in chosen}
        remaining = [u for u in remaining if id(u) not in ids]
        bins.append(tuple(chosen))
    if remaining:
        return Solution(Verdict.UNKNOWN, False)
    return Solution(Verdict.FEASIBLE, False, tuple(bins))


# -- sizes and tokens ------------------------------------------------------------------------------------------


def _solve_tokens(units: Sequence[Unit], k: int, c: BatchConstraints, sizes: list[int],
                  node_limit: int) -> Solution:
    budget = c.token_budget
    assert budget is not None
    if len(units) > _MAX_DEPTH:
        # the search recurses once per unit: deeper than this it would overflow Python's stack (RecursionError)
        # long before it could finish within node_limit, so go straight to the sound heuristic
        return _tokens_heuristic(units, k, c, sizes)
    allowed = set(sizes)
    lo, hi = sizes[0], sizes[-1]
    order = sorted(units, key=lambda u: (-u.tokens, -u.size))
    n = len(order)
    suffix_size = [0] * (n + 1)
    suffix_tok = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_size[i] = suffix_size[i + 1] + order[i].size
        suffix_tok[i] = suffix_tok[i + 1] + order[i].tokens
    cnt = [0] * k
    tok = [0] * k
    assign = [0] * n
    failed: set[tuple] = set()
    nodes = [0]

    def rec(i: int) -> bool:
        if i == n:
            return all(x in allowed for x in cnt)
        state = (i, tuple(sorted(zip(cnt, tok))))
        if state in failed:
            return False
        nodes[0] += 1
        if nodes[0] > node_limit:
            raise _OutOfNodes
        need = sum(max(0, lo - x) for x in cnt)
        room = sum(hi - x for x in cnt)
        if need > suffix_size[i] or room < suffix_size[i] or sum(budget - t for t in tok) < suffix_tok[i]:
            failed.add(state)
            return False
        u = order[i]
        seen: set[tuple[int, int]] = set()
        for j in range(k):
            if (cnt[j], tok[j]) in seen:  # identical bins are interchangeable
                continue
            seen.add((cnt[j], tok[j]))
            if cnt[j] + u.size > hi or tok[j] + u.tokens > budget:
                continue
            cnt[j] += u.size
            tok[j] += u.tokens
            assign[i] = j
            ok = rec(i + 1)
            cnt[j] -= u.size
            tok[j] -= u.tokens
            if ok:
                return True
        failed.add(state)
        return False

    try:
        found = rec(0)
    except _OutOfNodes:
        return _tokens_heuristic(units, k, c, sizes)
    if not found:
        return Solution(Verdict.INFEASIBLE, True)
    # re-run the successful path cheaply: assign[] holds the last successful choice for every i
    bins: list[list[Unit]] = [[] for _ in range(k)]
    for i, u in enumerate(order):
        bins[assign[i]].append(u)
    return Solution(Verdict.FEASIBLE, True, tuple(tuple(b) for b in bins))


def _tokens_heuristic(units: Sequence[Unit], k: int, c: BatchConstraints, sizes: list[int]) -> Solution:
    """Fix bin sizes from the size-only problem, then place units longest-first into the least-loaded bin with a
    free slot of their size class (LPT with cardinalities). Returns a checked witness or UNKNOWN."""
    shape = _solve_counts(units, k, sizes, DEFAULT_NODE_LIMIT, want_witness=True)
    if not shape.feasible or shape.bins is None:
        return Solution(Verdict.UNKNOWN, False)
    slots = [Counter(u.size for u in b) for b in shape.bins]
    bins: list[list[Unit]] = [[] for _ in range(k)]
    tok = [0] * k
    for u in sorted(units, key=lambda u: -u.tokens):
        cands = [j for j in range(k) if slots[j][u.size] > 0]
        j = min(cands, key=lambda j: tok[j])
        bins[j].append(u)
        tok[j] += u.tokens
        slots[j][u.size] -= 1
    if all(bin_ok(b, c) for b in bins):
        return Solution(Verdict.FEASIBLE, False, tuple(tuple(b) for b in bins))
    return Solution(Verdict.UNKNOWN, False)
