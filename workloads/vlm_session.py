"""Putting a tiny-VLM GRPO run together: a warm-started Qwen2-VL on the counting task (``vlm_setup``), one run per
mode through the orchestrator (``run_mode``, the multimodal twin of ``workloads.arith_session.run_mode``), and
held-out evaluation of the weight snapshots a run took (``evaluate_snapshots``).

A run is the orchestrator's (``knittrans.runtime.orchestrator``) with ``RuntimeConfig.multimodal``: the
``VLMRolloutEngine`` generates each wave (vision tower once per distinct image of the wave), the orchestrator
scores the samples (``MMCountingTask.reward``), computes group advantages and puts every trajectory with its
prompt's images into the handoff (each distinct image stored once), and ``MMGRPOLearner`` steps on each
``MMShare`` (distinct images + index map; the encoder runs once per distinct image with ``dedup``, every
occurrence without). ``StepRecord.encoder_patches`` / ``occurrence_patches`` account the encoder work per step.

Example::

    >>> from knittrans.runtime.config import RuntimeConfig
    >>> setup = vlm_setup(seed=0, warm=MMWarmStartConfig(max_steps=2, target_accuracy=None))
    >>> cfg = RuntimeConfig.for_system("knittrans", num_batches=1, prompts_per_batch=2, group_size=2,
    ...                                num_minibatches=2, max_new_tokens=3, wave_groups=1, multimodal=True)
    >>> run = run_mode(cfg, setup)
    >>> [s.version for s in run.steps], [s.occurrence_patches // s.encoder_patches for s in run.steps]
    ([1, 2], [2, 2])
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from knittrans.runtime.config import RuntimeConfig
from knittrans.runtime.engine import SamplingConfig
from knittrans.runtime.faults import RuntimeFaultPlan
from knittrans.runtime.orchestrator import Orchestrator, PolicyFactory, knittrans_policy
from knittrans.runtime.records import RunResult
from knittrans.runtime.trainer import GRPOConfig
from knittrans.runtime.vlm_engine import VLMRolloutEngine
from knittrans.runtime.vlm_learner import MMGRPOLearner
from workloads.mm_task import (MMCountingTask, MMPrompt, MMTaskConfig, MMWarmStartConfig, WarmStartResult,
                               warm_start)
from workloads.vlm import TinyVLMConfig, build_tiny_vlm


@dataclass
class VLMSetup:
    """A warm-started tiny VLM with its task, shared by every mode of one seed (each run copies the model)."""

    model: torch.nn.Module
    task: MMCountingTask
    seed: int
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    warm: WarmStartResult | None = None
    """What the warm start did (steps, losses, its evaluation accuracy)."""

    @property
    def vocab(self):
        return self.task.vocab

    def engine(self) -> VLMRolloutEngine:
        """A rollout engine over a private copy of the setup's weights."""
        return VLMRolloutEngine(self.model, eos_token_id=self.vocab.eos_id, pad_token_id=self.vocab.pad_id)

    def learner(self, dedup: bool = True) -> MMGRPOLearner:
        """A learner over a fresh copy of the setup's weights."""
        return MMGRPOLearner(copy.deepcopy(self.model), self.grpo, self.task.tokens, dedup=dedup)


def vlm_setup(seed: int, vlm: TinyVLMConfig = TinyVLMConfig(), task: MMTaskConfig | None = None,
              warm: MMWarmStartConfig = MMWarmStartConfig(), grpo: GRPOConfig = GRPOConfig()) -> VLMSetup:
    """Build the tiny VLM from ``seed`` and warm-start it on the counting task (``warm.seed`` is replaced by
    ``seed``, so each seed's start is its own)."""
    task_cfg = task if task is not None else MMTaskConfig(vlm=vlm)
    if task_cfg.vlm != vlm:
        raise ValueError(f"the task's prompts are built for {task_cfg.vlm}, the model is {vlm}")
    t = MMCountingTask(task_cfg)
    model = build_tiny_vlm(vlm, t.vocab, seed=seed)
    result = warm_start(model, t, dataclasses.replace(warm, seed=seed))
    return VLMSetup(model=model, task=t, seed=seed, grpo=grpo, warm=result)


@torch.no_grad()
def greedy_accuracy(setup: VLMSetup, weights: dict[str, torch.Tensor] | None, prompts: list[MMPrompt],
                    max_new_tokens: int = 3, greedy: bool = True, seed: int = 0) -> float:
    """Fraction of ``prompts`` the policy with ``weights`` (None: the setup's) answers exactly, greedy (or one
    sample per prompt at temperature 1 with ``greedy=False``: the mean sampled reward, GRPO's objective)."""
    engine = setup.engine()
    if weights is not None:
        engine.load_weights(weights, version=0)
    reqs = [p.request(i, 0, (i,)) for i, p in enumerate(prompts)]
    out = engine.generate(reqs, SamplingConfig(max_new_tokens=max_new_tokens, greedy=greedy), seed=seed)
    return sum(setup.task.reward(p, s.response_ids) for p, s in zip(prompts, out)) / len(prompts)


# -- one run per mode through the orchestrator ------------------------------------------------------------------


def run_mode(cfg: RuntimeConfig, setup: VLMSetup, learner: MMGRPOLearner | None = None,
             engine: VLMRolloutEngine | None = None, faults: RuntimeFaultPlan | None = None,
             make_policy: PolicyFactory = knittrans_policy, dedup: bool = True) -> RunResult:
    """One orchestrator run of ``cfg`` (``multimodal=True``) from the setup's weights (copied: the setup serves the
    next mode too). ``learner`` / ``engine`` default to fresh ones over those weights (``dedup``: the learner's
    encoder once per distinct image, or every occurrence). Baseline admission kinds need
    ``make_policy=baselines.admission.make_policy``."""
    if not cfg.multimodal:
        raise ValueError("vlm_session.run_mode: the counting task shows images; set RuntimeConfig.multimodal=True "
                         "(the handoff then stores each distinct image once and hands the learner MMShares)")
    learner = learner if learner is not None else setup.learner(dedup=dedup)
    engine = engine if engine is not None else setup.engine()
    return Orchestrator(cfg, learner, engine, setup.task, faults=faults, make_policy=make_policy).run()


def evaluate_snapshots(setup: VLMSetup, run: RunResult, prompts: list[MMPrompt],
                       max_new_tokens: int = 3) -> tuple[list[int], list[float], list[float]]:
    """Held-out greedy accuracy and sampled reward (one sample per prompt, T = 1, the same seed for every
    snapshot) of every weight snapshot of ``run`` (``RuntimeConfig.eval_every``), by version."""
    versions = sorted(run.snapshots)
    greedy = [greedy_accuracy(setup, run.snapshots[v], prompts, max_new_tokens) for v in versions]
    sampled = [greedy_accuracy(setup, run.snapshots[v], prompts, max_new_tokens, greedy=False, seed=1)
               for v in versions]
    return versions, greedy, sampled
