"""Calibrate the simulator from a real run and replay the run's settings in it.

From a real run (``knittrans.runtime.RunResult``) this fits the simulator's time model and rebuilds its workload:

- **rollout**: the real engine generates static waves (a plain HF ``generate`` call returns every sequence when
  the longest one ends), so the simulator runs ``wave_groups`` static batching too. Waves are recovered from the
  trace (trajectories dispatched together) and their durations fitted as
  ``longest * tpot * (1 + load_alpha * active / slots)`` by least squares;
- **trainer**: ``step_s = step_overhead + per_token * tokens``, least squares over the run's steps;
- **interference**: on shared hardware (this CPU testbed) each side runs slower while the other is busy: each
  side's model is fitted on its intervals that ran alone, and the slowdown from those that overlapped;
- **sync**: the measured mean cost of a weight publication plus load;
- **workload**: the run's own groups and response lengths, batch by batch.

The same admission policy, in-flight budget, batch constraints and sync policy then run in the simulator, and
``compare`` reports both mean staleness values. Contention between the rollout and trainer threads on a shared
machine is part of the measured times, so it is part of the calibrated model.

``compare`` calibrates on the very run it predicts (an in-sample fit). Held-out prediction: ``TimeModel.of`` each
calibration run, ``TimeModel.pooled`` (median of every parameter), then ``predict`` any ``RuntimeConfig`` with a
workload taken from a calibration run (``Calibration.batches``), never from the run being predicted.
``timing_spread`` says how much a prediction moves when rollout runs 2x faster or slower: ~0 means flow control
alone sets the staleness (any predictor that knows the budget gets it right). ``littles_law`` is the timing-free
predictor beside it (``knittrans.staleness.littles_law_staleness``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Sequence

import numpy as np

from knittrans.constraints import BatchConstraints
from knittrans.admission.base import AdmissionPolicy
from knittrans.sim.config import EngineConfig, FlowConfig, FlowKind, SimConfig, SyncConfig, TrainerConfig
from knittrans.sim.simulator import SimResult, simulate
from knittrans.staleness import littles_law_staleness
from knittrans.types import (AdmissionKind, BatchPlan, ExecutionMode, GroupSpec, InflightPolicy, SyncPolicy,
                             WorkloadBatch)

PolicyFactory = Callable[[AdmissionKind, BatchConstraints], AdmissionPolicy]


@dataclass(frozen=True)
class TimeModel:
    """A machine's measured time model: what the simulator needs to replay any setting on it."""

    tpot: float
    """Seconds per decode step of a wave, rollout alone, at light load."""
    load_alpha: float
    """Decode-step growth with the wave's share of slots: ``tpot * (1 + load_alpha * active / slots)``."""
    engine_interference: float
    """Decode slowdown while the trainer computes (shared hardware)."""
    step_overhead: float
    """Seconds per optimizer step, trainer alone, regardless of size."""
    per_token: float
    """Seconds per response token of a step, trainer alone."""
    trainer_interference: float
    """Step slowdown while rollout generates (shared hardware)."""
    sync_cost: float
    """Seconds per weight sync (publication plus load)."""

    @classmethod
    def pooled(cls, models: Sequence["TimeModel"]) -> "TimeModel":
        """The median of every parameter over ``models`` (calibration runs of several settings and seeds)."""
        if not models:
            raise ValueError("TimeModel.pooled: no calibration runs")
        return cls(**{f.name: float(np.median([getattr(m, f.name) for m in models])) for f in fields(cls)})

    def rollout_scaled(self, factor: float) -> "TimeModel":
        """Rollout ``factor`` times slower (decode step time scaled; trainer and sync unchanged)."""
        return replace(self, tpot=self.tpot * factor)



@dataclass(frozen=True)
class Calibration:
    sim: SimConfig
    batches: list[WorkloadBatch]
    constraints: BatchConstraints
    policy: AdmissionKind
    wave_fit_r2: float
    step_fit_r2: float
    time_model: TimeModel


