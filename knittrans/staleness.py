"""Staleness, admission delay, throughput and idle metrics of a run (simulated or real).

The version definitions (policy version, ``v_gen``, ``v_train``, staleness) are in ``knittrans.types``. Here:

- **Colocated reference**: the same batch constraints run synchronously on shared resources (generate a whole
  batch, then train its M mini-batches). There ``s = j`` for the j-th mini-batch, mean ``(M-1)/2``: that part is
  algorithmic, not architectural.
- **Architectural staleness** ``A = mean s(architecture) - mean s(colocated)``, same workload and constraints.
  The headline metric is ``1 - A(KnitTrans) / A(train-batch)``, uncapped, decided at train-batch's trainer-bound
  (maximum-throughput) Pareto point with KnitTrans throughput-matched (``trainer_bound``).
- **Admission delay** (seconds): time from a trajectory's completion to the start of the step that consumes it.
- **Throughput**: trajectories (and response tokens) consumed per second of steady state.
- **Matched comparison** (``matched_reductions``): policies are compared on the staleness-throughput frontier,
  never at one budget. For every train-batch Pareto point, KnitTrans's architectural staleness at equal or
  higher throughput is read off KnitTrans's own Pareto front, linearly between its neighbouring points
  (alternating those two budgets reaches about that point, so it is an operating point, not an extrapolation,
  and it is conservative next to the front's convex hull). The interpolation keeps the matched value from
  jumping between budgets of a coarse grid.
- **Reduction** (``arch_reduction``): ``1 - A_kt / A_tb``, uncapped: above 1 when KnitTrans runs below the
  colocated reference (``A_kt < 0``), negative when it is staler than train-batch. Only where
  ``A_tb >= MIN_ARCH_STALENESS`` (one optimizer step: the resolution of staleness; below it the ratio explodes and
  there is no architectural staleness to reduce); None where KnitTrans cannot reach the train-batch point's
  throughput at all (within ``THROUGHPUT_TIE``): there is no matched point to compare.
- **Trainer-bound point** (``trainer_bound``): of train-batch's Pareto points, the one with the highest throughput
  (the front's last point): where a disaggregated deployment runs train-batch admission (one-step-off or more in
  flight, the trainer saturated). The headline is decided there; the other points are context.

Metrics are taken over a steady-state window: the steps after the first ``warmup_batches`` batches' worth of
steps (the pipeline fill), so that throughput and staleness are not dominated by the start-up transient.

Example::

    >>> import numpy as np
    >>> s = StalenessStats.of(np.array([0, 1, 2, 3]))
    >>> (s.mean, s.max)
    (1.5, 3.0)
    >>> colocated_mean_staleness(16)
    7.5
    >>> arch_reduction(a_knittrans=-0.75, a_train_batch=7.5), arch_reduction(0.75, 7.5)  # below colocated: > 1
    (1.1, 0.9)
    >>> arch_reduction(0.1, 0.2) is None   # under one step of architectural staleness: nothing to reduce
    True
    >>> littles_law_staleness(budget_groups=4, groups_per_step=4, total_groups=64)  # one mini-batch in flight
    0.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MIN_ARCH_STALENESS = 1.0
"""Train-batch points with less architectural staleness than this (steps) give no reduction to measure."""
THROUGHPUT_TIE = 0.01
"""Relative throughput difference treated as a tie when matching at the top of a front: where both policies are
trainer-bound they run at the same rate and differ only by which trajectories fill the window's steps."""


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

    @classmethod
    def of_counts(cls, counts: "Sequence[tuple[float, int]]") -> "StalenessStats":
        """The same statistics as ``of`` over a histogram, (value, how many) pairs: what a controller keeps instead
        of every trajectory's value (bounded memory). Percentiles interpolate linearly between order statistics, as
        ``numpy.percentile``'s default does, so both give the same numbers.

            >>> StalenessStats.of_counts([(0, 3), (2, 1)]) == StalenessStats.of(np.array([0, 0, 0, 2]))
            True
        """
        pairs = sorted((float(v), int(n)) for v, n in counts if n > 0)
        if not pairs:
            return cls.of(np.zeros(0))
        values = np.array([v for v, _ in pairs])
        ends = np.cumsum([n for _, n in pairs])  # order statistics 0 .. ends[i] - 1 have values[<= i]
        total = int(ends[-1])

        def at(k: int) -> float:  # the k-th order statistic (0-based)
            return float(values[int(np.searchsorted(ends, k, side="right"))])

        def pct(q: float) -> float:
            pos = q / 100.0 * (total - 1)
            lo = int(np.floor(pos))
            hi = min(lo + 1, total - 1)
            return at(lo) + (at(hi) - at(lo)) * (pos - lo)

        mean = float(sum(v * n for v, n in pairs) / total)
        return cls(mean, pct(50), pct(99), float(values[-1]))


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
    steps_per_s: float
    """Optimizer steps per second of steady state (the window's steps over its span)."""


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
        violations=result.policy_stats.violations, wasted_tokens=result.wasted_tokens, steps_per_s=len(win) / span)


def pre_queue_staleness(result) -> np.ndarray:
    """Per trajectory: optimizer steps completed between its start and its group's completion (the staleness a
    trajectory accrues before its group can enter a training queue)."""
    ends = np.array([st.end for st in result.steps])
    r = result.records
    done = ~np.isnan(r.t_group_complete)
    v_at = np.searchsorted(ends, r.t_group_complete[done], side="right")
    return v_at - r.v_gen[done]


