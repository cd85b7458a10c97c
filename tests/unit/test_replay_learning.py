"""The replay learner (``knittrans.sim.replay``): deterministic, paired across schedules, refuses schedules it
cannot replay, and learns less from staler data -- the property the quality-replay table rests on."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from knittrans.sim.replay import BanditTask, ReplayConfig, replay


def schedule(groups: int = 64, per_step: int = 4, n: int = 8, lag: int = 0) -> SimpleNamespace:
    """``groups`` groups of ``n``, ``per_step`` groups per optimizer step, each generated ``lag`` steps before the
    step that consumes it (but never before step 0)."""
    g = np.repeat(np.arange(groups), n)
    step = g // per_step
    return SimpleNamespace(group=g, step=step, v_gen=np.maximum(step - lag, 0))


def test_a_replay_is_deterministic_and_starts_at_the_uniform_policy():
    task, cfg = BanditTask(), ReplayConfig()
    a, b = replay(schedule(), task, cfg, seed=3), replay(schedule(), task, cfg, seed=3)
    assert a == b
    assert a.expected_reward[0] == pytest.approx(1 / task.actions)
    assert len(a.expected_reward) == 17 and a.staleness_mean == 0
    assert replay(schedule(), task, cfg, seed=4) != a


def test_fresh_data_learns_and_stale_data_learns_less():
    task, cfg = BanditTask(), ReplayConfig()
    auc = {lag: np.mean([replay(schedule(groups=128, lag=lag), task, cfg, seed=s).auc for s in range(6)])
           for lag in (0, 4, 12)}
    fresh = replay(schedule(groups=128), task, cfg, seed=0)
    assert fresh.final > 1.4 / task.actions  # it learns: 40% above chance within 32 steps
    assert auc[0] > auc[4] > auc[12]
    stale = replay(schedule(groups=128, lag=12), task, cfg, seed=0)
    assert stale.clip_frac > fresh.clip_frac and stale.staleness_mean > 8


def test_the_same_seed_pairs_two_schedules_draw_for_draw():
    # two schedules that differ only in staleness see the same prompts and random draws: with no step taken
    # before either is consumed, the first step is identical
    a = replay(schedule(lag=0), BanditTask(), ReplayConfig(), seed=1)
    b = replay(schedule(lag=3), BanditTask(), ReplayConfig(), seed=1)
    assert a.expected_reward[:2] == b.expected_reward[:2] and a.expected_reward[5] != b.expected_reward[5]


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.step.__setitem__(3, -1), "never consumed"),
    (lambda s: s.v_gen.__setitem__(40, 9), "newer than its consuming step"),
    (lambda s: s.step.__setitem__(0, 1), "split across optimizer steps"),
])
def test_schedules_the_learner_cannot_replay_are_refused(edit, match):
    s = schedule()
    edit(s)
    with pytest.raises(ValueError, match=match):
        replay(s, BanditTask(), ReplayConfig(), seed=0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        ReplayConfig(lr=0)
    with pytest.raises(ValueError):
        ReplayConfig(clip_eps=1.5)
    with pytest.raises(ValueError):
        BanditTask(actions=1)
