"""Baseline admission policies, on the same protocol as KnitTrans's (``knittrans.admission.AdmissionPolicy``).

Each is what a careful user of today's systems runs:

- ``TrainBatchAdmission``: wait until the whole training batch has completed, then split it into its M
  mini-batches (verl's synchronous and one-step-off-policy trainers, and most fully-async pipelines, consume
  rollouts a training batch at a time). The split is an exact, constraint-respecting partition.
- ``GreedyStreamingAdmission``: stream mini-batches from completed trajectories as soon as one is locally valid,
  with no look-ahead. It can walk into a dead end, where what remains cannot form valid mini-batches; it then
  finishes the batch anyway and counts the dead end and each constraint it broke.
- ``BoundedAsyncAdmission``: AReaL-style: a training batch is whatever B trajectories (whole groups) complete
  first, whatever prompt batch they were dispatched with; paired with AReaL's flow control (rollout capacity
  ``(eta + v + 1) * B - (accepted + running)``, in ``knittrans.sim.FlowControl``).
- Colocated (synchronous generate-then-train) uses ``TrainBatchAdmission``; the simulator's and runtime's
  colocated mode makes generation and training take turns on shared resources.
"""

from __future__ import annotations

from collections import deque

from knittrans.admission.base import AdmissionError, BatchState, LedgerPolicy
from knittrans.admission.feasibility import DEFAULT_NODE_LIMIT, Unit, bin_ok, solve
from knittrans.admission.minibatch import _first_fit_to
from knittrans.constraints import BatchConstraints, ConstraintError
from knittrans.types import AdmissionKind, MiniBatch, Trajectory


class TrainBatchAdmission(LedgerPolicy):
    """Admit a batch only once all of it has completed, as its M mini-batches."""

    name = "train_batch"

    def __init__(self, constraints: BatchConstraints, node_limit: int = 200_000) -> None:
        super().__init__(constraints)
        self.node_limit = node_limit

    def on_trainer_ready(self, now: float) -> list[MiniBatch]:
        b = self.ledger.current()
        if b is None or b.committed or b.arrived < b.plan.num_trajectories:
            return []
        ready, pending = self.ledger.units(b)
        assert not pending
        self._stats.decisions += 1
        k = self.ledger.remaining_minibatches(b)
        sol = solve(ready, k, self.constraints, self.node_limit, want_witness=True)
        if not sol.feasible or sol.bins is None:
            raise AdmissionError(f"batch {b.plan.batch_id}: no split into {k} mini-batches was found "
                                 f"({sol.verdict.name}); the batch cannot be trained within its constraints")
        # run the mini-batches in prompt order, as a data loader's sequential split would
        bins = sorted(sol.bins, key=lambda bn: min(u.key for u in bn))
        self._stats.admitted += len(bins)
        return [self.ledger.commit(b, list(bn)) for bn in bins]


class GreedyStreamingAdmission(LedgerPolicy):
    """Stream the first locally valid mini-batch of completed units (FIFO), with no feasibility check."""

    name = "greedy"

    def __init__(self, constraints: BatchConstraints) -> None:
        super().__init__(constraints)
        self._dead: set[int] = set()

    def on_trainer_ready(self, now: float) -> list[MiniBatch]:
        b = self.ledger.current()
        if b is None or not self._dirty:
            return []
        c = self.constraints
        ready, pending = self.ledger.units(b)
        k = self.ledger.remaining_minibatches(b)
        if not ready:
            if not pending and b.arrived >= b.plan.num_trajectories:
                # Used up: an earlier mini-batch took more than its share (slack) and nothing is left for the
                # remaining k. Waiting would hang for ever; a careless stack moves on to the next batch with
                # fewer steps. Do that, and count it.
                self._end_short(b, k)
                return self.on_trainer_ready(now)  # the next batch may be ready already
            self._dirty = False
            return []
        self._stats.decisions += 1
        fifo = sorted(ready, key=lambda u: u.order)
        if k == 1:
            if pending:
                self._dirty = False
                return []
            return [self._commit(b, fifo)]
        targets = sorted(c.allowed_sizes(), key=lambda s: abs(s - c.minibatch_size))
        for t in targets:
            cand = _first_fit_to(fifo, t, c)
            if cand is not None:
                self._stats.admitted += 1
                return [self.ledger.commit(b, cand)]
        if pending:
            self._stats.waits += 1
            self._dirty = False
            return []
        # Dead end: everything has completed and no valid mini-batch can be formed. Finish the batch anyway by
        # dealing the rest round-robin into the k remaining mini-batches, and record what that breaks.
        bins: list[list[Unit]] = [[] for _ in range(k)]
        for i, u in enumerate(sorted(fifo, key=lambda u: -u.size)):
            bins[i % k].append(u)
        full = [bn for bn in bins if bn]  # fewer units than steps left: the batch ends short (no empty step)
        out = [self._commit(b, bn) for bn in full]
        if len(full) < k:
            self._end_short(b, k - len(full))
        return out

    def _end_short(self, b: BatchState, missing: int) -> None:
        """End batch ``b`` with ``missing`` fewer mini-batches than M (every trajectory of it was consumed)."""
        b.committed = self.constraints.num_minibatches
        self.ledger.finish(b)  # off the order, and its state forgotten (bounded memory)
        self._stats.ended_short += 1
        self._stats.skipped_minibatches += missing
        if b.plan.batch_id not in self._dead:
            self._dead.add(b.plan.batch_id)
            self._stats.dead_ends += 1

    def _commit(self, b: BatchState, units: list[Unit]) -> MiniBatch:
        c = self.constraints
        size = sum(u.size for u in units)
        tokens = sum(u.tokens for u in units)
        violations = []
        if not c.size_ok(size):
            violations.append(f"size {size} not in allowed sizes {c.allowed_sizes()[0]}..{c.allowed_sizes()[-1]}"
                              f" (multiple of dp_size={c.dp_size})")
        if not c.tokens_ok(tokens):
            violations.append(f"tokens {tokens} > token_budget {c.token_budget}")
        if violations:
            self._stats.violations += 1
            if b.plan.batch_id not in self._dead:
                self._dead.add(b.plan.batch_id)
                self._stats.dead_ends += 1
        self._stats.admitted += 1
        return self.ledger.commit(b, units, tuple(violations))


