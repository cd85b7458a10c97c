"""Bad input is rejected loudly, naming the field and the value, and rejecting it loses nothing."""

from __future__ import annotations

import pytest

from baselines.admission import make_policy
from knittrans.admission import AdmissionError
from knittrans.admission.feasibility import check_plan
from knittrans.constraints import BatchConstraints, ConstraintError
from knittrans.types import BatchPlan, GroupSpec, Trajectory


def plan_of(batch_id: int, sizes: list[int], first_gid: int = 0) -> BatchPlan:
    return BatchPlan(batch_id, tuple(GroupSpec(first_gid + i, batch_id, s) for i, s in enumerate(sizes)))


# -- messages ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [0, -3])
def test_empty_or_negative_length_trajectory_is_rejected_naming_num_tokens(tokens):
    with pytest.raises(ValueError, match=rf"Trajectory\.num_tokens must be >= 1.*got {tokens}"):
        Trajectory(traj_id=1, group_id=0, batch_id=0, num_tokens=tokens, v_gen=0)


@pytest.mark.parametrize("field,value", [("traj_id", -1), ("group_id", -2), ("batch_id", -1), ("v_gen", -1),
                                         ("prompt_tokens", -5)])
def test_negative_ids_and_counts_are_rejected_naming_the_field(field, value):
    kw = dict(traj_id=1, group_id=0, batch_id=0, num_tokens=3, v_gen=0)
    kw[field] = value
    with pytest.raises(ValueError, match=rf"Trajectory\.{field} must be >= 0, got {value}"):
        Trajectory(**kw)


def test_bool_where_a_count_belongs_is_rejected():
    with pytest.raises(ValueError, match=r"Trajectory\.num_tokens must be an int, got bool"):
        Trajectory(traj_id=1, group_id=0, batch_id=0, num_tokens=True, v_gen=0)
    with pytest.raises(ValueError, match=r"GroupSpec\.size must be an int, got bool"):
        GroupSpec(0, 0, True)
    with pytest.raises(ConstraintError, match=r"group_size must be an int >= 1 or None, got True"):
        BatchConstraints(batch_size=4, num_minibatches=2, max_response_len=8, group_size=True)
    with pytest.raises(ConstraintError, match=r"token_budget must be an int or None, got True"):
        BatchConstraints(batch_size=4, num_minibatches=2, max_response_len=1, token_budget=True)


def test_zero_size_group_and_empty_or_inconsistent_plans_are_rejected():
    with pytest.raises(ValueError, match=r"GroupSpec\.size must be >= 1, got 0"):
        GroupSpec(0, 0, 0)
    with pytest.raises(ValueError, match=r"BatchPlan 3 has no groups"):
        BatchPlan(3, ())
    with pytest.raises(ValueError, match=r"group 0 declares batch_id 1 but is in BatchPlan 0"):
        BatchPlan(0, (GroupSpec(0, 1, 2),))
    with pytest.raises(ValueError, match=r"duplicate group_id 4"):
        BatchPlan(0, (GroupSpec(4, 0, 2), GroupSpec(4, 0, 2)))


def test_minibatch_size_not_dividing_the_batch_is_rejected_naming_both_fields():
    with pytest.raises(ConstraintError, match=r"batch_size=10 is not a multiple of num_minibatches=4"):
        BatchConstraints(batch_size=10, num_minibatches=4, max_response_len=8)
    # with slack the sizes may differ, so the same numbers are fine
    BatchConstraints(batch_size=10, num_minibatches=4, max_response_len=8, size_slack=1)


def test_token_budget_below_the_longest_allowed_trajectory_is_rejected():
    with pytest.raises(ConstraintError, match=r"token_budget=99 is below the longest allowed trajectory "
                                              r"\(max_response_len=100\)"):
        BatchConstraints(batch_size=4, num_minibatches=2, max_response_len=100, token_budget=99, size_slack=1)


