"""``python -m repro.reliability`` end to end on a small config: summary.json holds the claims the issue asks for
(lost 0, duplicated 0, faults survived = injected, bad input rejected = tried, load throughput)."""

from __future__ import annotations

import json

from repro.reliability import ReliabilityConf, run


def test_reliability_table_reports_every_claim(tmp_path):
    cfg = ReliabilityConf(out_dir=str(tmp_path / "reliability"), logger="none", load_trajectories=2000,
                          load_minibatch=200, transports=["inprocess"], runtime_faults=False)
    summary = run(cfg)
    on_disk = json.loads((tmp_path / "reliability" / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    claims = {c["name"]: c for c in summary["claims"]}
    assert claims["trajectories_lost"]["measured"] == 0 and claims["trajectories_duplicated"]["measured"] == 0
    assert claims["faults_survived"]["measured"] == claims["faults_survived"]["paper"] > 0
    assert claims["bad_input_rejected"]["measured"] == claims["bad_input_rejected"]["paper"] >= 20
    assert claims["load_throughput_inprocess"]["measured"] > 0 and claims["memory_bounded_inprocess"]["holds"]
    assert all(c["holds"] for c in summary["claims"])
    assert {r["part"] for r in summary["rows"]} == {"fault", "bad_input", "load"}
    assert (tmp_path / "reliability" / "table.md").exists()
