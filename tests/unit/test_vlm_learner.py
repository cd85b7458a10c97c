"""The multimodal GRPO learner steps on the shares a multimodal handoff delivers: with dedup it encodes each
distinct image once and takes the same step as the baseline that encodes every occurrence.

Non-vacuous by construction: the behaviour log-probs come from a *perturbed* copy of the policy, so importance
ratios differ from 1 (some are clipped) and the loss depends on the logits (it is checked to differ from the
on-policy value -mean(advantage)). Tolerances (fp32): loss within 1e-6 relative, gradients within 1e-5 relative
per parameter tensor (observed: LM bitwise, vision ~5e-7, the summation order of the n occurrences), weights after
one Adam step within 1e-6 absolute (lr 1e-3)."""

from __future__ import annotations

import copy
import dataclasses
import random

import numpy as np
import pytest
import torch

from knittrans.handoff import Handoff, HandoffConfig, Rollout
from knittrans.mmdedup.gather import ImageSet, TrainSample, collate
from knittrans.runtime.trainer import GRPOConfig
from knittrans.runtime.vlm_learner import MMGRPOLearner, ShareOrderError, share_batch, token_logprobs
from knittrans.types import BatchPlan, GroupSpec, Trajectory
from workloads.mm_task import MMCountingTask, MMTaskConfig
from workloads.vlm import TinyVLMConfig, build_tiny_vlm, vision_tower

N, GROUPS = 3, 2
TASK = MMCountingTask(MMTaskConfig(image_sizes=((56, 56), (56, 84)), images_per_prompt=2))


