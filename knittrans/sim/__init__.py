"""Discrete-event simulator of rollout engines, weight sync, flow control and the trainer."""

from knittrans.sim.config import (BudgetRelease, EngineConfig, FlowConfig, FlowKind, SimConfig, SyncConfig,
                                  TrainerConfig)
from knittrans.sim.simulator import SimDeadlock, SimResult, Simulator, simulate
from knittrans.types import ExecutionMode, InflightPolicy, SyncPolicy

__all__ = ["BudgetRelease", "EngineConfig", "ExecutionMode", "FlowConfig", "FlowKind", "InflightPolicy", "SimConfig",
           "SimDeadlock", "SimResult", "Simulator", "SyncConfig", "SyncPolicy", "TrainerConfig", "simulate"]
