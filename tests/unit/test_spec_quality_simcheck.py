"""The quality and sim-vs-real claims as pure functions of hand-made rows: each verdict flips when the rows do,
and what the definitions exclude (no gap to narrow; flow-determined settings; calibration runs) stays out."""

from __future__ import annotations

import dataclasses

import pytest

from repro.spec import evaluate
from repro.spec.core import Status
from repro.spec.quality import ARMS, LongQualityRun, QualityRun, ThroughputProbe, matched_budget
from repro.spec.quality_replay import ReplayProbe, ReplayRun
from repro.spec.simcheck import FLOW_DETERMINED_SPREAD, SimCheckRun

SEEDS = range(5)
NOISE = (0.01, -0.02, 0.015, -0.005, 0.0)


def quality_rows(colo=0.50, tb=0.40, kt=0.48, kt_same=0.41, kt_rate=1.1) -> list[QualityRun]:
    base = dict(budget_groups=32, order=0, steps=320, final_acc=0.5, init_acc=0.2, mean_reward=0.3,
                staleness_mean=1.0, staleness_p99=1.0, staleness_max=1.0, staleness_bound=2, clip_frac=0.01,
                wall_s=10.0, steps_per_s=10.0, trainer_busy=0.9)
    auc = {"colocated": colo, "train_batch": tb, "knittrans_same_budget": kt_same, "knittrans_matched": kt}
    stale = {"colocated": 3.5, "train_batch": 7.0, "knittrans_same_budget": 7.0, "knittrans_matched": 1.0}
    rate = {"knittrans_matched": 10.0 * kt_rate}
    return [QualityRun(seed=s, arm=a, **{**base, "auc": auc[a] + NOISE[s] * (1 + i), "staleness_mean": stale[a],
                                        "steps_per_s": rate.get(a, 10.0)})
            for s in SEEDS for i, a in enumerate(ARMS)]


def long_rows(colo=0.50, tb=0.40, kt=0.48, kt_same=0.41, kt_rate=1.1) -> list[LongQualityRun]:
    """The same runs as the long profile (table quality-long, where paper claim 2 is decided) logs them."""
    return [LongQualityRun(**r.as_dict()) for r in quality_rows(colo, tb, kt, kt_same, kt_rate)]


def replay_rows(colo=0.50, tb=0.40, kt=0.48, kt_same=0.41, kt_rate=1.1) -> list[ReplayRun]:
    """The same arms as ``quality_rows``, as the SIMULATED replay table logs them."""
    return [ReplayRun(seed=r.seed, arm=r.arm, budget_groups=r.budget_groups, order=0, steps=r.steps, auc=r.auc,
                      final_acc=r.final_acc, init_acc=r.init_acc, staleness_mean=r.staleness_mean,
                      staleness_max=r.staleness_max, clip_frac=r.clip_frac, mean_reward=r.mean_reward,
                      steps_per_s=r.steps_per_s, lr=0.02)
            for r in quality_rows(colo, tb, kt, kt_same, kt_rate)]


def verdict(table: str, rows, name: str):
    (v,) = [v for v in evaluate(table, rows) if v.claim.name == name]
    return v


R, LONG = "quality-replay", "quality-long"


def test_gap_narrowed_holds_when_knittrans_beats_train_batch_and_fails_when_it_does_not():
    v = verdict(LONG, long_rows(), "quality_gap_narrowed")
    assert v.status is Status.HOLDS and v.measured.n == 5 and v.measured.low > 0
    assert verdict(LONG, long_rows(kt=0.39), "quality_gap_narrowed").status is Status.FAILS
    # a difference whose interval straddles 0 does not hold: the claim is decided on the interval's lower end
    assert verdict(LONG, long_rows(kt=0.402), "quality_gap_narrowed").status is Status.FAILS


def test_claim_2_is_never_decided_from_simulated_rows():
    """Acceptance (b) of issue 26: the replay's rows, however favourable, never give paper claim 2 a verdict, and
    the replay's own version of the definition is a SIMULATED measurement."""
    from repro.spec import claims
    from repro.spec.core import Evidence

    (target,) = [c for c in claims() if c.paper_claim == 2]
    assert target.table == LONG and target.evidence is Evidence.MEASURED
    assert verdict(LONG, replay_rows(), "quality_gap_narrowed").status is Status.NOT_MEASURED
    simulated = verdict(R, replay_rows(), "replay_gap_narrowed")
    assert simulated.status is Status.INFO and simulated.measured.low > 0 and "lr [0.02]" in simulated.measured.note
    assert all(c.evidence is Evidence.SIMULATED and c.kind.value == "measurement" for c in claims(R))


def test_the_default_runtime_rows_carry_the_same_definition_as_a_measurement():
    v = verdict("quality", quality_rows(), "quality_gap_narrowed_runtime")
    assert v.status is Status.INFO and v.measured.value == pytest.approx(
        verdict(LONG, long_rows(), "quality_gap_narrowed").measured.value)
    # the default run's rows never decide the target (its configuration is not the pre-registered one), and the
    # replay rows never feed the runtime's measurement
    assert verdict(LONG, quality_rows(), "quality_gap_narrowed").status is Status.NOT_MEASURED
    assert verdict("quality", replay_rows(), "quality_gap_narrowed_runtime").measured.value is None


def test_no_gap_between_colocated_and_train_batch_means_nothing_to_narrow():
    v = verdict(LONG, long_rows(colo=0.40), "quality_gap_narrowed")
    assert v.status is Status.NOT_MEASURED and "no gap" in v.measured.note
    fresher = verdict("quality", quality_rows(colo=0.40), "quality_matched_vs_train_batch")  # still reported
    assert fresher.status is Status.INFO and fresher.measured.value == pytest.approx(0.08, abs=0.02)
    assert verdict("quality", quality_rows(colo=0.40), "quality_gap_closed").measured.value is None
    assert verdict(R, replay_rows(colo=0.40), "replay_gap_closed").measured.value is None


