"""KnitTrans mini-batch admission: commit a mini-batch as soon as one can be composed safely.

When the trainer is ready, the policy looks at the oldest batch that still has mini-batches to run and commits
the next one as soon as it can be composed from *completed* units (whole groups, or single trajectories) such
that the units that remain, completed and still in flight, can still fill the remaining mini-batches under every
constraint. Among the safe choices it prefers the oldest completions (first in, first trained: lower staleness).

How a decision runs, cheapest question first (the ledger keeps every input incrementally, see ``base``):

1. **Uniform units, no binding token budget** (the DAPO-style case; a budget that the largest mini-batch at
   max_response_len fits never binds): closed form, O(1) amortized per trajectory.
2. **Sizes.** No ready subset sums to an allowed size (the ledger's subset-sum bitset, one AND) -> wait. Else
   ``sizes.SizeSearch.first_bins`` looks for a count vector of ready units by size whose rest splits into the
   remaining mini-batches: the FIFO candidates first (``compose.fifo_subsets``: the oldest completions that make
   each allowed size), then every other vector. Without a binding budget this is the whole answer: exact
   whenever the search completes (``exhaustive_max`` > 0, within ``subset_limit`` candidates and ``node_limit``
   nodes per split), and no count of ready units is too many for it.
3. **Tokens** (a budget that can bind): first the same search with the rest restricted to the *robust* sizes (a
   mini-batch that fits the budget even at max_response_len per response) and the mini-batch itself checked
   against its known tokens: a sufficient condition, and usually the answer. If it fails and the sizes-only
   search (a relaxation: tokens only remove options) says no, wait. Otherwise the exact unit-level search
   (``compose.ready_bin_search``) when the batch has at most ``exhaustive_max`` units; above that, or out of
   nodes, a few candidates checked with ``feasibility.solve`` (a witness split of the rest) and else wait,
   counted in ``stats.unknown``: sound, and may wait where a bigger search would admit.

When a decision re-runs (``_dirty``). The answer is a function of the current batch's ready units (their sizes
and tokens), its in-flight units' sizes (fixed by the plan) and their token bounds, and the mini-batches left.
So a decision is re-run after a commit or a new batch, when a unit of the current batch becomes ready, and,
only if the last wait was caused by tokens (step 3 reached), when a partial arrival lowers an in-flight group's
token bound. Every other arrival (a partial group while sizes block; anything of a later batch) leaves every
input the decision reads unchanged, so it cannot change the answer. A size-only wait cannot be undone by a lower
token bound because the size-only question ignores tokens. ``skip_unchanged=False`` is the plain twin that
decides whenever asked; a property test checks that both commit the same mini-batches at the same arrivals.

Guarantees:

- **No dead end.** A mini-batch is committed only with a feasibility proof for the rest (an exact answer, or a
  checked witness split when a search is cut off). So the batch always completes in exactly M mini-batches, each
  within the constraints.
- **Exact when the search completes.** Then the policy admits whenever *any* safe mini-batch exists
  (``tests/property`` checks it against brute force on instances of up to 24 groups). When everything has
  completed, a ready-only bin of a witness split of the rest keeps a cut-off search from stalling.
- **Exactly once.** Units are consumed through the ledger, which refuses to consume anything twice.

Cost: ``tests/bench/test_bench_admission.py`` and ``python -m repro.admission`` measure it per trajectory and per
arrival.

Example::

    >>> from knittrans.constraints import BatchConstraints
    >>> from knittrans.types import BatchPlan, GroupSpec, Trajectory
    >>> c = BatchConstraints(batch_size=4, num_minibatches=2, group_size=2, max_response_len=8)
    >>> p = KnitTransAdmission(c)
    >>> p.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2), GroupSpec(1, 0, 2))))
    >>> for i in range(2): p.on_complete(Trajectory(i, group_id=1, batch_id=0, num_tokens=3, v_gen=0))
    >>> [mb.group_ids for mb in p.on_trainer_ready(now=0.0)]   # group 1 is done: train it now
    [(1,)]
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, Sequence

from knittrans.admission.base import BatchState, LedgerPolicy
from knittrans.admission.compose import OutOfNodes, fifo_subsets, lightest_of, oldest_of, ready_bin_search
from knittrans.admission.feasibility import DEFAULT_NODE_LIMIT, Unit, Verdict, _uniform_counts, bin_ok, solve
from knittrans.admission.sizes import SizeSearch, Span
from knittrans.constraints import BatchConstraints
from knittrans.types import MiniBatch, Trajectory


def candidate_bins(ready: Sequence[Unit], c: BatchConstraints, exhaustive_max: int,
                   subset_limit: int) -> Iterator[list[Unit]]:
    """Valid mini-batches made of ready units, most preferred first: FIFO, longest-first, then (for small
    instances) every valid subset in oldest-first lexicographic order. (KnitTransAdmission searches count vectors
    by size instead, see the module docstring; this unit-level enumeration stays for callers that want one.)"""
    fifo = sorted(ready, key=lambda u: u.order)
    longest = sorted(ready, key=lambda u: (-u.tokens, u.order))
    seen: set[frozenset[int]] = set()
    for ordering in (fifo, longest):
        for target in c.allowed_sizes():
            b = _first_fit_to(ordering, target, c)
            if b is not None:
                key = frozenset(u.key for u in b)
                if key not in seen:
                    seen.add(key)
                    yield b
    if len(fifo) <= exhaustive_max:
        for b in _subsets(fifo, c, subset_limit):
            key = frozenset(u.key for u in b)
            if key not in seen:
                seen.add(key)
                yield b


def _first_fit_to(ordering: Sequence[Unit], target: int, c: BatchConstraints) -> list[Unit] | None:
    """Walk ``ordering`` and take each unit that keeps size <= target and tokens within budget; succeed if the
    size lands exactly on target."""
    out, size, tokens = [], 0, 0
    for u in ordering:
        if size + u.size <= target and c.tokens_ok(tokens + u.tokens):
            out.append(u)
            size += u.size
            tokens += u.tokens
            if size == target:
                return out
    return None


def _subsets(units: Sequence[Unit], c: BatchConstraints, limit: int) -> Iterator[list[Unit]]:
    """Every subset of ``units`` that forms a valid mini-batch, in lexicographic order of indices (oldest first),
    pruned by the largest allowed size and the token budget."""
    hi = c.max_minibatch_size
    budget = c.token_budget
    count = [0]
    chosen: list[Unit] = []

    def rec(i: int, size: int, tokens: int) -> Iterator[list[Unit]]:
        count[0] += 1
        if count[0] > limit:
            return
        if chosen and bin_ok(chosen, c):
            yield list(chosen)
        for j in range(i, len(units)):
            u = units[j]
            if size + u.size > hi or (budget is not None and tokens + u.tokens > budget):
                continue
            chosen.append(u)
            yield from rec(j + 1, size + u.size, tokens + u.tokens)
            chosen.pop()

    yield from rec(0, 0, 0)


class KnitTransAdmission(LedgerPolicy):
    """Mini-batch admission with a feasibility guarantee (see the module docstring).

    ``node_limit`` bounds each exact search; ``exhaustive_max`` is the number of units (ready and in flight) up to
    which a binding token budget is searched exactly, unit by unit (0 also turns off the size search beyond the
    FIFO candidates: what is left is sound but may wait); ``subset_limit`` bounds the count vectors tried per
    decision."""

    name = "knittrans"
    token_node_limit = 2_000
    """Node budget of the exact unit-level search with a binding token budget (a node costs ~10 us here; the
    property tests' instances of up to 24 groups need well under 1000)."""
    witness_node_limit = 200
    """Node budget of the exact search inside each candidate's rest check past that; beyond it ``solve`` builds
    a witness split (longest-first into the least-loaded bin) in O(n log n + n k)."""

    def __init__(self, constraints: BatchConstraints, node_limit: int = DEFAULT_NODE_LIMIT,
                 exhaustive_max: int = 40, subset_limit: int = 4096,
                 oracle_tokens: Callable[[int], int] | None = None, skip_unchanged: bool = True) -> None:
        super().__init__(constraints, oracle_tokens)
        self.node_limit = node_limit
        self.exhaustive_max = exhaustive_max
        self.subset_limit = subset_limit
        self.skip_unchanged = skip_unchanged
        """False: the plain twin, which re-runs the decision whenever the trainer asks (tests compare the two)."""
        c = constraints
        self._span = Span.of(c.allowed_sizes())
        self._robust = Span.of(c.robust_sizes())
        self._first_mask = self._span.mask()
        # A budget binds only if the largest allowed mini-batch can exceed it (every response <= max_response_len).
        self._tokens_bind = self._robust != self._span
        # closed form applies when tokens can never bind and every unit has the same size
        self._uniform = not self._tokens_bind and (c.group_size is not None or not c.whole_groups)
        self._g = (c.group_size or 1) if c.whole_groups else 1  # the uniform unit size
        self._allowed = c.allowed_sizes()
        # units per mini-batch the closed form tries, nominal first
        self._per_bin = sorted({s // self._g for s in self._allowed if s % self._g == 0},
                               key=lambda t: abs(t * self._g - c.minibatch_size))
        # The last wait was caused by tokens: only then can a partial arrival (which lowers an in-flight group's
        # token bound but makes no unit ready) change the answer. See the module docstring.
        self._blocked_by_tokens = False
        self._searches: dict[int, SizeSearch] = {}  # batch id -> its size search (memo valid for the batch)

    def on_complete(self, traj: Trajectory) -> None:
        g = self._record(traj)
        if self._blocked_by_tokens and not g.complete and self.ledger.order \
                and self.ledger.order[0] == traj.batch_id:
            self._dirty = True

    def on_trainer_ready(self, now: float) -> list[MiniBatch]:
        b = self.ledger.current()
        if b is None or not (self._dirty or not self.skip_unchanged):
            return []
        self._stats.decisions += 1
        mb = self._compose(b)
        if mb is None:
            self._stats.waits += 1
            self._dirty = False
            return []
        self._stats.admitted += 1
        if b.committed == self.constraints.num_minibatches:
            self._searches.pop(b.plan.batch_id, None)
        return [mb]

    # -- composition -----------------------------------------------------------------------------------------

    def _compose(self, b: BatchState) -> MiniBatch | None:
        k = self.ledger.remaining_minibatches(b)
        self._blocked_by_tokens = False
        if self._uniform:
            return self._compose_uniform(b, k)
        if not b.ready_units:
            return None
        c = self.constraints
        if k == 1:  # the last mini-batch takes everything that is left, once all of it has completed
            if b.pending_size == 0 and c.size_ok(b.ready_size) and c.tokens_ok(b.ready_tokens):
                return self.ledger.commit(b, list(b.ready_units.values()))
            return None
        if not b.ready_reach & self._first_mask:  # no ready subset holds an allowed number of trajectories
            return None
        search = self._search(b)
        r = search.vector(b.ready_sizes)
        u = tuple(a + p for a, p in zip(r, search.vector(b.pending_sizes)))
        if not self._tokens_bind:
            units = self._by_sizes(b, search, r, u, k, self._span)
            exact = search.complete
        else:
            units, exact = self._by_sizes(b, search, r, u, k, self._robust), True
            if units is None:
                relaxed = list(itertools.islice(search.first_bins(r, u, k, self._span, self._span), 4))
                if not relaxed and search.complete:
                    return None  # sizes alone rule out every mini-batch: a lower token bound cannot help
                self._blocked_by_tokens = True
                units, exact = self._by_tokens(b, search, relaxed, k)
        if units is None and not exact:
            self._stats.unknown += 1
            units = self._witness_bin(b, k)
        return None if units is None else self.ledger.commit(b, units)

    def _search(self, b: BatchState) -> SizeSearch:
        s = self._searches.get(b.plan.batch_id)
        if s is None:
            sizes = {g.size for g in b.plan.groups} if self.constraints.whole_groups else {1}
            limit = self.subset_limit if self.exhaustive_max > 0 else 0
            s = self._searches[b.plan.batch_id] = SizeSearch(sizes, self.node_limit, limit)
        return s

    def _by_sizes(self, b: BatchState, search: SizeSearch, r: tuple[int, ...], u: tuple[int, ...], k: int,
                  rest: Span) -> list[Unit] | None:
        """The first safe mini-batch by sizes (rest in ``rest`` sizes), FIFO candidates first, that also fits the
        token budget with its known tokens; None if there is none (exact iff ``search.complete``)."""
        ready = list(b.ready_units.values())
        total = search.total(u)
        fifo: dict[tuple[int, ...], list[Unit]] = {}

        def preferred():
            for units in fifo_subsets(ready, self._span, lambda t: rest.splits(total - t, k - 1)):
                v = search.vector(_size_counts(units))
                fifo.setdefault(v, units)
                yield v

        for v in search.first_bins(r, u, k, self._span, rest, preferred()):
            for units in (fifo.get(v) or oldest_of(ready, v, search), lightest_of(ready, v, search)):
                if self.constraints.tokens_ok(sum(x.tokens for x in units)):
                    return units
        return None

    def _by_tokens(self, b: BatchState, search: SizeSearch, relaxed: list[tuple[int, ...]],
                   k: int) -> tuple[list[Unit] | None, bool]:
        """A binding budget, and sizes alone allow a mini-batch: search units with their tokens. Returns the
        mini-batch (or None) and whether a None is exact."""
        c = self.constraints
        ready, pending = self.ledger.units(b)
        if len(ready) + len(pending) <= self.exhaustive_max:
            try:
                return ready_bin_search(ready, pending, k, c, min(self.node_limit, self.token_node_limit)), True
            except OutOfNodes:
                pass
        # Too large to search exactly: a few candidates, each checked with a witness split of its rest.
        longest = sorted(ready, key=lambda x: (-x.tokens, x.order))
        cands = [oldest_of(longest, v, search) for v in relaxed] + [lightest_of(ready, v, search) for v in relaxed]
        for units in cands:
            if not bin_ok(units, c):
                continue
            keys = {x.key for x in units}
            rest = [x for x in ready if x.key not in keys] + pending
            if solve(rest, k - 1, c, min(self.node_limit, self.witness_node_limit)).feasible:
                return units, True
        return None, False

    def _witness_bin(self, b: BatchState, k: int) -> list[Unit] | None:
        """Liveness once everything has completed: a ready-only bin of a witness split of all that remains. Its
        other k - 1 bins are a valid split of the rest, so it is safe. Only tried when a cut-off search found
        nothing; before the last unit completes, waiting is sound and the next arrival re-runs the search."""
        if b.pending_size:
            return None
        ready, pending = self.ledger.units(b)
        sol = solve(ready + pending, k, self.constraints, self.node_limit, want_witness=True)
        if sol.feasible and sol.bins is not None:
            for bn in sorted(sol.bins, key=lambda bn: max(u.order for u in bn)):
                if all(u.ready for u in bn):
                    return list(bn)
        return None

    def _compose_uniform(self, b: BatchState, k: int) -> MiniBatch | None:
        """Closed form for uniform units and no binding token budget: take the oldest t ready units, with t the
        nominal allowed count for which the rest stays splittable into k - 1 mini-batches."""
        g = self._g
        ready_n = len(b.ready_units)
        remaining = b.remaining_size // g  # units left in the batch, ready or in flight (O(1): kept by the ledger)
        for t in self._per_bin:
            if t > ready_n:
                continue
            if (k == 1 and t == remaining) or (k > 1 and _uniform_counts(remaining - t, g, k - 1,
                                                                           self._allowed) is not None):
                # ready_units is insertion-ordered, i.e. in completion order
                return self.ledger.commit(b, list(itertools.islice(b.ready_units.values(), t)))
        return None


def _size_counts(units: Sequence[Unit]) -> dict[int, int]:
    out: dict[int, int] = {}
    for u in units:
        out[u.size] = out.get(u.size, 0) + 1
    return out
