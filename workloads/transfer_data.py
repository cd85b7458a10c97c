"""The transfer tables' workloads as ``knittrans.bench.PassData``: one seeded batch shape, fresh ids per pass.

- ``TextPasses``: ``workloads.text_data`` (DAPO-like long-tailed responses): P prompts x n responses of
  ``input_ids``, ``old_logprobs``, ``advantages``, ``loss_mask``.
- ``MMPasses``: ``workloads.multimodal`` GRPO groups whose prompts show images (``pixel_values`` and
  ``grid_thw``); the n samples of a group share their prompt's image tensors (what a producer holds once).

``make(uid, slot)`` is a batch with id ``uid``, trajectory ids offset by ``uid * B`` and group ids by ``uid * P``
(data is consumed exactly once) and content chosen by ``slot`` (``knittrans.bench.interleaved_passes``: every
system moves the same content at the same position of its pass); the producer (rollout engine) of a text group g is
``g % num_producers``, of a multimodal sample the workload's ``placement`` decides (``multimodal_data.producer_of``:
spread over the least-loaded engines by default, as verl's agent loop places them).

    >>> tp = TextPasses(TextDataConfig(num_prompts=4, group_size=2, response_len_median=8, max_response_len=32),
    ...                 num_minibatches=2, num_producers=2)
    >>> d = tp.make(3)
    >>> d.batch_id, d.rollouts[0].traj.traj_id, d.minibatches[1].group_ids, d.plan.num_trajectories
    (3, 24, (14, 15), 8)
"""

from __future__ import annotations

import numpy as np

from knittrans.bench.types import PassData
from knittrans.handoff import Rollout
from knittrans.types import BatchPlan, GroupSpec, MiniBatch, Trajectory
from workloads.multimodal_data import (MMTransferWorkload, Placement, producer_of, prompt_len, trajectory_fields,
                                      workload_config)
from workloads.text_data import TextDataConfig, make_text_batch


