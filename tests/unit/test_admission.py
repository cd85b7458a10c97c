"""Admission policies on hand-built instances: who admits what, when, and who walks into a dead end."""

from __future__ import annotations

import pytest

from baselines.admission import (BoundedAsyncAdmission, GreedyStreamingAdmission, TrainBatchAdmission,
                                 make_policy)
from knittrans.admission import AdmissionPolicy, KnitTransAdmission
from knittrans.constraints import BatchConstraints
from knittrans.types import BatchPlan, GroupSpec, MiniBatch, Trajectory


class Feeder:
    """Builds a plan's trajectories and feeds them one completion at a time, asking the trainer after each."""

    def __init__(self, policy, plans: list[BatchPlan]):
        self.p = policy
        self.out: list[MiniBatch] = []
        self.trajs: dict[int, list[Trajectory]] = {}  # group id -> its trajectories, not yet fed
        self.tid = 0
        for plan in plans:
            policy.add_batch(plan)

    def complete(self, gid: int, batch_id: int, tokens: int) -> list[MiniBatch]:
        """One trajectory of group ``gid`` completes; returns what the trainer got after it."""
        t = Trajectory(self.tid, gid, batch_id, tokens, v_gen=0)
        self.tid += 1
        self.p.on_complete(t)
        return self.ask()

    def group(self, gid: int, batch_id: int, tokens: list[int]) -> list[MiniBatch]:
        got = []
        for n in tokens:
            got += self.complete(gid, batch_id, n)
        return got

    def ask(self) -> list[MiniBatch]:
        got = []
        while more := self.p.on_trainer_ready(0.0):
            got += more
        self.out += got
        return got


def plan_of(batch_id: int, sizes: list[int], first_gid: int = 0) -> BatchPlan:
    return BatchPlan(batch_id, tuple(GroupSpec(first_gid + i, batch_id, s) for i, s in enumerate(sizes)))


UNIFORM = BatchConstraints(batch_size=8, num_minibatches=2, max_response_len=16, group_size=2)


@pytest.mark.parametrize("name", ["knittrans", "train_batch", "greedy", "bounded_async"])
def test_every_policy_finishes_a_simple_batch_in_m_valid_minibatches(name):
    p = make_policy(name, UNIFORM)
    assert isinstance(p, AdmissionPolicy)
    f = Feeder(p, [plan_of(0, [2, 2, 2, 2])])
    for gid in (3, 1, 0, 2):
        f.group(gid, 0, [5, 7])
    assert [mb.index for mb in f.out] == [0, 1]
    assert all(mb.size == 4 and mb.violations == () for mb in f.out)
    assert sorted(i for mb in f.out for i in mb.traj_ids) == list(range(8))
    assert sum(mb.num_tokens for mb in f.out) == 4 * 12
    assert p.stats.admitted == 2 and p.stats.dead_ends == 0 and p.stats.violations == 0


def test_train_batch_waits_for_the_whole_batch():
    f = Feeder(TrainBatchAdmission(UNIFORM), [plan_of(0, [2, 2, 2, 2])])
    for gid in range(3):
        assert f.group(gid, 0, [3, 3]) == []
    assert f.complete(3, 0, 3) == []
    got = f.complete(3, 0, 3)
    assert [mb.index for mb in got] == [0, 1]  # both mini-batches at once, on the last completion


def test_knittrans_admits_before_the_batch_completes_when_safe():
    f = Feeder(KnitTransAdmission(UNIFORM), [plan_of(0, [2, 2, 2, 2])])
    assert f.group(2, 0, [3, 3]) == []  # one group (2 trajectories) cannot fill a mini-batch of 4
    got = f.group(0, 0, [3, 3])
    assert len(got) == 1 and set(got[0].group_ids) == {0, 2} and got[0].index == 0
    assert f.group(1, 0, [3]) == []  # group 1 is half done: nothing to add yet
    assert f.group(3, 0, [3, 3]) == []  # group 3 alone is only 2 of 4
    got = f.group(1, 0, [3])
    assert [mb.index for mb in got] == [1] and set(got[0].group_ids) == {1, 3}


def test_knittrans_prefers_the_oldest_completed_groups():
    c = BatchConstraints(batch_size=12, num_minibatches=3, max_response_len=16, group_size=2)
    f = Feeder(KnitTransAdmission(c), [plan_of(0, [2] * 6)])
    for gid in (5, 3):
        f.group(gid, 0, [1, 1])
    # group 4 completes: {5, 3} already made a mini-batch before it
    assert [set(mb.group_ids) for mb in f.out] == [{5, 3}]
    for gid in (4, 0, 1, 2):
        f.group(gid, 0, [1, 1])
    assert [set(mb.group_ids) for mb in f.out] == [{5, 3}, {4, 0}, {1, 2}]