@dataclass(frozen=True)
class Comparison:
    system: str
    """``colocated`` or the run's admission kind (``RuntimeConfig.system``)."""
    budget: int
    measured_mean: float
    simulated_mean: float
    measured_p99: float
    simulated_p99: float
    calibration: Calibration

    @property
    def rel_error(self) -> float:
        return abs(self.simulated_mean - self.measured_mean) / max(abs(self.measured_mean), 1e-9)


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares y = a + b x, with a, b >= 0; returns (a, b, r^2)."""
    if len(x) < 2 or np.ptp(x) == 0:
        return float(np.mean(y)), 0.0, 0.0
    b, a = np.polyfit(x, y, 1)
    if a < 0:
        a, b = 0.0, float(np.sum(x * y) / np.sum(x * x))
    if b < 0:
        a, b = float(np.mean(y)), 0.0
    pred = a + b * x
    ss = float(np.sum((y - y.mean()) ** 2))
    return float(a), float(b), (1 - float(np.sum((y - pred) ** 2)) / ss) if ss > 0 else 0.0


def _overlap(iv: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """Seconds of ``iv`` covered by the union of ``others`` (intervals of one side never overlap each other)."""
    a, b = iv
    return sum(max(0.0, min(b, d) - max(a, c)) for c, d in others)


def _excess(actual: np.ndarray, predicted: np.ndarray) -> float:
    """Median relative excess of actual over predicted (>= 0); 0 when nothing overlapped."""
    if len(actual) == 0:
        return 0.0
    return max(0.0, float(np.median(actual / np.maximum(predicted, 1e-12))) - 1.0)


def calibrate(run) -> Calibration:
    """Fit the simulator's time model to ``run`` and rebuild its workload (see the module docstring)."""
    cfg = run.config
    trajs = sorted(run.trajectories, key=lambda t: t.traj_id)
    n, W = cfg.group_size, cfg.wave_groups
    slots = W * n
    # waves: trajectories dispatched at the same instant, by the same generate call
    waves: dict[float, list] = {}
    for t in trajs:
        waves.setdefault(round(t.t_dispatch, 9), []).append(t)
    longest = np.array([max(t.num_tokens for t in w) for w in waves.values()], dtype=float)
    active = np.array([len(w) for w in waves.values()], dtype=float)
    w_iv = [(w[0].t_dispatch, max(t.t_complete for t in w)) for w in waves.values()]
    dur = np.array([b - a for a, b in w_iv])
    steps = run.steps
    s_iv = [(s.t_start, s.t_end) for s in steps]
    # Interference: on shared hardware each side runs slower while the other is busy. Fit each side's time model
    # on its intervals that ran alone, and the slowdown as the median excess of those that overlapped the other.
    w_shared = np.array([_overlap(iv, s_iv) > 0.5 * (iv[1] - iv[0]) for iv in w_iv])
    s_shared = np.array([_overlap(iv, w_iv) > 0.5 * (iv[1] - iv[0]) for iv in s_iv])
    alone = ~w_shared if (~w_shared).sum() >= 2 else np.ones_like(w_shared)
    per_step = dur / longest  # per decode step: tpot * (1 + alpha * active / slots)
    base, slope, r2_wave = _fit(active[alone] / slots, per_step[alone])
    tpot = max(base, 1e-9)
    alpha = slope / tpot if base > 0 else 0.0
    eng_int = _excess(per_step[w_shared], tpot * (1 + alpha * active[w_shared] / slots))
    tokens = np.array([s.tokens for s in steps], dtype=float)
    step_s = np.array([s.step_s for s in steps])
    alone = ~s_shared if (~s_shared).sum() >= 2 else np.ones_like(s_shared)
    overhead, per_token, r2_step = _fit(tokens[alone], step_s[alone])
    tr_int = _excess(step_s[s_shared], overhead + per_token * tokens[s_shared])
    timings = run.timings()
    sync_cost = timings.sync_s_mean if np.isfinite(timings.sync_s_mean) else 0.0
    tm = TimeModel(tpot=tpot, load_alpha=alpha, engine_interference=eng_int, step_overhead=overhead,
                   per_token=per_token, trainer_interference=tr_int, sync_cost=sync_cost)
    sim = sim_config(cfg, tm)
    by_batch: dict[int, dict[int, list]] = {}
    for t in trajs:
        by_batch.setdefault(t.batch_id, {}).setdefault(t.group_id, []).append(t)
    batches = []
    for b in sorted(by_batch):
        groups = tuple(GroupSpec(g, b, len(ts)) for g, ts in sorted(by_batch[b].items()))
        lengths = {g: np.array([t.num_tokens for t in ts], dtype=np.int64) for g, ts in by_batch[b].items()}
        batches.append(WorkloadBatch(BatchPlan(b, groups), lengths))
    return Calibration(sim, batches, constraints_of(cfg), cfg.admission, r2_wave, r2_step, tm)


