"""The speedup table's training step, on what the multimodal handoff delivers.

``deliver_share`` hands a rank's trajectories (whole groups) through an in-process multimodal ``Handoff`` -- the
producer streams fields and images to its unit, the controller admits the mini-batch, the consumer fetches it -- so
the dedup batch is built from a real ``MMShare`` (each distinct image once, plus the per-sample index map), and
turning dedup off in the plane shows up here. ``step_batches`` turns that share into the two trainer inputs: the
dedup batch and the baseline batch (one pixel copy per occurrence, as verl's rows carry them). ``time_train_steps``
times one forward + backward of each, alternately, and counts the patches the vision tower actually encodes (a
forward hook on it, not arithmetic on the batch).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from knittrans.bench.types import COMPLETION_FIELDS, PassData
from knittrans.handoff import Handoff, HandoffConfig, Rollout
from knittrans.mmdedup.gather import BatchTokens, ImageSet, MMBatch, TrainSample, collate, grpo_loss, policy_logits
from knittrans.mmdedup.plane import MMShare
from knittrans.types import BatchPlan


@dataclass(frozen=True)
class StepBatches:
    """One rank's mini-batch share as the two trainers take it."""

    dedup: MMBatch
    """Distinct images + per-sample index map (what the handoff delivered)."""
    baseline: MMBatch
    """The same samples with one pixel copy per image occurrence (verl's rows)."""


@dataclass(frozen=True)
class StepTiming:
    """Median seconds of one forward + backward, and the vision-tower patches each encoded (per step)."""

    baseline_s: float
    dedup_s: float
    baseline_patches: int
    dedup_patches: int


def deliver_share(d: PassData, traj_ids: Sequence[int], dedup: bool = True) -> MMShare:
    """``traj_ids`` (whole groups of ``d``) through an in-process multimodal handoff as one mini-batch of one rank:
    streamed (fields and images), completed with metadata, admitted by the controller, fetched, acked; raises if
    the units keep any byte afterwards."""
    ids = set(traj_ids)
    rollouts = [r for r in d.rollouts if r.traj.traj_id in ids]
    groups = {r.traj.group_id for r in rollouts}
    plan = BatchPlan(d.batch_id, tuple(g for g in d.plan.groups if g.group_id in groups))
    if plan.num_trajectories != len(rollouts):
        raise ValueError(f"deliver_share needs whole groups: {len(rollouts)} of {plan.num_trajectories} trajectories")
    h = Handoff(HandoffConfig.grpo(prompts_per_batch=len(plan.groups), group_size=d.group_size, num_minibatches=1,
                                   max_response_len=d.max_response_len, multimodal=True, dedup=dedup))
    try:
        h.add_batch(plan)
        h.seal()
        from knittrans.mmdedup.plane import MMPayload

        h.plane.client(h.config.units[0][0]).put([  # streamed while generating
            MMPayload(r.traj.traj_id, {k: v for k, v in r.tensors.items() if k not in COMPLETION_FIELDS},
                      group=r.traj.group_id, encodings=r.images, grids=r.grids) for r in rollouts])
        h.producer().put([Rollout(r.traj, {k: r.tensors[k] for k in COMPLETION_FIELDS}) for r in rollouts])
        consumer = h.consumer(0, count=1)
        (share,) = consumer.take(1)
        consumer.ack(share)
        h.wait_drained(timeout=60)
        if h.plane.live_bytes():
            raise RuntimeError(f"the encoding stores kept {h.plane.live_bytes()} bytes after the share was consumed")
    finally:
        h.close()
    assert isinstance(share, MMShare)
    return share


def step_batches(share: MMShare, tokens: BatchTokens) -> StepBatches:
    """The share's samples (token ids, loss mask over prompt + response, the GRPO advantage) collated twice."""
    ids, mask, adv = share.fields["input_ids"], share.fields["loss_mask"], share.fields["advantages"]
    image_ids = share.image_ids
    samples = []
    for i, t in enumerate(share.traj_ids):
        toks = ids.values[ids.cu_seqlens[i]:ids.cu_seqlens[i + 1]]
        resp = mask.values[mask.cu_seqlens[i]:mask.cu_seqlens[i + 1]]
        lm = torch.cat([torch.zeros(toks.shape[0] - resp.shape[0], dtype=torch.bool), resp])
        a = adv.values[adv.cu_seqlens[i]:adv.cu_seqlens[i + 1]]
        samples.append(TrainSample(t, toks, lm, float(a[0]) if a.numel() else 0.0, image_ids[t]))
    pix, grids, per_occurrence = [], [], []
    for s in samples:
        occ = []
        for i in s.image_ids:
            occ.append(len(pix))
            pix.append(share.images.pixels[i].clone())
            grids.append(share.images.grids[i])
        per_occurrence.append(dataclasses.replace(s, image_ids=tuple(occ)))
    return StepBatches(collate(samples, share.images, tokens),
                       collate(per_occurrence, ImageSet(tuple(pix), tuple(grids)), tokens))


def time_train_steps(model: torch.nn.Module, vision: torch.nn.Module, batches: StepBatches,
                     repeats: int, warmup: bool = True) -> StepTiming:
    """Median wall time of one forward + backward (no optimizer step) of the baseline batch (every occurrence
    encoded, ``policy_logits(dedup=False)``) and of the dedup batch (``dedup=True``), timed alternately (after one
    untimed step each when ``warmup``), so load from other processes falls on both alike; ``vision`` is the model's
    vision tower, whose forward calls are counted in patches."""
    seen: list[int] = []

    def count(module: torch.nn.Module, args: tuple, kwargs: dict, out: object) -> None:
        x = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        seen.append(int(x.shape[0]))

    times: dict[bool, list[float]] = {False: [], True: []}
    patches: dict[bool, int] = {}
    hook = vision.register_forward_hook(count, with_kwargs=True)
    try:
        first = 0 if warmup else 1
        for i in range(first, repeats + 1):
            for flag, batch in ((False, batches.baseline), (True, batches.dedup)):
                model.zero_grad(set_to_none=True)
                seen.clear()
                t = time.perf_counter()
                grpo_loss(policy_logits(model, batch, dedup=flag), batch).backward()
                if i > 0:
                    times[flag].append(time.perf_counter() - t)
                patches[flag] = sum(seen)
    finally:
        hook.remove()
    return StepTiming(statistics.median(times[False]), statistics.median(times[True]), patches[False], patches[True])
