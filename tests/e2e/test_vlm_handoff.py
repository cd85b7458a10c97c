"""GRPO on the tiny VLM through a multimodal ``Handoff`` (no orchestrator): the engine generates groups with images,
rewards and group advantages are exact, trajectories go into the handoff (KnitTrans admission; each distinct
image stored once), the learner steps on each ``MMShare`` (encoder once per distinct image) and acks, and the
weights reach the engine every step."""

from __future__ import annotations

import math

import pytest
import torch

from knittrans.handoff import Transport
from workloads.mm_task import MMWarmStartConfig
from workloads.vlm_session import HandoffLoopConfig, run_handoff_grpo, vlm_setup

torch.set_num_threads(1)  # rollout and trainer threads share 2 cores: intra-op threads would oversubscribe them

P, N, M, BATCHES, BUDGET = 4, 4, 2, 2, 2


@pytest.fixture(scope="module")
def setup():
    # a short warm start: the answer format and prior, so groups have mixed rewards
    return vlm_setup(seed=0, warm=MMWarmStartConfig(max_steps=30, batch_size=16, target_accuracy=None))


def check_run(run, dedup: bool) -> None:
    total = BATCHES * P * N
    # every trajectory trained exactly once, one step per mini-batch, versions one per step
    ids = [t for _, ts in run.trained for t in ts]
    assert sorted(ids) == list(range(total))
    assert [seq for seq, _ in run.trained] == list(range(BATCHES * M))
    assert [s.version for s in run.steps] == list(range(1, BATCHES * M + 1))
    assert all(math.isfinite(s.loss) and s.tokens > 0 for s in run.steps)
    # staleness recorded by the handoff: v_gen as the engine generated it, v_train the step that trained it
    step_of = {t: seq for seq, ts in run.trained for t in ts}
    assert len(run.records) == total
    for r in run.records:
        assert r.released and r.v_gen == run.samples[r.traj_id].v_gen and r.v_train == step_of[r.traj_id]
        assert 0 <= r.staleness <= BUDGET - 1  # flow control: wave w starts once step w - BUDGET finished
    assert max(r.v_gen for r in run.records) > 0  # weights did reach the engine
    # GRPO has signal: some group's rewards differ
    groups = {}
    for t, rew in run.rewards.items():
        groups.setdefault(run.samples[t].group_id, set()).add(rew)
    assert any(len(v) > 1 for v in groups.values())
    # the learner's vision tower ran over exactly each share's distinct images (hook), n times fewer patches
    # than the occurrences with dedup, every occurrence without
    expect = run.share_distinct_patches if dedup else [N * d for d in run.share_distinct_patches]
    assert run.learner_hook_patches == expect
    assert run.learner_occurrence_patches == N * sum(run.share_distinct_patches)
    # the engine encoded each distinct image of a wave once, not once per sample
    assert sum(run.engine_hook_patches) == run.engine_stats.encoded_patches
    assert run.engine_stats.occurrence_patches == N * run.engine_stats.encoded_patches


@pytest.mark.parametrize("dedup", [True, False])
def test_grpo_through_the_inprocess_handoff_trains_every_trajectory_once_with_the_encoder_once_per_image(
        setup, dedup):
    run = run_handoff_grpo(setup, HandoffLoopConfig(num_batches=BATCHES, prompts_per_batch=P, group_size=N,
                                                    num_minibatches=M, inflight_minibatches=BUDGET, dedup=dedup))
    check_run(run, dedup)


@pytest.mark.ray
def test_grpo_through_the_ray_handoff(setup, ray_local):
    pytest.importorskip("ray")
    run = run_handoff_grpo(setup, HandoffLoopConfig(num_batches=BATCHES, prompts_per_batch=P, group_size=N,
                                                    num_minibatches=M, inflight_minibatches=BUDGET,
                                                    transport=Transport.RAY))
    check_run(run, dedup=True)
