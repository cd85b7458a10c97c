"""The admission protocol, and the ledger every policy keeps its batches in.

An admission policy is event-driven. It is told about batches (``add_batch``, in training order), about each
completed trajectory (``on_complete``), and, when the trainer is ready for its next optimizer step, it answers
with the mini-batches it commits to now (``on_trainer_ready``), in the order they must run. Every policy in this
project, KnitTrans's and the baselines', implements this protocol, so the simulator and the real runtime run
each of them with one config switch.

The ledger validates every message before it changes any state: a bad trajectory raises ``AdmissionError`` and
leaves everything already received or admitted intact (nothing lost).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from knittrans.admission.feasibility import Unit, check_plan
from knittrans.constraints import BatchConstraints
from knittrans.types import BatchPlan, GroupSpec, MiniBatch, Trajectory


class AdmissionError(ValueError):
    """A message that the ledger rejects; nothing already received or admitted is changed."""


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Decides which completed trajectories the trainer consumes, a mini-batch (optimizer step) at a time."""

    name: str
    constraints: BatchConstraints

    def add_batch(self, plan: BatchPlan) -> None:
        """Announce training batch ``plan.batch_id`` (batches are trained in the order they are added)."""

    def on_complete(self, traj: Trajectory) -> None:
        """A trajectory finished generating."""

    def on_trainer_ready(self, now: float) -> list[MiniBatch]:
        """The trainer can start a step: the mini-batches committed now, in run order (maybe none)."""

    @property
    def stats(self) -> "AdmissionStats": ...


@dataclass
class AdmissionStats:
    decisions: int = 0  # on_trainer_ready calls that ran a composition attempt
    admitted: int = 0  # mini-batches committed
    waits: int = 0  # attempts that committed nothing
    unknown: int = 0  # feasibility searches that ran out of nodes without a witness (treated as infeasible)
    dead_ends: int = 0  # batches that could not be finished within the constraints (greedy baseline only)
    violations: int = 0  # mini-batches that break a constraint (greedy baseline only)


@dataclass
class GroupState:
    spec: GroupSpec
    arrived: list[Trajectory] = field(default_factory=list)
    consumed: bool = False  # whole-group mode: consumed as a unit
    ready_seq: int | None = None  # arrival sequence of the last trajectory (FIFO rank of a ready group)

    @property
    def complete(self) -> bool:
        return len(self.arrived) == self.spec.size


@dataclass
class BatchState:
    plan: BatchPlan
    groups: dict[int, GroupState]
    committed: int = 0  # mini-batches committed so far
    arrived: int = 0  # trajectories received so far
    consumed_traj: set[int] = field(default_factory=set)
    ready_groups: deque[int] = field(default_factory=deque)  # complete, unconsumed groups, in completion order
    ready_trajs: dict[int, tuple[int, Trajectory]] = field(default_factory=dict)  # traj mode: id -> (seq, traj)


