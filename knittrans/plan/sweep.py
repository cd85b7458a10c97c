"""The planner's sweep: every (policy, knob value) of the plan simulated on the user's scenario, in parallel.

Each setting is one ``knittrans.sim.sweep.run_config`` call (the staleness table's reduction to steady-state
metrics) on ``setting_config(scenario, setting)``; nothing else is computed, so a point's numbers are the
simulator's on those inputs. Settings run in worker processes (``concurrent.futures``: one per core by default);
a process pool, not Ray, because a one-machine command should not pay a cluster's start-up for ~20 tasks.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from tqdm import tqdm

from knittrans.plan.policies import COLOCATED, Knob, PolicyFactory, knob
from knittrans.plan.scenario import Scenario
from knittrans.sim.config import FlowConfig, FlowKind, SimConfig
from knittrans.sim.sweep import PointMetrics, PointRun, run_config
from knittrans.types import AdmissionKind


@dataclass(frozen=True)
class Setting:
    """One operating point: a policy at one value of its knob (``knittrans.plan.policies.Knob``)."""

    policy: str
    value: float
    """Budget in batches of groups, or eta (bounded async); ignored by the colocated reference."""

    @property
    def knob(self) -> Knob:
        return knob(self.policy)

    @property
    def short(self) -> str:
        """``policy knob=value``, e.g. ``knittrans budget=0.5`` or ``bounded_async eta=2``."""
        return COLOCATED if self.policy == COLOCATED else f"{self.policy} {self.knob.value}={self.value:g}"

    def label(self, prompts_per_batch: int) -> str:
        if self.policy == COLOCATED:
            return "synchronous (generate a batch, then train it)"
        if self.knob is Knob.ETA:
            return f"eta={self.value:g}"
        return f"budget {self.value:g} batch ({budget_groups(self, prompts_per_batch)} groups)"


def budget_groups(setting: Setting, prompts_per_batch: int) -> int:
    return max(1, round(setting.value * prompts_per_batch))


@dataclass(frozen=True)
class PlanPoint:
    """A setting and what the simulator predicts for it (``run``: its steady-state metrics, or why none)."""

    setting: Setting
    run: PointRun

    @property
    def ok(self) -> bool:
        return self.run.ok

    @property
    def note(self) -> str:
        return self.run.note

    @property
    def metrics(self) -> PointMetrics | None:
        return self.run.metrics

    @property
    def valid(self) -> bool:
        """Ran to the end with every batch constraint kept (greedy streaming can dead-end and break them)."""
        return self.ok and self.metrics is not None and self.metrics.violations == 0 and self.metrics.dead_ends == 0


def setting_config(scn: Scenario, s: Setting) -> SimConfig:
    """The simulator's config of setting ``s``: the scenario's engines, trainer and sync, ``s``'s flow control."""
    if s.policy == COLOCATED:
        return scn.colocated
    if s.knob is Knob.ETA:
        flow = FlowConfig(kind=FlowKind.AREAL, eta=int(s.value))
    else:
        flow = FlowConfig(kind=FlowKind.GROUPS, budget_groups=budget_groups(s, scn.prompts_per_batch),
                          release=scn.release)
    return replace(scn.disaggregated, flow=flow)


def policy_name(s: Setting) -> str:
    """The admission policy a setting runs (the colocated reference admits whole batches)."""
    return AdmissionKind.TRAIN_BATCH.value if s.policy == COLOCATED else s.policy


def run_setting(scn: Scenario, s: Setting, factories: Mapping[str, PolicyFactory]) -> PlanPoint:
    policy = factories[policy_name(s)](scn.constraints)
    return PlanPoint(s, run_config(setting_config(scn, s), policy, scn.batches, scn.warmup_batches,
                                   group_size=scn.group_size))


_WORKER: tuple[Scenario, Mapping[str, PolicyFactory]] | None = None


def _init_worker(scn: Scenario, factories: Mapping[str, PolicyFactory]) -> None:
    global _WORKER
    _WORKER = (scn, factories)


def _run_in_worker(s: Setting) -> PlanPoint:
    assert _WORKER is not None, "the pool's initializer did not run"
    return run_setting(_WORKER[0], s, _WORKER[1])


def sweep(scn: Scenario, settings: Sequence[Setting], factories: Mapping[str, PolicyFactory], workers: int = 0,
          progress: bool = True) -> list[PlanPoint]:
    """Every setting's point, in the order of ``settings``; ``workers`` processes (0: one per core, 1: this
    process). The scenario and factories go to each worker once, not once per setting."""
    n = min(len(settings), workers or os.cpu_count() or 1)
    bar = tqdm(total=len(settings), desc="knittrans-plan", unit="setting", disable=not progress, mininterval=0.5)
    try:
        if n <= 1:
            out = []
            for s in settings:
                out.append(run_setting(scn, s, factories))
                bar.update(1)
            return out
        results: dict[int, PlanPoint] = {}
        with ProcessPoolExecutor(n, initializer=_init_worker, initargs=(scn, factories)) as pool:
            futures = {pool.submit(_run_in_worker, s): i for i, s in enumerate(settings)}
            for f in as_completed(futures):
                results[futures[f]] = f.result()
                bar.update(1)
        return [results[i] for i in range(len(settings))]
    finally:
        bar.close()
