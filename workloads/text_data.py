"""Synthetic text trajectory tensors for data-plane benchmarks: what a GRPO rollout hands the trainer.

Each of P prompts has a group of n responses. Per trajectory: ``input_ids`` (prompt + response token ids,
int64), ``old_logprobs`` (fp32, per response token), ``advantages`` (fp32, per response token; GRPO's
group-normalized reward broadcast over the response), ``loss_mask`` (bool, per response token; a few spans are
masked as tool or truncation tokens). Response lengths are long-tailed (lognormal, clipped to
``max_response_len``), as reasoning rollouts are: most responses are short, a few run to the cap, which is what
makes padding to the batch maximum expensive. Everything is drawn from one ``numpy`` generator seeded by
``seed``: the same config gives byte-identical tensors.

    >>> b = make_text_batch(TextDataConfig(num_prompts=4, group_size=2, seed=3))
    >>> len(b.trajectories), b.trajectories[0].input_ids.dtype.name, len(b.minibatches(2))
    (8, 'int64', 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knittrans.dataplane.types import TEXT_SCHEMA, TrajectoryPayload
from knittrans.types import BatchPlan, GroupSpec, MiniBatch

RESPONSE_FIELDS = ("old_logprobs", "advantages", "loss_mask")


@dataclass(frozen=True)
class TextDataConfig:
    """Shape of one synthetic training batch."""

    num_prompts: int = 64
    """P: prompts (GRPO groups) per training batch."""
    group_size: int = 8
    """n: responses per prompt."""
    prompt_len_mean: int = 256
    """Mean prompt length in tokens (uniform in [mean/2, 3*mean/2])."""
    response_len_median: int = 512
    """Median response length; lengths are lognormal around it."""
    response_len_sigma: float = 1.0
    """Lognormal sigma: 1.0 puts the p99 near 10x the median (a long tail)."""
    max_response_len: int = 8192
    """Generation cap: responses are clipped here."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""
    batch_id: int = 0
    """Batch id stamped on the plan and mini-batches."""
    seed: int = 0
    """Seed of the one numpy generator that draws everything."""

    def __post_init__(self) -> None:
        for name in ("num_prompts", "group_size", "prompt_len_mean", "response_len_median", "max_response_len",
                     "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TextDataConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class TextTrajectory:
    """One response and its training tensors (``prompt_len`` leading tokens of ``input_ids`` are the prompt)."""

    traj_id: int
    group_id: int
    prompt_len: int
    input_ids: np.ndarray
    old_logprobs: np.ndarray
    advantages: np.ndarray
    loss_mask: np.ndarray

    @property
    def response_len(self) -> int:
        return int(self.old_logprobs.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.input_ids, self.old_logprobs, self.advantages, self.loss_mask))

    def payload(self) -> TrajectoryPayload:
        """What the rollout worker puts into the data plane for this trajectory."""
        return TrajectoryPayload(self.traj_id, {"input_ids": self.input_ids, "old_logprobs": self.old_logprobs,
                                                "advantages": self.advantages, "loss_mask": self.loss_mask})


@dataclass(frozen=True)
class TextBatch:
    """A training batch: ``prompts[g]`` is group g's prompt ids; trajectories are ordered by group."""

    config: TextDataConfig
    prompts: tuple[np.ndarray, ...]
    trajectories: tuple[TextTrajectory, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.trajectories)

    def plan(self) -> BatchPlan:
        c = self.config
        return BatchPlan(c.batch_id, tuple(GroupSpec(g, c.batch_id, c.group_size, int(p.shape[0]))
                                          for g, p in enumerate(self.prompts)))

    def minibatches(self, num_minibatches: int) -> tuple[MiniBatch, ...]:
        """Split into M mini-batches of whole groups, in group order (what train-batch admission commits)."""
        c = self.config
        if c.num_prompts % num_minibatches:
            raise ValueError(f"{c.num_prompts} prompts do not split into {num_minibatches} mini-batches of whole "
                             f"groups")
        per = c.num_prompts // num_minibatches
        out = []
        for k in range(num_minibatches):
            groups = range(k * per, (k + 1) * per)
            trajs = [t for t in self.trajectories if t.group_id in groups]
            out.append(MiniBatch(c.batch_id, k, tuple(t.traj_id for t in trajs), tuple(groups),
                                 sum(t.response_len for t in trajs)))
        return tuple(out)


def make_text_batch(config: TextDataConfig) -> TextBatch:
    """Draw one batch (deterministic in ``config``)."""
    c = config
    rng = np.random.default_rng(c.seed)
    lo, hi = max(1, c.prompt_len_mean // 2), max(1, (3 * c.prompt_len_mean) // 2)
    prompts = tuple(rng.integers(0, c.vocab_size, size=int(rng.integers(lo, hi + 1)), dtype=np.int64)
                    for _ in range(c.num_prompts))
    trajs = []
    for g, prompt in enumerate(prompts):
        lens = np.clip(np.round(rng.lognormal(np.log(c.response_len_median), c.response_len_sigma,
                                              size=c.group_size)), 1, c.max_response_len).astype(np.int64)
        rewards = rng.random(c.group_size).astype(np.float32)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for i, n in enumerate(lens):
            n = int(n)
            response = rng.integers(0, c.vocab_size, size=n, dtype=np.int64)
            mask = np.ones(n, dtype=bool)
            if n > 8:  # one masked span (tool output or truncation), so masks are not trivially all-ones
                s = int(rng.integers(0, n - 4))
                mask[s:s + int(rng.integers(1, 5))] = False
            trajs.append(TextTrajectory(
                traj_id=g * c.group_size + i, group_id=g, prompt_len=int(prompt.shape[0]),
                input_ids=np.concatenate([prompt, response]),
                old_logprobs=-rng.exponential(1.0, size=n).astype(np.float32),
                advantages=np.full(n, adv[i], dtype=np.float32), loss_mask=mask))
    return TextBatch(c, prompts, tuple(trajs))