@pytest.mark.parametrize("kwargs,pattern", [
    # nonpositive counts
    (dict(batch_size=0, num_minibatches=1, max_response_len=4), r"batch_size must be an int >= 1, got 0"),
    (dict(batch_size=4, num_minibatches=0, max_response_len=4), r"num_minibatches must be an int >= 1, got 0"),
    (dict(batch_size=4, num_minibatches=1, max_response_len=0), r"max_response_len must be an int >= 1, got 0"),
    (dict(batch_size=4, num_minibatches=1, max_response_len=4, dp_size=0), r"dp_size must be an int >= 1, got 0"),
    (dict(batch_size=4, num_minibatches=1, max_response_len=4, size_slack=-1), r"size_slack must be an int >= 0"),
    # the exact mini-batch size is not a multiple of the group size (whole groups)
    (dict(batch_size=12, num_minibatches=2, max_response_len=4, group_size=4),
     r"unsatisfiable constraint set: no mini-batch size in \[6, 6\] is a multiple of dp_size=1 and of group_size=4"),
    # ... or of the data-parallel size
    (dict(batch_size=12, num_minibatches=2, max_response_len=4, dp_size=4),
     r"unsatisfiable constraint set: no mini-batch size in \[6, 6\] is a multiple of dp_size=4"),
    # the smallest allowed mini-batch of long responses does not fit the budget
    (dict(batch_size=8, num_minibatches=2, max_response_len=10, token_budget=39),
     r"token_budget=39 cannot hold the smallest allowed mini-batch \(4 trajectories\) at max_response_len=10"),
    # the smallest fits, but M mini-batches that fit the budget cannot hold the batch (was accepted: bug 1)
    (dict(batch_size=12, num_minibatches=2, max_response_len=10, size_slack=2, token_budget=50, whole_groups=False),
     r"token_budget=50 holds at most 5 trajectories at max_response_len=10, so num_minibatches=2 mini-batches "
     r"cannot hold batch_size=12"),
    # allowed sizes step by 4 but the batch is not a multiple of 4 (was accepted: bug 1)
    (dict(batch_size=10, num_minibatches=2, max_response_len=5, dp_size=4, size_slack=3, whole_groups=False),
     r"batch_size=10 is not a multiple of 4, the step of the allowed mini-batch sizes \[4, 8\] \(dp_size=4\)"),
    (dict(batch_size=14, num_minibatches=2, max_response_len=5, group_size=2, dp_size=4, size_slack=3),
     r"batch_size=14 is not a multiple of 4.*group_size=2"),
])
def test_unsatisfiable_constraint_sets_are_rejected_naming_the_field(kwargs, pattern):
    with pytest.raises(ConstraintError, match=pattern):
        BatchConstraints(**kwargs)


def test_accepted_constraint_sets_have_a_robust_split_of_the_nominal_batch():
    """What the constructor accepts, a batch of B max-length responses can be split (closed-form check)."""
    for bs in range(1, 25):
        for m in range(1, 5):
            for slack in range(3):
                for dp in (1, 2, 3):
                    for budget in (None, 10, 25, 40):
                        try:
                            c = BatchConstraints(batch_size=bs, num_minibatches=m, max_response_len=5,
                                                 whole_groups=False, size_slack=slack, token_budget=budget,
                                                 dp_size=dp)
                        except ConstraintError:
                            continue
                        fit = c.robust_sizes()
                        # a multiset of m sizes from `fit` summing to bs exists (dynamic programming)
                        reach = {0}
                        for _ in range(m):
                            reach = {r + s for r in reach for s in fit if r + s <= bs}
                        assert bs in reach, c


# -- check_plan -----------------------------------------------------------------------------------------------


def test_group_size_mismatch_is_rejected_by_check_plan():
    c = BatchConstraints(batch_size=8, num_minibatches=2, max_response_len=4, group_size=4)
    with pytest.raises(ConstraintError, match=r"group 1 has size 3 but group_size=4"):
        c.check_plan(plan_of(0, [4, 3, 1]))


def test_group_larger_than_any_minibatch_is_rejected_by_check_plan():
    c = BatchConstraints(batch_size=8, num_minibatches=2, max_response_len=4)
    with pytest.raises(ConstraintError, match=r"group 0 of size 5 is larger than the largest allowed mini-batch "
                                              r"\(4\) but whole_groups=True"):
        c.check_plan(plan_of(0, [5, 3]))
    BatchConstraints(batch_size=8, num_minibatches=2, max_response_len=4, whole_groups=False).check_plan(
        plan_of(0, [5, 3]))


def test_plan_total_not_matching_an_exact_batch_size_is_rejected():
    c = BatchConstraints(batch_size=8, num_minibatches=2, max_response_len=4)
    with pytest.raises(ConstraintError, match=r"batch 0 holds 6 trajectories but batch_size=8"):
        c.check_plan(plan_of(0, [2, 2, 2]))


def test_plan_whose_whole_groups_cannot_be_split_is_rejected():
    """Sizes fit and the total is right, yet no split into whole groups exists (was accepted: bug 1)."""
    c = BatchConstraints(batch_size=12, num_minibatches=2, max_response_len=4)
    with pytest.raises(ConstraintError, match=r"groups \(sizes \[2, 5, 5\]\) cannot be split whole into "
                                              r"num_minibatches=2"):
        check_plan(c, plan_of(0, [5, 5, 2]))
    check_plan(c, plan_of(0, [5, 1, 4, 2]))
    one = BatchConstraints(batch_size=2, num_minibatches=2, max_response_len=1, size_slack=1)
    with pytest.raises(ConstraintError, match=r"cannot be split whole"):
        check_plan(one, plan_of(0, [2]))


