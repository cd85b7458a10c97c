"""Learning replayed over a simulated schedule: what a run's staleness does to learning, deterministically.

The simulator (``knittrans.sim.simulator``) decides, for an admission policy, an in-flight budget and a time
model, which optimizer step consumes every trajectory and which weights generated it (``v_gen``). This module
replays that schedule with a small learner: every trajectory is *generated* with the weights of its ``v_gen``
(kept for every version) and *trained on* in the step the simulator put it in, with the same GRPO objective as
the real trainer (``knittrans.runtime.trainer``: group-normalized advantages, PPO-clipped importance ratios
against the behaviour policy). So two schedules that differ only in staleness learn differently only through
staleness: the same prompts, the same random draws per trajectory (common random numbers), the same steps.

Task (``BanditTask``): a contextual bandit. Each group's prompt is a feature vector ``x`` (drawn from the task
seed and the group id); a response is one of ``K`` actions; the reward is 1 for the action a hidden linear
teacher ranks first, else 0. The policy is linear-softmax, ``pi(a | x) = softmax(theta x)``, started at uniform
(``theta = 0``), trained with Adam. Evaluation is exact: the expected reward of the policy (one sample at T = 1,
GRPO's objective) averaged over a fixed held-out set of prompts, after every step: no evaluation noise.

Why this learner: it is the smallest one with the property the claim is about, that an update computed from
stale samples helps less (their importance ratios leave the clip range and stop contributing, and their
advantages describe an older policy). It says nothing about *how much* a real LLM suffers from a step of
staleness: that sensitivity is set by ``ReplayConfig.lr`` (larger steps per update, more harm per stale step)
and is stated beside every result. What the replay isolates is the system's part: given a learner that staleness
hurts, which schedule loses less.

Deterministic: the same ``SimResult`` and seeds give the same curve bit for bit (numpy float64, no threads).

Example::

    >>> import numpy as np
    >>> from knittrans.sim.replay import BanditTask, ReplayConfig, replay
    >>> class R:  # a two-step schedule by hand: 2 groups of 4, one per step, generated fresh
    ...     group = np.array([0, 0, 0, 0, 1, 1, 1, 1]); step = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    ...     v_gen = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    >>> curve = replay(R(), BanditTask(), ReplayConfig(), seed=0)
    >>> len(curve.expected_reward), curve.expected_reward[0] == 1 / BanditTask().actions
    (3, True)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BanditTask:
    """The contextual bandit the replay learns (module docstring). Not frozen, so Hydra can override its fields."""

    actions: int = 16
    """K: responses per prompt (one is right)."""
    features: int = 16
    """D: prompt feature dimension."""
    heldout: int = 512
    """Held-out prompts of the exact evaluation."""

    def __post_init__(self) -> None:
        if self.actions < 2 or self.features < 1 or self.heldout < 1:
            raise ValueError(f"BanditTask: actions >= 2, features >= 1, heldout >= 1; got {self}")


@dataclass
class ReplayConfig:
    """The learner's update rule: GRPO with PPO clipping against the behaviour policy, Adam. Not frozen, so Hydra
    can override its fields."""

    lr: float = 0.02
    """Adam step size. It sets how far the policy moves per step, hence how much a step of staleness costs: at
    the default, of the samples with a non-zero advantage, about 11% of those 8 steps stale and 19% of those 12
    steps stale have left the clip range (tests/unit/test_replay_learning.py's schedules)."""
    clip_eps: float = 0.2
    """PPO clip range (the real trainer's default)."""
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    adv_eps: float = 1e-6
    """Added to a group's reward standard deviation (``knittrans.runtime.trainer.group_advantages``)."""

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 < self.clip_eps < 1:
            raise ValueError(f"ReplayConfig: lr > 0 and 0 < clip_eps < 1; got lr={self.lr}, clip_eps={self.clip_eps}")


@dataclass(frozen=True)
class ReplayCurve:
    """One replayed run."""

    expected_reward: tuple[float, ...]
    """Held-out expected reward after each of 0, 1, ..., S optimizer steps (entry 0: the initial policy)."""
    clip_frac: float
    """Of the samples with a non-zero advantage, the fraction whose ratio was outside the clip range (no
    gradient): what staleness costs this learner."""
    staleness_mean: float
    """Mean ``v_train - v_gen`` over every trajectory replayed."""
    mean_reward: float
    """Mean reward of the trajectories trained on (each drawn from its ``v_gen`` policy)."""

    @property
    def auc(self) -> float:
        """Mean held-out expected reward over the evaluation points (step 0 included), in [0, 1]."""
        return float(np.mean(self.expected_reward))

    @property
    def final(self) -> float:
        return self.expected_reward[-1]


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def replay(records, task: BanditTask, cfg: ReplayConfig, seed: int) -> ReplayCurve:  # noqa: ANN001
    """Replay a schedule: ``records`` has per-trajectory arrays ``group``, ``step`` (consuming optimizer step,
    0..S-1) and ``v_gen`` (weights version that generated it), as ``SimResult.records`` does; trajectory ids are
    array indices, in data-loader order. ``seed`` draws the task (teacher, prompts, held-out set) and every
    trajectory's sampling noise, so two schedules of the same workload replayed with one seed are paired.

    Raises ``ValueError`` on a schedule the learner cannot replay: a trajectory never consumed, a ``v_gen`` newer
    than the step that consumes it, or a group split across steps (GRPO normalizes within a whole group)."""
    group = np.asarray(records.group, dtype=np.int64)
    step = np.asarray(records.step, dtype=np.int64)
    v_gen = np.asarray(records.v_gen, dtype=np.int64)
    if not (len(group) == len(step) == len(v_gen)) or len(group) == 0:
        raise ValueError("replay: group, step and v_gen must be non-empty and of one length")
    if (step < 0).any() or (v_gen < 0).any():
        raise ValueError(f"replay: {int((step < 0).sum())} trajectories never consumed or never generated")
    if (v_gen > step).any():
        raise ValueError("replay: a trajectory generated with weights newer than its consuming step")
    gmin, gmax = {}, {}
    order = np.argsort(step, kind="stable")
    for g, s in zip(group[order], step[order]):
        gmin.setdefault(int(g), int(s))
        gmax[int(g)] = int(s)
    split = [g for g in gmin if gmin[g] != gmax[g]]
    if split:
        raise ValueError(f"replay: groups {split[:5]} are split across optimizer steps; GRPO needs whole groups")

    rng = np.random.default_rng([seed, 0x5EED])
    K, D = task.actions, task.features
    teacher = rng.normal(size=(K, D))
    heldout = rng.normal(size=(task.heldout, D))
    heldout_best = (heldout @ teacher.T).argmax(axis=1)
    uniq_groups, ginv = np.unique(group, return_inverse=True)
    prompts = np.random.default_rng([seed, 1]).normal(size=(len(uniq_groups), D))  # by rank of the group id
    best = (prompts @ teacher.T).argmax(axis=1)
    noise = np.random.default_rng([seed, 2]).random(len(group))  # each trajectory's sampling draw

    def expected(theta: np.ndarray) -> float:
        return float(_softmax(heldout @ theta.T)[np.arange(task.heldout), heldout_best].mean())

    theta = np.zeros((K, D))
    weights = [theta]  # weights[v]: the policy after v steps
    m, v = np.zeros_like(theta), np.zeros_like(theta)
    b1, b2 = cfg.beta1, cfg.beta2
    curve = [expected(theta)]
    n_steps = int(step.max()) + 1
    bounds = np.searchsorted(step[order], np.arange(n_steps + 1))
    clipped = informative = 0
    rewards_sum = 0.0
    for s in range(n_steps):
        ids = order[bounds[s]:bounds[s + 1]]
        if len(ids) == 0:
            raise ValueError(f"replay: optimizer step {s} consumed no trajectory")
        x, gi = prompts[ginv[ids]], ginv[ids]
        behaviour = np.empty((len(ids), K))
        for ver in np.unique(v_gen[ids]):
            sel = v_gen[ids] == ver
            behaviour[sel] = _softmax(x[sel] @ weights[ver].T)
        action = np.minimum((behaviour.cumsum(axis=1) < noise[ids, None]).sum(axis=1), K - 1)
        reward = (action == best[gi]).astype(np.float64)
        rewards_sum += reward.sum()
        adv = np.empty_like(reward)
        for g in np.unique(gi):
            sel = gi == g
            adv[sel] = (reward[sel] - reward[sel].mean()) / (reward[sel].std() + cfg.adv_eps)
        rows = np.arange(len(ids))
        current = _softmax(x @ theta.T)
        ratio = current[rows, action] / behaviour[rows, action]
        live = ((adv > 0) & (ratio < 1 + cfg.clip_eps)) | ((adv < 0) & (ratio > 1 - cfg.clip_eps))
        nonzero = adv != 0
        informative += int(nonzero.sum())
        clipped += int((nonzero & ~live).sum())
        # d/dtheta of -mean(min(r A, clip(r) A)): -r A (onehot(a) - pi) x^T on the unclipped samples
        coef = np.where(live, ratio * adv, 0.0) / len(ids)
        onehot = np.zeros_like(current)
        onehot[rows, action] = 1.0
        grad = -((onehot - current) * coef[:, None]).T @ x
        t = s + 1
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad * grad
        theta = theta - cfg.lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + cfg.adam_eps)
        weights.append(theta)
        curve.append(expected(theta))
    return ReplayCurve(tuple(curve), clipped / max(informative, 1), float(np.mean(step - v_gen)),
                       rewards_sum / len(group))
