"""Frontiers and the recommended setting for a target.

**Frontier** of a policy: its valid points (``PlanPoint.valid``) not dominated in (more steps/s, lower mean
staleness), by increasing throughput (``knittrans.staleness.pareto_front``). Staleness here is the raw
``v_train - v_gen`` a user bounds (AReaL's eta bounds it too); architectural staleness subtracts a constant
``(M - 1) / 2`` and orders the points the same way.

**Recommendation** for a ``Target``, over valid points only:

- ``max-throughput``: the most steps/s; among points within ``THROUGHPUT_TIE`` (1%) of it, the lowest mean
  staleness (a 0.5% slower setting at half the staleness is the better advice);
- ``staleness<=S`` / ``p99<=S``: the most steps/s among points whose mean (p99) staleness is at most S, ties as
  above;
- ``steps/s>=X``: the lowest mean staleness among points that reach X steps/s, ties to the faster.

Exact ties go to the smaller knob value (less work in flight), then away from greedy streaming (which keeps the
batch constraints only where it happens to meet no dead end; every other policy keeps them by construction), then
to the policy listed first.

A target no setting meets raises ``TargetUnreachable``, which names the constraint that binds and the best any
setting reached.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Sequence

from knittrans.plan.config import PlanError, PlanInputError
from knittrans.plan.sweep import PlanPoint
from knittrans.staleness import THROUGHPUT_TIE, OperatingPoint, pareto_front
from knittrans.types import AdmissionKind

class TargetKind(str, enum.Enum):
    MAX_THROUGHPUT = "max-throughput"
    MEAN_STALENESS = "staleness"
    P99_STALENESS = "p99"
    MIN_THROUGHPUT = "steps/s"


@dataclass(frozen=True)
class Target:
    kind: TargetKind
    value: float = math.nan

    @classmethod
    def parse(cls, text: str) -> "Target":
        """``max-throughput``, ``staleness<=S``, ``p99<=S`` or ``steps/s>=X``.

        >>> Target.parse("staleness<=2.5")
        Target(kind=<TargetKind.MEAN_STALENESS: 'staleness'>, value=2.5)
        """
        t = text.replace(" ", "")
        if t == TargetKind.MAX_THROUGHPUT.value:
            return cls(TargetKind.MAX_THROUGHPUT)
        m = re.fullmatch(r"(staleness|p99)<=([0-9.eE+-]+)|(steps/s)>=([0-9.eE+-]+)", t)
        try:
            value = float(m.group(2) or m.group(4)) if m else math.nan
        except ValueError:
            value = math.nan
        if not m or not math.isfinite(value) or value < 0:
            raise PlanInputError("target", f"{text!r}: use max-throughput, staleness<=S, p99<=S or steps/s>=X (S "
                                           f"in steps, X in optimizer steps per second, both >= 0)")
        return cls(TargetKind(m.group(1) or m.group(3)), value)

    def meets(self, p: PlanPoint) -> bool:
        m = p.metrics
        if m is None:
            return False
        if self.kind is TargetKind.MEAN_STALENESS:
            return m.staleness_mean <= self.value
        if self.kind is TargetKind.P99_STALENESS:
            return m.staleness_p99 <= self.value
        if self.kind is TargetKind.MIN_THROUGHPUT:
            return m.steps_per_s >= self.value
        return True

    def __str__(self) -> str:
        if self.kind is TargetKind.MAX_THROUGHPUT:
            return self.kind.value
        op = ">=" if self.kind is TargetKind.MIN_THROUGHPUT else "<="
        return f"{self.kind.value}{op}{self.value:g}"


class Binding(str, enum.Enum):
    """What stops a target from being met."""

    STALENESS = "staleness bound"
    TRAINER = "trainer throughput"
    ROLLOUT = "rollout throughput"
    NO_VALID_POINT = "no valid setting"


class TargetUnreachable(PlanError):
    """No swept setting meets the target. ``binding`` says which constraint binds; ``best`` is the setting that
    came closest (None when no setting ran)."""

    def __init__(self, target: Target, binding: Binding, best: PlanPoint | None, message: str) -> None:
        self.target, self.binding, self.best = target, binding, best
        super().__init__(f"--target {target}: unreachable ({binding.value} binds): {message}")


def frontier(points: Sequence[PlanPoint]) -> list[PlanPoint]:
    """The valid points of ``points`` on their staleness-throughput Pareto front, by increasing steps/s."""
    valid = [p for p in points if p.valid]
    # OperatingPoint's budget field carries each point's index through pareto_front (which keeps what it is given)
    ops = [OperatingPoint(p.metrics.steps_per_s, p.metrics.staleness_mean, budget=i) for i, p in enumerate(valid)]
    return [valid[int(op.budget)] for op in pareto_front(ops)]


def _tie_break(p: PlanPoint) -> tuple[float, bool]:
    return p.setting.value, p.setting.policy == AdmissionKind.GREEDY.value


def _best_by_throughput(cands: list[PlanPoint], tie: float) -> PlanPoint:
    top = max(p.metrics.steps_per_s for p in cands)
    near = [p for p in cands if p.metrics.steps_per_s >= top * (1.0 - tie)]
    return min(near, key=lambda p: (p.metrics.staleness_mean, -p.metrics.steps_per_s, *_tie_break(p)))


def recommend(points: Sequence[PlanPoint], target: Target, tie: float = THROUGHPUT_TIE) -> PlanPoint:
    """The recommended point for ``target`` (module docstring), or ``TargetUnreachable``."""
    valid = [p for p in points if p.valid]
    if not valid:
        raise TargetUnreachable(target, Binding.NO_VALID_POINT, None,
                                "no setting ran to the end with the batch constraints kept (every one stalled or "
                                "broke a constraint: see the points' notes)")
    meet = [p for p in valid if target.meets(p)]
    if not meet:
        raise _unreachable(valid, target)
    if target.kind is TargetKind.MIN_THROUGHPUT:
        return min(meet, key=lambda p: (p.metrics.staleness_mean, -p.metrics.steps_per_s, *_tie_break(p)))
    return _best_by_throughput(meet, tie)


def same_prediction(a: PlanPoint, b: PlanPoint) -> bool:
    """Whether two valid points predict the same mean staleness and steps/s (e.g. greedy streaming and KnitTrans
    at one budget where greedy never meets a dead end)."""
    return (math.isclose(a.metrics.staleness_mean, b.metrics.staleness_mean, rel_tol=1e-9, abs_tol=1e-12)
            and math.isclose(a.metrics.steps_per_s, b.metrics.steps_per_s, rel_tol=1e-9))


def _unreachable(valid: list[PlanPoint], target: Target) -> TargetUnreachable:
    if target.kind is TargetKind.MIN_THROUGHPUT:
        best = max(valid, key=lambda p: p.metrics.steps_per_s)
        m = best.metrics
        # which side is slower at full capacity (weight syncs pause both sides alike, so they do not decide it)
        trainer_bound = m.rollout_trainer_ratio >= 1.0
        why = (f"rollout could deliver {m.rollout_trainer_ratio:.2g}x what the trainer consumes, so only a faster "
               f"trainer (or fewer, cheaper steps) goes faster" if trainer_bound else
               f"rollout at full capacity delivers only {m.rollout_trainer_ratio:.2g}x what the trainer could "
               f"consume: rollout capacity (engines, slots, decode speed) or the response lengths bind")
        return TargetUnreachable(target, Binding.TRAINER if trainer_bound else Binding.ROLLOUT, best,
                                 f"the fastest setting, {best.setting.short}, reaches "
                                 f"{m.steps_per_s:.4g} steps/s (trainer idle {m.trainer_idle:.0%}, rollout idle "
                                 f"{m.rollout_idle:.0%}); {why}")
    key = "staleness_p99" if target.kind is TargetKind.P99_STALENESS else "staleness_mean"
    best = min(valid, key=lambda p: getattr(p.metrics, key))
    return TargetUnreachable(target, Binding.STALENESS, best,
                             f"the least stale setting, {best.setting.short}, has "
                             f"{target.kind.value} staleness {getattr(best.metrics, key):.3g} steps (smaller "
                             f"budgets, down to one mini-batch in flight, or more frequent weight syncs lower it)")
