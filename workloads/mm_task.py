"""The multimodal counting task as an RL task (the runtime's ``RLTask`` protocol), and its supervised warm start.

Prompts are ``workloads.multimodal``'s counting problems ("how many <colour> shapes?" over images of shapes drawn
with PIL, preprocessed as Qwen2-VL's processor would); the response is the count followed by EOS, and the reward
is exact (1.0 iff the text before EOS is the count; a response that never emits EOS scores 0).

Each prompt carries its images' ``pixel_values`` and ``grid_thw`` in placeholder order (``MMPrompt.images`` /
``.grids``): the orchestrator puts them into the ``GroupRequest`` (the engine encodes them) and into each
``Rollout`` (the handoff stores each distinct one once).

Example::

    >>> task = MMCountingTask(MMTaskConfig())
    >>> p = task.batch(seed=0, batch_id=0, n=2)[0]
    >>> p.images[0].shape, p.grids, task.vocab.decode(p.prompt_ids)[-20:]
    (torch.Size([36, 1176]), ((1, 6, 6),), 'how many red shapes?')
    >>> ans = task.vocab.encode(p.problem.answer) + [task.vocab.eos_id]
    >>> task.reward(p, tuple(ans)), task.reward(p, tuple(ans[:-1]))
    (1.0, 0.0)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

from knittrans.mmdedup.gather import BatchTokens, ImageSet, MMBatch, TrainSample, collate, policy_logits
from knittrans.runtime.engine import GroupRequest
from knittrans.runtime.trainer import check_reward
from knittrans.runtime.vlm_engine import suppress_logits, vision_special_ids
from workloads.multimodal import MMWorkloadConfig, MultimodalWorkload, VisualProblem, prompt_token_ids, reward
from workloads.vlm import TinyVLMConfig, VLMVocab


@dataclass(frozen=True)
class MMTaskConfig:
    """The counting problems the task draws (a ``MMWorkloadConfig`` without the synthetic rollout's knobs).

    Defaults: one 84 x 84 image per prompt (6 x 6 patches, 9 image tokens), 1-6 red shapes, each centred in its
    own merge cell (``layout="cells"``: one shape per image token). What a ~170K-parameter Qwen2-VL learns in a CPU
    warm start, measured: with that layout it jumps from the answer prior to ~100% after 70-500 supervised steps
    (seed-dependent); with shapes anywhere (straddling tokens), or with two colours (the question's colour must be bound to
    the image), it stayed at the answer prior for 1,000-2,500 steps (docs/mmdedup.md)."""

    image_sizes: tuple[tuple[int, int], ...] = ((84, 84),)
    """(height, width) choices, drawn per prompt; multiples of 28 keep the cells aligned with image tokens."""
    images_per_prompt: int = 1
    """Images per prompt; the question counts over all of them."""
    max_shapes: int = 6
    """Shapes per image: uniform in 1..max_shapes (at most one per cell)."""
    colours: tuple[str, ...] = ("red",)
    """Colours of the shapes and of the question's target."""
    shape_radius_div: int = 6
    """Shape radius = min side // this (capped to fit a cell)."""
    layout: str = "cells"
    """``cells`` (one shape per image token) or ``random`` (``MMWorkloadConfig.layout``)."""
    vlm: TinyVLMConfig = field(default_factory=TinyVLMConfig)
    """The policy the prompts' tokens and patches are built for."""

    def workload(self, seed: int) -> MMWorkloadConfig:
        return MMWorkloadConfig(prompts_per_batch=1, n=1, images_per_prompt=self.images_per_prompt,
                                image_sizes=self.image_sizes, max_shapes=self.max_shapes, colours=self.colours,
                                shape_radius_div=self.shape_radius_div, layout=self.layout, seed=seed,
                                vlm=self.vlm)


@dataclass(frozen=True)
class MMPrompt:
    """One prompt as the runtime sees it: token ids (BOS, image placeholders, question), the images' pixel values
    and grids in placeholder order, and the problem its reward is checked against."""

    prompt_ids: tuple[int, ...]
    images: tuple[torch.Tensor, ...]
    grids: tuple[tuple[int, int, int], ...]
    problem: VisualProblem

    def request(self, group_id: int, batch_id: int, traj_ids: tuple[int, ...]) -> GroupRequest:
        """This prompt's GRPO group as a rollout request."""
        return GroupRequest(group_id, batch_id, self.prompt_ids, traj_ids, images=self.images, grids=self.grids)


HELDOUT_SEED = 987_654_321
"""Seed of the evaluation prompts (a stream of its own; the problem space is finite, so problems can recur)."""


class MMCountingTask:
    """Seeded prompt batches of counting problems and an exact reward on response token ids (``RLTask``)."""

    def __init__(self, cfg: MMTaskConfig = MMTaskConfig(), vocab: VLMVocab | None = None) -> None:
        self.cfg = cfg
        self.vocab = vocab or VLMVocab()
        self._workloads: dict[int, MultimodalWorkload] = {}

    def prompt(self, seed: int, prompt_id: int) -> MMPrompt:
        """Prompt ``prompt_id`` of the stream seeded ``seed`` (a pure function of both)."""
        wl = self._workloads.get(seed)
        if wl is None:
            wl = self._workloads.setdefault(seed, MultimodalWorkload(self.cfg.workload(seed), self.vocab))
        prob = wl.problem(prompt_id)
        return MMPrompt(tuple(prompt_token_ids(self.vocab, prob.question, prob.images)),
                        tuple(im.pixel_values for im in prob.images), tuple(im.grid_thw for im in prob.images), prob)

    def batch(self, seed: int, batch_id: int, n: int) -> list[MMPrompt]:
        """The ``n`` prompts of batch ``batch_id`` in the run seeded ``seed``."""
        return [self.prompt(seed, batch_id * 1_000_003 + i) for i in range(n)]

    def heldout(self, n: int) -> list[MMPrompt]:
        """A fixed evaluation set (the same for every run and mode)."""
        return [self.prompt(HELDOUT_SEED, i) for i in range(n)]

    def reward(self, prompt: MMPrompt, response_ids: Sequence[int]) -> float:
        """1.0 iff the response emitted EOS and its text before EOS is exactly the count."""
        if self.vocab.eos_id not in response_ids:
            return 0.0
        return check_reward(reward(self.vocab, response_ids, prompt.problem.answer),
                            lambda: f"prompt {prompt.problem}")

    def answer_ids(self, prompt: MMPrompt) -> list[int]:
        """The exact answer's tokens with EOS (the warm start's targets)."""
        return self.vocab.encode(prompt.problem.answer) + [self.vocab.eos_id]

    @property
    def tokens(self) -> BatchTokens:
        return BatchTokens(self.vocab.pad_id, self.vocab.image_pad_id, self.cfg.vlm.spatial_merge_size)


# -- supervised warm start ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MMWarmStartConfig:
    """A supervised warm start so GRPO starts from a policy that partly counts (a random policy answers at chance,
    and one at the answer prior gets rewards that never depend on the image).

    The tiny VLM leaves the answer prior abruptly (from ~20% to ~100% greedy accuracy within ~50 steps, after a
    seed-dependent ~100-300), so a fixed step count lands at one end or the other. The warm start therefore stops
    at the first evaluation (every ``eval_every`` steps, on a stream of its own) whose greedy accuracy reaches
    ``target_accuracy``, or after ``max_steps``."""

    max_steps: int = 600
    """Most optimizer steps on teacher-forced (prompt, answer) pairs."""
    target_accuracy: float | None = 0.5
    """Stop once the greedy exact-match accuracy on the warm start's evaluation prompts reaches this (None: run
    ``max_steps``)."""
    eval_every: int = 10
    """Steps between accuracy evaluations."""
    eval_prompts: int = 128
    """Prompts of the warm start's evaluation (its own stream: neither the RL prompts nor ``heldout``)."""
    batch_size: int = 32
    """Problems per step (each with its own images: the warm start has no groups to deduplicate)."""
    lr: float = 3e-3
    """Adam learning rate."""
    seed: int = 0
    """Problem stream seed (shifted away from the RL and held-out streams)."""

    def __post_init__(self) -> None:
        if self.max_steps < 0 or self.eval_every < 1 or self.eval_prompts < 1 or self.batch_size < 1:
            raise ValueError(f"MMWarmStartConfig: max_steps >= 0, eval_every, eval_prompts, batch_size >= 1; got {self}")
        if self.target_accuracy is not None and not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(f"MMWarmStartConfig.target_accuracy must be in (0, 1] or None, got {self.target_accuracy}")


@dataclass(frozen=True)
class WarmStartResult:
    losses: tuple[float, ...]
    """Cross-entropy of every step taken."""
    accuracy: float
    """Greedy exact-match accuracy on the warm start's evaluation prompts when it stopped."""
    accuracies: tuple[tuple[int, float], ...]
    """(step, accuracy) at every evaluation."""

    @property
    def steps(self) -> int:
        return len(self.losses)


def supervised_batch(task: MMCountingTask, prompts: Sequence[MMPrompt]) -> MMBatch:
    """A right-padded batch of prompt + answer + EOS (loss mask on answer and EOS) over the prompts' images."""
    samples, pixels, grids = [], [], []
    for j, p in enumerate(prompts):
        ans = task.answer_ids(p)
        ids = torch.tensor(p.prompt_ids + tuple(ans))
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(p.prompt_ids):] = True
        samples.append(TrainSample(j, ids, mask, 0.0, tuple(range(len(pixels), len(pixels) + len(p.images)))))
        pixels += p.images
        grids += p.grids
    return collate(samples, ImageSet(tuple(pixels), tuple(grids)), task.tokens)


