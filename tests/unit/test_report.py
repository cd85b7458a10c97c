"""The report and the README's results table come from trial logs through the spec: the paper's claims first (one
verdict each), our goals, the MODELLED and SIMULATED claims and the measurements apart, each counted apart."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import repro.spec as spec
from repro.report import README_BEGIN, README_END, main, results_table, update_readme, write_report
from repro.spec.core import PAPER_CLAIMS, Bound, Claim, ClaimKind, Evidence, Trial, median_range, trial
from repro.trials import write_trials

ROOT = Path(__file__).resolve().parents[2]


@trial("report-demo")
@dataclasses.dataclass(frozen=True)
class ReportTrial(Trial):
    ratio: float


CLAIMS = [
    Claim("demo_paper", "report-demo", ClaimKind.TARGET, "~100", "x", "baseline / ours, raw",
          lambda rows: median_range([r.ratio for r in rows]), bound=Bound(">=", 5.0), paper_claim=3),
    Claim("demo_modelled", "report-demo", ClaimKind.TARGET, "~100", "x", "projected",
          lambda rows: median_range([r.ratio * 10 for r in rows]), bound=Bound(">=", 50.0),
          evidence=Evidence.MODELLED),
    Claim("demo_target", "report-demo", ClaimKind.TARGET, "~100", "x", "baseline / ours, same transport",
          lambda rows: median_range([r.ratio for r in rows]), bound=Bound(">=", 10.0)),
    Claim("demo_info", "report-demo", ClaimKind.MEASUREMENT, "(ours)", "x", "context | with a pipe",
          lambda rows: median_range([r.ratio for r in rows])),
    Claim("never_run", "report-missing", ClaimKind.TARGET, "0.93", "fraction", "a table nobody ran",
          lambda rows: median_range([]), bound=Bound(">=", 0.9)),
]


@pytest.fixture
def demo_spec(monkeypatch):
    monkeypatch.setattr(spec, "claims", lambda table=None: [c for c in CLAIMS if table in (None, c.table)])


def test_report_counts_each_part_apart_and_lists_tables_not_run(tmp_path, demo_spec):
    write_trials(tmp_path / "report-demo", "report-demo", [ReportTrial(0, 12.0), ReportTrial(1, 11.0),
                                                           ReportTrial(2, 30.0)])
    text = write_report(tmp_path).read_text()
    assert ("Paper claims, measured on CPU: 1 of 1 reproduced. Our own goals: 1 of 2 hold (1 not measured). "
            "MODELLED and SIMULATED targets, counted apart: 1 of 1 hold.") in text
    assert f"| 3 | {PAPER_CLAIMS[3]} | report-demo | `demo_paper` (x) | ~100 | >= 5 | 12 [11, 30] | 3 | reproduced |" \
        in text
    assert "| report-demo | `demo_target` | ~100 | >= 10 | 12 [11, 30] x | 3 | holds |" in text
    assert "| report-demo | `demo_modelled` (MODELLED) | ~100 | >= 50 | 120 [110, 300] x | 3 | holds |" in text
    assert "| report-missing | `never_run` | 0.93 | >= 0.9 | not measured fraction |  | not measured |" in text
    assert "context \\| with a pipe" in text  # a pipe in a definition cannot break the table
    info = [line for line in text.splitlines() if "`demo_info`" in line]
    assert info and all("holds" not in line for line in info)  # a measurement never carries a verdict


def test_the_verdict_follows_the_logged_rows(tmp_path, demo_spec):
    write_trials(tmp_path / "report-demo", "report-demo", [ReportTrial(0, 9.0), ReportTrial(1, 9.8),
                                                           ReportTrial(2, 9.5)])
    text = write_report(tmp_path).read_text()
    assert "| 9.5 [9, 9.8] x | 3 | **does not hold** |" in text
    write_trials(tmp_path / "report-demo", "report-demo", [ReportTrial(0, 9.0), ReportTrial(1, 11.0),
                                                           ReportTrial(2, 9.5)])
    text = write_report(tmp_path).read_text()
    assert "| 9.5 [9, 11] x | 3 | unstable |" in text  # the passes straddle 10: never "holds"
    assert "Our own goals: 0 of 2 hold (1 unstable, 1 not measured)" in text


def test_report_without_results_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="make repro"):
        write_report(tmp_path / "nothing")


def test_readme_block_is_regenerated_from_the_logs(tmp_path, demo_spec, capsys):
    write_trials(tmp_path / "r" / "report-demo", "report-demo", [ReportTrial(0, 12.0)])
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_BEGIN}\nhand-typed 92.4\n{README_END}\noutro\n")
    main(["--readme", str(readme), "--results", str(tmp_path / "r")])
    text = readme.read_text()
    assert "hand-typed" not in text and "| `demo_target` |" in text and text.endswith("outro\n")
    assert not update_readme(readme, tmp_path / "r")  # idempotent
    assert "updated" in capsys.readouterr().out


def test_the_readme_results_table_is_the_spec_over_the_committed_trial_logs():
    """README figures are generated, never typed: its block must equal the spec's table over docs/results/ (the
    trial logs of the last full `make repro`, copied there by `python -m repro.report --snapshot docs/results`)."""
    from repro.spec import evaluate_dir

    text = (ROOT / "README.md").read_text()
    assert README_BEGIN in text and README_END in text, "README.md lost its generated results block"
    block = text.split(README_BEGIN, 1)[1].split(README_END, 1)[0]
    from repro.report import repro_times

    snap = ROOT / "docs" / "results"
    assert block == "\n" + results_table(evaluate_dir(snap), repro_times(snap)), (
        "README results are stale: run `python -m repro.report --readme README.md --results docs/results`")


def test_the_readmes_first_results_table_lists_exactly_the_four_paper_claims():
    """Acceptance of issue 26: one row per paper claim, each with one verdict and its metric."""
    text = (ROOT / "README.md").read_text()
    block = text.split(README_BEGIN, 1)[1].split(README_END, 1)[0]
    first = block.split("\n\n| ", 1)[1].split("\n\n", 1)[0].splitlines()[2:]  # after the header and rule
    assert [line.split(" | ")[0].lstrip("| ") for line in first] == [str(k) for k in sorted(PAPER_CLAIMS)]
    decided = {c.paper_claim: c.name for c in spec.claims() if c.paper_claim is not None}
    for k, line in zip(sorted(PAPER_CLAIMS), first):
        assert f"`{decided[k]}`" in line
        assert any(w in line for w in ("| reproduced |", "| **not reproduced** |", "| unstable |",
                                       "| not measured |"))


def test_the_run_time_comes_from_make_repros_log_and_travels_with_the_snapshot(tmp_path, demo_spec):
    """The README's `make repro` time is generated from the run's repro-times.tsv (copied by --snapshot), never
    typed; a run that did not finish says so."""
    from repro.report import repro_times, snapshot

    run = tmp_path / "results"
    write_trials(run / "report-demo", "report-demo", [ReportTrial(0, 12.0)])
    assert repro_times(run) is None
    (run / "repro-times.tsv").write_text("table\tseconds\nstaleness\t137\ntransfer:workload=text\t172\n")
    assert "did not finish" in repro_times(run)
    (run / "repro-times.tsv").write_text("table\tseconds\nstaleness\t137\ntransfer:workload=text\t172\ntotal\t309\n")
    line = repro_times(run)
    assert line.startswith("`make repro` took 309 s = 5.2 min for its 2 tables") and "transfer text 172" in line
    snapshot(run, tmp_path / "docs")
    readme = tmp_path / "README.md"
    readme.write_text(f"{README_BEGIN}\n{README_END}\n")
    update_readme(readme, tmp_path / "docs")
    assert line in readme.read_text()
    (run / "repro-times.tsv").unlink()  # a later run without times: the snapshot drops the older run's line
    snapshot(run, tmp_path / "docs")
    update_readme(readme, tmp_path / "docs")
    assert "`make repro` took" not in readme.read_text()
