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
    (torch.Size([16, 1176]), ((1, 4, 4),), 'how many red shapes?')
    >>> ans = task.vocab.encode(p.problem.answer) + [task.vocab.eos_id]
    >>> task.reward(p, tuple(ans)), task.reward(p, tuple(ans[:-1]))
    (1.0, 0.0)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

from knittrans.mmdedup.gather import BatchTokens, ImageSet, TrainSample, collate, policy_logits
from knittrans.runtime.engine import GroupRequest
from knittrans.runtime.trainer import check_reward
from workloads.multimodal import MMWorkloadConfig, MultimodalWorkload, VisualProblem, prompt_token_ids, reward
from workloads.vlm import TinyVLMConfig, VLMVocab


@dataclass(frozen=True)
class MMTaskConfig:
    """The counting problems the task draws (a ``MMWorkloadConfig`` without the synthetic rollout's knobs).

    Defaults: one 56 x 56 image per prompt (4 x 4 patches, 4 image tokens), 1-3 shapes of radius 9 px in one of
    two colours: small enough that a ~170K-parameter Qwen2-VL learns to look at the image in a CPU warm start
    (with five colours and 4-px shapes it stays at the answer prior for the first thousand steps)."""

    image_sizes: tuple[tuple[int, int], ...] = ((56, 56),)
    """(height, width) choices, drawn per prompt."""
    images_per_prompt: int = 1
    """Images per prompt; the question counts over all of them."""
    max_shapes: int = 3
    """Shapes per image: uniform in 1..max_shapes."""
    colours: tuple[str, ...] = ("blue", "red")
    """Colours of the shapes and of the question's target."""
    shape_radius_div: int = 6
    """Shape radius = min side // this."""
    vlm: TinyVLMConfig = field(default_factory=TinyVLMConfig)
    """The policy the prompts' tokens and patches are built for."""

    def workload(self, seed: int) -> MMWorkloadConfig:
        return MMWorkloadConfig(prompts_per_batch=1, n=1, images_per_prompt=self.images_per_prompt,
                                image_sizes=self.image_sizes, max_shapes=self.max_shapes, colours=self.colours,
                                shape_radius_div=self.shape_radius_div, seed=seed, vlm=self.vlm)


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
        return check_reward(reward(self.vocab, response_ids, prompt.problem.answer), f"prompt {prompt.problem}")

    def answer_ids(self, prompt: MMPrompt) -> list[int]:
        """The exact answer's tokens with EOS (the warm start's targets)."""
        return self.vocab.encode(prompt.problem.answer) + [self.vocab.eos_id]

    @property
    def tokens(self) -> BatchTokens:
        return BatchTokens(self.vocab.pad_id, self.vocab.image_pad_id, self.cfg.vlm.spatial_merge_size)


# -- supervised warm start ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MMWarmStartConfig:
    """A supervised warm start so GRPO starts from a policy that looks at the image (a random policy answers at
    chance, and the answer prior alone gives groups whose rewards never depend on the image)."""

    steps: int = 1500
    """Optimizer steps on teacher-forced (prompt, answer) pairs."""
    batch_size: int = 32
    """Problems per step (each with its own images: the warm start has no groups to deduplicate)."""
    lr: float = 3e-3
    """Adam learning rate."""
    seed: int = 0
    """Problem stream seed (shifted away from the RL and held-out streams)."""


def supervised_batch(task: MMCountingTask, prompts: Sequence[MMPrompt]):
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


def warm_start(model: torch.nn.Module, task: MMCountingTask, cfg: MMWarmStartConfig) -> list[float]:
    """Train ``model`` in place with cross-entropy on answer + EOS tokens; returns the loss of every step."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    rng = random.Random(20_000_003 + cfg.seed)
    stream = 30_000_001 + cfg.seed
    model.train()
    losses = []
    for _ in range(cfg.steps):
        batch = supervised_batch(task, [task.prompt(stream, rng.randrange(1 << 40)) for _ in range(cfg.batch_size)])
        logits = policy_logits(model, batch, dedup=True)[:, :-1]
        labels = batch.input_ids[:, 1:].masked_fill(~batch.loss_mask[:, 1:], -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
