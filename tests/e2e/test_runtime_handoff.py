"""The real runtime trains the tiny policy through the handoff, on both transports (in-process and Ray): every
trajectory is consumed exactly once, and the staleness the handoff records (``v_train - v_gen``) is the
orchestrator's own accounting, trajectory by trajectory."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from baselines.admission import make_policy
from knittrans.handoff import Transport
from knittrans.runtime.config import RuntimeConfig
from knittrans.runtime.faults import RuntimeFaultPlan
from knittrans.staleness import StalenessStats
from workloads.arith_session import arith_setup, run_mode
from workloads.tiny_models import WarmStartConfig

torch.set_num_threads(1)

SMALL = dict(num_batches=3, prompts_per_batch=4, group_size=2, num_minibatches=2, wave_groups=1)


class ParityTask:
    """The arithmetic prompts with a reward that varies within a group from the first step (a barely warm policy
    answers nothing right, so exact-match rewards would all be 0 and every advantage with them): 1 if the first
    response token id is even. Any ``RLTask`` will do; the orchestrator knows only the protocol."""

    def __init__(self, inner):
        self.inner = inner

    def batch(self, seed, batch_id, n):
        return self.inner.batch(seed, batch_id, n)

    def reward(self, prompt, response_ids):
        return float(response_ids[0] % 2 == 0)


@pytest.fixture(scope="module")
def setup():
    s = arith_setup(seed=0, warm=WarmStartConfig(steps=10))
    return dataclasses.replace(s, task=ParityTask(s.task))


@pytest.fixture(params=[Transport.INPROCESS, pytest.param(Transport.RAY, marks=pytest.mark.ray)], ids=["inprocess", "ray"])
def transport(request):
    if request.param is Transport.RAY:
        pytest.importorskip("ray")
        request.getfixturevalue("ray_local")
    return request.param


def _consumed_exactly_once_with_the_recorded_staleness(run, cfg, setup) -> None:
    n = cfg.num_batches * cfg.prompts_per_batch * cfg.group_size
    # exactly once, by the handoff's account: every trajectory admitted into one mini-batch and released
    recs = run.handoff_records
    assert len(recs) == n and sorted(Counter(r.traj_id for r in recs).values()) == [1] * n
    assert all(r.released for r in recs)
    assert run.controller.admitted == run.controller.released_minibatches == cfg.total_steps
    # ... and by the orchestrator's: one step per trajectory, every step used
    assert sorted(t.traj_id for t in run.trajectories) == sorted(r.traj_id for r in recs)
    assert Counter(t.step for t in run.trajectories).keys() == set(range(cfg.total_steps))
    # recorded staleness = the orchestrator's, per trajectory (v_train = the step that consumed it)
    mine = {t.traj_id: (t.v_gen, t.v_train, t.staleness) for t in run.trajectories}
    assert all(mine[r.traj_id] == (r.v_gen, r.v_train, r.staleness) for r in recs)
    assert all(0 <= r.staleness <= cfg.staleness_bound() for r in recs)
    assert run.staleness_stats == StalenessStats.of(np.array([t.staleness for t in run.trajectories]))
    assert [s.version for s in run.steps] == list(range(1, cfg.total_steps + 1))


@pytest.mark.parametrize("system,budget", [("knittrans", 4), ("train_batch", 4), ("colocated", 0)])
def test_tiny_policy_trains_through_the_handoff_consuming_each_trajectory_once(setup, transport, system, budget):
    cfg = RuntimeConfig.for_system(system, inflight_groups=budget, transport=transport, eval_every=1, **SMALL)
    run = run_mode(cfg, setup, make_policy=make_policy)
    _consumed_exactly_once_with_the_recorded_staleness(run, cfg, setup)
    # trained for real: every step moved the weights, and the engine generated with them (v_gen > 0 after sync)
    w0, w_end = run.snapshots[0], run.snapshots[cfg.total_steps]
    assert any(not torch.equal(w0[k], w_end[k]) for k in w0)
    assert all(np.isfinite(s.loss) and s.tokens > 0 for s in run.steps)
    assert max(t.v_gen for t in run.trajectories) > 0
    if system == "colocated":  # algorithmic staleness only: the j-th mini-batch of a batch is j steps stale
        assert run.staleness_stats.mean == pytest.approx((cfg.num_minibatches - 1) / 2)
    assert (run.admission is None) == (transport is Transport.RAY)  # the policy ran in the controller actor


def test_trainer_crash_is_recovered_through_the_handoff(setup, transport):
    cfg = RuntimeConfig.for_system("knittrans", inflight_groups=4, transport=transport, **SMALL)
    run = run_mode(cfg, setup, faults=RuntimeFaultPlan(crash_steps=(2,)), make_policy=make_policy)
    _consumed_exactly_once_with_the_recorded_staleness(run, cfg, setup)
    assert run.faults_recovered == {"trainer_restart": 1} and run.controller.claims > cfg.total_steps


class ImageTask:
    """The parity task with one image per prompt (the same tensor for every sample of a group): what a
    multimodal ``RLTask`` hands the orchestrator. The text engine ignores the images; the handoff must still store
    each once and hand the learner an ``MMShare``."""

    def __init__(self, inner):
        self.inner = inner

    def batch(self, seed, batch_id, n):
        g = torch.Generator().manual_seed(seed * 1000 + batch_id)
        return [dataclasses.make_dataclass("ImagePrompt", ["prompt_ids", "images", "grids"])(
            p.prompt_ids, (torch.randn(4, 24, generator=g),), ((1, 2, 2),)) for p in self.inner.batch(seed, batch_id, n)]

    def reward(self, prompt, response_ids):
        return self.inner.reward(prompt, response_ids)


class RecordingLearner:
    """A ``Learner`` around the text trainer that records what each share carried."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    @property
    def version(self):
        return self.inner.version

    def step(self, share):
        self.seen.append((type(share).__name__, len(share.images.pixels), len(share.traj_ids)))
        return self.inner.step(share)

    def weights(self):
        return self.inner.weights()


def test_multimodal_prompts_reach_the_learner_through_the_handoff_once_per_distinct_image(setup):
    import copy

    from knittrans.runtime import GRPOTrainer, HFRolloutEngine, Learner, Orchestrator

    cfg = RuntimeConfig.for_system("knittrans", inflight_groups=4, multimodal=True, **SMALL)
    model = copy.deepcopy(setup.model)
    learner = RecordingLearner(GRPOTrainer(model, setup.grpo, setup.tokenizer.pad_token_id))
    assert isinstance(learner, Learner)
    engine = HFRolloutEngine(model, setup.tokenizer.eos_token_id, setup.tokenizer.pad_token_id)
    run = Orchestrator(cfg, learner, engine, ImageTask(setup.task), make_policy=make_policy).run()
    _consumed_exactly_once_with_the_recorded_staleness(run, cfg, setup)
    # each mini-batch holds 2 groups of 2 samples that show 1 image per group: 2 distinct images, 4 occurrences
    assert learner.seen == [("MMShare", 2, 4)] * cfg.total_steps