def constraints_of(cfg) -> BatchConstraints:  # noqa: ANN001 - a knittrans.runtime.RuntimeConfig
    """The batch constraints a real run of ``cfg`` keeps (whole groups, exact size, M mini-batches)."""
    return BatchConstraints(batch_size=cfg.prompts_per_batch * cfg.group_size, num_minibatches=cfg.num_minibatches,
                            group_size=cfg.group_size, max_response_len=cfg.max_new_tokens)


def sim_config(cfg, tm: TimeModel) -> SimConfig:  # noqa: ANN001 - a knittrans.runtime.RuntimeConfig
    """The simulator's settings for a real run's config on a machine with time model ``tm``: one engine running
    static waves of ``wave_groups`` groups, the run's budget, sync policy and mode."""
    colocated = cfg.mode is ExecutionMode.COLOCATED
    return SimConfig(
        mode=ExecutionMode.COLOCATED if colocated else ExecutionMode.DISAGGREGATED,
        engine=EngineConfig(num_engines=1, slots=cfg.wave_groups * cfg.group_size, tpot=tm.tpot,
                            load_alpha=tm.load_alpha, wave_groups=cfg.wave_groups,
                            interference=0.0 if colocated else tm.engine_interference),
        trainer=TrainerConfig(step_overhead=tm.step_overhead, per_token=tm.per_token,
                              interference=0.0 if colocated else tm.trainer_interference),
        sync=SyncConfig(policy=cfg.sync, k=cfg.sync_every, cost=tm.sync_cost, inflight=InflightPolicy.CONTINUE),
        flow=FlowConfig(kind=FlowKind.GROUPS, budget_groups=cfg.budget),
        colocated_switch_cost=tm.sync_cost)


def predict(cfg, tm: TimeModel, batches: Sequence[WorkloadBatch], make_policy: PolicyFactory  # noqa: ANN001
            ) -> SimResult:
    """The simulator's replay of real config ``cfg`` on time model ``tm`` with workload ``batches`` (from a
    calibration run: the same batch shape, never the predicted run's own lengths)."""
    return simulate(sim_config(cfg, tm), make_policy(cfg.admission, constraints_of(cfg)), batches)


def timing_spread(cfg, tm: TimeModel, batches: Sequence[WorkloadBatch], make_policy: PolicyFactory,  # noqa: ANN001
                  factor: float = 2.0) -> float:
    """Max - min predicted mean staleness with rollout ``factor`` times faster, as measured, and ``factor`` times
    slower. About 0: timing does not matter at this setting, flow control alone sets its staleness."""
    means = [float(predict(cfg, tm.rollout_scaled(f), batches, make_policy).records.staleness.mean())
             for f in (1.0 / factor, 1.0, factor)]
    return max(means) - min(means)


def littles_law(cfg) -> float:  # noqa: ANN001 - a knittrans.runtime.RuntimeConfig
    """The timing-free prediction of a run's mean staleness from its flow control and sync policy alone."""
    lag = {SyncPolicy.EVERY_STEP: 0.0, SyncPolicy.EVERY_K: (cfg.sync_every - 1) / 2,
           SyncPolicy.EVERY_BATCH: (cfg.num_minibatches - 1) / 2}[cfg.sync]
    if cfg.mode is ExecutionMode.COLOCATED:
        return (cfg.num_minibatches - 1) / 2
    return littles_law_staleness(cfg.budget, cfg.groups_per_minibatch, cfg.num_batches * cfg.prompts_per_batch, lag)


def compare(run, make_policy: PolicyFactory) -> Comparison:
    """Mean staleness measured in ``run`` against the calibrated simulator's for the same settings; ``make_policy``
    builds the run's admission policy (``baselines.admission.make_policy``)."""
    cal = calibrate(run)
    res = simulate(cal.sim, make_policy(cal.policy, cal.constraints), cal.batches)
    measured = run.staleness()
    simulated = res.records.staleness
    return Comparison(run.config.system, run.config.budget, float(measured.mean()), float(simulated.mean()),
                      float(np.percentile(measured, 99)), float(np.percentile(simulated, 99)), cal)
