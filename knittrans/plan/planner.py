"""``plan``: the user's inputs in, each policy's staleness-throughput frontier and the recommended setting out.

Stages: resolve the inputs into a scenario (``scenario.resolve``, or ``calibrated.resolve_calibrated`` from run
traces); list the settings (each policy at each value of its knob, plus the colocated reference); simulate them
(``sweep.sweep``); read off each policy's frontier and the recommendation for the target (``recommend``); state
the simulator's validation error beside them (``Validation``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from knittrans.plan import calibrated
from knittrans.plan.calibrated import HeldOut
from knittrans.plan.config import PlanConfig
from knittrans.plan.policies import COLOCATED, PolicyFactory, grids, resolve
from knittrans.plan.recommend import Target, TargetUnreachable, frontier, recommend
from knittrans.plan.scenario import Scenario
from knittrans.plan.scenario import resolve as resolve_scenario
from knittrans.plan.sweep import PlanPoint, Setting, sweep
from knittrans.sim.simulator import SimDeadlock
from knittrans.sim.theory import budget_check
from knittrans.types import AdmissionKind

THEORY_BATCHES = 6
"""Batches of the scenario the Little's-law check simulates (it needs a steady state, not the whole sweep's)."""


@dataclass(frozen=True)
class Validation:
    """How far the simulator is from theory and, with a real trial, from reality, on this workload."""

    littles_law_error: float | None
    """|simulated / closed-form - 1| of mean staleness at a binding budget of two mini-batches, on the plan's batch
    shape and lengths (``knittrans.sim.theory.budget_check``): checks the simulator's flow control and version
    accounting, not its time model. None when KnitTrans's policy is not swept."""
    littles_law_note: str
    heldout_method: str
    heldout: tuple[HeldOut, ...] = ()
    """Real runs predicted by a time model fitted without them (``--calibrate``); empty otherwise."""

    def heldout_summary(self, timing_sensitive: bool | None = None) -> HeldOutSummary | None:
        """The held-out errors summarized as the sim-vs-real table does (per setting, the median over its runs;
        then the median and max over settings), over timing-sensitive settings only when True; None if none."""
        by: dict[str, list[HeldOut]] = {}
        for h in self.heldout:
            by.setdefault(h.setting, []).append(h)
        per = {s: float(np.median([h.error for h in hs])) for s, hs in by.items()
               if timing_sensitive is None or all(h.timing_sensitive for h in hs) == timing_sensitive}
        if not per:
            return None
        runs = [h for h in self.heldout if h.setting in per]
        worst = max(per, key=per.get)
        return HeldOutSummary(float(np.median(list(per.values()))), per[worst], worst, len(per), len(runs),
                              max(h.error for h in runs), float(np.median([h.steps_error for h in runs])),
                              max(h.steps_error for h in runs))


@dataclass(frozen=True)
class HeldOutSummary:
    median: float
    """Median over settings of each setting's median error (the sim-vs-real claim's statistic)."""
    worst: float
    worst_setting: str
    settings: int
    runs: int
    worst_run: float
    """The largest single run's error."""
    steps_median: float
    """Median over runs of the whole-run steps/s error (context; the bound is on staleness)."""
    steps_worst: float


@dataclass(frozen=True)
class Plan:
    config: PlanConfig
    scenario: Scenario
    target: Target
    points: tuple[PlanPoint, ...]
    """Every setting's point, the colocated reference first."""
    frontiers: dict[str, tuple[PlanPoint, ...]]
    """Each swept policy's frontier (``recommend.frontier``)."""
    best: dict[str, PlanPoint | None]
    """Each policy's recommended point for the target (None: it cannot meet it)."""
    recommendation: PlanPoint | None
    """The recommended point over every policy; None when the target is unreachable (``unmet``)."""
    unmet: TargetUnreachable | None
    validation: Validation

    def of(self, policy: str) -> list[PlanPoint]:
        return [p for p in self.points if p.setting.policy == policy]

    def recommended(self) -> PlanPoint:
        """The recommendation; raises ``TargetUnreachable`` (naming the binding constraint) when no setting meets
        the target. The plan itself is returned either way, so its frontiers can still be shown."""
        if self.recommendation is None:
            assert self.unmet is not None
            raise self.unmet
        return self.recommendation


def settings(scn: Scenario, policies: tuple[str, ...], grid: tuple[str, ...]) -> list[Setting]:
    """The colocated reference, then each policy at each value of its knob."""
    g = grids(policies, grid, scn.num_minibatches)
    return [Setting(COLOCATED, 1.0)] + [Setting(p, v) for p in policies for v in g[p]]


def littles_law(scn: Scenario, factories: Mapping[str, PolicyFactory]) -> tuple[float | None, str]:
    kt = AdmissionKind.KNITTRANS.value
    if kt not in factories:
        return None, "not measured: the check runs KnitTrans's policy, which this plan does not sweep"
    groups = max(1, round(2 * scn.constraints.minibatch_size / scn.group_size))
    batches = scn.batches[:THEORY_BATCHES]
    try:
        chk = budget_check(factories[kt](scn.constraints), batches, groups, scn.release,
                           warmup_batches=min(2, len(batches) - 1))
    except SimDeadlock as e:  # e.g. a token budget two mini-batches of groups cannot fill: say so, do not fail
        return None, f"not measured: the check's budget of {groups} groups stalled ({e})"
    return chk.rel_error, (f"budget of {groups} groups, {len(batches)} batches: simulated mean staleness "
                           f"{chk.measured:.3f} vs Little's law {chk.predicted:.3f}")


def plan(cfg: PlanConfig, factories: Mapping[str, PolicyFactory] | None = None, progress: bool = True) -> Plan:
    """Run the planner on ``cfg``. ``factories`` maps policy names to ``BatchConstraints -> AdmissionPolicy``
    callables; None reads them from the ``knittrans.policies`` entry points (``knittrans.plan.policies``)."""
    target = Target.parse(cfg.target)
    runs = calibrated.load_runs(cfg.calibrate) if cfg.calibrate else []
    extra = tuple(r.config.admission.value for r in runs)
    fac = resolve(tuple(dict.fromkeys(cfg.policies + extra)), factories)
    scn = calibrated.resolve_calibrated(cfg, runs)[0] if runs else resolve_scenario(cfg)
    points = tuple(sweep(scn, settings(scn, cfg.policies, cfg.grid), fac, cfg.workers, progress))
    frontiers = {p: tuple(frontier([q for q in points if q.setting.policy == p])) for p in cfg.policies}
    best: dict[str, PlanPoint | None] = {}
    for p in cfg.policies:
        try:
            best[p] = recommend([q for q in points if q.setting.policy == p], target)
        except TargetUnreachable:
            best[p] = None
    swept = [q for q in points if q.setting.policy != COLOCATED]
    try:
        rec, unmet = recommend(swept, target), None
    except TargetUnreachable as e:
        rec, unmet = None, e
    lit, lit_note = littles_law(scn, fac)
    method, held = calibrated.heldout(runs, fac) if runs else (
        "not measured: no real run given (--calibrate TRACE fits the time model to a trial and measures it)", [])
    return Plan(cfg, scn, target, points, frontiers, best, rec, unmet,
                Validation(lit if lit is None or math.isfinite(lit) else None, lit_note, method, tuple(held)))