def test_plan_that_only_short_responses_could_split_is_rejected():
    """With every response at max_response_len no mini-batch of 4 fits the budget: no promise is possible."""
    c = BatchConstraints(batch_size=6, num_minibatches=2, max_response_len=10, size_slack=1, token_budget=30)
    assert c.robust_sizes() == [2, 3]
    with pytest.raises(ConstraintError, match=r"cannot be split whole"):
        check_plan(c, plan_of(0, [2, 2, 2]))
    check_plan(c, plan_of(0, [1, 2, 1, 2]))


# -- the ledger: bad trajectories are rejected and nothing is lost --------------------------------------------


ALL = ["knittrans", "train_batch", "greedy", "bounded_async"]


def uniform_policy(name):
    c = BatchConstraints(batch_size=8, num_minibatches=2, max_response_len=16, group_size=2)
    p = make_policy(name, c)
    p.add_batch(plan_of(0, [2, 2, 2, 2]))
    return p


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad,pattern", [
    (Trajectory(90, group_id=7, batch_id=0, num_tokens=3, v_gen=0), r"trajectory 90: group 7 is unknown to batch 0"),
    (Trajectory(91, group_id=0, batch_id=5, num_tokens=3, v_gen=0), r"trajectory 91: batch 5 is unknown"),
    (Trajectory(0, group_id=1, batch_id=0, num_tokens=3, v_gen=0), r"duplicate trajectory id 0"),
    (Trajectory(92, group_id=0, batch_id=0, num_tokens=3, v_gen=0),
     r"trajectory 92: group 0 already has its declared 2 trajectories \(a group larger than declared\)"),
    (Trajectory(93, group_id=1, batch_id=0, num_tokens=17, v_gen=0),
     r"trajectory 93: num_tokens=17 exceeds max_response_len=16"),
    ("not a trajectory", r"expected a Trajectory, got str"),
])
def test_nothing_already_admitted_is_lost_when_a_bad_trajectory_arrives(name, bad, pattern):
    p = uniform_policy(name)
    good = [Trajectory(i, group_id=i // 2, batch_id=0, num_tokens=1 + i, v_gen=0) for i in range(8)]
    out = []
    for t in good[:3]:  # group 0 complete (admissible by streaming policies), group 1 half done
        p.on_complete(t)
        out += p.on_trainer_ready(0.0)
    with pytest.raises(AdmissionError, match=pattern):
        p.on_complete(bad)
    for t in good[3:]:
        p.on_complete(t)
        out += p.on_trainer_ready(0.0)
    while more := p.on_trainer_ready(0.0):
        out += more
    consumed = [i for mb in out for i in mb.traj_ids]
    assert sorted(consumed) == list(range(8)), "a good trajectory was lost or consumed twice"
    assert len(out) == 2 and all(mb.violations == () for mb in out)


def test_batches_must_be_added_in_order_and_group_ids_stay_unique():
    c = BatchConstraints(batch_size=4, num_minibatches=2, max_response_len=4, group_size=2)
    p = make_policy("knittrans", c)
    p.add_batch(plan_of(1, [2, 2]))
    with pytest.raises(AdmissionError, match=r"batch 1 was already added"):
        p.add_batch(plan_of(1, [2, 2], first_gid=10))
    with pytest.raises(AdmissionError, match=r"batch 0 added after batch 1"):
        p.add_batch(plan_of(0, [2, 2], first_gid=10))
    with pytest.raises(AdmissionError, match=r"group 1 of batch 2 already belongs to batch 1"):
        p.add_batch(plan_of(2, [2, 2], first_gid=1))
    with pytest.raises(ConstraintError, match=r"group 20 has size 1 but group_size=2"):
        p.add_batch(plan_of(2, [1, 3], first_gid=20))
    p.add_batch(plan_of(2, [2, 2], first_gid=20))  # the rejected plans left no trace


def test_make_policy_names_the_unknown_policy():
    c = BatchConstraints(batch_size=4, num_minibatches=2, max_response_len=4, group_size=2)
    with pytest.raises(ValueError, match=r"unknown admission policy 'fifo'"):
        make_policy("fifo", c)
    with pytest.raises(ValueError, match=r"clairvoyant policy needs oracle_tokens"):
        make_policy("clairvoyant", c)
    with pytest.raises(ConstraintError, match=r"BoundedAsyncAdmission needs uniform groups"):
        make_policy("bounded_async", BatchConstraints(batch_size=4, num_minibatches=2, max_response_len=4))