@torch.no_grad()
def teacher_forced_accuracy(model: torch.nn.Module, batch: MMBatch) -> float:
    """Fraction of samples whose every answer token (EOS included) is the argmax given the correct prefix: exactly
    the samples greedy decoding answers right (the engine's argmax, vision specials masked), in one forward."""
    was = model.training
    model.eval()
    logits = suppress_logits(policy_logits(model, batch, dedup=True)[:, :-1].float(),
                             torch.tensor(vision_special_ids(model.config), dtype=torch.long))
    model.train(was)
    mask = batch.loss_mask[:, 1:]
    hit = (logits.argmax(-1) == batch.input_ids[:, 1:]) | ~mask
    return float(hit.all(dim=1).float().mean())


def warm_start(model: torch.nn.Module, task: MMCountingTask, cfg: MMWarmStartConfig) -> WarmStartResult:
    """Train ``model`` in place with cross-entropy on answer + EOS tokens until ``cfg.target_accuracy`` (see
    ``MMWarmStartConfig``)."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    rng = random.Random(20_000_003 + cfg.seed)
    stream = 30_000_001 + cfg.seed
    evaluation = supervised_batch(task, [task.prompt(40_000_003 + cfg.seed, i) for i in range(cfg.eval_prompts)])
    model.train()
    losses: list[float] = []
    accs: list[tuple[int, float]] = []

    def reached() -> bool:
        accs.append((len(losses), teacher_forced_accuracy(model, evaluation)))
        return cfg.target_accuracy is not None and accs[-1][1] >= cfg.target_accuracy

    while len(losses) < cfg.max_steps and not (len(losses) % cfg.eval_every == 0 and reached()):
        batch = supervised_batch(task, [task.prompt(stream, rng.randrange(1 << 40)) for _ in range(cfg.batch_size)])
        logits = policy_logits(model, batch, dedup=True)[:, :-1]
        labels = batch.input_ids[:, 1:].masked_fill(~batch.loss_mask[:, 1:], -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if not accs or accs[-1][0] != len(losses):
        reached()
    model.eval()
    return WarmStartResult(tuple(losses), accs[-1][1], tuple(accs))
