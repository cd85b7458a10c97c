"""The spec framework: verdicts come from logged rows alone, flip when the rows do, and measurements never count."""

from __future__ import annotations

import dataclasses
import json

import pytest

from repro.spec import claims, evaluate_dir, tables
from repro.spec.core import (Bound, Claim, ClaimKind, Status, Trial, median_range, paired_mean_ci, row_from_dict,
                             trial)
from repro.trials import read_trials, write_trials


@trial("spec-selftest")
@dataclasses.dataclass(frozen=True)
class SelfTestTrial(Trial):
    ratio: float
    arm: str = "a"


TARGET = Claim("selftest_ratio", "spec-selftest", ClaimKind.TARGET, ">= 2", "x", "a ratio in [0, inf)",
               lambda rows: median_range([r.ratio for r in rows]), bound=Bound(">=", 2.0))
INFO = Claim("selftest_info", "spec-selftest", ClaimKind.MEASUREMENT, "(ours)", "x", "context",
             lambda rows: median_range([r.ratio for r in rows]))


def rows(*ratios: float) -> list[SelfTestTrial]:
    return [SelfTestTrial(seed=i, ratio=r) for i, r in enumerate(ratios)]


def test_target_verdict_is_decided_on_the_median_and_flips_with_the_rows():
    assert TARGET.evaluate(rows(2.2, 2.5, 3.0)).status is Status.HOLDS
    assert TARGET.evaluate(rows(1.0, 1.5, 1.8)).status is Status.FAILS


def test_a_target_whose_repeats_straddle_its_bound_is_unstable_never_holds():
    """Item 2 of issue 26: the passes disagree about the bound, so the verdict would flip with the run."""
    for ratios in ((1.0, 2.5, 3.0), (1.0, 1.5, 3.0)):  # median holding or failing: neither is reported
        v = TARGET.evaluate(rows(*ratios))
        assert v.status is Status.UNSTABLE and v.as_dict()["holds"] is None
    # the gate decides on the value alone (its bounds carry their own margins)
    gated = dataclasses.replace(TARGET, gate=Bound(">=", 2.0))
    assert gated.evaluate(rows(1.0, 2.5, 3.0), gate=True).status is Status.HOLDS
    # an interval's end or a worst case is not a median of repeats: not judged so
    worst = dataclasses.replace(TARGET, measure=lambda rs: dataclasses.replace(
        median_range([r.ratio for r in rs]), repeats=False))
    assert worst.evaluate(rows(1.0, 2.5, 3.0)).status is Status.HOLDS


def test_a_paper_claim_is_decided_by_one_measured_target():
    from repro.spec.core import PAPER_CLAIMS, Evidence

    with pytest.raises(ValueError, match="MEASURED target only"):
        dataclasses.replace(TARGET, paper_claim=2, evidence=Evidence.SIMULATED)
    with pytest.raises(ValueError, match="MEASURED target only"):
        dataclasses.replace(INFO, paper_claim=2)
    decided = {c.paper_claim: c for c in claims() if c.paper_claim is not None}
    assert sorted(decided) == sorted(PAPER_CLAIMS)  # each of the four, exactly once (claims() checks duplicates)
    assert all(c.evidence is Evidence.MEASURED and c.kind is ClaimKind.TARGET for c in decided.values())


def test_measurement_carries_no_verdict_and_a_target_without_rows_is_not_measured():
    assert INFO.evaluate(rows(9.0)).status is Status.INFO
    assert INFO.evaluate(rows(9.0)).as_dict()["holds"] is None
    assert TARGET.evaluate([]).status is Status.NOT_MEASURED


def test_a_target_needs_a_bound_and_a_measurement_may_not_have_one():
    with pytest.raises(ValueError, match="pre-registered bound"):
        Claim("x", "t", ClaimKind.TARGET, "", "", "", lambda r: median_range([]))
    with pytest.raises(ValueError, match="carries no verdict"):
        Claim("x", "t", ClaimKind.MEASUREMENT, "", "", "", lambda r: median_range([]), bound=Bound(">=", 1))


def test_trial_log_round_trips_rows_and_records_the_run(tmp_path):
    p = write_trials(tmp_path, "spec-selftest", rows(1.0, 2.0), config={"passes": 3})
    log = read_trials(p)
    assert log.rows == rows(1.0, 2.0)
    assert log.run["config"] == {"passes": 3} and log.run["seeds"] == [0, 1] and "git_sha" in log.run
    assert "cpu_count" in log.run


def test_rows_of_another_table_or_fields_the_spec_does_not_know_are_rejected(tmp_path):
    @trial("spec-other")
    @dataclasses.dataclass(frozen=True)
    class OtherTrial(Trial):
        pass

    with pytest.raises(ValueError, match="rows of other tables"):
        write_trials(tmp_path, "spec-selftest", [OtherTrial(seed=0)])
    with pytest.raises(ValueError, match=r"logged fields \['bogus'\]"):
        row_from_dict("SelfTestTrial", {"seed": 0, "ratio": 1.0, "bogus": 1})
    p = tmp_path / "trials.jsonl"
    p.write_text(json.dumps({"kind": "trial", "type": "SelfTestTrial", "row": {"seed": 0, "ratio": 1}}) + "\n")
    with pytest.raises(ValueError, match="no run header"):
        read_trials(p)


def test_paired_interval_uses_the_sample_std():
    m = paired_mean_ci([0.1, 0.2, 0.3])
    assert m.value == pytest.approx(0.2) and m.low < 0.2 < m.high and m.n == 3
    assert m.high - m.value == pytest.approx(4.303 * 0.1 / 3 ** 0.5, rel=1e-3)  # t(0.975, 2) * s / sqrt(n)


def test_every_spec_claim_is_defined_and_unique_and_every_table_is_evaluated(tmp_path):
    cs = claims()
    assert all(c.definition and c.unit is not None for c in cs)
    assert all((c.bound is not None) == (c.kind is ClaimKind.TARGET) for c in cs)
    v = evaluate_dir(tmp_path)  # an empty results folder: every claim listed, none measured
    assert set(v) == set(tables())
    assert all(x.status in (Status.NOT_MEASURED, Status.INFO) for vs in v.values() for x in vs)