def perturbed(model, scale: float = 0.3, seed: int = 1):
    """A copy of ``model`` with noise on every weight: the 'generating' policy of stale behaviour log-probs."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * p.std().nan_to_num(0.02).clamp_min(0.02) * torch.randn(p.shape, generator=g))
    return m


def share_of(model, behaviour) -> tuple:
    """One mini-batch of GROUPS groups x N samples (random responses) through a multimodal handoff; behaviour
    log-probs from ``behaviour``; advantages normalised per group from random rewards."""
    rng = random.Random(0)
    prompts = TASK.batch(seed=0, batch_id=0, n=GROUPS)
    alphabet = list(range(7, len(TASK.vocab))) + [TASK.vocab.eos_id]
    rows = []
    for g, p in enumerate(prompts):
        rewards = np.array([rng.random() for _ in range(N)], dtype=np.float32)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for j in range(N):
            resp = tuple(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
            rows.append((g * N + j, g, p, resp, float(adv[j])))
    # behaviour log-probs: teacher-forced under ``behaviour``
    samples, pixels, grids = [], [], []
    for t, g, p, resp, _ in rows:
        ids = torch.tensor(p.prompt_ids + resp)
        m = torch.zeros(len(ids), dtype=torch.bool)
        m[len(p.prompt_ids):] = True
        samples.append(TrainSample(t, ids, m, 0.0, tuple(range(len(pixels), len(pixels) + len(p.images)))))
        pixels += p.images
        grids += p.grids
    b = collate(samples, ImageSet(tuple(pixels), tuple(grids)), TASK.tokens)
    with torch.no_grad():
        old = token_logprobs(behaviour.eval(), b, dedup=True)
    h = Handoff(HandoffConfig.grpo(GROUPS, N, 1, 3, multimodal=True))
    h.add_batch(BatchPlan(0, tuple(GroupSpec(g, 0, N) for g in range(GROUPS))))
    h.seal()
    puts = []
    for i, (t, g, p, resp, a) in enumerate(rows):
        lp = old[i][b.loss_mask[i, 1:]].numpy()
        puts.append(Rollout(Trajectory(t, g, 0, len(resp), 0), {
            "input_ids": np.asarray(p.prompt_ids + resp, np.int64), "old_logprobs": lp.astype(np.float32),
            "advantages": np.full(len(resp), a, np.float32), "loss_mask": np.ones(len(resp), bool)},
            images=p.images, grids=p.grids))
    h.put(puts)
    c = h.consumer()
    (share,) = c.take(1)
    return h, c, share


@pytest.fixture(scope="module")
def model():
    return build_tiny_vlm(TinyVLMConfig(), TASK.vocab, seed=0)


def loss_and_grads(learner: MMGRPOLearner, share):
    learner.model.zero_grad(set_to_none=True)
    surr, _, batch = learner.loss(share)
    surr.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    return surr, grads, batch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm().clamp_min(1e-30))


def test_dedup_learner_takes_the_baseline_step_with_n_times_fewer_encoder_patches(model):
    h, c, share = share_of(model, perturbed(model))
    assert len(share.images.pixels) == GROUPS * 2  # 2 images per prompt, each once despite N samples
    cfg = GRPOConfig(lr=1e-3, clip_eps=0.2)
    learners = {d: MMGRPOLearner(copy.deepcopy(model), cfg, TASK.tokens, dedup=d) for d in (True, False)}
    seen: dict[bool, list[int]] = {True: [], False: []}
    hooks = [vision_tower(lr.model).register_forward_hook(
        lambda m, args, out, d=d: seen[d].append(int(args[0].shape[0]))) for d, lr in learners.items()]
    try:
        (s1, g1, b1), (s0, g0, _) = loss_and_grads(learners[True], share), loss_and_grads(learners[False], share)
        distinct = sum(x.shape[0] for x in share.images.pixels)
        assert seen == {True: [distinct], False: [N * distinct]}  # exactly n times fewer patches
        # the loss is a real function of the logits: ratios differ from 1 and some are clipped
        on_policy = -share["advantages"].mean()
        mask = b1.loss_mask[:, 1:]
        ratios = s1.ratio.detach()[mask]
        assert abs(float(s1.loss.detach()) - float(on_policy)) > 1e-3
        assert float((ratios - 1).abs().max()) > 0.2 and bool(((ratios < 0.8) | (ratios > 1.2)).any())
        assert abs(float((s1.loss - s0.loss).detach())) <= 1e-6 * abs(float(s0.loss.detach()))
        assert set(g0) == set(g1) and any("visual" in n for n in g0)
        for name in g0:
            assert rel(g0[name], g1[name]) <= 1e-5, name
        assert all(g0[n].norm() > 0 for n in g0 if "visual.blocks" in n and n.endswith("weight") and "norm" not in n)
        # one optimizer step each: the same weights
        res = {d: lr.step(share) for d, lr in learners.items()}
    finally:
        for hk in hooks:
            hk.remove()
    assert res[True].version == res[False].version == 1 and res[True].tokens == int(share["loss_mask"].sum())
    assert res[True].clip_frac == pytest.approx(res[False].clip_frac) and res[True].clip_frac > 0
    w1, w0 = learners[True].weights(), learners[False].weights()
    moved = max(float((w1[k] - model.state_dict()[k]).abs().max()) for k in w1)
    assert moved > 1e-4
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-6, rtol=0)
    assert learners[True].encoded_patches * N == learners[False].encoded_patches == learners[True].occurrence_patches
    c.ack(share)
    assert h.version == 1
    h.close()


def test_on_policy_behaviour_logprobs_give_ratio_one_so_response_fields_are_aligned_with_their_tokens(model):
    """If old_logprobs were shifted by one column against the tokens they score, ratios would not be 1."""
    h, _, share = share_of(model, model)
    learner = MMGRPOLearner(copy.deepcopy(model), GRPOConfig(lr=1e-3), TASK.tokens)
    res = learner.step(share)
    assert res.mean_ratio == pytest.approx(1.0, abs=1e-5) and res.clip_frac == 0.0
    _, targets = share_batch(share, TASK.tokens)
    assert int(targets.mask.sum()) == int(share["loss_mask"].sum()) == res.tokens
    old = targets.old_logprobs
    assert bool((old[targets.mask] < 0).all()) and bool((old[~targets.mask] == 0).all())
    h.close()


def test_shares_are_stepped_on_in_admission_order(model):
    h, _, share = share_of(model, model)
    learner = MMGRPOLearner(copy.deepcopy(model), GRPOConfig(), TASK.tokens, version=3)
    with pytest.raises(ShareOrderError, match="admitted as step 0 but the learner is at version 3"):
        learner.step(share)
    bad = dataclasses.replace(share, fields={**share.fields, "old_logprobs": dataclasses.replace(
        share.fields["old_logprobs"], cu_seqlens=share.fields["old_logprobs"].cu_seqlens * 0)})
    with pytest.raises(ValueError, match="response fields of lengths"):
        share_batch(bad, TASK.tokens)
    h.close()
