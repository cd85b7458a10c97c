"""The combined report renders from existing results alone (fixture results, nothing rerun)."""

import shutil
from pathlib import Path

import pytest

from repro.report import main, write_report

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "results"


def test_report_renders_every_claim_with_paper_ours_and_verdict(tmp_path):
    res = tmp_path / "results"
    shutil.copytree(FIXTURES, res)
    text = write_report(res).read_text()
    assert "| staleness | `arch_staleness_reduction` | 0.93 | 0.95 fraction | HOLDS |" in text
    assert "| staleness | `throughput_ratio` | >= 1 | 0.8 x | DOES NOT HOLD |" in text
    assert "`hash_kernel_fraction_of_hbm` | 0.7 | not measured |" in text and "NOT MEASURED" in text
    assert "fixture \\| with a pipe" in text  # a pipe in a note cannot break the table
    assert "![staleness/frontier.png](staleness/frontier.png)" in text
    assert "| quality | `quality_gap_closed` | | | MISSING (table not run) |" in text
    assert "git 0123456789" in text


def test_report_without_results_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="make repro"):
        write_report(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="make repro"):
        write_report(tmp_path / "empty")


def test_report_rejects_a_malformed_summary(tmp_path):
    bad = tmp_path / "results" / "x"
    bad.mkdir(parents=True)
    (bad / "summary.json").write_text("{not json")
    with pytest.raises(ValueError, match="summary.json"):
        write_report(tmp_path / "results")


def test_report_cli(tmp_path, capsys):
    res = tmp_path / "results"
    shutil.copytree(FIXTURES, res)
    main(["--results", str(res)])
    assert "REPORT.md" in capsys.readouterr().out
