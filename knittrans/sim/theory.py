"""The simulator against queueing theory: two closed forms it must reproduce (Little's law, L = lambda W).

**Group queue** (fully asynchronous, no flow control). Whole groups enter a queue when their last sample
finishes; the trainer consumes B trajectories per step; weights reach the engines after every step at no cost;
rollout keeps every slot busy. A trajectory is in generation from its start until its group completes,
E[max length in a group] * tpot on average, while steps happen at min(rollout, trainer) throughput / B. So its
mean pre-queue staleness (steps completed between its start and its group's completion) is

    C * M_tail / (B * max(1, rho)),   M_tail = E[max length in a group] / E[length],  rho = rollout / trainer

with C the concurrent slots and rho the ratio of rollout to trainer throughput in trajectories per second.

**In-flight budget.** With a budget of ``G`` groups that binds at all times (it fits in the engines' slots),
first-in-first-out admission, and weights synced after every step at no cost, a group spends exactly
``G / (groups per step) = G * n / (B / M)`` steps between its dispatch and the release of its budget place
(Little's law in the step clock). It is consumed one step before its release when the budget is released at
the end of the consuming step (``BudgetRelease.STEP_END``), at its release otherwise, so

    mean staleness = G * n / (B / M) - [release at step end].

Both checks take the admission policy and the workload as arguments (``knittrans`` builds neither).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from knittrans.admission.base import AdmissionPolicy
from knittrans.sim.config import (BudgetRelease, EngineConfig, FlowConfig, FlowKind, SimConfig, SyncConfig,
                                  TrainerConfig)
from knittrans.sim.simulator import simulate
from knittrans.staleness import pre_queue_staleness, run_metrics
from knittrans.types import SyncPolicy, WorkloadBatch


@dataclass(frozen=True)
class TheoryCheck:
    measured: float
    predicted: float

    @property
    def rel_error(self) -> float:
        """|measured / predicted - 1|; infinite when the prediction is 0 and the measurement is not."""
        if self.predicted == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return abs(self.measured / self.predicted - 1.0)


def group_queue_check(policy: AdmissionPolicy, batches: Sequence[WorkloadBatch], rho: float, slots: int = 128,
                      num_engines: int = 2, tpot: float = 0.01) -> TheoryCheck:
    """Mean pre-queue staleness against ``C * M_tail / (B * max(1, rho))``. ``policy`` must consume whole groups in
    completion order, one batch of B per step (``baselines.admission.BoundedAsyncAdmission`` with M = 1)."""
    lengths = np.concatenate([np.concatenate(list(b.lengths.values())) for b in batches])
    mean_len = float(lengths.mean())
    m_tail = float(np.mean([g.max() for b in batches for g in b.lengths.values()])) / mean_len
    C = slots * num_engines
    B = policy.constraints.batch_size
    rollout_thr = C / (mean_len * tpot)  # trajectories per second with every slot busy
    cfg = SimConfig(engine=EngineConfig(num_engines=num_engines, slots=slots, tpot=tpot),
                    trainer=TrainerConfig(step_overhead=B * rho / rollout_thr, per_token=0.0),
                    sync=SyncConfig(policy=SyncPolicy.EVERY_STEP, cost=0.0), flow=FlowConfig(kind=FlowKind.UNBOUNDED))
    res = simulate(cfg, policy, batches)
    # steady state: trajectories that started in the middle of the rollout phase
    start = res.records.t_start
    done = ~np.isnan(res.records.t_group_complete)
    pq = np.full(len(start), np.nan)
    pq[done] = pre_queue_staleness(res)
    lo, hi = np.quantile(start, [0.2, 0.7])
    measured = float(np.nanmean(pq[(start >= lo) & (start <= hi)]))
    return TheoryCheck(measured, C * m_tail / (B * max(1.0, rho)))


def budget_check(policy: AdmissionPolicy, batches: Sequence[WorkloadBatch], budget_groups: int,
                 release: BudgetRelease, warmup_batches: int = 2, tpot: float = 0.001,
                 step_overhead: float = 0.05) -> TheoryCheck:
    """Mean staleness against ``G * n / (B / M) - [release at step end]`` (module docstring). The engines get a
    slot for every trajectory the budget admits, so the budget is what binds; ``policy`` must admit the oldest
    completed groups first (KnitTrans does). Uniform group sizes only."""
    c = policy.constraints
    n = c.group_size
    if n is None:
        raise ValueError("budget_check needs uniform group sizes (constraints.group_size)")
    cfg = SimConfig(engine=EngineConfig(num_engines=1, slots=budget_groups * n, tpot=tpot),
                    trainer=TrainerConfig(step_overhead=step_overhead, per_token=0.0),
                    sync=SyncConfig(policy=SyncPolicy.EVERY_STEP, cost=0.0),
                    flow=FlowConfig(kind=FlowKind.GROUPS, budget_groups=budget_groups, release=release))
    m = run_metrics(simulate(cfg, policy, batches), warmup_batches=warmup_batches)
    steps_in_flight = budget_groups * n / c.minibatch_size
    return TheoryCheck(m.staleness.mean, steps_in_flight - (1.0 if release is BudgetRelease.STEP_END else 0.0))
