"""The sim-vs-real gate (``repro.gates`` over ``repro.simcheck.gate_trials``: the calibrated simulator over recorded
real runs) holds on this code and fails when the simulator or its calibration regresses (product code)."""

import dataclasses

from knittrans.sim import calibrate
from knittrans.sim.simulator import Simulator
from knittrans.types import ExecutionMode
from repro.gates import evaluate_gate, run_gate
from repro.simcheck import GATE_TRACES, gate_trials
from repro.spec.core import Status


def _verdict():
    (v,) = evaluate_gate("sim-vs-real", gate_trials())
    return v


def test_the_sim_vs_real_gate_holds_on_the_recorded_runs():
    out = run_gate("sim-vs-real")
    assert not out.skipped and [v.claim.name for v in out.verdicts] == ["sim_heldout_staleness_error"]
    (v,) = out.verdicts
    assert v.status is Status.HOLDS, out.lines()
    assert v.measured.n >= 8  # timing-sensitive held-out settings behind the median


def test_the_gate_replays_recorded_runs_from_both_roles():
    from knittrans.sim.trace import load_traces

    traces = load_traces(GATE_TRACES)
    roles = {t.role for t in traces}
    assert roles == {"calibration", "heldout"}
    assert {t.config.mode for t in traces} == {ExecutionMode.DISAGGREGATED}
    assert all(len(t.trajectories) == t.config.num_batches * t.config.prompts_per_batch * t.config.group_size
               for t in traces)


def test_a_simulator_that_ignores_the_inflight_budget_fails_the_gate(monkeypatch):
    original = Simulator._flow_allows
    monkeypatch.setattr(Simulator, "_flow_allows", lambda self, size, batch_idx: True
                        if self.cfg.mode is ExecutionMode.DISAGGREGATED else original(self, size, batch_idx))
    v = _verdict()
    assert v.status is Status.FAILS, v.measured


def test_a_calibration_that_drops_interference_fails_the_gate(monkeypatch):
    # the fit forgets that rollout and training slow each other down on shared hardware
    fit = calibrate.fit_time_model

    def no_interference(runs):
        tm, r2_wave, r2_step = fit(runs)
        return dataclasses.replace(tm, engine_interference=0.0, trainer_interference=0.0), r2_wave, r2_step

    monkeypatch.setattr(calibrate, "fit_time_model", no_interference)
    v = _verdict()
    assert v.status is Status.FAILS, v.measured
