"""Stateful fuzzing of the data-plane API (Hypothesis rule-based state machine), with faults.

Random interleavings of: producers putting trajectories (kept until released, ``ProducerBuffer``), admission of
mini-batches, rank fetches (acked at once, or after a "step"), malformed and corrupted messages, a storage unit
dying, a trainer rank crashing and restarting, and the controller dying and being rebuilt from its journal and the
units (``restart_controller``: a share claimed and not yet acked may then be claimed again by its rank). Invariants
after every step: nothing delivered twice, every delivered byte equal to what was put, a rejected message changes
nothing, no share handed out partially. At
teardown, after re-puts and restarts, every trajectory was delivered exactly once and every unit is empty.
(The admission API has its own machine: tests/property/test_admission_stateful.py.)
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from knittrans.dataplane import (DataPlaneError, FieldSpec, MiniBatchKey, TrajectoryPayload, TrajectorySchema,
                                 build_inprocess)
from knittrans.dataplane.faults import CorruptGet, FaultPlan, ProducerBuffer
from knittrans.dataplane.types import (CorruptPayloadError, DataLostError, UnitLostError)
from knittrans.types import MiniBatch

SCHEMA = TrajectorySchema((FieldSpec("ids", "int64"), FieldSpec("lp", "float32", finite=True)), token_field="ids",
                          same_length=(("ids", "lp"),))
UNITS = {"u0": "a", "u1": "b"}
RANKS = 2
MB_SIZE = 4
NUM_MB = 4
N = MB_SIZE * NUM_MB


def _payload(t: int) -> TrajectoryPayload:
    n = t % 5 + 1
    return TrajectoryPayload(t, {"ids": np.arange(t, t + n, dtype=np.int64),
                                 "lp": np.full(n, -0.5 - t, dtype=np.float32)})


class DataPlaneMachine(RuleBasedStateMachine):
    @initialize(corrupt_on=st.integers(1, 12), checksums=st.booleans())
    def setup(self, corrupt_on, checksums):
        plan = FaultPlan((CorruptGet("u0", on_get=corrupt_on, field="lp"),)) if checksums else FaultPlan()
        self.dp = build_inprocess(SCHEMA, UNITS, ("a", "b"), checksums=checksums, faults=plan, recoverable=True)
        self.producers = {u: ProducerBuffer(self.dp.client(u), [v for v in UNITS if v != u]) for u in UNITS}
        self.next_put = 0
        self.admitted = 0
        self.delivered: dict[int, int] = {}
        self.deferred: list = []  # fetched shares waiting for their ack (the step is running)
        self.next_seq = [0] * RANKS  # per rank: next admitted mini-batch to fetch
        self.reclaimable: set[tuple[int, int]] = set()  # (rank, seq) claimed, un-acked across a controller restart

    # -- production and admission ---------------------------------------------------------------------------

    @precondition(lambda self: self.next_put < N)
    @rule(k=st.integers(1, 5), unit=st.sampled_from(sorted(UNITS)))
    def put(self, k, unit):
        ids = range(self.next_put, min(N, self.next_put + k))
        self.producers[unit].put([_payload(t) for t in ids])
        self.next_put = ids[-1] + 1

    @precondition(lambda self: self.admitted < NUM_MB and self.next_put >= (self.admitted + 1) * MB_SIZE)
    @rule()
    def admit(self):
        k = self.admitted
        ids = tuple(range(k * MB_SIZE, (k + 1) * MB_SIZE))
        if self.dp.controller.untracked(ids):  # lost with a unit while the controller was down: re-put first
            for p in self.producers.values():
                p.reput_missing()
            assert not self.dp.controller.untracked(ids)
        self.dp.controller.admit(MiniBatch(0, k, ids, (k,), 0))
        self.admitted += 1

    # -- consumption ------------------------------------------------------------------------------------------

    def _take(self, share):
        for i, t in enumerate(share.traj_ids):
            want = _payload(t).tensors
            for name in SCHEMA.names:
                f = share.fields[name]
                got = f.values[f.cu_seqlens[i]:f.cu_seqlens[i + 1]].numpy()
                np.testing.assert_array_equal(got, want[name])
            self.delivered[t] = self.delivered.get(t, 0) + 1

    @precondition(lambda self: any(s < self.admitted for s in self.next_seq))
    @rule(rank=st.integers(0, RANKS - 1), defer=st.booleans())
    def fetch(self, rank, defer):
        seq = self.next_seq[rank]
        if seq >= self.admitted:
            return
        defer = defer or any(s.rank == rank for s in self.deferred)  # a rank acks in order (after each step)
        before = dict(self.delivered)
        try:
            share = self.dp.client().fetch(MiniBatchKey(0, seq), rank, ack=not defer)
        except (CorruptPayloadError, DataLostError, UnitLostError):
            assert self.delivered == before  # nothing handed out: the claim is undone, retry later
            return
        self._take(share)
        self.next_seq[rank] += 1
        if defer:
            self.deferred.append(share)

    @precondition(lambda self: self.deferred)
    @rule()
    def ack(self):
        self.dp.client().ack(self.deferred.pop(0))

    @precondition(lambda self: self.deferred)
    @rule(rank=st.integers(0, RANKS - 1))
    def crash_rank(self, rank):
        """The rank dies with its un-acked shares; on restart they are re-delivered (its step ledger would skip
        the step, so here the re-delivery is not counted again)."""
        lost = [s for s in self.deferred if s.rank == rank]
        if not lost:
            return
        self.deferred = [s for s in self.deferred if s.rank != rank]
        resume = self.dp.controller.recover_rank(rank)
        assert resume == min(s.key.index for s in lost)
        for s in lost:
            for t in s.traj_ids:
                self.delivered[t] -= 1  # the crashed rank's copy is gone; the re-delivery is the one that counts
        self.next_seq[rank] = resume

    # -- faults and bad input ---------------------------------------------------------------------------------

    @rule(unit=st.sampled_from(sorted(UNITS)))
    def lose_unit(self, unit):
        self.dp.units[unit].clear()  # it dies with everything it held, and comes back empty
        self.dp.controller.lose_unit(unit)

    @rule()
    def restart_controller(self):
        before, missing = self.dp.controller.stats(), set(self.dp.controller.missing())
        self.dp.restart_controller()
        after, still = self.dp.controller.stats(), set(self.dp.controller.missing())
        assert (after.released_minibatches, after.admitted) == (before.released_minibatches, before.admitted)
        # a missing trajectory stays missing, unless it was never admitted: then the rebuilt controller does not
        # know it at all (no unit reported it) and its producer re-puts it as untracked
        assert still <= missing and missing - still == set(self.dp.controller.untracked(sorted(missing)))
        self.reclaimable |= {(s.rank, s.key.index) for s in self.deferred}

    @precondition(lambda self: self.dp.controller.missing())
    @rule()
    def reput(self):
        for p in self.producers.values():
            p.reput_missing()

    @rule(kind=st.sampled_from(["dtype", "mismatched_length", "nan", "duplicate", "unknown_mb", "refetch"]))
    def bad_message(self, kind):
        c = self.dp.client("u1")
        t = max(0, self.next_put - 1)
        bad = {
            "dtype": lambda: c.put([TrajectoryPayload(900, {"ids": np.zeros(2, np.int32)})]),
            "mismatched_length": lambda: c.put([TrajectoryPayload(901, {"ids": np.zeros(2, np.int64),
                                                                        "lp": np.zeros(3, np.float32)})]),
            "nan": lambda: c.put([TrajectoryPayload(902, {"lp": np.array([np.nan], np.float32)})]),
            "duplicate": lambda: c.put([_payload(t)]) if self.next_put else c.put([]),
            "unknown_mb": lambda: c.fetch(MiniBatchKey(7, 0), 0),
            "refetch": lambda: c.fetch(MiniBatchKey(0, self.next_seq[0] - 1), 0),
        }[kind]
        before = (dict(self.delivered), [u.stats() for u in self.dp.units.values()], self.dp.controller.stats())
        reclaim = (0, self.next_seq[0] - 1)
        try:
            bad()
        except DataPlaneError:
            pass
        else:
            if kind == "refetch" and reclaim in self.reclaimable:  # its claim was not journaled: re-claimed once
                self.reclaimable.discard(reclaim)
                return
            assert kind in ("duplicate", "refetch") and (not self.next_put or self.next_seq[0] == 0 or
                                                         kind == "duplicate"), f"{kind} was accepted"
        if kind != "duplicate" or not self.next_put:
            assert (dict(self.delivered), [u.stats() for u in self.dp.units.values()],
                    self.dp.controller.stats()) == before, f"rejected {kind} changed state"

    @invariant()
    def nothing_delivered_twice(self):
        if hasattr(self, "delivered"):
            assert all(v <= 1 for v in self.delivered.values()), self.delivered

    def teardown(self):
        if not hasattr(self, "dp"):
            return
        while self.next_put < N:
            self.put(5, "u0")
        while self.admitted < NUM_MB:
            self.admit()
        for share in self.deferred:
            self.dp.client().ack(share)
        self.deferred = []
        for _ in range(4):
            self.reput()
            for rank in range(RANKS):
                while self.next_seq[rank] < NUM_MB:
                    n = self.next_seq[rank]
                    self.fetch(rank, False)
                    if self.next_seq[rank] == n:
                        break
        assert self.delivered == {t: 1 for t in range(N)}, "a trajectory was lost or delivered twice"
        assert all(u.stats().nbytes == 0 for u in self.dp.units.values()), "storage not freed after consumption"
        assert all(p.prune() == 0 for p in self.producers.values())


DataPlaneMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestDataPlaneStateMachine = DataPlaneMachine.TestCase
