"""The simulator against queueing theory (``knittrans.sim.theory``): Little's law in the fully asynchronous
group-queue setting (pre-queue staleness ``C * M_tail / (B * max(1, rho))``) and under a binding in-flight budget
(mean staleness ``G * n / (B/M) - [release at step end]``), within 10%."""

import pytest

from baselines.admission import make_policy
from knittrans.constraints import BatchConstraints
from knittrans.sim import BudgetRelease
from knittrans.sim.theory import budget_check, group_queue_check
from workloads.text import LengthDist, TextWorkloadConfig, generate_batches, small

GQ = TextWorkloadConfig(name="theory", prompts_per_batch=16, group_size=8, num_minibatches=1, prompt_len=0,
                        lengths=LengthDist(median=400, sigma=0.8, max_len=4000, min_len=8))


@pytest.mark.parametrize("rho", [0.3, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0])
def test_pre_queue_staleness_matches_littles_law(rho):
    c = BatchConstraints(batch_size=GQ.batch_size, num_minibatches=1, max_response_len=4000, group_size=8)
    chk = group_queue_check(make_policy("bounded_async", c), generate_batches(GQ, 60, seed=1), rho)
    assert chk.rel_error <= 0.10, (rho, chk)


@pytest.mark.parametrize("release", list(BudgetRelease))
@pytest.mark.parametrize("budget_groups", [4, 6, 16])
def test_mean_staleness_under_a_binding_budget_matches_littles_law(release, budget_groups):
    wl = small()
    c = BatchConstraints(batch_size=wl.batch_size, num_minibatches=wl.num_minibatches, group_size=wl.group_size,
                         max_response_len=wl.lengths.max_len)
    chk = budget_check(make_policy("knittrans", c), generate_batches(wl, 10, seed=2), budget_groups, release)
    assert chk.rel_error <= 0.10, (release, budget_groups, chk)


def test_budget_check_needs_uniform_groups():
    wl = small()
    c = BatchConstraints(batch_size=wl.batch_size, num_minibatches=wl.num_minibatches, max_response_len=2048)
    with pytest.raises(ValueError, match="uniform"):
        budget_check(make_policy("knittrans", c), generate_batches(wl, 2, seed=0), 4, BudgetRelease.STEP_END)
