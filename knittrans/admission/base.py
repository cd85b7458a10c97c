"""The admission protocol, and the ledger every policy keeps its batches in.

An admission policy is event-driven. It is told about batches (``add_batch``, in training order), about each
completed trajectory (``on_complete``), and, when the trainer is ready for its next optimizer step, it answers
with the mini-batches it commits to now (``on_trainer_ready``), in the order they must run. Every policy in this
project, KnitTrans's and the baselines', implements this protocol, so the simulator and the real runtime run
each of them with one config switch.

The ledger validates every message before it changes any state: a bad trajectory raises ``AdmissionError`` and
leaves everything already received or admitted intact (nothing lost).

The ledger's state is incremental: each arrival updates its group's token sum, the batch's ready units (with
their size counts, token sum and the bitset of subset sums of their sizes) and the pending units' token bounds in
O(1); a commit updates them in time linear in what it consumes plus the ready units left. A decision reads these
instead of re-summing every group (that rebuild made each decision O(P), a batch O(P^2) in its P groups).
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from knittrans.admission.feasibility import Unit, check_plan
from knittrans.dataplane.idset import IdRanges
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
    ended_short: int = 0  # batches used up before their M mini-batches, ended with fewer (greedy baseline only)
    skipped_minibatches: int = 0  # the mini-batches those batches never had (a sealed stream ends that much earlier)


@dataclass
class GroupState:
    spec: GroupSpec
    arrived: list[Trajectory] = field(default_factory=list)
    consumed: bool = False  # whole-group mode: consumed as a unit
    ready_seq: int | None = None  # arrival sequence of the last trajectory (FIFO rank of a ready group)
    tokens: int = 0  # response tokens of the trajectories arrived so far (kept on arrival, never re-summed)

    @property
    def complete(self) -> bool:
        return len(self.arrived) == self.spec.size


@dataclass
class BatchState:
    """One batch in the ledger. Besides the groups, it keeps the admission units incrementally:

    - ready units (whole complete groups, or single trajectories without whole groups), not yet consumed, in
      completion order: ``ready_units`` (key -> Unit with exact tokens), ``ready_sizes`` (size -> count),
      ``ready_size`` and ``ready_tokens`` (sums), and ``ready_reach``, a bitset with bit s set iff some subset of
      the ready units holds exactly s trajectories (s up to the largest allowed mini-batch);
    - pending units (what is still in flight): ``pending`` (incomplete groups, in plan order), ``pending_sizes``
      (unit size -> count; without whole groups each missing trajectory is a unit of size 1), ``pending_size``
      and ``pending_tokens`` (the sum of their token upper bounds)."""

    plan: BatchPlan
    groups: dict[int, GroupState]
    committed: int = 0  # mini-batches committed so far
    arrived: int = 0  # trajectories received so far
    consumed_traj: set[int] = field(default_factory=set)
    ready_groups: deque[int] = field(default_factory=deque)  # complete, unconsumed groups, in completion order
    ready_trajs: dict[int, tuple[int, Trajectory]] = field(default_factory=dict)  # traj mode: id -> (seq, traj)
    ready_units: dict[int, Unit] = field(default_factory=dict)
    ready_sizes: Counter[int] = field(default_factory=Counter)
    ready_size: int = 0
    ready_tokens: int = 0
    ready_reach: int = 1
    pending: dict[int, GroupState] = field(default_factory=dict)
    pending_sizes: Counter[int] = field(default_factory=Counter)
    pending_size: int = 0
    pending_tokens: int = 0

    @property
    def remaining_size(self) -> int:
        """Trajectories of this batch not yet consumed (ready or still in flight)."""
        return self.ready_size + self.pending_size


class BatchLedger:
    """Batches, groups and trajectories received so far, with validation and consumption bookkeeping.

    Bounded memory: a batch whose M mini-batches are all committed is forgotten (``finish``): its state, groups and
    trajectory objects go, and what validation still needs of it stays as id ranges (its batch id, group ids and
    trajectory ids: a late duplicate or a re-announcement is still refused by name). A long run's ledger holds the
    batches in flight, not every batch it ever trained (~400 B per trajectory before)."""

    def __init__(self, constraints: BatchConstraints,
                 oracle_tokens: Callable[[int], int] | None = None) -> None:
        self.c = constraints
        self.batches: dict[int, BatchState] = {}
        self.order: deque[int] = deque()  # batch ids not yet fully committed, in training order
        self._group_batch: dict[int, int] = {}
        self._traj_ids: set[int] = set()
        self._last_batch: int | None = None  # the highest batch id added (batches come in increasing order)
        self._finished_batches = IdRanges()  # batches forgotten by ``finish``: their ids, groups, trajectories
        self._finished_groups = IdRanges()
        self._finished_trajs = IdRanges()
        self._seq = itertools.count()
        # Clairvoyant bound only: the true token count of an in-flight group (by group id), in place of the
        # max_response_len upper bound.
        self._oracle = oracle_tokens
        # read on every arrival: plain attributes, not properties of the constraints
        self._whole = constraints.whole_groups
        self._max_len = constraints.max_response_len
        self._reach_mask = (2 << constraints.max_minibatch_size) - 1  # subset sums up to the largest mini-batch

    # -- messages --------------------------------------------------------------------------------------------

    def add_batch(self, plan: BatchPlan) -> None:
        if plan.batch_id in self.batches or plan.batch_id in self._finished_batches:
            raise AdmissionError(f"batch {plan.batch_id} was already added")
        if self._last_batch is not None and plan.batch_id < self._last_batch:
            raise AdmissionError(f"batch {plan.batch_id} added after batch {self._last_batch}: batches are "
                                 f"trained in the order they are added")
        for g in plan.groups:
            if g.group_id in self._group_batch:
                raise AdmissionError(f"group {g.group_id} of batch {plan.batch_id} already belongs to batch "
                                     f"{self._group_batch[g.group_id]}")
            if g.group_id in self._finished_groups:
                raise AdmissionError(f"group {g.group_id} of batch {plan.batch_id} already belonged to a trained "
                                     f"batch (group ids are never reused)")
        check_plan(self.c, plan)
        b = BatchState(plan, {g.group_id: GroupState(g) for g in plan.groups})
        b.pending = dict(b.groups)
        for g in b.pending.values():
            if self.c.whole_groups:
                b.pending_sizes[g.spec.size] += 1
            b.pending_size += g.spec.size
            b.pending_tokens += self._pending_bound(g)
        if not self.c.whole_groups:
            b.pending_sizes[1] = b.pending_size
        self.batches[plan.batch_id] = b
        self._last_batch = plan.batch_id
        self.order.append(plan.batch_id)
        for g in plan.groups:
            self._group_batch[g.group_id] = plan.batch_id

    def add(self, t: Trajectory) -> GroupState:
        """Validate and record a completed trajectory; returns its group's state. O(1): this runs once per
        trajectory, so it reads and writes only the arrival's group and its batch's running sums."""
        if not isinstance(t, Trajectory):
            raise AdmissionError(f"expected a Trajectory, got {type(t).__name__}")
        b = self.batches.get(t.batch_id)
        if b is None:
            if t.batch_id in self._finished_batches:
                raise AdmissionError(f"trajectory {t.traj_id}: batch {t.batch_id} is finished (all its mini-batches "
                                     f"were committed); it takes no more trajectories")
            raise AdmissionError(f"trajectory {t.traj_id}: batch {t.batch_id} is unknown (add_batch first)")
        g = b.groups.get(t.group_id)
        if g is None:
            raise AdmissionError(f"trajectory {t.traj_id}: group {t.group_id} is unknown to batch {t.batch_id}")
        if t.traj_id in self._traj_ids or t.traj_id in self._finished_trajs:
            raise AdmissionError(f"duplicate trajectory id {t.traj_id}")
        arrived, size, n = g.arrived, g.spec.size, t.num_tokens
        if len(arrived) >= size:
            raise AdmissionError(f"trajectory {t.traj_id}: group {t.group_id} already has its declared "
                                 f"{size} trajectories (a group larger than declared)")
        if n > self._max_len:
            raise AdmissionError(f"trajectory {t.traj_id}: num_tokens={n} exceeds max_response_len="
                                 f"{self._max_len}")
        # validated: now mutate
        self._traj_ids.add(t.traj_id)
        if self._oracle is not None:
            b.pending_tokens -= self._pending_bound(g)
        elif self._whole:
            b.pending_tokens += n - self._max_len  # one missing response (bound L) became n known tokens
        else:
            b.pending_tokens -= self._max_len  # one missing trajectory (a pending unit at L) became ready
        arrived.append(t)
        g.tokens += n
        b.arrived += 1
        seq = next(self._seq)
        complete = len(arrived) == size
        if self._whole:
            if complete:
                g.ready_seq = seq
                gid = g.spec.group_id
                b.ready_groups.append(gid)
                del b.pending[gid]
                b.pending_sizes[size] -= 1
                b.pending_size -= size
                if self._oracle is None:
                    b.pending_tokens -= g.tokens  # the bound of a complete group is its tokens: it leaves
                self._add_ready(b, Unit(gid, size, g.tokens, True, seq))
            elif self._oracle is not None:
                b.pending_tokens += self._pending_bound(g)
        else:
            b.ready_trajs[t.traj_id] = (seq, t)
            b.pending_sizes[1] -= 1
            b.pending_size -= 1
            if complete:
                del b.pending[g.spec.group_id]
            elif self._oracle is not None:
                b.pending_tokens += self._pending_bound(g)
            self._add_ready(b, Unit(t.traj_id, 1, n, True, seq))
        return g

    def _pending_bound(self, g: GroupState) -> int:
        """Token upper bound of ``g``'s pending unit(s): what has arrived plus max_response_len per missing
        trajectory with whole groups (the group is one unit), max_response_len per missing trajectory without.
        With the clairvoyant oracle, the group's true total in place of the bound."""
        missing = g.spec.size - len(g.arrived)
        if not missing:
            return 0
        if self._oracle:
            return self._oracle(g.spec.group_id) - (0 if self._whole else g.tokens)
        return (g.tokens if self._whole else 0) + missing * self._max_len

    def _add_ready(self, b: BatchState, u: Unit) -> None:
        b.ready_units[u.key] = u
        b.ready_sizes[u.size] += 1
        b.ready_size += u.size
        b.ready_tokens += u.tokens
        b.ready_reach = (b.ready_reach | (b.ready_reach << u.size)) & self._reach_mask

    # -- views -----------------------------------------------------------------------------------------------

    def current(self) -> BatchState | None:
        """The oldest batch that still has mini-batches to commit."""
        return self.batches[self.order[0]] if self.order else None

    def remaining_minibatches(self, b: BatchState) -> int:
        return self.c.num_minibatches - b.committed

    def units(self, b: BatchState) -> tuple[list[Unit], list[Unit]]:
        """(ready, pending) admission units of batch ``b`` that are not yet consumed: ready ones in completion
        order with exact tokens, pending ones in plan order with their token upper bounds. Built from the
        incremental state (no token re-summing), in time linear in the units returned."""
        ready = list(b.ready_units.values())
        pending: list[Unit] = []
        if self.c.whole_groups:
            pending = [Unit(gid, g.spec.size, self._pending_bound(g), False, float("inf"))
                       for gid, g in b.pending.items()]
        else:
            for gid, g in b.pending.items():
                missing = g.spec.size - len(g.arrived)
                rest = self._pending_bound(g)
                # spread the bound over the missing trajectories (max_response_len each without the oracle)
                per = [rest // missing + (1 if i < rest % missing else 0) for i in range(missing)]
                pending.extend(Unit(-1 - gid * 1_000_003 - i, 1, p, False, float("inf"))
                               for i, p in enumerate(per))
        return ready, pending

    def commit(self, b: BatchState, units: list[Unit], violations: tuple[str, ...] = ()) -> MiniBatch:
        """Consume ``units`` (all ready) as the next mini-batch of ``b``."""
        traj: list[Trajectory] = []
        keys = {u.key for u in units}
        assert len(keys) == len(units), "a unit was listed twice"
        if self.c.whole_groups:
            for gid in keys:
                g = b.groups[gid]
                assert g.complete and not g.consumed, f"group {gid} committed while not ready"
                g.consumed = True
                traj.extend(g.arrived)
            b.ready_groups = deque(gid for gid in b.ready_groups if gid not in keys)
        else:
            for u in units:
                traj.append(b.ready_trajs.pop(u.key)[1])
        for key in keys:
            u = b.ready_units.pop(key)
            b.ready_sizes[u.size] -= 1
            b.ready_size -= u.size
            b.ready_tokens -= u.tokens
        # a subset-sum bitset cannot forget a unit: rebuild it from the ready units left (M times per batch)
        reach, mask = 1, self._reach_mask
        for u in b.ready_units.values():
            reach = (reach | (reach << u.size)) & mask
        b.ready_reach = reach
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
            self.finish(b)
        return mb

    def finish(self, b: BatchState) -> None:
        """Batch ``b`` will commit nothing more (its M mini-batches are committed, or a policy ended it short):
        take it off the order and forget its state, keeping its ids for validation (see the class doc)."""
        bid = b.plan.batch_id
        if self.order and self.order[0] == bid:
            self.order.popleft()
        elif bid in self.order:
            self.order.remove(bid)
        self.batches.pop(bid, None)
        self._finished_batches.update((bid,))
        gids = [g.group_id for g in b.plan.groups]
        for gid in gids:
            self._group_batch.pop(gid, None)
        self._finished_groups.update(gids)
        arrived = [t.traj_id for g in b.groups.values() for t in g.arrived]
        self._traj_ids.difference_update(arrived)
        self._finished_trajs.update(arrived)


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
        """Validate and record ``traj`` (the ledger rejects it before changing anything); mark a ready unit of the
        current batch (decisions only look at the current batch; the next one's turn starts with a commit, which
        leaves the flag set)."""
        g = self.ledger.add(traj)
        if (not self.constraints.whole_groups or g.complete) and self.ledger.order \
                and self.ledger.order[0] == traj.batch_id:
            self._dirty = True
        return g