# -- the greedy dead end ------------------------------------------------------------------------------------------

# Sizes [5, 1, 4, 2, 3, 3], B = 18, M = 3 (exact size 6), whole groups. The 1-, 2- and 3-groups complete first,
# so FIFO first-fit commits {1, 2, 3}; then {5, 4, 3} cannot make two mini-batches of 6.
DEAD_END = BatchConstraints(batch_size=18, num_minibatches=3, max_response_len=8)
DEAD_END_PLAN = plan_of(0, [5, 1, 4, 2, 3, 3])
DEAD_END_ORDER = [1, 3, 4, 2, 0, 5]  # group ids in completion order


def run_dead_end(policy) -> Feeder:
    f = Feeder(policy, [DEAD_END_PLAN])
    for gid in DEAD_END_ORDER:
        f.group(gid, 0, [2] * DEAD_END_PLAN.groups[gid].size)
    return f


def test_greedy_dead_ends_and_records_every_violation():
    p = GreedyStreamingAdmission(DEAD_END)
    f = run_dead_end(p)
    assert set(f.out[0].group_ids) == {1, 3, 4}  # the greedy FIFO pick
    assert p.stats.dead_ends >= 1 and p.stats.violations >= 1
    broken = [mb for mb in f.out if mb.size != 6]
    assert broken and all(mb.violations and "size" in mb.violations[0] for mb in broken)
    assert [mb for mb in f.out if mb.violations] == broken
    assert sorted(i for mb in f.out for i in mb.traj_ids) == list(range(18))  # it still consumed all, once


def test_knittrans_never_reaches_the_greedy_dead_end():
    p = KnitTransAdmission(DEAD_END)
    f = run_dead_end(p)
    assert [mb.index for mb in f.out] == [0, 1, 2]
    assert all(mb.size == 6 and mb.violations == () for mb in f.out)
    assert {frozenset(mb.group_ids) for mb in f.out} == {frozenset({2, 3}), frozenset({0, 1}),
                                                         frozenset({4, 5})}
    assert p.stats.dead_ends == 0 and p.stats.waits >= 1


# -- token budget: short responses complete first ----------------------------------------------------------------

# B = 4, M = 2, sizes 1..4 (slack 2), budget 12, L = 6: at most 2 long responses per mini-batch.
BUDGET = BatchConstraints(batch_size=4, num_minibatches=2, max_response_len=6, whole_groups=False, size_slack=2,
                          token_budget=12)
BUDGET_ORDER = [(0, 2), (1, 3), (1, 5), (0, 6)]  # (group id, tokens): shortest first


def run_budget(policy) -> Feeder:
    f = Feeder(policy, [plan_of(0, [2, 2])])
    for gid, tokens in BUDGET_ORDER:
        f.complete(gid, 0, tokens)
    return f


def test_greedy_breaks_the_token_budget_when_short_responses_complete_first():
    p = GreedyStreamingAdmission(BUDGET)
    f = run_budget(p)
    assert f.out[0].traj_ids == (0,)  # a locally valid 1-trajectory mini-batch, admitted at once
    assert f.out[1].num_tokens == 14 and any("token_budget 12" in v for v in f.out[1].violations)
    assert p.stats.dead_ends == 1 and p.stats.violations == 1


def test_knittrans_keeps_the_token_budget_when_short_responses_complete_first():
    p = KnitTransAdmission(BUDGET)
    f = run_budget(p)
    assert [mb.traj_ids for mb in f.out] == [(0, 1), (2, 3)]
    assert all(mb.num_tokens <= 12 and mb.violations == () for mb in f.out)


def test_knittrans_rechecks_when_a_partial_group_lowers_its_token_bound():
    """Regression (bug 2): a trajectory that completes only part of a group lowers the group's token bound
    (known + missing * max_response_len) and can make a waiting candidate safe; KnitTrans used to skip the check
    because no unit became ready, and waited where a safe mini-batch existed."""
    c = BatchConstraints(batch_size=5, num_minibatches=2, max_response_len=3, size_slack=1, token_budget=10)
    f = Feeder(KnitTransAdmission(c), [plan_of(0, [2, 1, 2])])
    assert f.complete(1, 0, 3) == []  # {g1} leaves g0 + g2 at 6 + 6 = 12 > 10 tokens: unsafe
    got = f.complete(2, 0, 1)  # g2's bound drops to 1 + 3: now 6 + 4 = 10 fits
    assert [mb.group_ids for mb in got] == [(1,)]


