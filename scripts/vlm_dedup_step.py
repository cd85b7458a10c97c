"""Time one MMGRPOLearner step on the same MMShare with dedup on and off (K interleaved passes, median [min, max]),
and count the vision tower's patches with a forward hook. The speedup is the median over passes of the paired
per-pass ratio (baseline / dedup), with [min, max]. Prints a table, then one JSON line.

    PYTHONPATH=. python scripts/vlm_dedup_step.py [--side 84] [--groups 4] [--group-size 8] [--passes 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch

from knittrans.handoff import Handoff, HandoffConfig
from knittrans.runtime.engine import SamplingConfig
from knittrans.runtime.trainer import group_advantages
from knittrans.runtime.vlm_learner import MMGRPOLearner, mm_rollout
from knittrans.types import BatchPlan, GroupSpec
from workloads.mm_task import MMCountingTask, MMTaskConfig
from workloads.vlm import TinyVLMConfig, build_tiny_vlm, vision_tower
from workloads.vlm_session import VLMSetup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", type=int, default=84)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--passes", type=int, default=5)
    a = ap.parse_args()
    task = MMCountingTask(MMTaskConfig(image_sizes=((a.side, a.side),)))
    setup = VLMSetup(build_tiny_vlm(TinyVLMConfig(), task.vocab, seed=0), task, seed=0)
    prompts = task.batch(0, 0, a.groups)
    reqs = [p.request(g, 0, tuple(range(g * a.group_size, (g + 1) * a.group_size))) for g, p in enumerate(prompts)]
    out = setup.engine().generate(reqs, SamplingConfig(max_new_tokens=3), seed=0)
    h = Handoff(HandoffConfig.grpo(a.groups, a.group_size, 1, 3, multimodal=True))
    h.add_batch(BatchPlan(0, tuple(GroupSpec(g, 0, a.group_size) for g in range(a.groups))))
    h.seal()
    rollouts = []
    for g, p in enumerate(prompts):
        group = [s for s in out if s.group_id == g]
        rewards = [float(i % 2) for i in range(len(group))]  # mixed rewards: nonzero advantages
        rollouts += [mm_rollout(it, p.images, p.grids) for it in group_advantages(group, rewards)]
    h.put(rollouts)
    (share,) = h.consumer().take(1)
    learners = {d: MMGRPOLearner(copy.deepcopy(setup.model), setup.grpo, task.tokens, dedup=d) for d in (True, False)}
    patches: dict[bool, list[int]] = {True: [], False: []}
    for d, lr in learners.items():
        vision_tower(lr.model).register_forward_hook(lambda m, args, o, d=d: patches[d].append(int(args[0].shape[0])))
    times: dict[bool, list[float]] = {True: [], False: []}
    torch.manual_seed(0)
    for k in range(a.passes + 1):  # pass 0 warms up; the systems alternate within each pass
        for d in ((True, False) if k % 2 == 0 else (False, True)):
            learners[d].version = share.seq
            r = learners[d].step(share)
            if k:
                times[d].append(r.step_s)
    med = {d: statistics.median(t) for d, t in times.items()}
    ratios = [b / d for b, d in zip(times[False], times[True])]  # paired within a pass
    row = {"side": a.side, "patches_per_image": int(share.images.pixels[0].shape[0]), "groups": a.groups,
           "group_size": a.group_size, "passes": a.passes,
           "step_s_dedup": med[True], "step_s_dedup_range": [min(times[True]), max(times[True])],
           "step_s_baseline": med[False], "step_s_baseline_range": [min(times[False]), max(times[False])],
           "step_speedup": statistics.median(ratios), "step_speedup_range": [min(ratios), max(ratios)],
           "encoder_patches_per_step_dedup": patches[True][0], "encoder_patches_per_step_baseline": patches[False][0],
           "encoder_patch_ratio": patches[False][0] / patches[True][0]}
    print(f"side {a.side} ({row['patches_per_image']} patches/image), {a.groups} groups x n={a.group_size}: "
          f"step dedup {med[True]:.3f}s [{min(times[True]):.3f}, {max(times[True]):.3f}], baseline "
          f"{med[False]:.3f}s [{min(times[False]):.3f}, {max(times[False]):.3f}], speedup (per-pass ratio) "
          f"{row['step_speedup']:.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]; "
          f"encoder patches {patches[True][0]} vs {patches[False][0]} ({row['encoder_patch_ratio']:.1f}x)")
    h.close()
    print(json.dumps(row))


if __name__ == "__main__":
    main()
