"""The two multimodal tables end to end on a tiny config (issue 6): results contract, trial rows, deterministic
bytes and encoder-patch ratios (timings are reported, never asserted)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.ray


def test_speedup_table_on_a_tiny_sweep_logs_rows_and_exact_patch_ratios(tmp_path):
    from repro.speedup import SpeedupConfig, run
    from repro.spec.speedup import SpeedupTrial
    from repro.trials import read_trials

    cfg = SpeedupConfig(group_sizes=[2, 4], images_per_prompt=[1], prompts_per_batch=4, image_side=56,
                        train_repeats=1, passes=2, model="tiny", out_dir=str(tmp_path / "speedup"), logger="none")
    res = run(cfg)
    summary = res.write(config=OmegaConf.structured(cfg), seed=0)
    assert json.loads((tmp_path / "speedup" / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (tmp_path / "speedup" / "speedup.png").exists()
    log = read_trials(tmp_path / "speedup" / "trials.jsonl")
    assert len(log.rows) == 2 * 2 and all(isinstance(r, SpeedupTrial) for r in log.rows)
    for r in log.rows:  # counted by a hook on the vision tower, on the share the handoff delivered
        assert r.baseline_patches == r.group_size * r.knittrans_patches
        assert r.baseline_bytes > r.knittrans_bytes
    claims = {c["name"]: c for c in summary["claims"]}
    assert claims["mm_encoder_patch_ratio"]["status"] == "holds" and claims["mm_encoder_patch_ratio"]["measured"] == 1
    assert claims["mm_transfer_train_speedup"]["status"] in ("holds", "fails")  # a verdict, decided by the spec
    assert claims["mm_transfer_train_speedup"]["note"].startswith("n=4, 1 image(s)")  # the pre-registered point


def test_verl_baseline_moves_every_occurrence_and_the_handoff_each_distinct_image_once():
    """The same batch through the centralized driver's build and through the in-process multimodal handoff."""
    from baselines.centralized import balance_plan
    from baselines.centralized_mm import build_mm_dense_batch
    from knittrans.bench import BenchLayout, KnitTransSystem
    from knittrans.handoff import Transport
    from workloads.multimodal_data import MMTransferWorkload
    from workloads.transfer_data import MMPasses

    src = MMPasses(MMTransferWorkload(prompts_per_batch=4, group_size=4, images_per_prompt=2, image_side=56),
                   num_minibatches=2, num_producers=2)
    data = src.make(0)
    plan = balance_plan(data.minibatches, data.tokens, 2)
    batch = build_mm_dense_batch([data.payloads()], data.prompts, data.prompt_of, data.group_size, plan, data.images,
                                 data.grids)
    chunks = batch.chunk(2)
    assert sum(c.pixel_nbytes for c in chunks) == 4 * data.distinct_pixel_nbytes  # n copies through the driver
    for c in chunks:  # every row's images travel with it, in row order
        for mb in c.split(plan.per_minibatch):
            assert mb.pixel_values.shape[0] == int(mb.row_patches.sum())
    for dedup, copies in ((True, 1), (False, 4)):  # the plane's switch: each distinct image once, or every copy
        kt = KnitTransSystem("knittrans-inproc", BenchLayout(), Transport.INPROCESS, multimodal=True, dedup=dedup)
        try:
            res = kt.run_raw(src.make(1))
        finally:
            kt.close()
        assert res.pixel_nbytes == copies * data.distinct_pixel_nbytes and res.live_bytes_after == 0
