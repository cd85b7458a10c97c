"""The frontier comparison (``knittrans.staleness``): Pareto front, interpolated matching, the uncapped reduction and
the trainer-bound point."""

import math

import numpy as np
import pytest

from knittrans.staleness import (OperatingPoint, arch_reduction, frontier_staleness, matched_reductions,
                                 pareto_front, trainer_bound)

P = OperatingPoint


def test_pareto_front_drops_dominated_and_non_finite_points():
    pts = [P(1.0, 5.0), P(2.0, 4.0), P(1.5, 6.0), P(3.0, 8.0), P(math.nan, 0.0), P(2.0, 4.0)]
    assert [(p.throughput, p.arch_staleness) for p in pareto_front(pts)] == [(2.0, 4.0), (3.0, 8.0)]


def test_matched_staleness_is_continuous_in_the_target_throughput():
    """The reviewer's step function: with a coarse budget grid, 'the best point at >= throughput' jumps from one
    budget's A to the next as the target crosses a grid point. Interpolated, it moves continuously."""
    kt = [P(1.0, -2.0), P(2.0, 2.0), P(3.0, 10.0)]
    xs = np.linspace(0.5, 3.0, 251)
    a = np.array([frontier_staleness(kt, x) for x in xs])
    assert np.all(np.diff(a) >= -1e-12)  # more throughput never costs less staleness
    assert np.max(np.abs(np.diff(a))) < 0.1  # no jumps: 251 targets, slopes 4 and 8 per traj/s
    assert frontier_staleness(kt, 1.5) == pytest.approx(0.0)


def test_matching_never_uses_a_slower_point_beyond_the_tie_tolerance():
    kt = [P(1.0, 0.0), P(2.0, 4.0)]
    assert frontier_staleness(kt, 2.0 * 1.005) == 4.0  # within 1%: the same trainer-bound rate
    assert frontier_staleness(kt, 2.0 * 1.02) is None


@pytest.mark.parametrize("a_kt, a_tb, want", [(-5.0, 1.0, 6.0), (0.0, 1.0, 1.0), (100.0, 1.0, -99.0),
                                              (0.5, 1.0, 0.5), (-0.75, 7.5, 1.1)])
def test_the_reduction_is_never_clamped(a_kt, a_tb, want):
    # below the colocated reference reads above 1, staler than train-batch below 0: shown as measured
    assert arch_reduction(a_kt, a_tb) == pytest.approx(want)


def test_the_reduction_has_no_value_where_train_batch_has_under_a_step_to_reduce():
    # the ratio 1 - A_kt/A_tb explodes as A_tb -> 0 (-12.7 with in-flight requests aborted): not a reduction
    assert arch_reduction(0.3, 0.02) is None and arch_reduction(0.3, -1.0) is None


def test_every_train_batch_pareto_point_gets_a_match_and_the_fastest_is_the_trainer_bound_one():
    tb = [P(1.0, 7.5, budget=1.0), P(1.2, 11.0, budget=1.5), P(1.1, 12.0, budget=2.0), P(2.0, 20.0, budget=3.0)]
    kt = [P(0.8, -4.0), P(1.3, 0.5), P(1.9, 8.0)]
    ms = matched_reductions(kt, tb)
    assert [m.train_batch.budget for m in ms] == [1.0, 1.5, 3.0]  # budget 2.0 is dominated by 1.5
    assert ms[-1].arch_knittrans is None and ms[-1].reduction is None  # KnitTrans never that fast: no match
    assert ms[0].reduction > 1.0  # KnitTrans below the colocated reference there: uncapped
    assert trainer_bound(ms) is ms[-1] and trainer_bound([]) is None
