"""Calibrate the simulator from a real run and replay the run's settings in it.

From real runs (``knittrans.runtime.RunResult``) this fits the simulator's time model and rebuilds a workload:

- **rollout**: the real engine generates static waves (a plain HF ``generate`` call returns every sequence when
  the longest one ends), so the simulator runs ``wave_groups`` static batching too. Waves are recovered from the
  trace (trajectories dispatched together) and their time per decode step fitted as
  ``decode_s + decode_per_seq_s * active`` (``active``: sequences in the wave) by least squares. Within one run
  every wave is about the same size, so the per-sequence slope is only identified across runs of different wave
  sizes: ``fit_time_model(runs)`` fits all of them jointly;
- **trainer**: ``step_s = step_overhead + per_token * tokens``, least squares over the runs' steps;
- **interference**: on shared hardware (this CPU testbed) each side runs slower while the other is busy: each
  side's model is fitted on its intervals that ran alone, and the slowdown from those that overlapped;
- **sync**: the measured mean cost of a weight publication plus load;
- **workload**: a run's own groups and response lengths, batch by batch (``Calibration.batches``).

The same admission policy, in-flight budget, batch constraints and sync policy then run in the simulator, and
``compare`` reports both mean staleness values. Contention between the rollout and trainer threads on a shared
machine is part of the measured times, so it is part of the calibrated model.

``compare`` calibrates on the very run it predicts (an in-sample fit). Held-out prediction: ``fit_time_model`` on
the calibration runs, then ``predict`` any ``RuntimeConfig`` with a workload taken from a calibration run
(``Calibration.batches``), never from the run being predicted. ``timing_spread`` says how much a prediction moves
when rollout runs 2x faster or slower: ~0 means flow control alone sets the staleness (any predictor that knows
the budget gets it right). ``littles_law`` is the timing-free predictor beside it
(``knittrans.staleness.littles_law_staleness``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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

FLOW_DETERMINED_SPREAD = 0.01
"""Steps: a setting whose predicted mean staleness moves less than this when rollout runs 2x faster or slower
(``timing_spread``) is flow-determined: flow control alone sets its staleness, so any predictor that knows the
budget gets it right, and it says nothing about the time model."""


def heldout_error(predicted: float, measured: float) -> float:
    """Error of a mean-staleness prediction: ``|predicted - measured| / max(measured, 1)`` (a floor of one step,
    the resolution of staleness, so that near-zero staleness does not blow the ratio up).

    >>> heldout_error(2.2, 2.0), heldout_error(0.3, 0.1)
    (0.10000000000000009, 0.19999999999999998)
    """
    return abs(predicted - measured) / max(measured, 1.0)


@dataclass(frozen=True)
class TimeModel:
    """A machine's measured time model: what the simulator needs to replay any setting on it."""

    decode_s: float
    """Seconds per decode step of a wave, rollout alone, independent of the wave's size."""
    decode_per_seq_s: float
    """Seconds per decode step per sequence in the wave: a step of ``a`` sequences takes
    ``decode_s + decode_per_seq_s * a``."""
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

    def engine(self, slots: int) -> tuple[float, float]:
        """``(tpot, load_alpha)`` of the simulator's ``EngineConfig`` for an engine of ``slots`` sequences:
        ``tpot * (1 + load_alpha * active / slots)`` is ``decode_s + decode_per_seq_s * active``."""
        if self.decode_s > 1e-9:
            return self.decode_s, self.decode_per_seq_s * slots / self.decode_s
        return max(self.decode_per_seq_s * slots, 1e-9), 0.0

    def rollout_scaled(self, factor: float) -> "TimeModel":
        """Rollout ``factor`` times slower (decode step time scaled; trainer and sync unchanged)."""
        return replace(self, decode_s=self.decode_s * factor, decode_per_seq_s=self.decode_per_seq_s * factor)


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


@dataclass(frozen=True)
class _Intervals:
    """One run's measured waves and steps, each flagged if it mostly overlapped the other side."""

    wave_active: np.ndarray
    wave_per_step: np.ndarray  # wave duration / its longest response: seconds per decode step
    wave_shared: np.ndarray
    step_tokens: np.ndarray
    step_s: np.ndarray
    step_shared: np.ndarray
    sync_s: float


