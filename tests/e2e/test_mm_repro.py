"""The two multimodal tables end to end on a tiny config (issue 6): results contract, deterministic bytes and
encoder-patch ratios (timings are reported, never asserted)."""

from __future__ import annotations

import json

from omegaconf import OmegaConf


def test_speedup_table_on_a_tiny_sweep(tmp_path):
    from repro.speedup import SpeedupConfig, _register, run

    _register()
    cfg = SpeedupConfig(ns=[2, 4], images_per_prompt=[1], prompts=4, image_side=56, train_repeats=1,
                        transfer_repeats=1, out_dir=str(tmp_path / "speedup"), logger="none")
    res = run(cfg)
    summary = res.write(config=OmegaConf.structured(cfg), seed=0)
    assert json.loads((tmp_path / "speedup" / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (tmp_path / "speedup" / "speedup.png").exists()
    rows = {r["n"]: r for r in summary["rows"]}
    for n in (2, 4):
        assert rows[n]["encoder_patch_ratio"] == n
        assert rows[n]["bytes_saved"] > 0
    names = {c["name"] for c in summary["claims"]}
    assert {"mm_transfer_train_speedup", "mm_encoder_patch_ratio"} <= names


def test_multimodal_transfer_moves_distinct_bytes_once(tmp_path):
    from knittrans.mmdedup.transfer_mm import MMPlan, baseline_pass, knittrans_pass
    from workloads.multimodal import MMWorkloadConfig, MultimodalWorkload

    wl = MultimodalWorkload(MMWorkloadConfig(prompts_per_batch=4, n=4, images_per_prompt=2,
                                             image_sizes=((56, 56), (56, 84))))
    groups = wl.sample_batch(0)
    plan = MMPlan.make(groups, 2, 2)
    distinct = sum(im.nbytes for g in groups for im in g.images)
    kt = knittrans_pass(groups, plan, 2, None)  # raises if the store leaked after consumption
    base = baseline_pass(groups, plan, 2, None)
    assert kt.pixel_bytes_moved == distinct
    assert base.pixel_bytes_moved == 4 * distinct
