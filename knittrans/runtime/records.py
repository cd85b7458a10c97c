"""What a real run records: every trajectory's versions and timestamps, every step, and the measured time model.

``measure_timings`` turns a run into the numbers the simulator's time model is calibrated from (decode time per
token, trainer step time per token, sync cost), so the simulator-vs-reality comparison reads them from a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from knittrans.admission.base import AdmissionStats
from knittrans.dataplane.controller import ControllerStats, HandoffRecord
from knittrans.runtime.config import RuntimeConfig
from knittrans.runtime.engine import EngineStats
from knittrans.staleness import StalenessStats


@dataclass
class TrajRecord:
    """One trajectory's life. Times are seconds since the run started."""

    traj_id: int
    group_id: int
    batch_id: int
    num_tokens: int
    reward: float
    v_gen: int
    """Policy version the engine had loaded when the trajectory started generating."""
    t_dispatch: float
    t_complete: float
    v_train: int = -1
    """Trainer version at the step that consumed it (-1 until consumed)."""
    t_train_start: float = -1.0
    step: int = -1
    """0-based index of the optimizer step that consumed it."""

    @property
    def staleness(self) -> int:
        return self.v_train - self.v_gen


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step."""

    step: int
    version: int
    """Version after the step."""
    batch_id: int
    minibatch_index: int
    t_start: float
    t_end: float
    step_s: float
    tokens: int
    mean_reward: float
    mean_staleness: float
    clip_frac: float
    loss: float
    kl: float
    encoder_patches: int = 0
    """Image patches the learner's vision encoder ran over in this step (``StepResult.encoder_patches``)."""
    occurrence_patches: int = 0
    """Image patches of every sample's images in this step (what an encoder without dedup would run over)."""


@dataclass(frozen=True)
class RuntimeTimings:
    """The measured time model of a run, for calibrating the simulator."""

    decode_s_per_token: float
    """Engine wall time per generated token (batched: a wave's time over its tokens)."""
    train_s_per_token: float
    """Trainer step time (forward + backward + optimizer) per response token."""
    step_s_mean: float
    """Mean wall time of one optimizer step."""
    sync_s_mean: float
    """Mean cost of one weight sync: the trainer's copy plus the engine's load."""
    syncs: int
    """Weight syncs performed."""
    wave_s_mean: float
    """Mean wall time of one generation call (``wave_groups`` groups)."""


@dataclass
class RunResult:
    """Everything one real run produced."""

    config: RuntimeConfig
    trajectories: list[TrajRecord]
    """The orchestrator's own account of every trajectory (dispatch, completion, the step that consumed it)."""
    steps: list[StepRecord]
    wall_s: float
    engine: EngineStats
    handoff_records: list[HandoffRecord]
    """The handoff's account of every trajectory (``v_gen`` as put, ``v_train`` = its mini-batch's admission
    order); ``check_run`` holds it equal to ``trajectories``."""
    staleness_stats: StalenessStats
    """Staleness ``v_train - v_gen`` over every trajectory, from the handoff's records (``Handoff.staleness``)."""
    controller: ControllerStats
    """The handoff controller's counts at the end of the run (admitted, released, claims ...)."""
    admission: AdmissionStats | None = None
    """The admission policy's counters; None on the Ray transport, where the policy ran in the controller actor."""
    publish_s: list[float] = field(default_factory=list)
    """Trainer-side cost of each weight publication (copying the state dict)."""
    snapshots: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Weights after step k (keys: versions), every ``eval_every`` steps, for offline evaluation."""
    rollout_failures: int = 0
    """Waves that raised and were retried."""
    faults_injected: dict[str, int] = field(default_factory=dict)
    """Faults a ``RuntimeFaultPlan`` fired, by kind (``knittrans.runtime.faults``)."""
    faults_recovered: dict[str, int] = field(default_factory=dict)
    """Recoveries by kind: regenerated waves, abandoned stragglers, trainer restarts."""

    def staleness(self) -> np.ndarray:
        return np.array([t.staleness for t in self.trajectories], dtype=float)


    def throughput_steps_per_s(self) -> float:
        return len(self.steps) / self.wall_s if self.wall_s > 0 else float("nan")

    def trainer_busy_fraction(self) -> float:
        """Fraction of the run's wall-clock the trainer spent in optimizer steps (the rest it waited for data).

        Throughput is this fraction over the step time; the step's work is the same in every mode, so comparing
        busy fractions compares what admission and flow control cost, without the step-time noise of a shared
        machine that raw steps/s carries."""
        return sum(s.step_s for s in self.steps) / self.wall_s if self.wall_s > 0 else float("nan")

    def timings(self) -> RuntimeTimings:
        return measure_timings(self)


def measure_timings(run: RunResult) -> RuntimeTimings:
    """The run's measured decode time per token, trainer step time per token and sync cost."""
    e = run.engine
    tokens = sum(s.tokens for s in run.steps)
    step_s = sum(s.step_s for s in run.steps)
    syncs = len(run.publish_s)
    sync_total = sum(run.publish_s) + e.load_s
    return RuntimeTimings(
        decode_s_per_token=e.generate_s / e.generated_tokens if e.generated_tokens else float("nan"),
        train_s_per_token=step_s / tokens if tokens else float("nan"),
        step_s_mean=step_s / len(run.steps) if run.steps else float("nan"),
        sync_s_mean=sync_total / max(syncs, e.weight_loads, 1),
        syncs=max(syncs, e.weight_loads),
        wave_s_mean=e.generate_s / e.generate_calls if e.generate_calls else float("nan"))


TRACE_COLUMNS = ("traj_id", "group_id", "batch_id", "num_tokens", "reward", "v_gen", "v_train", "step", "t_dispatch",
                 "t_complete", "t_train_start")


def write_trace(run: RunResult, path) -> None:
    """Every trajectory's versions and timestamps as CSV (gzip if ``path`` ends in .gz): the measured trace the
    simulator's staleness is compared against."""
    import csv
    import gzip
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open(path, "wt", newline="") if path.suffix == ".gz" else open(path, "w", newline="")) as f:
        w = csv.writer(f)
        w.writerow(TRACE_COLUMNS)
        for t in run.trajectories:
            w.writerow([round(v, 6) if isinstance(v, float) else v for v in (getattr(t, c) for c in TRACE_COLUMNS)])