def _minibatches(p: int, groups: list[list[int]], per: int, tokens: dict[int, int], P: int) -> tuple[MiniBatch, ...]:
    """Train-batch admission's split: M mini-batches of ``per`` whole groups, in group order."""
    out = []
    for k in range(len(groups) // per):
        gs = range(k * per, (k + 1) * per)
        ids = tuple(t for g in gs for t in groups[g])
        out.append(MiniBatch(p, k, ids, tuple(p * P + g for g in gs), sum(tokens[t] for t in ids)))
    return tuple(out)


class TextPasses:
    """Text trajectories (``workloads.text_data``), one seeded batch re-issued under fresh ids per pass."""

    def __init__(self, config: TextDataConfig, num_minibatches: int, num_producers: int) -> None:
        if config.num_prompts % num_minibatches:
            raise ValueError(f"{config.num_prompts} prompts do not split into {num_minibatches} mini-batches of "
                             f"whole groups")
        self.config, self.num_minibatches, self.num_producers = config, num_minibatches, num_producers
        self.base = make_text_batch(config)

    def make(self, p: int, slot: int = 0) -> PassData:
        """Batch ``p`` (fresh ids); text has one content for every slot."""
        c, base = self.config, self.base
        P, n = c.num_prompts, c.group_size
        off = p * P * n
        rollouts, producer, prompt_of, groups = [], {}, {}, [[] for _ in range(P)]
        for t in base.trajectories:
            tid = t.traj_id + off
            rollouts.append(Rollout(Trajectory(tid, p * P + t.group_id, p, t.response_len, v_gen=0,
                                               prompt_tokens=t.prompt_len), t.payload().tensors))
            producer[tid], prompt_of[tid] = t.group_id % self.num_producers, t.group_id
            groups[t.group_id].append(tid)
        tokens = {r.traj.traj_id: int(r.tensors["input_ids"].shape[0]) for r in rollouts}
        plan = BatchPlan(p, tuple(GroupSpec(p * P + g, p, n, int(pr.shape[0])) for g, pr in enumerate(base.prompts)))
        return PassData(p, plan, tuple(rollouts), producer, _minibatches(p, groups, P // self.num_minibatches,
                                                                          tokens, P),
                        base.prompts, prompt_of, n, c.max_response_len)

    def describe(self) -> str:
        c, lens = self.config, np.array([t.response_len for t in self.base.trajectories])
        return (f"text: {c.num_prompts} prompts x {c.group_size} = {len(lens)} trajectories, response length median "
                f"{np.median(lens):.0f} / mean {lens.mean():.0f} / max {lens.max()} tokens, "
                f"{self.base.nbytes / 1e6:.1f} MB of fields")


class MMPasses:
    """Multimodal GRPO groups (``workloads.multimodal``): ``pool`` distinct seeded batches (so consecutive batches
    of a pass show different images); slot s uses batch ``s mod pool``. ``vlm``: the policy the tokens and patches
    are built for (a ``workloads.vlm.TinyVLMConfig``; default the unit-test model)."""

    def __init__(self, shape: MMTransferWorkload, num_minibatches: int, num_producers: int, seed: int = 0,
                 pool: int = 3, vlm=None) -> None:  # noqa: ANN001
        from workloads.multimodal import MultimodalWorkload

        if shape.prompts_per_batch % num_minibatches:
            raise ValueError(f"multimodal prompts_per_batch={shape.prompts_per_batch} must be a multiple of "
                             f"num_minibatches={num_minibatches} (whole groups per mini-batch)")
        self.shape, self.num_minibatches, self.num_producers, self.seed = shape, num_minibatches, num_producers, seed
        gen = MultimodalWorkload(workload_config(shape, seed, vlm))
        self.pool = [[(g, [trajectory_fields(s, seed) for s in g.samples]) for g in gen.sample_batch(b)]
                     for b in range(max(1, pool))]
        self.max_response_len = max(int(f["old_logprobs"].shape[0]) for b in self.pool for _, fs in b for f in fs)

    def make(self, p: int, slot: int = 0) -> PassData:
        """Batch ``p`` (fresh ids) with the content of pool entry ``slot mod pool``."""
        groups = self.pool[slot % len(self.pool)]
        P, n = self.shape.prompts_per_batch, self.shape.group_size
        rollouts, prompt_of, producer, ids_of = [], {}, {}, [[] for _ in range(P)]
        for gi, (g, fields) in enumerate(groups):
            imgs, grids = tuple(im.pixel_values for im in g.images), tuple(im.grid_thw for im in g.images)
            for i, (s, f) in enumerate(zip(g.samples, fields)):
                t = p * P * n + gi * n + i
                rollouts.append(Rollout(Trajectory(t, p * P + gi, p, int(f["old_logprobs"].shape[0]), v_gen=0,
                                                   prompt_tokens=prompt_len(s)), f,
                                        images=tuple(imgs[j] for j in s.image_index),
                                        grids=tuple(grids[j] for j in s.image_index)))
                prompt_of[t] = gi
                producer[t] = producer_of(self.shape.placement, gi, i, n, self.num_producers)
                ids_of[gi].append(t)
        tokens = {r.traj.traj_id: int(r.tensors["input_ids"].shape[0]) for r in rollouts}
        plan = BatchPlan(p, tuple(GroupSpec(p * P + gi, p, n, prompt_len(g.samples[0])) for gi, (g, _) in
                                  enumerate(groups)))
        return PassData(p, plan, tuple(rollouts), producer, _minibatches(p, ids_of, P // self.num_minibatches,
                                                                          tokens, P),
                        tuple(g.samples[0].token_ids[:prompt_len(g.samples[0])].numpy() for g, _ in groups),
                        prompt_of, n, self.max_response_len,
                        images={gi: tuple(im.pixel_values.numpy() for im in g.images) for gi, (g, _) in
                                enumerate(groups)},
                        grids={gi: tuple(im.grid_thw for im in g.images) for gi, (g, _) in enumerate(groups)})

    def describe(self) -> str:
        w, probe = self.shape, self.make(0)
        return (f"multimodal: {w.prompts_per_batch} prompts x n={w.group_size} = {w.prompts_per_batch * w.group_size} "
                f"trajectories ({Placement(w.placement).value} placement over {self.num_producers} engines), "
                f"{w.images_per_prompt} "
                f"image(s) per prompt ({w.image_side}px and 3/4 rectangles), "
                f"{probe.distinct_pixel_nbytes / 1e6:.1f} MB of distinct pixel_values per batch "
                f"({probe.occurrence_pixel_nbytes / 1e6:.0f} MB with one copy per sample), "
                f"{probe.field_nbytes / 1e6:.2f} MB of token fields")

