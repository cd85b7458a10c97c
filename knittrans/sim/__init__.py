"""Discrete-event simulator of rollout engines, weight sync, flow control and the trainer."""

from knittrans.sim.config import (EngineConfig, FlowConfig, FlowKind, Inflight, Mode, SimConfig, SyncConfig,
                                  SyncPolicy, TrainerConfig)
from knittrans.sim.simulator import SimDeadlock, SimResult, Simulator, simulate

__all__ = ["EngineConfig", "FlowConfig", "FlowKind", "Inflight", "Mode", "SimConfig", "SimDeadlock", "SimResult",
           "Simulator", "SyncConfig", "SyncPolicy", "TrainerConfig", "simulate"]