class BatchLedger:
    """Batches, groups and trajectories received so far, with validation and consumption bookkeeping."""

    def __init__(self, constraints: BatchConstraints,
                 oracle_tokens: Callable[[int], int] | None = None) -> None:
        self.c = constraints
        self.batches: dict[int, BatchState] = {}
        self.order: deque[int] = deque()  # batch ids not yet fully committed, in training order
        self._group_batch: dict[int, int] = {}
        self._traj_ids: set[int] = set()
        self._seq = itertools.count()
        # Clairvoyant bound only: the true token count of an in-flight group (by group id), in place of the
        # max_response_len upper bound.
        self._oracle = oracle_tokens

    # -- messages --------------------------------------------------------------------------------------------

    def add_batch(self, plan: BatchPlan) -> None:
        if plan.batch_id in self.batches:
            raise AdmissionError(f"batch {plan.batch_id} was already added")
        if self.batches and plan.batch_id < max(self.batches):
            raise AdmissionError(f"batch {plan.batch_id} added after batch {max(self.batches)}: batches are "
                                 f"trained in the order they are added")
        for g in plan.groups:
            if g.group_id in self._group_batch:
                raise AdmissionError(f"group {g.group_id} of batch {plan.batch_id} already belongs to batch "
                                     f"{self._group_batch[g.group_id]}")
        check_plan(self.c, plan)
        self.batches[plan.batch_id] = BatchState(plan, {g.group_id: GroupState(g) for g in plan.groups})
        self.order.append(plan.batch_id)
        for g in plan.groups:
            self._group_batch[g.group_id] = plan.batch_id

    def add(self, t: Trajectory) -> GroupState:
        """Validate and record a completed trajectory; returns its group's state."""
        if not isinstance(t, Trajectory):
            raise AdmissionError(f"expected a Trajectory, got {type(t).__name__}")
        b = self.batches.get(t.batch_id)
        if b is None:
            raise AdmissionError(f"trajectory {t.traj_id}: batch {t.batch_id} is unknown (add_batch first)")
        g = b.groups.get(t.group_id)
        if g is None:
            raise AdmissionError(f"trajectory {t.traj_id}: group {t.group_id} is unknown to batch {t.batch_id}")
        if t.traj_id in self._traj_ids:
            raise AdmissionError(f"duplicate trajectory id {t.traj_id}")
        if len(g.arrived) >= g.spec.size:
            raise AdmissionError(f"trajectory {t.traj_id}: group {t.group_id} already has its declared "
                                 f"{g.spec.size} trajectories (a group larger than declared)")
        if t.num_tokens > self.c.max_response_len:
            raise AdmissionError(f"trajectory {t.traj_id}: num_tokens={t.num_tokens} exceeds max_response_len="
                                 f"{self.c.max_response_len}")
        # validated: now mutate
        self._traj_ids.add(t.traj_id)
        g.arrived.append(t)
        b.arrived += 1
        seq = next(self._seq)
        if self.c.whole_groups:
            if g.complete:
                g.ready_seq = seq
                b.ready_groups.append(g.spec.group_id)
        else:
            b.ready_trajs[t.traj_id] = (seq, t)
        return g

    # -- views -----------------------------------------------------------------------------------------------

    def current(self) -> BatchState | None:
        """The oldest batch that still has mini-batches to commit."""
        return self.batches[self.order[0]] if self.order else None

    def remaining_minibatches(self, b: BatchState) -> int:
        return self.c.num_minibatches - b.committed

    def units(self, b: BatchState) -> tuple[list[Unit], list[Unit]]:
        """(ready, pending) admission units of batch ``b`` that are not yet consumed."""
        L = self.c.max_response_len
        ready: list[Unit] = []
        pending: list[Unit] = []
        if self.c.whole_groups:
            for gid in b.ready_groups:
                g = b.groups[gid]
                ready.append(Unit(gid, g.spec.size, sum(t.num_tokens for t in g.arrived), True, g.ready_seq))
            for gid, g in b.groups.items():
                if not g.complete:
                    known = sum(t.num_tokens for t in g.arrived)
                    bound = self._oracle(gid) if self._oracle else known + (g.spec.size - len(g.arrived)) * L
                    pending.append(Unit(gid, g.spec.size, bound, False, float("inf")))
        else:
            for tid, (seq, t) in b.ready_trajs.items():
                ready.append(Unit(tid, 1, t.num_tokens, True, seq))
            for gid, g in b.groups.items():
                missing = g.spec.size - len(g.arrived)
                if missing:
                    if self._oracle:
                        # spread the group's true remaining tokens over its missing trajectories (upper part)
                        rest = self._oracle(gid) - sum(t.num_tokens for t in g.arrived)
                        per = [rest // missing + (1 if i < rest % missing else 0) for i in range(missing)]
                    else:
                        per = [L] * missing
                    pending.extend(Unit(-1 - gid * 1_000_003 - i, 1, p, False, float("inf"))
                                   for i, p in enumerate(per))
        return ready, pending

    def commit(self, b: BatchState, units: list[Unit], violations: tuple[str, ...] = ()) -> MiniBatch:
        """Consume ``units`` (all ready) as the next mini-batch of ``b``."""
        traj: list[Trajectory] = []
        if self.c.whole_groups:
            keys = {u.key for u in units}
            for gid in keys:
                g = b.groups[gid]
                assert g.complete and not g.consumed, f"group {gid} committed while not ready"
                g.consumed = True
                traj.extend(g.arrived)
            b.ready_groups = deque(gid for gid in b.ready_groups if gid not in keys)
        else:
            for u in units:
                traj.append(b.ready_trajs.pop(u.key)[1])
        ids = tuple(t.traj_id for t in traj)
        assert not (set(ids) & b.consumed_traj), "a trajectory was committed twice"
        b.consumed_traj.update(ids)
        mb = MiniBatch(batch_id=b.plan.batch_id, index=b.committed, traj_ids=ids,
                       group_ids=tuple(dict.fromkeys(t.group_id for t in traj)),
                       num_tokens=sum(t.num_tokens for t in traj), violations=violations)
        b.committed += 1
        if b.committed == self.c.num_minibatches:
            assert len(b.consumed_traj) == b.plan.num_trajectories or violations, \
                f"batch {b.plan.batch_id} finished with unconsumed trajectories"
            self.order.popleft()
        return mb


class LedgerPolicy:
    """Plumbing every policy here shares: the ledger, the stats, and a ``_dirty`` flag that is set whenever a
    batch is added or a unit (a whole group, or a trajectory without whole groups) becomes ready, so a policy can
    skip composition attempts that cannot succeed. Subclasses implement ``on_trainer_ready``."""

    name = "ledger"

    def __init__(self, constraints: BatchConstraints,
                 oracle_tokens: Callable[[int], int] | None = None) -> None:
        self.constraints = constraints
        self.ledger = BatchLedger(constraints, oracle_tokens=oracle_tokens)
        self._stats = AdmissionStats()
        self._dirty = True  # something changed since the last attempt that committed nothing

    @property
    def stats(self) -> AdmissionStats:
        return self._stats

    def add_batch(self, plan: BatchPlan) -> None:
        self.ledger.add_batch(plan)
        self._dirty = True

    def on_complete(self, traj: Trajectory) -> None:
        self._record(traj)

    def _record(self, traj: Trajectory) -> GroupState:
        """Validate and record ``traj`` (the ledger rejects it before changing anything); mark a ready unit."""
        g = self.ledger.add(traj)
        if not self.constraints.whole_groups or g.complete:
            self._dirty = True
        return g
