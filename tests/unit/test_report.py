"""The report and the README's results table come from trial logs through the spec, and count only targets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import repro.spec as spec
from repro.report import README_BEGIN, README_END, main, results_table, update_readme, write_report
from repro.spec.core import Bound, Claim, ClaimKind, Trial, median_range, trial
from repro.trials import write_trials

ROOT = Path(__file__).resolve().parents[2]


@trial("report-demo")
@dataclasses.dataclass(frozen=True)
class ReportTrial(Trial):
    ratio: float


CLAIMS = [
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


def test_report_counts_only_target_claims_and_lists_tables_not_run(tmp_path, demo_spec):
    write_trials(tmp_path / "report-demo", "report-demo", [ReportTrial(0, 12.0), ReportTrial(1, 8.0),
                                                           ReportTrial(2, 30.0)])
    text = write_report(tmp_path).read_text()
    assert "1 of 2 target claims hold (1 measured, 1 not measured)" in text
    assert "| report-demo | `demo_target` | ~100 | >= 10 | 12 [8, 30] x | 3 | holds |" in text
    assert "| report-missing | `never_run` | 0.93 | >= 0.9 | not measured fraction |  | not measured |" in text
    assert "context \\| with a pipe" in text  # a pipe in a definition cannot break the table
    info = [line for line in text.splitlines() if "`demo_info`" in line]
    assert info and all("holds" not in line for line in info)  # a measurement never carries a verdict


def test_the_verdict_follows_the_logged_rows(tmp_path, demo_spec):
    write_trials(tmp_path / "report-demo", "report-demo", [ReportTrial(0, 9.0), ReportTrial(1, 11.0),
                                                           ReportTrial(2, 9.5)])
    assert "| 9.5 [9, 11] x | 3 | **does not hold** |" in write_report(tmp_path).read_text()


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
