"""Operating points of the staleness-throughput frontier: one simulated run per (policy, batch shape, in-flight
budget, sync policy, budget-release convention), reduced to its steady-state metrics.

The time model is a reference cluster's (``SystemModel``; its defaults are our DAPO-scale assumptions), scaled to
the batch being simulated so that a smaller batch is a time-scaled replica of the reference rather than a
different system. **Scaling rule** (``SystemModel.scaled``), with ``c = B / reference_batch_size``:

- rollout capacity (total sequence slots) is ``c`` times the reference's, so the slots per trajectory of a batch,
  and with the same length distribution the time to generate a batch, are the reference's;
- the trainer's time per response token is divided by ``c`` and its per-step overhead is multiplied by
  ``reference_num_minibatches / M``, so the trainer's time per *batch* is the reference's at any M;
- a weight sync costs the reference's time (the model's size does not change).

So the ratio of rollout to trainer throughput (``rollout_trainer_ratio``: trainer seconds per batch over rollout
seconds per batch with every slot busy) is the reference's at every sweep point, and a point with the reference's
batch shape is the reference config in miniature. The policy and the workload are passed in (``knittrans`` builds
neither): see ``repro.staleness`` for how the table builds them.

Example (a smaller batch keeps the reference's throughput ratio)::

    >>> m = SystemModel()
    >>> engine, trainer = m.scaled(batch_size=1024, num_minibatches=16, group_size=16)
    >>> engine.num_engines, engine.slots, trainer.step_overhead, round(trainer.per_token, 6)
    (1, 256, 2.0, 0.0001)
    >>> round(m.rollout_trainer_ratio(8192, 16, mean_len=4500), 3) == round(
    ...     m.rollout_trainer_ratio(1024, 16, mean_len=4500), 3)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from knittrans.admission.base import AdmissionPolicy
from knittrans.constraints import BatchConstraints
from knittrans.sim.config import (BudgetRelease, EngineConfig, FlowConfig, FlowKind, SimConfig, SyncConfig,
                                  TrainerConfig)
from knittrans.sim.simulator import SimDeadlock, SimResult, simulate
from knittrans.staleness import run_metrics, window
from knittrans.types import AdmissionKind, ExecutionMode, InflightPolicy, SyncPolicy, WorkloadBatch

COLOCATED = "colocated"
"""The policy label of the colocated reference (it admits with train-batch; generation and training alternate)."""


@dataclass
class SystemModel:
    """The reference cluster's time model. Defaults: our DAPO-scale assumptions, not published figures (8 vLLM
    engines of 256 sequences at 25 ms per decode step, a trainer at 80k response tokens/s plus 2 s per step, a 5 s
    weight broadcast), which put rollout and trainer throughput within 10% of each other (the trainer slightly
    slower), the regime where the handoff matters. Not frozen, so Hydra can override its fields."""

    num_engines: int = 8
    """Rollout engines of the reference cluster."""
    slots: int = 256
    """Concurrent sequences per engine (vLLM's max_num_seqs)."""
    tpot: float = 0.025
    """Seconds per decode step."""
    load_alpha: float = 0.0
    """Decode step time grows by this fraction at full load."""
    step_overhead: float = 2.0
    """Trainer seconds per optimizer step independent of tokens, at the reference's mini-batches per batch."""
    per_token: float = 12.5e-6
    """Trainer seconds per response token (fwd + bwd + old-logprob recompute), at the reference batch size."""
    sync_cost: float = 5.0
    """Seconds per weight sync (both sides pause); also the colocated mode's switch cost."""
    sync_k: int = 4
    """With sync policy every_k: push weights every this many optimizer steps."""
    inflight: InflightPolicy = InflightPolicy.CONTINUE
    """Requests in flight at a sync: continue (keep their oldest version) or abort (regenerate)."""
    reference_batch_size: int = 8192
    """B of the reference config (DAPO: 512 prompts x 16 samples)."""
    reference_num_minibatches: int = 16
    """M of the reference config (DAPO: 512 / 32 prompts per mini-batch)."""

    def __post_init__(self) -> None:
        if min(self.num_engines, self.slots, self.reference_batch_size, self.reference_num_minibatches) < 1:
            raise ValueError(f"SystemModel: engines, slots and reference sizes must be >= 1: {self}")
        self.inflight = InflightPolicy(self.inflight)

    def scaled(self, batch_size: int, num_minibatches: int, group_size: int) -> tuple[EngineConfig, TrainerConfig]:
        """Engines and trainer for a batch of ``batch_size`` trajectories in ``num_minibatches`` steps (the rule in
        the module docstring). Every engine keeps room for one group of ``group_size``."""
        c = batch_size / self.reference_batch_size
        engines = max(1, round(self.num_engines * c))
        slots = max(group_size, round(self.slots * self.num_engines * c / engines))
        engine = EngineConfig(num_engines=engines, slots=slots, tpot=self.tpot, load_alpha=self.load_alpha)
        trainer = TrainerConfig(step_overhead=self.step_overhead * self.reference_num_minibatches / num_minibatches,
                                per_token=self.per_token / c)
        return engine, trainer

    def rollout_trainer_ratio(self, batch_size: int, num_minibatches: int, mean_len: float,
                              group_size: int = 1) -> float:
        """Rollout throughput over trainer throughput (> 1: the trainer is the bottleneck): the trainer's seconds
        per batch over the seconds rollout needs for a batch with every slot busy."""
        engine, trainer = self.scaled(batch_size, num_minibatches, group_size)
        return capacity_ratio(engine, trainer, batch_size, num_minibatches, mean_len)


def capacity_ratio(engine: EngineConfig, trainer: TrainerConfig, batch_size: int, num_minibatches: int,
                   mean_len: float) -> float:
    """Rollout throughput over trainer throughput (> 1: the trainer is the bottleneck) of ``engine`` and
    ``trainer``: the trainer's seconds per batch of ``batch_size`` responses of ``mean_len`` tokens in
    ``num_minibatches`` steps, over the seconds rollout needs for it with every slot busy at light load."""
    tokens = batch_size * mean_len
    rollout_s = tokens * engine.tpot / (engine.num_engines * engine.slots)
    return (num_minibatches * trainer.step_overhead + trainer.per_token * tokens) / rollout_s


@dataclass(frozen=True)
class PointSpec:
    """One operating point: which policy, which batch shape, which in-flight budget and version semantics."""

    policy: str
    """An ``AdmissionKind`` value, or ``"colocated"`` for the synchronous reference."""
    prompts_per_batch: int
    group_size: int
    """Samples per prompt (the largest group when group sizes vary)."""
    num_minibatches: int
    batch_size: int
    """B: trajectories per batch (``prompts_per_batch * group_size`` unless group sizes vary)."""
    budget: float
    """In-flight budget in batches of groups (x ``prompts_per_batch`` groups); bounded_async: eta = budget - 1."""
    sync: SyncPolicy
    release: BudgetRelease
    system: SystemModel
    warmup_batches: int
    """Batches excluded from the metrics (the pipeline fill)."""
    variable_groups: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "sync", SyncPolicy(self.sync))
        object.__setattr__(self, "release", BudgetRelease(self.release))
        if self.policy != COLOCATED:
            AdmissionKind(self.policy)  # a clear error for an unknown policy
        if self.budget <= 0:
            raise ValueError(f"PointSpec: budget must be > 0 batches, got {self.budget}")

    def constraints(self, max_response_len: int) -> BatchConstraints:
        return BatchConstraints(batch_size=self.batch_size, num_minibatches=self.num_minibatches,
                                group_size=None if self.variable_groups else self.group_size,
                                max_response_len=max_response_len)

    def sim_config(self, record_timeline: bool = False) -> SimConfig:
        engine, trainer = self.system.scaled(self.batch_size, self.num_minibatches, self.group_size)
        if self.policy == AdmissionKind.BOUNDED_ASYNC.value:
            flow = FlowConfig(kind=FlowKind.AREAL, eta=max(0, int(round(self.budget)) - 1))
        else:
            groups = max(1, int(round(self.budget * self.prompts_per_batch)))
            flow = FlowConfig(kind=FlowKind.GROUPS, budget_groups=groups, release=self.release)
        mode = ExecutionMode.COLOCATED if self.policy == COLOCATED else ExecutionMode.DISAGGREGATED
        s = self.system
        return SimConfig(mode=mode, engine=engine, trainer=trainer,
                         sync=SyncConfig(policy=self.sync, k=s.sync_k, cost=s.sync_cost, inflight=s.inflight),
                         flow=flow, colocated_switch_cost=s.sync_cost, record_timeline=record_timeline)