class BoundedAsyncAdmission(LedgerPolicy):
    """AReaL-style: a training batch is the first B trajectories (whole groups) to complete, from any prompt
    batch; it is split into M mini-batches in completion order. Requires uniform groups, whole-group
    mini-batches and no token budget (AReaL's setting)."""

    name = "bounded_async"

    def __init__(self, constraints: BatchConstraints) -> None:
        c = constraints
        if c.group_size is None or not c.whole_groups or c.token_budget is not None or c.size_slack:
            raise ConstraintError("BoundedAsyncAdmission needs uniform groups (group_size set), whole_groups=True,"
                                  " no token_budget and exact mini-batch sizes (size_slack=0)")
        if c.minibatch_size % c.group_size:
            raise ConstraintError(f"BoundedAsyncAdmission: mini-batch size {c.minibatch_size} is not a multiple "
                                  f"of group_size {c.group_size}")
        super().__init__(c)  # the ledger: validation and per-group state only
        self._ready: deque[tuple[int, int]] = deque()  # (batch_id, group_id) in completion order
        self._next_batch = 0

    def on_complete(self, traj: Trajectory) -> None:
        g = self._record(traj)
        if g.complete:
            self._ready.append((traj.batch_id, traj.group_id))

    def on_trainer_ready(self, now: float) -> list[MiniBatch]:
        c = self.constraints
        assert c.group_size is not None
        per_batch = c.batch_size // c.group_size
        per_mb = c.minibatch_size // c.group_size
        if len(self._ready) < per_batch:
            return []
        self._stats.decisions += 1
        taken = [self._ready.popleft() for _ in range(per_batch)]
        out = []
        for j in range(c.num_minibatches):
            traj: list[Trajectory] = []
            chunk = taken[j * per_mb:(j + 1) * per_mb]
            for bid, gid in chunk:
                g = self.ledger.batches[bid].groups[gid]
                assert not g.consumed, f"group {gid} consumed twice"
                g.consumed = True
                traj.extend(g.arrived)
            out.append(MiniBatch(batch_id=self._next_batch, index=j, traj_ids=tuple(t.traj_id for t in traj),
                                 group_ids=tuple(gid for _, gid in chunk),
                                 num_tokens=sum(t.num_tokens for t in traj)))
        self._next_batch += 1
        self._stats.admitted += len(out)
        return out


def make_policy(kind: AdmissionKind | str, constraints: BatchConstraints, **kwargs) -> LedgerPolicy:
    """Build an admission policy by kind (``knittrans.types.AdmissionKind`` or its value): knittrans, clairvoyant
    (needs ``oracle_tokens``), train_batch, greedy, bounded_async. A colocated run admits with train_batch. The
    signature is ``knittrans.runtime.orchestrator.PolicyFactory``'s, so this can be passed to the runtime."""
    from knittrans.admission.minibatch import KnitTransAdmission

    try:
        kind = AdmissionKind(kind)
    except ValueError:
        raise ValueError(f"unknown admission policy {kind!r}; choose one of {[k.value for k in AdmissionKind]} (a "
                         f"colocated run admits with train_batch)") from None
    if kind is AdmissionKind.KNITTRANS:
        return KnitTransAdmission(constraints, **kwargs)
    if kind is AdmissionKind.CLAIRVOYANT:
        if "oracle_tokens" not in kwargs:
            raise ValueError("the clairvoyant policy needs oracle_tokens (true token count per group id)")
        p = KnitTransAdmission(constraints, **kwargs)
        p.name = "clairvoyant"
        return p
    if kind is AdmissionKind.TRAIN_BATCH:
        return TrainBatchAdmission(constraints)
    if kind is AdmissionKind.GREEDY:
        return GreedyStreamingAdmission(constraints)
    return BoundedAsyncAdmission(constraints)


__all__ = ["BoundedAsyncAdmission", "GreedyStreamingAdmission", "TrainBatchAdmission", "bin_ok", "make_policy",
           "DEFAULT_NODE_LIMIT"]
