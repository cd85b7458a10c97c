"""GRPO on the tiny VLM through the orchestrator, in all three modes (colocated, train-batch, KnitTrans): the
``VLMRolloutEngine`` generates groups that show images, rewards and group advantages are exact, every trajectory
goes through a multimodal ``Handoff`` (each distinct image stored once), and ``MMGRPOLearner`` steps on each
``MMShare`` with the vision encoder run once per distinct image of the share (forward hook: measured, not
accounted). Every trajectory is trained exactly once, with the staleness the handoff records."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from baselines.admission import make_policy
from knittrans.handoff import Transport
from knittrans.runtime.config import RuntimeConfig
from knittrans.runtime.records import RunResult
from workloads.mm_task import MMWarmStartConfig
from workloads.vlm import vision_tower
from workloads.vlm_session import VLMSetup, run_mode, vlm_setup

torch.set_num_threads(1)  # rollout and trainer threads share 2 cores: intra-op threads would oversubscribe them

P, N, M, BATCHES = 4, 4, 2, 2
SMALL = dict(num_batches=BATCHES, prompts_per_batch=P, group_size=N, num_minibatches=M, max_new_tokens=3,
             wave_groups=P // M, inflight_groups=P, multimodal=True)


@pytest.fixture(scope="module")
def setup():
    # a short warm start (the answer format and prior, so groups have mixed rewards), evaluated only at its ends
    return vlm_setup(seed=0, warm=MMWarmStartConfig(max_steps=30, batch_size=16, target_accuracy=None,
                                                    eval_every=1000, eval_prompts=8))


def patches(images) -> int:
    return sum(int(x.shape[0]) for x in images)


def distinct(images) -> list[torch.Tensor]:
    """The distinct images by content (two prompts of the finite problem space can show the same image)."""
    out: list[torch.Tensor] = []
    for x in images:
        if not any(x.shape == y.shape and torch.equal(x, y) for y in out):
            out.append(x)
    return out


def run_hooked(setup: VLMSetup, cfg: RuntimeConfig, dedup: bool = True):
    """A run with forward hooks counting the patches each vision tower (learner's, engine's) runs over."""
    learner, engine = setup.learner(dedup=dedup), setup.engine()
    seen: dict[str, list[int]] = {"learner": [], "engine": []}
    hooks = [vision_tower(m).register_forward_hook(lambda mod, args, out, k=k: seen[k].append(int(args[0].shape[0])))
             for k, m in (("learner", learner.model), ("engine", engine.model))]
    try:
        run = run_mode(cfg, setup, learner=learner, engine=engine, make_policy=make_policy)
    finally:
        for h in hooks:
            h.remove()
    return run, seen, engine


def check(run: RunResult, cfg: RuntimeConfig, setup: VLMSetup, seen: dict[str, list[int]], engine,
          dedup: bool) -> None:
    total = BATCHES * P * N
    # every trajectory trained exactly once, by the handoff's account and the orchestrator's
    recs = run.handoff_records
    assert len(recs) == total and sorted(Counter(r.traj_id for r in recs).values()) == [1] * total
    assert sorted(t.traj_id for t in run.trajectories if t.step >= 0) == list(range(total))
    assert [s.version for s in run.steps] == list(range(1, cfg.total_steps + 1))
    assert all(math.isfinite(s.loss) and s.tokens > 0 for s in run.steps)
    # staleness recorded by the handoff is the orchestrator's (v_gen from the engine, v_train the consuming step)
    mine = {t.traj_id: t for t in run.trajectories}
    for r in recs:
        t = mine[r.traj_id]
        assert r.released and (r.v_gen, r.v_train) == (t.v_gen, t.v_train) and r.v_train == t.step
        assert 0 <= r.staleness <= cfg.staleness_bound()
    if cfg.system == "colocated":  # the j-th mini-batch of a batch is j steps stale, nothing more
        assert all(r.staleness == t.step % M for r in recs for t in [mine[r.traj_id]])
    else:
        assert max(r.v_gen for r in recs) > 0  # weights did reach the engine
    # GRPO has signal: some group's rewards differ
    rewards: dict[int, set[float]] = {}
    for t in run.trajectories:
        rewards.setdefault(t.group_id, set()).add(t.reward)
    assert any(len(v) > 1 for v in rewards.values())
    # the learner's vision tower ran over exactly the distinct images of each step's share (hook), and the step
    # records account the same patches; without dedup it runs over every occurrence
    prompts = {b * P + i: p for b in range(BATCHES) for i, p in enumerate(setup.task.batch(cfg.seed, b, P))}
    for s, hooked in zip(run.steps, seen["learner"], strict=True):
        images = [x for t in run.trajectories if t.step == s.step for x in prompts[t.group_id].images]
        assert s.occurrence_patches == patches(images)
        assert s.encoder_patches == hooked == (patches(distinct(images)) if dedup else patches(images))
    if dedup:
        assert sum(s.occurrence_patches for s in run.steps) >= N * sum(s.encoder_patches for s in run.steps)
    # the engine encoded each distinct image of a wave once, not once per sample
    assert sum(seen["engine"]) == engine.stats.encoded_patches
    assert engine.stats.occurrence_patches == N * patches(x for p in prompts.values() for x in p.images)
    assert N * engine.stats.encoded_patches <= engine.stats.occurrence_patches


@pytest.mark.parametrize("system", ["colocated", "train_batch", "knittrans"])
def test_vlm_grpo_through_the_orchestrator_trains_every_trajectory_once_with_the_encoder_once_per_image(
        setup, system):
    cfg = RuntimeConfig.for_system(system, **SMALL)
    run, seen, engine = run_hooked(setup, cfg)
    check(run, cfg, setup, seen, engine, dedup=True)


def test_without_dedup_the_learner_encodes_every_occurrence_and_trains_the_same_trajectories(setup):
    cfg = RuntimeConfig.for_system("knittrans", **SMALL)
    run, seen, engine = run_hooked(setup, cfg, dedup=False)
    check(run, cfg, setup, seen, engine, dedup=False)


def test_a_text_config_is_refused_for_the_image_task(setup):
    with pytest.raises(ValueError, match="multimodal=True"):
        run_mode(RuntimeConfig.for_system("knittrans", **{**SMALL, "multimodal": False}), setup)


@pytest.mark.ray
def test_vlm_grpo_through_the_ray_handoff(setup, ray_local):
    pytest.importorskip("ray")
    cfg = RuntimeConfig.for_system("knittrans", transport=Transport.RAY, **SMALL)
    run, seen, engine = run_hooked(setup, cfg)
    check(run, cfg, setup, seen, engine, dedup=True)