@dataclass(frozen=True)
class PointMetrics:
    """Steady-state metrics of one point (``knittrans.staleness`` defines them)."""

    staleness_mean: float
    staleness_p50: float
    staleness_p99: float
    staleness_max: float
    colocated_mean: float
    arch_staleness: float
    throughput_traj_s: float
    admission_delay_s: float
    trainer_idle: float
    rollout_idle: float
    violations: int
    dead_ends: int
    wasted_tokens: int
    unknown_checks: int
    rollout_trainer_ratio: float
    hist: tuple[int, ...] = ()
    """Trajectories per staleness value 0, 1, ... in the window (only when asked for)."""
    steps_per_s: float = float("nan")
    """Optimizer steps per second of steady state."""


@dataclass(frozen=True)
class Timeline:
    """Rollout activity and trainer steps around one batch (for a timeline plot)."""

    t: tuple[float, ...]
    active: tuple[int, ...]
    """Active sequences over all engines at each time in ``t``."""
    t0: float
    t1: float
    steps: tuple[tuple[float, float, int, int], ...]
    """(start, end, batch, mini-batch index) of every step in view."""
    syncs: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class PointOutcome:
    spec: PointSpec
    ok: bool
    note: str = ""
    """Why the point did not run (not applicable, or a stall)."""
    stalled: bool = False
    """The run deadlocked: trajectories were left that the policy never admitted."""
    metrics: PointMetrics | None = None
    timeline: Timeline | None = None