def _intervals(run) -> _Intervals:  # noqa: ANN001 - a knittrans.runtime.RunResult
    waves: dict[float, list] = {}  # trajectories dispatched at the same instant, by the same generate call
    for t in run.trajectories:
        waves.setdefault(round(t.t_dispatch, 9), []).append(t)
    longest = np.array([max(t.num_tokens for t in w) for w in waves.values()], dtype=float)
    w_iv = [(w[0].t_dispatch, max(t.t_complete for t in w)) for w in waves.values()]
    s_iv = [(s.t_start, s.t_end) for s in run.steps]
    timings = run.timings()
    return _Intervals(
        wave_active=np.array([len(w) for w in waves.values()], dtype=float),
        wave_per_step=np.array([b - a for a, b in w_iv]) / longest,
        wave_shared=np.array([_overlap(iv, s_iv) > 0.5 * (iv[1] - iv[0]) for iv in w_iv], dtype=bool),
        step_tokens=np.array([s.tokens for s in run.steps], dtype=float),
        step_s=np.array([s.step_s for s in run.steps]),
        step_shared=np.array([_overlap(iv, w_iv) > 0.5 * (iv[1] - iv[0]) for iv in s_iv], dtype=bool),
        sync_s=timings.sync_s_mean if np.isfinite(timings.sync_s_mean) else 0.0)


def fit_time_model(runs: Sequence) -> tuple[TimeModel, float, float]:
    """The time model fitted jointly to ``runs`` (their waves and steps together), with the r^2 of the decode and
    the step fits. Interference: each side's model is fitted on its intervals that ran alone, and the slowdown is
    the median excess of those that overlapped the other side (colocated runs never overlap)."""
    if not runs:
        raise ValueError("fit_time_model: no runs")
    iv = [_intervals(r) for r in runs]
    cat = lambda name: np.concatenate([getattr(x, name) for x in iv])  # noqa: E731
    active, per_step, w_shared = cat("wave_active"), cat("wave_per_step"), cat("wave_shared")
    tokens, step_s, s_shared = cat("step_tokens"), cat("step_s"), cat("step_shared")
    alone = ~w_shared if (~w_shared).sum() >= 2 else np.ones_like(w_shared)
    base, slope, r2_wave = _fit(active[alone], per_step[alone])
    eng_int = _excess(per_step[w_shared], base + slope * active[w_shared])
    alone = ~s_shared if (~s_shared).sum() >= 2 else np.ones_like(s_shared)
    overhead, per_token, r2_step = _fit(tokens[alone], step_s[alone])
    tr_int = _excess(step_s[s_shared], overhead + per_token * tokens[s_shared])
    tm = TimeModel(decode_s=base, decode_per_seq_s=slope, engine_interference=eng_int, step_overhead=overhead,
                   per_token=per_token, trainer_interference=tr_int,
                   sync_cost=float(np.mean([x.sync_s for x in iv])))
    return tm, r2_wave, r2_step


def workload_of(run) -> list[WorkloadBatch]:  # noqa: ANN001 - a knittrans.runtime.RunResult
    """A run's groups and response lengths, batch by batch (what the simulator replays)."""
    by_batch: dict[int, dict[int, list]] = {}
    for t in sorted(run.trajectories, key=lambda t: t.traj_id):
        by_batch.setdefault(t.batch_id, {}).setdefault(t.group_id, []).append(t)
    batches = []
    for b in sorted(by_batch):
        groups = tuple(GroupSpec(g, b, len(ts)) for g, ts in sorted(by_batch[b].items()))
        lengths = {g: np.array([t.num_tokens for t in ts], dtype=np.int64) for g, ts in by_batch[b].items()}
        batches.append(WorkloadBatch(BatchPlan(b, groups), lengths))
    return batches


def calibrate(run) -> Calibration:  # noqa: ANN001 - a knittrans.runtime.RunResult
    """Fit the simulator's time model to ``run`` alone and rebuild its workload (see the module docstring)."""
    cfg = run.config
    tm, r2_wave, r2_step = fit_time_model([run])
    return Calibration(sim_config(cfg, tm), workload_of(run), constraints_of(cfg), cfg.admission, r2_wave, r2_step,
                       tm)


def constraints_of(cfg) -> BatchConstraints:  # noqa: ANN001 - a knittrans.runtime.RuntimeConfig
    """The batch constraints a real run of ``cfg`` keeps (whole groups, exact size, M mini-batches)."""
    return BatchConstraints(batch_size=cfg.prompts_per_batch * cfg.group_size, num_minibatches=cfg.num_minibatches,
                            group_size=cfg.group_size, max_response_len=cfg.max_new_tokens)


def sim_config(cfg, tm: TimeModel) -> SimConfig:  # noqa: ANN001 - a knittrans.runtime.RuntimeConfig
    """The simulator's settings for a real run's config on a machine with time model ``tm``: one engine running
    static waves of ``wave_groups`` groups, the run's budget, sync policy and mode."""
    colocated = cfg.mode is ExecutionMode.COLOCATED
    slots = cfg.wave_groups * cfg.group_size
    tpot, alpha = tm.engine(slots)
    return SimConfig(
        mode=ExecutionMode.COLOCATED if colocated else ExecutionMode.DISAGGREGATED,
        engine=EngineConfig(num_engines=1, slots=slots, tpot=tpot, load_alpha=alpha, wave_groups=cfg.wave_groups,
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
