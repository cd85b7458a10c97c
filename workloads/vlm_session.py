"""Putting a tiny-VLM GRPO run together: a warm-started Qwen2-VL on the counting task (``vlm_setup``), greedy
held-out accuracy, and a small GRPO loop through a multimodal ``Handoff`` without the orchestrator
(``run_handoff_grpo``: what the e2e test and the quick measurements run).

The loop: a rollout thread generates one mini-batch's worth of groups per wave with ``VLMRolloutEngine`` (each
distinct image encoded once per wave), scores them exactly, computes group advantages and ``put``\\ s the
trajectories into the handoff with their images (stored once per distinct image); the calling thread iterates its
consumer's ``MMShare``\\ s, steps ``MMGRPOLearner`` (encoder once per distinct image of the share, or every
occurrence with ``dedup=False``), acks, and publishes the weights every step; the engine loads the newest
published weights before its next wave. Flow control: wave w starts once the trainer has finished step
``w - inflight_minibatches``, so staleness is bounded by the budget.

Example::

    >>> setup = vlm_setup(seed=0, warm=MMWarmStartConfig(max_steps=2, target_accuracy=None))
    >>> run = run_handoff_grpo(setup, HandoffLoopConfig(num_batches=1, prompts_per_batch=2, group_size=2,
    ...                                                 num_minibatches=2))
    >>> [s.version for s in run.steps], sorted(t for _, ts in run.trained for t in ts)
    ([1, 2], [0, 1, 2, 3])
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from knittrans.dataplane.controller import HandoffRecord
from knittrans.handoff import Handoff, HandoffConfig, Transport
from knittrans.runtime.engine import Sample, SamplingConfig
from knittrans.runtime.trainer import GRPOConfig, StepResult, group_advantages
from knittrans.runtime.vlm_engine import VLMEngineStats, VLMRolloutEngine
from knittrans.runtime.vlm_learner import MMGRPOLearner, mm_rollout
from knittrans.types import BatchPlan, GroupSpec
from workloads.mm_task import (MMCountingTask, MMPrompt, MMTaskConfig, MMWarmStartConfig, WarmStartResult,
                               warm_start)
from workloads.vlm import TinyVLMConfig, build_tiny_vlm, vision_tower


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
                    max_new_tokens: int = 3) -> float:
    """Fraction of ``prompts`` the policy with ``weights`` (None: the setup's) answers exactly, greedy."""
    engine = setup.engine()
    if weights is not None:
        engine.load_weights(weights, version=0)
    reqs = [p.request(i, 0, (i,)) for i, p in enumerate(prompts)]
    out = engine.generate(reqs, SamplingConfig(max_new_tokens=max_new_tokens, greedy=True), seed=0)
    return sum(setup.task.reward(p, s.response_ids) for p, s in zip(prompts, out)) / len(prompts)


# -- a GRPO loop through the handoff (no orchestrator) ----------------------------------------------------------


@dataclass(frozen=True)
class HandoffLoopConfig:
    """A small disaggregated GRPO run through a multimodal ``Handoff``."""

    num_batches: int = 2
    """Training batches (each announced to the handoff before the run starts)."""
    prompts_per_batch: int = 4
    """Prompts (GRPO groups) per training batch."""
    group_size: int = 4
    """Samples per prompt; each prompt's images recur this many times in a batch."""
    num_minibatches: int = 2
    """Optimizer steps per batch (whole groups per mini-batch)."""
    max_new_tokens: int = 3
    """Response cap (the count's digits + EOS fit in 2)."""
    temperature: float = 1.0
    """Sampling temperature (behaviour log-probs are taken at it; keep 1.0 for exact ratios)."""
    inflight_minibatches: int = 2
    """Waves (one mini-batch of groups each) the rollout may run ahead of the trainer's finished steps."""
    dedup: bool = True
    """Learner: encoder once per distinct image of a share (True) or every occurrence (False)."""
    transport: Transport = Transport.INPROCESS
    """The handoff's transport (Ray needs ``ray.init``)."""
    seed: int = 0
    """Prompt and sampling streams."""
    admit_timeout_s: float = 120.0
    """A trainer waiting longer than this for a mini-batch fails the run instead of hanging."""

    def __post_init__(self) -> None:
        if self.prompts_per_batch % self.num_minibatches:
            raise ValueError(f"HandoffLoopConfig: prompts_per_batch={self.prompts_per_batch} must be a multiple of "
                             f"num_minibatches={self.num_minibatches} (whole groups per mini-batch)")
        if self.inflight_minibatches < 1:
            raise ValueError(f"HandoffLoopConfig.inflight_minibatches must be >= 1, got {self.inflight_minibatches}")


@dataclass
class HandoffLoopResult:
    """What a loop run did: the learner's steps, each step's trajectories, the handoff's records, every sample
    and reward, and the encoder counters of learner and engine."""

    steps: list[StepResult]
    trained: list[tuple[int, tuple[int, ...]]]
    """(share.seq, trajectory ids) per step, in order."""
    records: list[HandoffRecord]
    samples: dict[int, Sample]
    rewards: dict[int, float]
    share_distinct_patches: list[int]
    """Patches of each share's distinct images (what the learner's encoder must run over with dedup)."""
    learner_encoded_patches: int
    learner_occurrence_patches: int
    learner_hook_patches: list[int]
    """Patches the learner's vision tower ran over, per forward (a forward hook: measured, not accounted)."""
    engine_hook_patches: list[int]
    """The same for the engine's vision tower, per generate call."""
    engine_stats: VLMEngineStats
    final_weights: dict[str, torch.Tensor]
    wall_s: float

    @property
    def mean_reward(self) -> float:
        return float(np.mean(list(self.rewards.values())))


class _Weights:
    """The newest published (version, weights); the trainer publishes, the rollout thread takes."""

    def __init__(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self._cv = threading.Condition()
        self.latest = (version, weights)

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        with self._cv:
            self.latest = (version, weights)

    def take(self) -> tuple[int, dict[str, torch.Tensor]]:
        with self._cv:
            return self.latest


def run_handoff_grpo(setup: VLMSetup, cfg: HandoffLoopConfig, policy=None) -> HandoffLoopResult:
    """Run ``cfg`` from the setup's weights (copied) through a multimodal handoff (``policy``: its admission
    policy, default KnitTrans's). Raises whatever the rollout thread raised."""
    P, n, M = cfg.prompts_per_batch, cfg.group_size, cfg.num_minibatches
    h = Handoff(HandoffConfig.grpo(P, n, M, cfg.max_new_tokens, multimodal=True, transport=cfg.transport,
                                   admit_timeout_s=cfg.admit_timeout_s), policy)
    engine, learner = setup.engine(), setup.learner(dedup=cfg.dedup)
    prompts: dict[int, MMPrompt] = {}
    for b in range(cfg.num_batches):
        batch = setup.task.batch(cfg.seed, b, P)
        for i, p in enumerate(batch):
            prompts[b * P + i] = p
        h.add_batch(BatchPlan(b, tuple(GroupSpec(b * P + i, b, n, len(p.prompt_ids)) for i, p in enumerate(batch))))
    h.seal()
    weights = _Weights(0, learner.weights())
    samples: dict[int, Sample] = {}
    rewards: dict[int, float] = {}
    errors: list[BaseException] = []
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    per_wave = P // M
    groups = sorted(prompts)

    def rollout() -> None:
        try:
            producer = h.producer()
            for w in range(len(groups) // per_wave):
                h.wait_version(w - cfg.inflight_minibatches + 1)  # flow control: the budget in mini-batches
                version, state = weights.take()
                if version != engine.version:
                    engine.load_weights(state, version)
                gids = groups[w * per_wave:(w + 1) * per_wave]
                reqs = [prompts[g].request(g, g // P, tuple(g * n + j for j in range(n))) for g in gids]
                out = engine.generate(reqs, sampling, seed=cfg.seed * 1_000_003 + w)
                rollouts = []
                for g in gids:
                    group = [s for s in out if s.group_id == g]
                    rs = [setup.task.reward(prompts[g], s.response_ids) for s in group]
                    for item in group_advantages(group, rs):
                        samples[item.sample.traj_id] = item.sample
                        rewards[item.sample.traj_id] = item.reward
                        rollouts.append(mm_rollout(item, prompts[g].images, prompts[g].grids))
                producer.put(rollouts)
        except BaseException as e:  # noqa: BLE001 - re-raised in the trainer thread
            errors.append(e)
            h.close()  # wakes the consumer instead of leaving it waiting for trajectories that never come

    seen: dict[str, list[int]] = {"learner": [], "engine": []}
    hooks = [vision_tower(m).register_forward_hook(lambda mod, args, out, k=k: seen[k].append(int(args[0].shape[0])))
             for k, m in (("learner", learner.model), ("engine", engine.model))]
    t0 = time.perf_counter()
    thread = threading.Thread(target=rollout, name="vlm-rollout", daemon=True)
    thread.start()
    steps, trained, distinct = [], [], []
    consumer = h.consumer(0)
    try:
        for share in consumer:
            steps.append(learner.step(share))
            trained.append((share.seq, share.traj_ids))
            distinct.append(sum(int(x.shape[0]) for x in share.images.pixels))
            # a sync point every step, published before the ack advances the version the rollout waits on
            weights.publish(learner.version, learner.weights())
            consumer.ack(share)
    except BaseException as e:  # noqa: BLE001 - close, join, then re-raise (the rollout's error if it came first)
        h.close()  # wakes a rollout thread waiting on flow control
        thread.join(timeout=cfg.admit_timeout_s)
        raise (errors[0] if errors else e) from None
    finally:
        for hook in hooks:
            hook.remove()
    thread.join(timeout=cfg.admit_timeout_s)
    if errors:
        h.close()
        raise errors[0]
    h.wait_version(len(steps), timeout=cfg.admit_timeout_s)  # Ray: the last ack's release is asynchronous
    records = h.records()
    h.close()
    return HandoffLoopResult(steps=steps, trained=trained, records=records, samples=samples, rewards=rewards,
                             share_distinct_patches=distinct, learner_encoded_patches=learner.encoded_patches,
                             learner_occurrence_patches=learner.occurrence_patches, engine_stats=engine.stats,
                             learner_hook_patches=seen["learner"], engine_hook_patches=seen["engine"],
                             final_weights=learner.weights(), wall_s=time.perf_counter() - t0)
