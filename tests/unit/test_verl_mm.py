"""The faithful verl multimodal baseline's DataProto (baselines/verl_mm.py), without Ray: each sample carries its own
processor outputs, a pickled batch carries every occurrence's pixels (pickle's memo cannot fold them: they are
distinct tensors), and balancing, chunking and splitting keep every row's images with it."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from baselines.centralized import balance_plan
from baselines.verl_mm import MM_KEY, VerlProto, concat_pixels, rollout_output
from workloads.multimodal_data import MMTransferWorkload
from workloads.transfer_data import MMPasses


def _data(placement="spread"):
    src = MMPasses(MMTransferWorkload(prompts_per_batch=4, group_size=4, images_per_prompt=2, image_side=56,
                                      placement=placement), num_minibatches=2, num_producers=2)
    return src.make(0)


def _outputs(d):
    lp = max(int(p.shape[0]) for p in d.prompts)
    lr = max(int(r.tensors["old_logprobs"].shape[0]) for r in d.rollouts)
    by: dict[int, list[int]] = {}
    for r in d.rollouts:
        by.setdefault(d.producer_of[r.traj.traj_id], []).append(r.traj.traj_id)
    return [rollout_output(d, ts, lp, lr) for _, ts in sorted(by.items())]


def test_every_sample_carries_its_own_pixel_tensors_and_pickling_ships_each_occurrence():
    d = _data()
    outs = _outputs(d)
    assert len(outs) == 2  # spread: each group's samples on both engines
    ptrs = [m["pixel_values"].data_ptr() for o in outs for m in o.non_tensor_batch[MM_KEY]]
    assert len(set(ptrs)) == len(ptrs) == len(d.rollouts)  # per-sample processor outputs: no shared storage
    assert sum(o.pixel_nbytes for o in outs) == d.occurrence_pixel_nbytes
    for o in outs:
        raw = pickle.dumps(o)
        assert len(raw) >= o.pixel_nbytes  # every occurrence in the message, none folded by pickle's memo
        back = pickle.loads(raw)
        assert back.batch.keys() == o.batch.keys() and all(torch.equal(back.batch[k], o.batch[k]) for k in o.batch)
        for a, b in zip(back.non_tensor_batch[MM_KEY], o.non_tensor_batch[MM_KEY]):
            assert torch.equal(a["pixel_values"], b["pixel_values"])
            assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])


def test_balanced_chunks_keep_every_rows_images_and_cover_each_row_once():
    d = _data()
    batch = VerlProto.concat(_outputs(d))
    plan = balance_plan(d.minibatches, d.tokens, 2)
    row = {int(t): i for i, t in enumerate(batch.non_tensor_batch["traj_id"])}
    order = np.array([row[t] for rows in plan.rows_per_rank for t in rows])
    balanced = batch.select(order)
    seen = []
    by_id = {r.traj.traj_id: r for r in d.rollouts}
    for chunk in balanced.chunk(2):
        for mb in chunk.split(plan.per_minibatch):
            pixels, grids = concat_pixels(mb)
            ids = [int(t) for t in mb.non_tensor_batch["traj_id"]]
            want = torch.cat([torch.as_tensor(x) for t in ids for x in by_id[t].images])
            assert torch.equal(pixels, want)  # each row's images, in row order
            assert grids.tolist() == [list(g) for t in ids for g in by_id[t].grids]
            seen += ids
    assert sorted(seen) == sorted(by_id)
    assert balanced.pixel_nbytes == d.occurrence_pixel_nbytes  # one copy per occurrence per dispatch


def test_the_verl_speedup_uses_the_baselines_step_and_is_not_measured_without_verl_rows():
    from repro.spec.speedup import CLAIMS, SpeedupTrial

    base = dict(seed=0, group_size=8, images_per_prompt=1, pass_index=0, num_minibatches=2, baseline_transfer_s=0.5,
                knittrans_transfer_s=0.1, baseline_step_s=1.0, knittrans_step_s=0.5, baseline_patches=8,
                knittrans_patches=1, baseline_bytes=8, knittrans_bytes=1)
    claim = next(c for c in CLAIMS if c.name == "mm_transfer_train_speedup_verl")
    with_verl = SpeedupTrial(**base, verl_transfer_s=1.9)
    assert with_verl.speedup_verl == (1.9 + 2 * 1.0) / (0.1 + 2 * 0.5)
    assert claim.measure([with_verl]).value == with_verl.speedup_verl
    assert claim.measure([SpeedupTrial(**base)]).value is None  # verl-mm not run: not measured, never a verdict
