"""Sweep points (``knittrans.sim.sweep``): the time-scaling rule and one point's metrics."""

import pytest

from baselines.admission import make_policy
from knittrans.sim import BudgetRelease, SyncPolicy
from knittrans.sim.sweep import COLOCATED, PointSpec, SystemModel, measure
from workloads.text import generate_batches, small

REF = SystemModel()


def test_the_reference_shape_is_the_reference_system():
    engine, trainer = REF.scaled(REF.reference_batch_size, REF.reference_num_minibatches, 16)
    assert (engine.num_engines, engine.slots) == (REF.num_engines, REF.slots)
    assert (trainer.step_overhead, trainer.per_token) == (REF.step_overhead, REF.per_token)


@pytest.mark.parametrize("prompts, n, M", [(64, 16, 16), (64, 4, 1), (64, 8, 32), (32, 8, 4), (512, 16, 16)])
def test_time_scaling_keeps_the_reference_rollout_trainer_ratio(prompts, n, M):
    """The old sweep scaled the engines with the batch but not the trainer (ratio 0.13 instead of 1.1: a trainer
    idle 90% of the time). Every scaled point must keep the reference's ratio (to rounding of the slot count)."""
    ref = REF.rollout_trainer_ratio(REF.reference_batch_size, REF.reference_num_minibatches, mean_len=4500.0)
    assert ref == pytest.approx(1.097, abs=0.01)
    got = REF.rollout_trainer_ratio(prompts * n, M, mean_len=4500.0, group_size=n)
    assert got == pytest.approx(ref, rel=0.02)


def test_point_spec_rejects_unknown_policies_and_coerces_enum_values():
    kw = dict(prompts_per_batch=16, group_size=4, num_minibatches=4, batch_size=64, budget=1.0,
              system=REF, warmup_batches=1)
    with pytest.raises(ValueError):
        PointSpec(policy="fifo", sync="every_step", release="step_end", **kw)
    with pytest.raises(ValueError, match="budget"):
        PointSpec(policy="knittrans", sync="every_step", release="step_end", **{**kw, "budget": 0.0})
    s = PointSpec(policy=COLOCATED, sync="every_batch", release="step_start", **kw)
    assert s.sync is SyncPolicy.EVERY_BATCH and s.release is BudgetRelease.STEP_START


def test_a_point_reports_its_steady_state_or_why_it_did_not_run():
    wl = small()
    kw = dict(prompts_per_batch=16, group_size=4, num_minibatches=4, batch_size=64, sync=SyncPolicy.EVERY_STEP,
              release=BudgetRelease.STEP_END, system=REF, warmup_batches=1)
    batches = generate_batches(wl, 4, seed=0)
    ok = measure(PointSpec(policy="knittrans", budget=1.0, **kw), make_policy("knittrans", _c(wl)), batches,
                 keep_hist=True)
    assert ok.ok and ok.metrics is not None and sum(ok.metrics.hist) > 0
    assert ok.metrics.violations == 0 and 0.0 <= ok.metrics.trainer_idle <= 1.0
    small_budget = measure(PointSpec(policy="knittrans", budget=0.1, **kw), make_policy("knittrans", _c(wl)), batches)
    assert not small_budget.ok and "below one mini-batch" in small_budget.note
    stalled = measure(PointSpec(policy="train_batch", budget=0.5, **kw), make_policy("train_batch", _c(wl)), batches)
    assert not stalled.ok and stalled.stalled and "never consumed" in stalled.note


def _c(wl):
    from knittrans.constraints import BatchConstraints

    return BatchConstraints(batch_size=wl.batch_size, num_minibatches=wl.num_minibatches, group_size=wl.group_size,
                            max_response_len=wl.lengths.max_len)
