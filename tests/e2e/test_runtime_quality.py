"""repro.quality end to end at toy size: the throughput probes, every arm per seed through the handoff, typed
trial rows logged through the spec, and the results contract."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import torch

from repro.quality import MMQuality, QualityConfig, candidates, run_table
from repro.spec.quality import ARMS, QualityRun, ThroughputProbe
from repro.spec.quality_multimodal import MM_ARMS, MMQualityRun
from repro.trials import read_trials

torch.set_num_threads(1)


def test_quality_table_logs_typed_trials_and_writes_the_results_contract(tmp_path):
    cfg = QualityConfig(seeds=[0, 1], num_batches=2, prompts_per_batch=4, group_size=2, num_minibatches=2,
                        warm_steps=5, eval_every=2, heldout=16, wave_groups=1, match_batches=1, match_passes=1,
                        out_dir=str(tmp_path / "quality"))
    assert candidates(cfg) == [2, 4]
    results = run_table(cfg)
    summary = results.write(config=cfg, seed=0)
    out = tmp_path / "quality"
    for f in ("summary.json", "table.md", "quality_curves.png", "config.yaml", "meta.json", "trials.jsonl"):
        assert (out / f).exists(), f
    log = read_trials(out / "trials.jsonl")
    runs = [r for r in log.rows if isinstance(r, QualityRun)]
    probes = [r for r in log.rows if isinstance(r, ThroughputProbe)]
    assert sorted((r.seed, r.arm) for r in runs) == sorted((s, a) for s in (0, 1) for a in ARMS)
    assert {(p.arm, p.budget_groups) for p in probes} == {("train_batch", 4), ("knittrans", 2), ("knittrans", 4)}
    assert all(r.steps == 4 and 0 <= r.auc <= 1 and r.staleness_max <= r.staleness_bound for r in runs)
    matched = {r.budget_groups for r in runs if r.arm == "knittrans_matched"}
    assert matched == {summary["matched_budget"]["budget_groups"]} and matched <= {2, 4}
    names = {c["name"]: c for c in json.loads((out / "summary.json").read_text())["claims"]}
    assert names["quality_gap_narrowed_runtime"]["kind"] == "measurement" and "quality_throughput_match" in names
    assert names["quality_staleness_colocated"]["measured"] == 0.5  # (M - 1) / 2, from the handoff's records
    with gzip.open(out / "traces" / "knittrans_matched-seed1.csv.gz", "rt") as f:
        trace = list(csv.DictReader(f))
    assert len(trace) == 2 * 4 * 2 and all(int(r["v_train"]) >= int(r["v_gen"]) >= 0 for r in trace)


def test_multimodal_quality_run_logs_rows_without_verdicts_and_the_encoder_once_per_image(tmp_path):
    out = tmp_path / "quality-multimodal"
    mm = MMQuality(seeds=[0], num_batches=2, prompts_per_batch=4, group_size=4, num_minibatches=2,
                   warm_max_steps=2, eval_every=2, heldout=8, wave_groups=1, out_dir=str(out))
    results = run_table(QualityConfig(workload="multimodal", mm=mm, out_dir=str(tmp_path / "unused")))
    results.write(config=mm, seed=0)
    for f in ("summary.json", "table.md", "quality_curves.png", "trials.jsonl"):
        assert (out / f).exists(), f
    runs = read_trials(out / "trials.jsonl").rows
    assert all(isinstance(r, MMQualityRun) for r in runs)
    assert sorted(r.arm for r in runs) == sorted(MM_ARMS) and {r.seed for r in runs} == {0}
    budgets = {r.arm: r.budget_groups for r in runs}
    assert budgets == {"colocated": 0, "train_batch": 4, "knittrans": 4}  # two mini-batches of 2 groups
    for r in runs:
        assert r.steps == 4 and 0 <= r.auc <= 1 and 0 <= r.sampled_auc <= 1 and r.staleness_max <= r.staleness_bound
        # every sample's image counted, the encoder over each share's distinct images: n = 4 times fewer
        assert r.occurrence_patches == 2 * 4 * 4 * 36 and r.occurrence_patches >= 4 * r.encoder_patches > 0
    claims = json.loads((out / "summary.json").read_text())["claims"]
    assert claims and all(c["table"] == "quality-multimodal" and c["status"] == "info" for c in claims)
    colo = next(c for c in claims if c["name"] == "mmquality_staleness_colocated")
    assert colo["measured"] == 0.5  # (M - 1) / 2


def test_a_batch_smaller_than_its_mini_batch_count_is_refused_not_looped_forever():
    import pytest

    with pytest.raises(ValueError, match="positive multiple of num_minibatches=16"):
        candidates(QualityConfig(prompts_per_batch=8, num_minibatches=16))


def test_the_long_profile_writes_its_own_table_whose_target_decides_paper_claim_2(tmp_path):
    """``table="quality-long"`` (``python -m repro.quality_long``) runs the same runtime into the long profile's rows;
    the pre-registered config composes with the deciding size."""
    from hydra import compose, initialize_config_dir

    from repro.spec.quality import LongQualityRun

    cfg = QualityConfig(table="quality-long", seeds=[0, 1], num_batches=2, prompts_per_batch=4, group_size=2,
                        num_minibatches=2, warm_steps=5, eval_every=2, heldout=16, wave_groups=1, knittrans_budget=2,
                        out_dir=str(tmp_path / "quality-long"))
    summary = run_table(cfg).write(config=cfg, seed=0)
    rows = read_trials(tmp_path / "quality-long" / "trials.jsonl").rows
    assert rows and all(isinstance(r, LongQualityRun) for r in rows)
    names = {c["name"]: c for c in summary["claims"]}
    assert names["quality_gap_narrowed"]["kind"] == "target" and names["quality_gap_narrowed"]["paper_claim"] == 2
    conf = str(Path(__file__).resolve().parents[2] / "repro" / "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        long = compose(config_name="quality_long")
    assert (long.table, list(long.seeds), long.num_batches * long.num_minibatches) == ("quality-long", list(range(8)),
                                                                                      480)