def test_gap_closed_is_the_fraction_of_the_colocated_gap_and_the_match_is_reported():
    v = verdict("quality", quality_rows(colo=0.50, tb=0.40, kt=0.45), "quality_gap_closed")
    assert v.status is Status.INFO and v.measured.value == pytest.approx(0.5, abs=0.05)
    m = verdict("quality", quality_rows(kt_rate=1.2), "quality_throughput_match")
    assert m.measured.value == pytest.approx(1.2)
    assert "1.20x train-batch" in verdict(LONG, long_rows(kt_rate=1.2), "quality_gap_narrowed").measured.note
    assert "simulated" in verdict(R, replay_rows(kt_rate=1.2), "replay_throughput_match").measured.note
    red = verdict("quality", quality_rows(), "quality_arch_staleness_reduction").measured
    assert red.value == pytest.approx(1 - (1.0 - 3.5) / (7.0 - 3.5))


def test_a_single_seed_gives_no_interval_and_no_verdict():
    rows = [r for r in long_rows() if r.seed == 0]
    assert verdict(LONG, rows, "quality_gap_narrowed").status is Status.NOT_MEASURED


def test_matched_budget_is_the_smallest_candidate_at_train_batch_throughput():
    def probes(rates):  # budget -> per-pass steps/s, train-batch at 10 in every pass
        out = [ThroughputProbe(seed=0, pass_index=k, arm="train_batch", budget_groups=32, steps_per_s=10.0,
                               staleness_mean=7.0) for k in range(3)]
        return out + [ThroughputProbe(seed=0, pass_index=k, arm="knittrans", budget_groups=b, steps_per_s=r,
                                      staleness_mean=1.0) for b, rs in rates.items() for k, r in enumerate(rs)]

    assert matched_budget(probes({4: [8, 9, 12], 8: [10, 11, 9], 16: [12, 12, 12]})) == (8, pytest.approx(1.0))
    assert matched_budget(probes({4: [8, 9, 9], 8: [9, 9.5, 9.6]}))[0] == 8  # none reaches 1: the best one
    with pytest.raises(ValueError):
        matched_budget(probes({})[:3])


def test_replay_probes_match_per_seed_and_a_stalled_budget_never_matches():
    def p(seed, arm, b, rate, stalled=False):
        return ReplayProbe(seed=seed, arm=arm, budget_groups=b, steps_per_s=rate, staleness_mean=1.0,
                           stalled=stalled)
    tb = [p(s, "train_batch", 32, 10.0 + s) for s in range(3)]
    kt = [p(s, "knittrans", 8, 0.0, True) for s in range(3)] + [p(s, "knittrans", 16, 10.0 + s) for s in range(3)]
    assert matched_budget(tb + kt) == (16, pytest.approx(1.0))


# -- sim-vs-real --------------------------------------------------------------------------------------------------

def sim_row(budget, measured, sim, little, role="heldout", spread=1.0, seed=1, waves=1) -> SimCheckRun:
    return SimCheckRun(seed=seed, mode="knittrans", budget=budget, sync="every_step", wave_groups=waves, role=role,
                       measured_mean=measured, measured_p99=measured, sim_mean=sim, sim_p99=sim,
                       little_mean=little, sim_spread=spread, wall_s=1.0, steps_per_s=10.0)


def sim_rows(err=0.1) -> list[SimCheckRun]:
    return [sim_row(b, 2.0, 2.0 * (1 + err), 3.0) for b in (8, 16, 32)] + [sim_row(16, 2.0, 2.0, 2.0, role="calibration")]


def test_sim_heldout_error_holds_within_20_percent_and_fails_beyond():
    v = verdict("sim-vs-real", sim_rows(0.1), "sim_heldout_staleness_error")
    assert v.status is Status.HOLDS and v.measured.value == pytest.approx(0.1) and v.measured.n == 3
    assert verdict("sim-vs-real", sim_rows(0.3), "sim_heldout_staleness_error").status is Status.FAILS
    lit = verdict("sim-vs-real", sim_rows(0.1), "littles_law_heldout_staleness_error").measured
    assert lit.value == pytest.approx(0.5)


def test_flow_determined_settings_and_calibration_runs_stay_out_of_the_verdict():
    exact = [sim_row(b, 1.0, 1.0, 1.0, spread=FLOW_DETERMINED_SPREAD / 2, waves=4) for b in (8, 16, 32, 64, 128)]
    bad_cal = [sim_row(64, 1.0, 9.0, 9.0, role="calibration")]
    rows = sim_rows(0.3) + exact + bad_cal
    v = verdict("sim-vs-real", rows, "sim_heldout_staleness_error")
    assert v.status is Status.FAILS and v.measured.value == pytest.approx(0.3)  # five exact settings do not dilute it
    assert verdict("sim-vs-real", rows, "sim_heldout_error_all_settings").measured.value == pytest.approx(0.0)
    assert verdict("sim-vs-real", rows, "sim_flow_determined_settings").measured.value == 5
    only_flow = exact + sim_rows(0.1)[-1:]
    assert verdict("sim-vs-real", only_flow, "sim_heldout_staleness_error").status is Status.NOT_MEASURED


def test_error_has_a_one_step_floor_so_near_zero_staleness_does_not_blow_up():
    rows = [sim_row(8, 0.01, 0.11, 0.5)]
    assert verdict("sim-vs-real", rows, "sim_heldout_staleness_error").measured.value == pytest.approx(0.1)
    assert dataclasses.replace(rows[0], measured_mean=4.0).measured_mean == 4.0