@dataclass(frozen=True)
class PointRun:
    """One simulated run reduced to its steady-state metrics, or why it has none."""

    ok: bool
    note: str = ""
    """Why the point did not run (not applicable, or a stall)."""
    stalled: bool = False
    """The run deadlocked: trajectories were left that the policy never admitted."""
    metrics: PointMetrics | None = None
    timeline: Timeline | None = None


def run_config(cfg: SimConfig, policy: AdmissionPolicy, batches: Sequence[WorkloadBatch], warmup_batches: int,
               keep_hist: bool = False, timeline_batch: int | None = None, group_size: int | None = None) -> PointRun:
    """Simulate ``policy`` over ``batches`` with ``cfg`` and reduce the run to its steady-state metrics (after
    ``warmup_batches`` batches). A budget below one mini-batch (of groups of ``group_size``, default the largest
    group in ``batches``) is not applicable; a stall is reported, not raised. ``cfg.record_timeline`` must be set
    when ``timeline_batch`` is given."""
    c = policy.constraints
    largest = group_size or max((g.size for wb in batches for g in wb.plan.groups), default=1)
    if cfg.flow.kind is FlowKind.GROUPS and cfg.flow.budget_groups * largest < c.min_minibatch_size:
        return PointRun(False, "budget below one mini-batch")
    try:
        res = simulate(cfg, policy, batches)
    except SimDeadlock as e:
        return PointRun(False, f"stalled: {e}", stalled=True)
    m = run_metrics(res, warmup_batches=warmup_batches, engine_slots=cfg.engine.slots)
    mean_len = float(np.mean(res.records.length))
    hist: tuple[int, ...] = ()
    if keep_hist:
        mask, *_ = window(res, warmup_batches)
        hist = tuple(int(x) for x in np.bincount(res.records.staleness[mask].astype(np.int64)))
    metrics = PointMetrics(
        staleness_mean=m.staleness.mean, staleness_p50=m.staleness.p50, staleness_p99=m.staleness.p99,
        staleness_max=m.staleness.max, colocated_mean=m.staleness.mean - m.arch_staleness,
        arch_staleness=m.arch_staleness, throughput_traj_s=m.throughput_traj_s,
        admission_delay_s=m.admission_delay_mean, trainer_idle=m.trainer_idle_frac, rollout_idle=m.rollout_idle_frac,
        violations=m.violations, dead_ends=m.dead_ends, wasted_tokens=m.wasted_tokens,
        unknown_checks=res.policy_stats.unknown,
        rollout_trainer_ratio=capacity_ratio(cfg.engine, cfg.trainer, c.batch_size, c.num_minibatches, mean_len),
        hist=hist, steps_per_s=m.steps_per_s)
    timeline = timeline_of(res, timeline_batch) if timeline_batch is not None else None
    return PointRun(True, metrics=metrics, timeline=timeline)


def measure(spec: PointSpec, policy: AdmissionPolicy, batches: Sequence[WorkloadBatch], keep_hist: bool = False,
            timeline_batch: int | None = None) -> PointOutcome:
    """Simulate ``policy`` (built for ``spec.constraints(...)``) over ``batches`` at ``spec``'s operating point
    (``run_config`` with ``spec.sim_config()``)."""
    cfg = spec.sim_config(record_timeline=timeline_batch is not None)
    r = run_config(cfg, policy, batches, spec.warmup_batches, keep_hist, timeline_batch, spec.group_size)
    return PointOutcome(spec, r.ok, r.note, r.stalled, r.metrics, r.timeline)


def timeline_of(res: SimResult, batch: int) -> Timeline:
    """Rollout activity (all engines) and trainer steps from the start of ``batch``'s generation to its last step
    (the run must have recorded its timeline)."""
    r = res.records
    in_batch = r.batch == batch
    t0 = float(np.nanmin(r.t_start[in_batch])) if in_batch.any() else 0.0
    own = [s for s in res.steps if s.batch_id == batch]
    t1 = max(s.end for s in own) if own else res.total_time
    active: dict[int, int] = {}
    ts, tot = [], []
    for t, e, a in res.timeline:
        active[e] = a
        if t0 - 0.1 * (t1 - t0) <= t <= t1:
            ts.append(t)
            tot.append(sum(active.values()))
    return Timeline(tuple(ts), tuple(tot), t0, t1,
                    tuple((s.start, s.end, s.batch_id, s.index) for s in res.steps if s.end >= t0 and s.start <= t1),
                    tuple((a, b) for a, b in res.syncs if b >= t0 and a <= t1))
