"""Real execution: rollout engines (HF transformers, vLLM), the GRPO trainer, and the orchestrator that runs
colocated and disaggregated modes through the handoff (``knittrans.handoff``) with the project's admission
policies. The contracts a task, an engine and a learner implement are in ``protocols``. See docs/runtime.md.

Imports are light: torch and transformers only; vllm is imported when a ``VLLMRolloutEngine`` is built.
"""

from knittrans.runtime.config import OnRolloutError, RuntimeConfig, RuntimeConfigError, SyncPolicy
from knittrans.runtime.engine import (EngineStats, GenerationError, GroupRequest, RolloutEngine, Sample,
                                      SamplingConfig)
from knittrans.runtime.hf_engine import HFRolloutEngine
from knittrans.runtime.orchestrator import (Orchestrator, PolicyFactory, RolloutWorkerError, RunInvariantError,
                                            StalenessBoundError, check_run)
from knittrans.runtime.protocols import Learner, Prompt, RLTask, StepResult
from knittrans.runtime.records import RunResult, RuntimeTimings, StepRecord, TrajRecord, measure_timings
from knittrans.runtime.rollouts import pack_rollouts, to_rollout
from knittrans.runtime.trainer import GRPOConfig, GRPOTrainer, TrainItem, VarlenBatch, group_advantages

__all__ = ["EngineStats", "GRPOConfig", "GRPOTrainer", "GenerationError", "GroupRequest", "HFRolloutEngine",
           "Learner", "OnRolloutError", "Orchestrator", "PolicyFactory", "Prompt", "RLTask", "RolloutEngine",
           "RolloutWorkerError", "RunInvariantError", "RunResult", "RuntimeConfig", "RuntimeConfigError",
           "RuntimeTimings", "Sample", "SamplingConfig", "StalenessBoundError", "StepRecord", "StepResult",
           "SyncPolicy", "TrainItem", "TrajRecord", "VarlenBatch", "check_run", "group_advantages",
           "measure_timings", "pack_rollouts", "to_rollout"]
