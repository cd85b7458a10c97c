"""Staleness, admission delay, throughput and idle metrics of a run (simulated or real).

The version definitions (policy version, ``v_gen``, ``v_train``, staleness) are in ``knittrans.types``. Here:

- **Colocated reference**: the same batch constraints run synchronously on shared resources (generate a whole
  batch, then train its M mini-batches). There ``s = j`` for the j-th mini-batch, mean ``(M-1)/2``: that part is
  algorithmic, not architectural.
- **Architectural staleness** ``A = mean s(architecture) - mean s(colocated)``, same workload and constraints.
  The headline metric is ``1 - A(KnitTrans) / A(train-batch)``.
- **Admission delay** (seconds): time from a trajectory's completion to the start of the step that consumes it.
- **Throughput**: trajectories (and response tokens) consumed per second of steady state.

Metrics are taken over a steady-state window: the steps after the first ``warmup_batches`` batches' worth of
steps (the pipeline fill), so that throughput and staleness are not dominated by the start-up transient.

Example::

    >>> import numpy as np
    >>> s = StalenessStats.of(np.array([0, 1, 2, 3]))
    >>> (s.mean, s.max)
    (1.5, 3.0)
    >>> colocated_mean_staleness(16)
    7.5
    >>> littles_law_staleness(budget_groups=4, groups_per_step=4, total_groups=64)  # one mini-batch in flight
    0.0
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def colocated_mean_staleness(num_minibatches: int) -> float:
    """Mean staleness of the colocated reference: the j-th of M mini-batches is j steps stale."""
    return (num_minibatches - 1) / 2.0


def littles_law_staleness(budget_groups: int, groups_per_step: float, total_groups: int,
                          sync_lag_mean: float = 0.0) -> float:
    """Mean staleness predicted from flow control alone, without any timing (Little's law, ``L = lambda W``).

    With the in-flight budget always full (rollout keeps up), ``L = budget`` groups are in flight and the trainer
    consumes ``lambda = groups_per_step`` per step, so a group spends ``W = budget / groups_per_step`` steps from
    dispatch to the step that consumes it: staleness ``W - 1`` (a group dispatched right after step v is trained
    at version ``v + W - 1``). The first ``budget`` groups all start at version 0 and are trained at steps
    ``0 .. W-1`` (mean ``(W - 1) / 2``); every later group is ``W - 1`` stale, plus the mean lag of the engine's
    weights behind the trainer's (``sync_lag_mean``: ``(k - 1) / 2`` for a sync every k steps). Rollout slower than
    training keeps fewer groups in flight, and the real staleness is lower.

        >>> littles_law_staleness(budget_groups=16, groups_per_step=8, total_groups=6400)  # two mini-batches
        0.99875
    """
    if budget_groups < 1 or groups_per_step <= 0 or total_groups < 1:
        raise ValueError(f"littles_law_staleness: budget_groups={budget_groups}, groups_per_step={groups_per_step} "
                         f"and total_groups={total_groups} must be positive")
    w = budget_groups / groups_per_step
    first = min(1.0, budget_groups / total_groups)
    return (w - 1.0) * (1.0 - first / 2.0) + sync_lag_mean * (1.0 - first)


@dataclass(frozen=True)
class StalenessStats:
    mean: float
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, s: np.ndarray) -> "StalenessStats":
        s = np.asarray(s, dtype=float)
        if s.size == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan)
        return cls(float(s.mean()), float(np.percentile(s, 50)), float(np.percentile(s, 99)), float(s.max()))


@dataclass(frozen=True)
class RunMetrics:
    policy: str
    staleness: StalenessStats
    arch_staleness: float  # mean staleness minus the colocated reference's
    admission_delay_mean: float
    admission_delay_p99: float
    throughput_traj_s: float
    throughput_tok_s: float
    trainer_idle_frac: float
    rollout_idle_frac: float  # 1 - slot utilization over the window
    steps: int
    trajectories: int
    dead_ends: int
    violations: int
    wasted_tokens: int


def window(result, warmup_batches: int) -> tuple[np.ndarray, float, float, list]:
    """Trajectory mask, window start and end time, and the steps of the steady-state window.

    The window runs from the end of the last warm-up step to the end of the last step, so it spans whole batch
    periods for every policy alike (batch end to batch end). Starting it at the first window step instead would
    favour train-batch admission, whose first step of a batch comes only after the whole batch has generated."""
    steps = result.steps
    first = min(warmup_batches * result.num_minibatches, max(0, len(steps) - 1))
    win = steps[first:]
    t0 = steps[first - 1].end if first > 0 else 0.0
    t1 = win[-1].end
    mask = result.records.step >= first
    return mask, t0, t1, win


def run_metrics(result, warmup_batches: int = 1, colocated_mean: float | None = None,
                engine_slots: int | None = None) -> RunMetrics:
    """Steady-state metrics of a simulator result (``knittrans.sim.SimResult``)."""
    r = result.records
    mask, t0, t1, win = window(result, warmup_batches)
    span = max(t1 - t0, 1e-12)
    s = r.staleness[mask]
    delay = (r.t_consumed - r.t_complete)[mask]
    coloc = colocated_mean if colocated_mean is not None else colocated_mean_staleness(result.num_minibatches)
    busy = sum(st.end - st.start for st in win)
    stats = StalenessStats.of(s)
    rollout_idle = float("nan")
    if engine_slots is not None and result.total_time > 0:
        cap = engine_slots * len(result.engine_slot_seconds) * result.total_time
        rollout_idle = 1.0 - float(result.engine_slot_seconds.sum()) / cap
    return RunMetrics(
        policy=result.policy, staleness=stats, arch_staleness=stats.mean - coloc,
        admission_delay_mean=float(delay.mean()) if delay.size else float("nan"),
        admission_delay_p99=float(np.percentile(delay, 99)) if delay.size else float("nan"),
        throughput_traj_s=float(mask.sum()) / span, throughput_tok_s=float(r.length[mask].sum()) / span,
        trainer_idle_frac=1.0 - busy / span, rollout_idle_frac=rollout_idle, steps=len(win),
        trajectories=int(mask.sum()), dead_ends=result.policy_stats.dead_ends,
        violations=result.policy_stats.violations, wasted_tokens=result.wasted_tokens)


def pre_queue_staleness(result) -> np.ndarray:
    """Per trajectory: optimizer steps completed between its start and its group's completion (the staleness a
    trajectory accrues before its group can enter a training queue)."""
    ends = np.array([st.end for st in result.steps])
    r = result.records
    done = ~np.isnan(r.t_group_complete)
    v_at = np.searchsorted(ends, r.t_group_complete[done], side="right")
    return v_at - r.v_gen[done]
