"""Configuration of the discrete-event model of a disaggregated RL system.

Version semantics are part of the model, so each run states them here: how often weights reach the rollout
engines (``SyncConfig.policy``), what a sync costs (``SyncConfig.cost``: engines and trainer both pause, as in an
NCCL broadcast), and what happens to requests in flight at a sync (``SyncConfig.inflight``: continue with the
new weights, keeping the oldest version as ``v_gen``; or abort and regenerate).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from knittrans.types import ExecutionMode, InflightPolicy, SyncPolicy, ValueNamedEnum


class FlowKind(str, enum.Enum):
    GROUPS = "groups"  # at most budget_groups groups dispatched and not yet consumed by the trainer
    AREAL = "areal"  # AReaL: trajectories submitted <= (eta + batches trained + 1) * B
    UNBOUNDED = "unbounded"  # keep every rollout slot busy (the group-queue theory setting)


class BudgetRelease(str, enum.Enum, metaclass=ValueNamedEnum):
    """When a consumed group stops counting against the in-flight budget (``FlowKind.GROUPS`` only).

    The choice moves mean staleness by about one step: in the regime where the budget binds, by Little's law a
    group spends ``budget_groups / groups per step`` steps between dispatch and release, and it is consumed one
    step before its release with ``STEP_END`` and at its release with ``STEP_START``."""

    STEP_END = "step_end"
    """When the step that consumes its last trajectory ends (the real runtime's convention,
    ``knittrans.runtime.orchestrator``): the slot is freed once the gradient is applied."""
    STEP_START = "step_start"
    """When that step starts (the trainer has taken the data): the next group generates during the step, with the
    weights the step is about to replace."""


@dataclass(frozen=True)
class EngineConfig:
    num_engines: int = 8
    """Rollout engines (e.g. vLLM instances, each over its own GPUs)."""
    slots: int = 256
    """C per engine: concurrent sequences under continuous batching (vLLM's max_num_seqs)."""
    tpot: float = 0.025
    """Seconds per decode step (one token for every active sequence) at light load."""
    load_alpha: float = 0.0
    """Load dependence: step time = tpot * (1 + load_alpha * active / slots)."""
    interference: float = 0.0
    """Decode slows by this fraction while the trainer computes: rollout and training sharing hardware (a CPU
    testbed, or time-shared GPUs). 0 for disaggregated clusters."""
    wave_groups: int = 0
    """0: continuous batching. k > 0: static batching, as a plain HF ``generate`` call does: an idle engine starts
    a wave of up to k groups (as many as flow control allows), and every sequence of the wave is returned when
    the longest one finishes."""

    def step_time(self, active: int) -> float:
        return self.tpot * (1.0 + self.load_alpha * active / self.slots)


@dataclass(frozen=True)
class TrainerConfig:
    step_overhead: float = 2.0
    """Seconds per optimizer step regardless of size (optimizer, collectives, launch)."""
    per_token: float = 12.5e-6
    """Seconds per response token of forward + backward (plus old-logprob recompute)."""
    interference: float = 0.0
    """A step that starts while rollout is generating takes this fraction longer (shared hardware; see
    ``EngineConfig.interference``)."""

    def step_time(self, tokens: int) -> float:
        return self.step_overhead + self.per_token * tokens


@dataclass(frozen=True)
class SyncConfig:
    policy: SyncPolicy = SyncPolicy.EVERY_STEP
    """How often new weights reach the rollout engines."""
    k: int = 1
    """With EVERY_K: sync after every k optimizer steps."""
    cost: float = 5.0
    """Seconds both sides pause per sync (weight broadcast)."""
    inflight: InflightPolicy = InflightPolicy.CONTINUE
    """What happens to requests in flight at a sync."""

    def __post_init__(self) -> None:
        if self.k < 1 or self.cost < 0:
            raise ValueError(f"SyncConfig: k must be >= 1 and cost >= 0, got k={self.k}, cost={self.cost}")


@dataclass(frozen=True)
class FlowConfig:
    kind: FlowKind = FlowKind.GROUPS
    budget_groups: int = 512
    """GROUPS: in-flight budget, in groups dispatched to rollout and not yet consumed by the trainer."""
    eta: int = 1
    """AREAL: maximum staleness in training batches (AReaL's max_head_offpolicyness)."""
    release: BudgetRelease = BudgetRelease.STEP_END
    """GROUPS: when a consumed group frees its place in the budget (see ``BudgetRelease``)."""

    def __post_init__(self) -> None:
        if self.budget_groups < 1 or self.eta < 0:
            raise ValueError(f"FlowConfig: budget_groups must be >= 1 and eta >= 0, got {self.budget_groups}, "
                             f"{self.eta}")
        object.__setattr__(self, "kind", FlowKind(self.kind))
        object.__setattr__(self, "release", BudgetRelease(self.release))


@dataclass(frozen=True)
class SimConfig:
    mode: ExecutionMode = ExecutionMode.DISAGGREGATED
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    colocated_switch_cost: float = 5.0
    """Colocated mode: seconds to switch the shared GPUs between generation and training (weight reload)."""
    record_timeline: bool = False
    """Record per-engine active counts and trainer intervals (for timeline plots)."""
    max_events: int = 50_000_000
    """Safety bound on processed events (a livelock guard, not a tuning knob)."""
