"""Stateful fuzzing of the admission API (Hypothesis rule-based state machine).

Random interleavings of: announcing batches, completing trajectories in any order, the trainer asking for work,
and malformed messages. Invariants after every step: nothing consumed twice, nothing consumed before it
completed, mini-batches in order (batch by batch, index 0..M-1), every mini-batch within the constraints, and a
rejected message changes nothing. At teardown, once everything has completed, the policy drains every batch.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from baselines.admission import make_policy
from knittrans.admission import AdmissionError
from knittrans.constraints import BatchConstraints
from knittrans.types import BatchPlan, GroupSpec, Trajectory

L = 10
CONSTRAINT_SETS = {
    "uniform": (BatchConstraints(batch_size=8, num_minibatches=2, group_size=2, max_response_len=L), [2, 2, 2, 2]),
    "variable_exact": (BatchConstraints(batch_size=12, num_minibatches=2, max_response_len=L),
                       [5, 1, 4, 2]),
    "token_budget": (BatchConstraints(batch_size=8, num_minibatches=2, group_size=2, max_response_len=L,
                                      size_slack=2, token_budget=4 * L), [2, 2, 2, 2]),
    "per_trajectory_dp": (BatchConstraints(batch_size=8, num_minibatches=2, group_size=4, whole_groups=False,
                                           dp_size=2, max_response_len=L), [4, 4]),
}


class AdmissionMachine(RuleBasedStateMachine):
    @initialize(kind=st.sampled_from(sorted(CONSTRAINT_SETS)), policy=st.sampled_from(["knittrans", "train_batch"]))
    def setup(self, kind, policy):
        self.c, self.sizes = CONSTRAINT_SETS[kind]
        self.policy = make_policy(policy, self.c)
        self.next_batch = 0
        self.next_gid = 0
        self.next_tid = 0
        self.pending: list[Trajectory] = []  # generated, not yet delivered
        self.completed: set[int] = set()
        self.consumed: set[int] = set()
        self.batch_traj: dict[int, set[int]] = {}
        self.progress: list[tuple[int, int]] = []  # (batch, index) of every mini-batch, in order

    @precondition(lambda self: self.next_batch < 3)
    @rule(lengths=st.lists(st.integers(1, L), min_size=12, max_size=12))
    def add_batch(self, lengths):
        b = self.next_batch
        groups = []
        ids = set()
        it = iter(lengths)
        for size in self.sizes:
            groups.append(GroupSpec(self.next_gid, b, size))
            for _ in range(size):
                self.pending.append(Trajectory(self.next_tid, self.next_gid, b, next(it), v_gen=0))
                ids.add(self.next_tid)
                self.next_tid += 1
            self.next_gid += 1
        self.policy.add_batch(BatchPlan(b, tuple(groups)))
        self.batch_traj[b] = ids
        self.next_batch += 1

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 1000))
    def complete(self, i):
        t = self.pending.pop(i % len(self.pending))
        self.policy.on_complete(t)
        self.completed.add(t.traj_id)

    @rule()
    def trainer_ready(self):
        for mb in self.policy.on_trainer_ready(now=0.0):
            self._check(mb)

    @precondition(lambda self: self.completed)
    @rule(kind=st.sampled_from(["duplicate", "unknown_group", "unknown_batch", "too_long"]))
    def bad_message(self, kind):
        tid = min(self.completed)
        bid = max(self.batch_traj)
        bad = {
            "duplicate": lambda: Trajectory(tid, 0, 0, 1, 0),
            "unknown_group": lambda: Trajectory(10_000, 99_999, bid, 1, 0),
            "unknown_batch": lambda: Trajectory(10_001, 0, 77, 1, 0),
            "too_long": lambda: Trajectory(10_002, 0, 0, L + 1, 0),
        }[kind]()
        before = (set(self.consumed), len(self.progress))
        try:
            self.policy.on_complete(bad)
        except AdmissionError:
            pass
        else:
            raise AssertionError(f"{kind} message was accepted")
        assert (set(self.consumed), len(self.progress)) == before

    def _check(self, mb):
        ids = set(mb.traj_ids)
        assert not (ids & self.consumed), "a trajectory was consumed twice"
        assert ids <= self.completed, "a trajectory was consumed before it completed"
        assert ids <= self.batch_traj[mb.batch_id], "a mini-batch mixes batches"
        assert not mb.violations
        assert self.c.size_ok(mb.size) and self.c.tokens_ok(mb.num_tokens)
        expected = (mb.batch_id, mb.index)
        if self.progress:
            pb, pi = self.progress[-1]
            assert expected == ((pb, pi + 1) if pi + 1 < self.c.num_minibatches else (pb + 1, 0)), \
                f"mini-batch {expected} after {(pb, pi)}"
        else:
            assert expected == (0, 0)
        self.progress.append(expected)
        self.consumed |= ids

    @invariant()
    def consumed_is_a_subset_of_completed(self):
        if hasattr(self, "consumed"):
            assert self.consumed <= self.completed

    def teardown(self):
        if not hasattr(self, "pending"):
            return
        while self.pending:  # complete the rest, asking for work as a trainer would
            self.complete(0)
            self.trainer_ready()
        for _ in range(4 * self.c.num_minibatches + 4):
            self.trainer_ready()
        everything = set().union(*self.batch_traj.values()) if self.batch_traj else set()
        assert self.consumed == everything, f"{len(everything - self.consumed)} trajectories never consumed"


AdmissionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAdmissionStateMachine = AdmissionMachine.TestCase
