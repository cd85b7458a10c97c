"""Short real runs of every execution mode (a few optimizer steps each, tiny batches, one thread per side).

Invariants, named in the tests: versions rise by one per step; no trajectory is lost or trained twice; staleness
stays within the configured bound; colocated staleness is exactly the mini-batch index; a failing rollout worker
is retried or fails loudly, never drops a group.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from knittrans.runtime.config import OnRolloutError, RuntimeConfig, SyncPolicy
from knittrans.runtime.hf_engine import HFRolloutEngine
from knittrans.runtime.orchestrator import Orchestrator, RolloutWorkerError
from workloads.arith_session import arith_setup, run_mode
from knittrans.runtime.trainer import GRPOTrainer
from workloads.arith import RewardError
from workloads.tiny_models import WarmStartConfig
from baselines.admission import make_policy

torch.set_num_threads(1)

SMALL = dict(num_batches=3, prompts_per_batch=4, group_size=2, num_minibatches=2, wave_groups=1)


@pytest.fixture(scope="module")
def setup():
    return arith_setup(seed=0, warm=WarmStartConfig(steps=10))


def _check(run, cfg):
    assert [s.version for s in run.steps] == list(range(1, cfg.total_steps + 1))
    ids = Counter(t.traj_id for t in run.trajectories)
    assert len(ids) == cfg.num_batches * cfg.prompts_per_batch * cfg.group_size and set(ids.values()) == {1}
    steps = Counter(t.step for t in run.trajectories)
    assert set(steps) == set(range(cfg.total_steps))  # every step consumed something, nobody twice
    assert all(0 <= t.staleness <= cfg.staleness_bound() for t in run.trajectories)
    assert all(t.t_dispatch <= t.t_complete <= t.t_train_start for t in run.trajectories)
    tm = run.timings()
    assert tm.decode_s_per_token > 0 and tm.train_s_per_token > 0 and tm.syncs >= 1


@pytest.mark.parametrize("mode,budget", [("colocated", 0), ("train_batch", 4), ("knittrans", 2), ("knittrans", 4),
                                         ("greedy", 2), ("bounded_async", 4)])
def test_versions_rise_per_step_and_nothing_lost_or_trained_twice(setup, mode, budget):
    cfg = RuntimeConfig.for_system(mode, inflight_groups=budget, **SMALL)
    run = run_mode(cfg, setup, make_policy=make_policy)
    _check(run, cfg)


def test_colocated_staleness_is_the_minibatch_index(setup):
    cfg = RuntimeConfig.for_system("colocated", **SMALL)
    run = run_mode(cfg, setup, make_policy=make_policy)
    by_step = {s.step: s.minibatch_index for s in run.steps}
    assert all(t.staleness == by_step[t.step] for t in run.trajectories)
    assert run.staleness_stats.mean == pytest.approx((cfg.num_minibatches - 1) / 2)


def test_train_batch_consumes_only_whole_batches_and_is_staler_than_knittrans_at_min_budget(setup):
    tb = RuntimeConfig.for_system("train_batch", inflight_groups=4, **SMALL)
    kt = RuntimeConfig.for_system("knittrans", inflight_groups=2, **SMALL)
    r_tb, r_kt = run_mode(tb, setup, make_policy=make_policy), run_mode(kt, setup, make_policy=make_policy)
    for b in range(tb.num_batches):
        done = max(t.t_complete for t in r_tb.trajectories if t.batch_id == b)
        assert all(t.t_train_start >= done for t in r_tb.trajectories if t.batch_id == b)
    # Each mode at its minimum budget: train-batch must hold a whole batch in flight, KnitTrans one mini-batch.
    # With one mini-batch in flight a group is dispatched only after the previous step published its weights, so
    # KnitTrans trains on-policy; train-batch's later mini-batches (and every batch after the first) are stale.
    assert r_kt.staleness_stats.max == 0
    assert r_tb.staleness_stats.mean > 0.5 and kt.staleness_bound() < tb.staleness_bound()


def test_sync_every_batch_keeps_engine_version_at_batch_boundaries(setup):
    cfg = RuntimeConfig.for_system("knittrans", inflight_groups=4, sync=SyncPolicy.EVERY_BATCH, **SMALL)
    run = run_mode(cfg, setup, make_policy=make_policy)
    _check(run, cfg)
    assert {t.v_gen for t in run.trajectories} <= {0, 2, 4}  # versions that end a batch of M=2 steps


class FlakyEngine(HFRolloutEngine):
    """Raises on chosen generate calls (1-based), then behaves."""

    def __init__(self, *a, fail_calls=(1,), **kw):
        super().__init__(*a, **kw)
        self.fail_calls = set(fail_calls)
        self.calls = 0

    def generate(self, requests, sampling, seed):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise RuntimeError(f"injected failure on call {self.calls}")
        return super().generate(requests, sampling, seed)


def _flaky(setup, fail_calls):
    return FlakyEngine(setup.model, eos_token_id=setup.tokenizer.eos_token_id,
                       pad_token_id=setup.tokenizer.pad_token_id, fail_calls=fail_calls)


@pytest.mark.parametrize("mode", ["colocated", "knittrans"])
def test_failed_wave_is_retried_and_no_group_is_lost(setup, mode):
    cfg = RuntimeConfig.for_system(mode, on_rollout_error=OnRolloutError.RETRY, rollout_retries=1, **SMALL)
    run = run_mode(cfg, setup, engine=_flaky(setup, fail_calls=(2,)), make_policy=make_policy)
    _check(run, cfg)
    assert run.rollout_failures == 1


@pytest.mark.parametrize("mode", ["colocated", "knittrans", "train_batch"])
def test_failed_wave_under_fail_policy_fails_the_run_loudly(setup, mode):
    cfg = RuntimeConfig.for_system(mode, on_rollout_error=OnRolloutError.FAIL, **SMALL)
    with pytest.raises(RolloutWorkerError, match=r"groups \[1\]"):
        run_mode(cfg, setup, engine=_flaky(setup, fail_calls=(2,)), make_policy=make_policy)


def test_retries_exhausted_fail_loudly(setup):
    cfg = RuntimeConfig.for_system("knittrans", rollout_retries=2, **SMALL)
    with pytest.raises(RolloutWorkerError, match="after 3 attempt"):
        run_mode(cfg, setup, engine=_flaky(setup, fail_calls=(1, 2, 3)), make_policy=make_policy)


class NaNRewardTask:
    """The setup's task with a NaN reward for one group: the run must stop with a clear error."""

    def __init__(self, inner):
        self.inner = inner

    def batch(self, seed, batch_id, n):
        return self.inner.batch(seed, batch_id, n)

    def reward(self, prompt, response_ids):
        return math.nan


@pytest.mark.parametrize("mode", ["colocated", "knittrans"])
def test_nan_reward_stops_the_run_with_a_clear_error(setup, mode):
    import copy

    cfg = RuntimeConfig.for_system(mode, **SMALL)
    model = copy.deepcopy(setup.model)
    orch = Orchestrator(cfg, GRPOTrainer(model, setup.grpo, setup.tokenizer.pad_token_id),
                        HFRolloutEngine(model, setup.tokenizer.eos_token_id, setup.tokenizer.pad_token_id),
                        NaNRewardTask(setup.task), make_policy=make_policy)
    with pytest.raises(RewardError, match="non-finite reward"):
        orch.run()