# -- the frontier and the matched comparison -------------------------------------------------------------------


@dataclass(frozen=True)
class OperatingPoint:
    """One run on the staleness-throughput plane."""

    throughput: float
    """Trajectories consumed per second of steady state."""
    arch_staleness: float
    """Mean staleness minus the colocated reference's, in steps."""
    budget: float = math.nan
    """The in-flight budget that produced it (for reporting)."""


def pareto_front(points: Sequence[OperatingPoint]) -> list[OperatingPoint]:
    """Points not dominated in (higher throughput, lower architectural staleness), by increasing throughput (so
    also by increasing staleness). Non-finite points are dropped.

    >>> [p.throughput for p in pareto_front([OperatingPoint(1, 5), OperatingPoint(2, 4), OperatingPoint(1.5, 6),
    ...                                      OperatingPoint(3, 8)])]
    [2, 3]
    """
    ok = [p for p in points if math.isfinite(p.throughput) and math.isfinite(p.arch_staleness)]
    front = [p for p in ok if not any(
        q.throughput >= p.throughput and q.arch_staleness <= p.arch_staleness
        and (q.throughput > p.throughput or q.arch_staleness < p.arch_staleness) for q in ok)]
    front = sorted(front, key=lambda p: (p.throughput, p.arch_staleness))
    return [p for i, p in enumerate(front) if i == 0 or p != front[i - 1]]


def frontier_staleness(points: Sequence[OperatingPoint], throughput: float,
                       tie: float = THROUGHPUT_TIE) -> float | None:
    """The lowest architectural staleness reachable at ``throughput`` or more along the points' Pareto front:
    linear between the two front points around ``throughput``; the front's first point when it is already
    faster; the fastest point when it is within ``tie`` (relative) of ``throughput``; None otherwise.

    >>> pts = [OperatingPoint(1.0, 0.0), OperatingPoint(2.0, 4.0)]
    >>> frontier_staleness(pts, 0.5), frontier_staleness(pts, 1.5), frontier_staleness(pts, 2.5)
    (0.0, 2.0, None)
    """
    front = pareto_front(points)
    if not front:
        return None
    if throughput > front[-1].throughput:
        return front[-1].arch_staleness if throughput <= front[-1].throughput * (1.0 + tie) else None
    if throughput <= front[0].throughput:
        return front[0].arch_staleness
    for lo, hi in zip(front, front[1:]):
        if lo.throughput <= throughput <= hi.throughput:
            w = (throughput - lo.throughput) / (hi.throughput - lo.throughput)
            return lo.arch_staleness + w * (hi.arch_staleness - lo.arch_staleness)
    return front[-1].arch_staleness  # unreachable: the loop covers [first, last]


def arch_reduction(a_knittrans: float, a_train_batch: float, min_arch: float = MIN_ARCH_STALENESS) -> float | None:
    """``1 - A_kt / A_tb``, uncapped (module docstring); None when ``A_tb < min_arch``."""
    if not a_train_batch >= min_arch:
        return None
    return float(1.0 - a_knittrans / a_train_batch)


@dataclass(frozen=True)
class MatchedPoint:
    train_batch: OperatingPoint
    arch_knittrans: float | None
    """KnitTrans's architectural staleness at equal or higher throughput (None: it never gets that fast)."""
    reduction: float | None
    """``arch_reduction`` of the pair, uncapped; None where KnitTrans has no matching point."""


def matched_reductions(knittrans: Sequence[OperatingPoint], train_batch: Sequence[OperatingPoint],
                       min_arch: float = MIN_ARCH_STALENESS) -> list[MatchedPoint]:
    """One ``MatchedPoint`` for every train-batch Pareto point with ``A_tb >= min_arch``, by increasing throughput
    (so the last one is the trainer-bound point, ``trainer_bound``).

    >>> tb = [OperatingPoint(2.0, 4.0), OperatingPoint(3.0, 8.0)]
    >>> kt = [OperatingPoint(1.0, 0.1), OperatingPoint(2.5, 2.0), OperatingPoint(3.0, 4.0)]
    >>> [round(m.arch_knittrans, 3) for m in matched_reductions(kt, tb)]  # 2/3 of the way from (1, 0.1) to (2.5, 2)
    [1.367, 4.0]
    >>> [round(m.reduction, 3) for m in matched_reductions(kt, tb)]
    [0.658, 0.5]
    """
    out = []
    for q in pareto_front(train_batch):
        if not q.arch_staleness >= min_arch:
            continue
        a_kt = frontier_staleness(knittrans, q.throughput)
        out.append(MatchedPoint(q, a_kt, None if a_kt is None else arch_reduction(a_kt, q.arch_staleness, min_arch)))
    return out


def trainer_bound(matched: Sequence[MatchedPoint]) -> MatchedPoint | None:
    """The matched point at train-batch's fastest Pareto point (``matched_reductions``' last), or None.

    >>> tb = [OperatingPoint(2.0, 4.0, budget=1), OperatingPoint(3.0, 8.0, budget=2)]
    >>> trainer_bound(matched_reductions([OperatingPoint(3.0, 2.0)], tb)).train_batch.budget
    2
    """
    return max(matched, key=lambda m: m.train_batch.throughput, default=None)
