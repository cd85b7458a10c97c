"""repro.quality end to end at toy size: the results contract (summary.json, table.md, plot, config, meta) and
the claims it must report."""

from __future__ import annotations

import csv
import gzip
import json

import numpy as np
import pytest
import torch

from repro.quality import QualityConfig, bootstrap_ci, gap_closed, run_table

torch.set_num_threads(1)


def test_gap_closed_is_one_when_knittrans_matches_colocated_and_zero_when_it_matches_train_batch():
    assert gap_closed(0.4, 0.3, 0.4) == pytest.approx(1.0) and gap_closed(0.4, 0.3, 0.3) == pytest.approx(0.0)
    assert gap_closed(0.4, 0.3, 0.35) == pytest.approx(0.5)
    assert np.isnan(gap_closed(0.4, 0.4, 0.3))  # no gap to close: reported as NaN, not a division by zero


def test_quality_table_writes_the_results_contract(tmp_path):
    cfg = QualityConfig(seeds=[0, 1], num_batches=3, prompts_per_batch=8, group_size=4, num_minibatches=2,
                        warm_steps=5, eval_every=2, heldout=32, bootstrap=50, wave_groups=2,
                        out_dir=str(tmp_path / "quality"))
    results = run_table(cfg)
    summary = results.write(config=cfg, seed=0)
    names = {c["name"] for c in summary["claims"]}
    assert {"quality_gap_closed", "architectural_staleness_reduction", "throughput_matched",
            "staleness_mean_knittrans", "wallclock_colocated"} <= names
    out = tmp_path / "quality"
    for f in ("summary.json", "table.md", "quality_curves.png", "quality_staleness.png", "config.yaml", "meta.json"):
        assert (out / f).exists(), f
    assert json.loads((out / "summary.json").read_text())["table"] == "quality"
    with gzip.open(out / "traces" / "knittrans-seed1.csv.gz", "rt") as f:
        trace = list(csv.DictReader(f))
    assert len(trace) == 3 * 8 * 4 and all(int(r["v_train"]) >= int(r["v_gen"]) >= 0 for r in trace)
    runs = [r for r in summary["rows"] if r["seed"] != "mean"]
    assert len(runs) == 6 and all(r["staleness_max"] <= r["staleness_bound"] for r in runs)
    assert {r["mode"] for r in summary["calibration"]} == {"colocated", "train_batch", "knittrans"}
    assert all(r["decode_s_per_token"] > 0 and r["train_s_per_token"] > 0 for r in summary["calibration"])
    lo, hi = bootstrap_ci({m: np.array([r["auc_acc"] for r in runs if r["mode"] == m])
                           for m in ("colocated", "train_batch", "knittrans")}, 50)
    assert lo <= hi or (lo != lo)  # an interval, or NaN when the two baselines tie on every resample
