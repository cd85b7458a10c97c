"""KnitTrans mini-batch admission: commit a mini-batch as soon as one can be composed safely.

When the trainer is ready, the policy looks at the oldest batch that still has mini-batches to run and commits
the next one as soon as it can be composed from *completed* units (whole groups, or single trajectories) such
that the units that remain, completed and still in flight, can still fill the remaining mini-batches under every
constraint (``feasibility.solve``). Among the safe choices it prefers the oldest completions (first in, first
trained: lower staleness), then tries the longest completions first (admitting long responses while the token
budget has room for them is what keeps a token-budgeted batch from ending in a dead end).

Guarantees:

- **No dead end.** A mini-batch is committed only with a feasibility proof for the rest (an exact answer, or a
  checked witness partition when the search is cut off). So the batch always completes in exactly M
  mini-batches, each within the constraints.
- **Exact on small instances.** When a batch has at most ``exhaustive_max`` ready units and every rest check is
  exact, the policy enumerates every candidate mini-batch: it admits whenever *any* safe mini-batch exists.
  Beyond that it tries a few principled candidates (FIFO, longest-first, then a ready-only bin of a witness
  partition of everything that remains) and is sound but may wait where an exhaustive search would not; the
  witness keeps it from stalling once everything has completed unless that search, too, runs out of nodes.
  ``stats.unknown`` counts checks that ran out of nodes.
- **Exactly once.** Units are consumed through the ledger, which refuses to consume anything twice.

Cost: with uniform groups and no binding token budget (the DAPO-style case) the decision is closed-form and
costs O(1) per completed trajectory amortized; ``tests/bench`` measures it.

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
from knittrans.admission.feasibility import DEFAULT_NODE_LIMIT, Unit, Verdict, _uniform_counts, bin_ok, solve
from knittrans.constraints import BatchConstraints
from knittrans.types import MiniBatch, Trajectory


def candidate_bins(ready: Sequence[Unit], c: BatchConstraints, exhaustive_max: int,
                   subset_limit: int) -> Iterator[list[Unit]]:
    """Valid mini-batches made of ready units, most preferred first: FIFO, longest-first, then (for small
    instances) every valid subset in oldest-first lexicographic order."""
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
    """Mini-batch admission with a feasibility guarantee (see the module docstring)."""

    name = "knittrans"

    def __init__(self, constraints: BatchConstraints, node_limit: int = DEFAULT_NODE_LIMIT,
                 exhaustive_max: int = 12, subset_limit: int = 4096,
                 oracle_tokens: Callable[[int], int] | None = None) -> None:
        super().__init__(constraints, oracle_tokens)
        self.node_limit = node_limit
        self.exhaustive_max = exhaustive_max
        self.subset_limit = subset_limit
        # Whether the last failed attempt had a valid candidate among ready units whose rest was not provably
        # feasible. Only then can a partial arrival (which lowers a pending group's token bound but makes no unit
        # ready) change the answer.
        self._blocked_by_rest = False
        c = constraints
        # closed form applies when tokens can never bind and every unit has the same size
        self._uniform = c.token_budget is None and (c.group_size is not None or not c.whole_groups)

    def on_complete(self, traj: Trajectory) -> None:
        g = self._record(traj)
        if not g.complete and self.constraints.token_budget is not None and self._blocked_by_rest:
            # a partial group's token bound (known + missing * max_response_len) just dropped, which can make the
            # rest of a candidate fit the budget: re-check even though no unit became ready
            self._dirty = True

    def on_trainer_ready(self, now: float) -> list[MiniBatch]:
        b = self.ledger.current()
        if b is None or not self._dirty:
            return []
        self._stats.decisions += 1
        mb = self._compose(b)
        if mb is None:
            self._stats.waits += 1
            self._dirty = False
            return []
        self._stats.admitted += 1
        return [mb]

    # -- composition -----------------------------------------------------------------------------------------

    def _compose(self, b: BatchState) -> MiniBatch | None:
        k = self.ledger.remaining_minibatches(b)
        if self._uniform:
            return self._compose_uniform(b, k)
        ready, pending = self.ledger.units(b)
        if not ready:
            return None
        if k == 1:  # the last mini-batch takes everything that is left, once all of it has completed
            return self.ledger.commit(b, ready) if not pending and bin_ok(ready, self.constraints) else None
        # beyond exhaustive_max not every valid bin is enumerated, so assume a partial arrival may matter
        self._blocked_by_rest = len(ready) > self.exhaustive_max
        for cand in candidate_bins(ready, self.constraints, self.exhaustive_max, self.subset_limit):
            self._blocked_by_rest = True
            keys = {u.key for u in cand}
            rest = [u for u in ready if u.key not in keys] + pending
            sol = solve(rest, k - 1, self.constraints, self.node_limit)
            if sol.verdict is Verdict.UNKNOWN:
                self._stats.unknown += 1
            if sol.feasible:
                return self.ledger.commit(b, cand)
        # Fallback (liveness beyond exhaustive_max): a witness partition of everything that remains. Any of its
        # bins made only of ready units is safe to commit, because the other k - 1 bins are a valid split of the
        # rest (pending units at their upper bounds). Without it a large batch could stall even after every unit
        # had completed, when neither first-fit candidate leaves a splittable rest.
        sol = solve(ready + pending, k, self.constraints, self.node_limit, want_witness=True)
        if sol.verdict is Verdict.UNKNOWN:
            self._stats.unknown += 1
        if sol.feasible and sol.bins is not None:
            for bn in sorted(sol.bins, key=lambda bn: max(u.order for u in bn)):
                if all(u.ready for u in bn):
                    return self.ledger.commit(b, list(bn))
        return None

    def _compose_uniform(self, b: BatchState, k: int) -> MiniBatch | None:
        """Closed form for uniform units and no binding token budget: take the oldest t ready units, with t the
        nominal allowed count for which the rest stays splittable into k - 1 mini-batches."""
        c = self.constraints
        if c.whole_groups:
            g, ready_n = c.group_size, len(b.ready_groups)
            assert g is not None
            # groups are consumed whole and all have size g; counting consumed trajectories keeps this O(1) (a
            # scan over the groups made every decision O(P), the whole batch O(P^2))
            remaining = (b.plan.num_trajectories - len(b.consumed_traj)) // g
        else:
            g, ready_n = 1, len(b.ready_trajs)
            remaining = b.plan.num_trajectories - len(b.consumed_traj)
        assert g is not None
        per_bin = sorted({s // g for s in c.allowed_sizes() if s % g == 0},
                         key=lambda t: abs(t * g - c.minibatch_size))
        for t in per_bin:
            if t > ready_n:
                continue
            if (k == 1 and t == remaining) or (k > 1 and _uniform_counts(remaining - t, g, k - 1,
                                                                           c.allowed_sizes()) is not None):
                if c.whole_groups:
                    take = [b.ready_groups[i] for i in range(t)]
                    units = [Unit(gid, g, 0, True, 0) for gid in take]
                else:
                    # ready_trajs is insertion-ordered, i.e. in completion order
                    units = [Unit(tid, 1, 0, True, 0) for tid in itertools.islice(b.ready_trajs, t)]
                return self.ledger.commit(b, units)
        return None
