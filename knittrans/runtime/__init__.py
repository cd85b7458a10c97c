"""Real execution: rollout engines (HF transformers, vLLM, and ``VLMRolloutEngine`` for Qwen2-VL-family
policies), the GRPO trainers (``GRPOTrainer`` for text, ``MMGRPOLearner`` for vision-language policies, encoder
once per distinct image), and the orchestrator that runs colocated and disaggregated modes through the handoff
(``knittrans.handoff``) with the project's admission policies. The contracts a task, an engine and a learner
implement are in ``protocols``. See docs/runtime.md and docs/mmdedup.md.

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
from knittrans.runtime.vlm_engine import VLMEngineStats, VLMRolloutEngine
from knittrans.runtime.vlm_learner import MMGRPOLearner, ShareOrderError, mm_rollout

__all__ = ["EngineStats", "GRPOConfig", "GRPOTrainer", "GenerationError", "GroupRequest", "HFRolloutEngine",
           "Learner", "MMGRPOLearner", "OnRolloutError", "Orchestrator", "PolicyFactory", "Prompt", "RLTask", "RolloutEngine",
           "RolloutWorkerError", "RunInvariantError", "RunResult", "RuntimeConfig", "RuntimeConfigError",
           "RuntimeTimings", "Sample", "SamplingConfig", "ShareOrderError", "StalenessBoundError", "StepRecord",
           "StepResult", "SyncPolicy", "TrainItem", "TrajRecord", "VLMEngineStats", "VLMRolloutEngine", "VarlenBatch",
           "check_run", "group_advantages", "measure_timings", "mm_rollout", "pack_rollouts", "to_rollout"]
