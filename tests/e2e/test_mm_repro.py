"""The two multimodal tables end to end on a tiny config (issue 6): results contract, deterministic bytes and
encoder-patch ratios (timings are reported, never asserted)."""

from __future__ import annotations

import json

from omegaconf import OmegaConf


def test_speedup_table_on_a_tiny_sweep(tmp_path):
    from repro.speedup import SpeedupConfig, _register, run

    _register()
    cfg = SpeedupConfig(ns=[2, 4], images_per_prompt=[1], prompts=4, image_side=56, train_repeats=1,
                        transfer_repeats=1, num_batches=2, model="tiny", out_dir=str(tmp_path / "speedup"),
                        logger="none")
    res = run(cfg)
    summary = res.write(config=OmegaConf.structured(cfg), seed=0)
    assert json.loads((tmp_path / "speedup" / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (tmp_path / "speedup" / "speedup.png").exists()
    rows = {r["n"]: r for r in summary["rows"]}
    for n in (2, 4):
        assert rows[n]["encoder_patch_ratio"] == n
        assert rows[n]["bytes_saved"] > 0
    claims = {c["name"]: c for c in summary["claims"]}
    assert {"mm_transfer_train_speedup", "mm_encoder_patch_ratio"} <= set(claims)
    assert claims["mm_store_live_bytes_after_sweep"]["measured"] == 0  # refcounts back to zero at every point


def test_verl_baseline_moves_every_occurrence_and_the_data_plane_each_distinct_image_once():
    from baselines.centralized import balance_plan
    from baselines.centralized_mm import build_mm_dense_batch
    from knittrans.dataplane import TrajectoryPayload
    from repro.transfer import TransferConfig, mm_workload, unit_nodes, rank_nodes
    from knittrans.mmdedup.plane import build_mm_inprocess
    from workloads.multimodal_data import MMTransferWorkload

    cfg = TransferConfig(workload="multimodal", multimodal=MMTransferWorkload(prompts=4, n=4, images_per_prompt=2,
                                                                                image_side=56),
                         num_minibatches=2, num_batches=1)
    data = mm_workload(cfg).make_pass(0)
    plan = balance_plan(data.minibatches, data.tokens, cfg.num_ranks)
    gathered = [[TrajectoryPayload(p.traj_id, p.tensors) for p in data.payloads]]
    batch = build_mm_dense_batch(gathered, data.prompts, data.prompt_of, data.group_size, plan, data.images,
                                 data.grids)
    chunks = batch.chunk(cfg.num_ranks)
    assert sum(c.pixel_nbytes for c in chunks) == 4 * data.distinct_pixel_nbytes  # n copies through the driver
    for c in chunks:  # every row's images travel with it, in row order
        for mb in c.split(plan.per_minibatch):
            assert mb.pixel_values.shape[0] == int(mb.row_patches.sum())
    dp = build_mm_inprocess(unit_nodes(cfg), rank_nodes(cfg))
    for p in data.payloads:
        dp.client(f"unit{data.producer_of[p.traj_id]}").put([p])
    moved = 0
    for mb in data.minibatches:
        dp.controller.admit(mb)
        moved += sum(dp.client().fetch(mb, rank=r).pixel_nbytes for r in range(cfg.num_ranks))
    assert moved == data.distinct_pixel_nbytes and dp.live_bytes() == 0
