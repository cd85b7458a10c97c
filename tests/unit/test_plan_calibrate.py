"""The planner calibrated from recorded runtime runs (``knittrans-plan --calibrate``): it predicts held-out real
runs within the sim-vs-real bound, by the same procedure as the sim-vs-real table, and its sweep runs the
calibrated simulator's own config."""

from __future__ import annotations

import pytest

from baselines.admission import make_policy
from knittrans.plan import PlanConfig, PlanInputError, plan
from knittrans.plan.calibrated import load_runs, split
from knittrans.plan.sweep import Setting, setting_config
from knittrans.sim.calibrate import fit_time_model, sim_config
from knittrans.sim.trace import RunTrace, save_traces
from repro.simcheck import GATE_TRACES, gate_trials
from repro.spec.simcheck import CLAIMS

FACTORIES = {k: (lambda c, k=k: make_policy(k, c)) for k in ("knittrans", "train_batch", "greedy", "bounded_async")}
BOUND = next(c.bound for c in CLAIMS if c.name == "sim_heldout_staleness_error")


@pytest.fixture(scope="module")
def calibrated():
    return plan(PlanConfig(calibrate=(str(GATE_TRACES),), num_batches=6, workers=1,
                           policies=("knittrans", "train_batch")), FACTORIES, progress=False)


def test_calibrating_from_recorded_runs_predicts_the_held_out_runs_within_the_sim_vs_real_bound(calibrated):
    v = calibrated.validation
    assert len(v.heldout) == sum(r.role == "heldout" for r in load_runs([str(GATE_TRACES)])) == 14
    summary = v.heldout_summary(timing_sensitive=True)
    assert summary is not None and summary.settings >= 5  # the verdict rests on timing-sensitive settings
    assert BOUND.holds(summary.median), (summary, BOUND)


def test_the_planners_held_out_predictions_are_the_sim_vs_real_tables(calibrated):
    """Same fit, same lengths, same replay: every held-out run's predicted mean staleness and timing spread equal
    the sim-vs-real gate's rows for it (so the planner's error is the table's, not a second implementation)."""
    rows = {(r.mode, r.budget, r.sync, r.wave_groups, r.seed): r for r in gate_trials() if r.role == "heldout"}
    for h in calibrated.validation.heldout:
        mode, b, sync, w = h.setting.split("/")
        r = rows[(mode, int(b[1:]), sync, int(w[1:]), h.seed)]
        assert (h.predicted_mean, h.measured_mean, h.spread) == (r.sim_mean, r.measured_mean, r.sim_spread)


def test_a_calibrated_setting_runs_the_calibrated_simulators_config(calibrated):
    """At a setting a user ran, the planner's simulator config is ``calibrate.sim_config`` of that run's config on
    the fitted model: what ``calibrate.predict`` simulates."""
    cal, _ = split(load_runs([str(GATE_TRACES)]))
    tm, _, _ = fit_time_model(cal)
    scn = calibrated.scenario
    same = [r.config for r in cal if r.config.system == "knittrans"
            and r.config.wave_groups == scn.disaggregated.engine.wave_groups]  # the plan's engine: the first run's
    assert same
    for c in same:
        assert setting_config(scn, Setting("knittrans", c.budget / c.prompts_per_batch)) == sim_config(c, tm), c


def test_a_single_run_has_no_held_out_error_and_the_plan_says_so(tmp_path):
    one = load_runs([str(GATE_TRACES)])[0]
    path = save_traces(tmp_path / "one.jsonl.gz", [RunTrace(**{**one.__dict__, "role": ""})])
    p = plan(PlanConfig(calibrate=(str(path),), num_batches=4, warmup_batches=1, workers=1,
                        policies=("knittrans",)), FACTORIES, progress=False)
    assert p.validation.heldout == () and "none: one run" in p.validation.heldout_method
    assert p.recommendation is not None


def test_without_roles_every_run_is_predicted_from_the_others(tmp_path):
    runs = [r for r in load_runs([str(GATE_TRACES)]) if r.config.seed == 0][:3]
    path = save_traces(tmp_path / "three.jsonl.gz", [RunTrace(**{**r.__dict__, "role": ""}) for r in runs])
    p = plan(PlanConfig(calibrate=(str(path),), num_batches=4, warmup_batches=1, workers=1,
                        policies=("knittrans",)), FACTORIES, progress=False)
    assert len(p.validation.heldout) == 3 and "leave one run out" in p.validation.heldout_method


def test_a_fitted_input_cannot_also_be_given_and_a_bad_trace_is_named(tmp_path):
    with pytest.raises(PlanInputError, match="measured by the trace") as e:
        plan(PlanConfig(calibrate=(str(GATE_TRACES),), engines=4), FACTORIES, progress=False)
    assert e.value.argument == "engines"
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(PlanInputError, match="not a gzip'd run-trace file") as e:
        plan(PlanConfig(calibrate=(str(tmp_path / "bad.jsonl.gz"),)), FACTORIES, progress=False)
    assert e.value.argument == "calibrate"
