"""Text (math-reasoning) workloads for the simulator: prompts, group sizes and long-tailed response lengths.

The DAPO-like preset follows the public DAPO recipe (Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv:2503.14476, and its verl recipe ``recipe/dapo``):

- 512 prompts per training batch (``data.train_batch_size=512``), 16 samples per prompt (``rollout.n=16``);
- mini-batches of 32 prompts (``ppo_mini_batch_size=32``), so M = 512 / 32 = 16 optimizer steps per batch;
- responses up to 20480 tokens (``max_response_length=20480``, with a 4096-token overlong buffer), prompts up
  to 2048 tokens (``max_prompt_length=2048``).

The length distribution is ours (an assumption, not a published figure; ``knittrans.sim.lengths.LengthDist``):
log-normal with a median of 3000 tokens, so the mean is about 4.5k tokens, in the range of the mean response
lengths DAPO's training curves show, and a tail truncated at the maximum (truncated responses come back at exactly ``max_response_len``, as an overlong
response does). Half of the log-variance is per prompt (hard prompts give long answers for all their samples),
which is what makes the longest member of a group much longer than the mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from knittrans.sim.lengths import TAILS, LengthDist, batches_of
from knittrans.types import WorkloadBatch

__all__ = ["TAILS", "LengthDist", "TextWorkloadConfig", "dapo", "generate_batches", "small"]


@dataclass(frozen=True)
class TextWorkloadConfig:
    name: str = "dapo"
    prompts_per_batch: int = 512
    """P: prompts per training batch."""
    group_size: int = 16
    """n: samples per prompt (GRPO group size)."""
    num_minibatches: int = 16
    """M: optimizer steps per batch."""
    lengths: LengthDist = field(default_factory=LengthDist)
    prompt_len: int = 512
    """Prompt length in tokens (DAPO's math prompts are short; 2048 is the cap)."""
    variable_groups: bool = False
    """Draw each group's size uniformly from [group_size // 2, group_size] (filtered or agentic groups)."""
    batch_total: int | None = None
    """With variable groups: adjust the drawn sizes (within their range) so every batch holds exactly this many
    trajectories, as a trainer with a fixed batch of B trajectories needs. None: sizes as drawn."""

    @property
    def batch_size(self) -> int:
        if self.variable_groups and self.batch_total is not None:
            return self.batch_total
        return self.prompts_per_batch * self.group_size


def generate_batches(cfg: TextWorkloadConfig, num_batches: int, seed: int) -> list[WorkloadBatch]:
    """Deterministic given the seed. Group ids are global (batch b holds groups b*P .. b*P+P-1)."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(num_batches):
        lens = cfg.lengths.sample(rng, cfg.prompts_per_batch, cfg.group_size)
        sizes = np.full(cfg.prompts_per_batch, cfg.group_size)
        if cfg.variable_groups:
            lo = max(1, cfg.group_size // 2)
            sizes = rng.integers(lo, cfg.group_size + 1, size=cfg.prompts_per_batch)
            if cfg.batch_total is not None:
                if not lo * cfg.prompts_per_batch <= cfg.batch_total <= cfg.group_size * cfg.prompts_per_batch:
                    raise ValueError(f"batch_total={cfg.batch_total} is outside what {cfg.prompts_per_batch} groups "
                                     f"of {lo}..{cfg.group_size} samples can hold")
                while sizes.sum() != cfg.batch_total:  # nudge random groups by one sample, within range
                    i = int(rng.integers(cfg.prompts_per_batch))
                    step = 1 if sizes.sum() < cfg.batch_total else -1
                    if lo <= sizes[i] + step <= cfg.group_size:
                        sizes[i] += step
        out += batches_of([lens[i, :int(sizes[i])] for i in range(cfg.prompts_per_batch)], cfg.prompts_per_batch,
                          cfg.prompt_len, first_batch=b)
    return out


def dapo(tail: str = "light", **overrides) -> TextWorkloadConfig:
    """The DAPO-like preset (see the module docstring for sources)."""
    return TextWorkloadConfig(lengths=LengthDist(sigma=TAILS[tail]), **overrides)


def small(tail: str = "light", **overrides) -> TextWorkloadConfig:
    """A scaled-down preset for tests: 16 prompts x 4 samples, M = 4, responses up to 2048 tokens."""
    base = dict(name="small", prompts_per_batch=16, group_size=4, num_minibatches=4, prompt_len=64,
                lengths=LengthDist(median=300.0, sigma=TAILS[tail], max_len=2048, min_len=8))
    base.update(overrides)
    return TextWorkloadConfig(**base)