def test_knittrans_finishes_without_the_exhaustive_search():
    """Regression (bug 3): with the subset enumeration off (as for batches with many ready units), the FIFO and
    longest-first candidates can both leave an unsplittable rest; KnitTrans used to stall forever with every
    trajectory completed. The witness-partition fallback finishes the batch."""
    c = BatchConstraints(batch_size=22, num_minibatches=5, max_response_len=3, size_slack=2)
    order = [(6, 2), (2, 1), (1, 3), (1, 1), (2, 2), (5, 3), (3, 2), (0, 1), (0, 2), (2, 2), (3, 3), (3, 2), (6, 3),
             (5, 3), (4, 1), (0, 3), (4, 3), (6, 3), (4, 1), (4, 3), (6, 1), (4, 1)]
    f = Feeder(KnitTransAdmission(c, exhaustive_max=0), [plan_of(0, [3, 2, 3, 3, 5, 2, 4])])
    for gid, tokens in order:
        f.complete(gid, 0, tokens)
    assert [mb.index for mb in f.out] == [0, 1, 2, 3, 4]
    assert all(c.size_ok(mb.size) and mb.violations == () for mb in f.out)
    assert sorted(i for mb in f.out for i in mb.traj_ids) == list(range(22))


# -- bounded async --------------------------------------------------------------------------------------------


def test_bounded_async_forms_batches_from_the_first_completed_groups_across_prompt_batches():
    p = BoundedAsyncAdmission(UNIFORM)
    f = Feeder(p, [plan_of(0, [2, 2, 2, 2]), plan_of(1, [2, 2, 2, 2], first_gid=4)])
    for gid, bid in [(5, 1), (0, 0), (7, 1)]:
        assert f.group(gid, bid, [1, 1]) == []
    got = f.group(2, 0, [1, 1])
    assert [mb.group_ids for mb in got] == [(5, 0), (7, 2)]  # completion order, mixing prompt batches
    assert [(mb.batch_id, mb.index) for mb in got] == [(0, 0), (0, 1)]
    for gid, bid in [(1, 0), (3, 0), (4, 1), (6, 1)]:
        f.group(gid, bid, [1, 1])
    assert [mb.group_ids for mb in f.out[2:]] == [(1, 3), (4, 6)]
    assert sorted(i for mb in f.out for i in mb.traj_ids) == list(range(16))


# -- several batches ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["knittrans", "train_batch", "greedy"])
def test_batch_b_runs_all_its_minibatches_before_batch_b_plus_1(name):
    p = make_policy(name, UNIFORM)
    f = Feeder(p, [plan_of(0, [2, 2, 2, 2]), plan_of(1, [2, 2, 2, 2], first_gid=4),
                   plan_of(2, [2, 2, 2, 2], first_gid=8)])
    # batch 2 and 1 complete first; batch 0 last: nothing of 1 or 2 may run before batch 0 is done
    for gid in list(range(8, 12)) + list(range(4, 8)):
        f.group(gid, gid // 4, [2, 2])
        assert f.out == []
    for gid in range(4):
        f.group(gid, 0, [2, 2])
    assert [(mb.batch_id, mb.index) for mb in f.out] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert sorted(i for mb in f.out for i in mb.traj_ids) == list(range(24))


def test_knittrans_streams_the_next_batch_once_the_current_one_finishes():
    p = KnitTransAdmission(UNIFORM)
    f = Feeder(p, [plan_of(0, [2, 2, 2, 2]), plan_of(1, [2, 2, 2, 2], first_gid=4)])
    for gid in (0, 1, 4, 5):
        f.group(gid, gid // 4, [2, 2])
    assert [(mb.batch_id, mb.index) for mb in f.out] == [(0, 0)]
    f.group(2, 0, [2, 2])
    f.group(3, 0, [2, 2])
    # the last group of batch 0 completes: batch 0's second mini-batch, then batch 1's first, at once
    assert [(mb.batch_id, mb.index) for mb in f.out] == [(0, 0), (0, 1), (1, 0)]


def test_clairvoyant_admits_where_the_length_bound_makes_knittrans_wait():
    """With the true token counts in place of the max_response_len bound, a mini-batch is safe earlier."""
    true_tokens = {0: 2 + 1, 1: 1 + 1}  # every response turns out short
    clair = Feeder(make_policy("clairvoyant", BUDGET, oracle_tokens=true_tokens.__getitem__), [plan_of(0, [2, 2])])
    knit = Feeder(KnitTransAdmission(BUDGET), [plan_of(0, [2, 2])])
    assert clair.p.name == "clairvoyant"
    # {t0} leaves 3 trajectories: 3 * 6 = 18 > 12 tokens at the bound, 1 + 1 + 1 = 3 in truth
    assert [mb.traj_ids for mb in clair.complete(0, 0, 2)] == [(0,)]
    assert knit.complete(0, 0, 2) == []
