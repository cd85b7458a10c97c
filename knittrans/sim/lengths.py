"""Response lengths for the simulator: the log-normal length model and the batches a list of groups makes.

The length model is ours (an assumption, not a published figure; ``workloads.text`` documents the DAPO preset
built on it): log-normal with a median and a shape ``sigma``, part of whose log-variance is shared by the samples
of one prompt (hard prompts give long answers for all their samples, which is what makes the longest member of a
group much longer than the mean), truncated at the maximum response length (a truncated response comes back at
exactly ``max_len``, as an overlong one does). ``TAILS`` names the two shapes the tables use.

``batches_of`` turns groups of lengths (any sizes) into the ``WorkloadBatch`` list the simulator replays, with
global group ids in data-loader order (batch b holds groups ``b*P .. b*P+P-1``).

    >>> import numpy as np
    >>> d = LengthDist(median=100.0, sigma=0.5, max_len=400, min_len=4)
    >>> lens = d.sample(np.random.default_rng(0), groups=3, n=2)
    >>> lens.shape, bool((lens >= 4).all() and (lens <= 400).all())
    ((3, 2), True)
    >>> [b.plan.num_trajectories for b in batches_of(list(lens), prompts_per_batch=1)]
    [2, 2, 2]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from knittrans.types import BatchPlan, GroupSpec, WorkloadBatch


@dataclass(frozen=True)
class LengthDist:
    median: float = 3000.0
    """Median response length in tokens."""
    sigma: float = 0.9
    """Log-normal shape: standard deviation of log(length). 0.9 'light' tail, 1.3 'heavy' tail."""
    prompt_share: float = 0.5
    """Fraction of the log-variance that is shared by the samples of one prompt (0: independent samples)."""
    max_len: int = 20480
    """Truncation: longer responses are cut to exactly this length."""
    min_len: int = 16
    """Shortest response (an answer with no reasoning)."""

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 0 <= self.prompt_share <= 1
                and 1 <= self.min_len <= self.max_len):
            raise ValueError(f"LengthDist: invalid parameters {self}")

    def sample(self, rng: np.random.Generator, groups: int, n: int) -> np.ndarray:
        """Lengths of ``groups`` groups of ``n`` samples, shape [groups, n], int64."""
        sp = self.sigma * np.sqrt(self.prompt_share)
        ss = self.sigma * np.sqrt(1.0 - self.prompt_share)
        log = np.log(self.median) + sp * rng.standard_normal((groups, 1)) + ss * rng.standard_normal((groups, n))
        return np.clip(np.exp(log), self.min_len, self.max_len).astype(np.int64)


TAILS = {"light": 0.9, "heavy": 1.3}
"""Named shapes (``LengthDist.sigma``) of the length tail."""


def batches_of(groups: Sequence[np.ndarray], prompts_per_batch: int, prompt_len: int = 0,
               first_batch: int = 0) -> list[WorkloadBatch]:
    """Consecutive runs of ``prompts_per_batch`` groups (each an array of its samples' lengths) as batches
    ``first_batch, first_batch + 1, ...``; a trailing partial batch is dropped. Group ids are global."""
    out = []
    for i in range(len(groups) // prompts_per_batch):
        b = first_batch + i
        specs, lengths = [], {}
        for j in range(prompts_per_batch):
            gid = b * prompts_per_batch + j
            lens = np.asarray(groups[i * prompts_per_batch + j], dtype=np.int64)
            specs.append(GroupSpec(gid, b, len(lens), prompt_len))
            lengths[gid] = lens
        out.append(WorkloadBatch(BatchPlan(b, tuple(specs)), lengths))
    return out
