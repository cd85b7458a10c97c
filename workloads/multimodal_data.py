"""The multimodal transfer workload: batch shapes for ``repro.transfer workload=multimodal`` and ``repro.speedup``
(built into passes by ``workloads.transfer_data.MMPasses``), and the per-trajectory fields a rollout engine writes
for a multimodal sample (``knittrans.mmdedup.plane``'s ``MM_SCHEMA``: prompt + response ids, response-length
logprobs, advantages and loss mask; the images travel beside them, once per distinct image).

    >>> from workloads.multimodal import MultimodalWorkload
    >>> w = MMTransferWorkload(prompts_per_batch=2, group_size=4, image_side=56)
    >>> groups = MultimodalWorkload(workload_config(w, seed=0)).sample_batch(0)
    >>> f = trajectory_fields(groups[0].samples[0])
    >>> sorted(f), f["old_logprobs"].shape == f["loss_mask"].shape
    (['advantages', 'input_ids', 'loss_mask', 'old_logprobs'], True)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

import numpy as np

from workloads.multimodal import MMSample, MMWorkloadConfig
from workloads.vlm import TinyVLMConfig


class Placement(str, Enum):
    """Which rollout engine (producer) generates each sample of a batch; it writes to the storage unit on its node."""

    SPREAD = "spread"
    """verl's agent loop: every sample is its own request, sent to the least-loaded server (``AsyncLLMServerManager.
    _choose_server``: a heap of request counts, each new request to the least-used server), so with the batch's
    n x P requests issued together the samples are dealt round robin and a group's n samples sit on min(n, E)
    engines: ``producer(row) = row mod E`` over the repeated batch's rows."""
    GROUP = "group"
    """Every sample of group g on engine ``g mod E`` (one request with n samples per prompt): each unit holds whole
    groups, so per-unit dedup alone already moves each image once."""


def producer_of(placement: Placement | str, group_index: int, sample: int, group_size: int, num_producers: int) -> int:
    """The producer of sample ``sample`` of group ``group_index`` under ``placement``.

        >>> [producer_of("spread", g, i, 4, 3) for g in range(2) for i in range(4)]
        [0, 1, 2, 0, 1, 2, 0, 1]
        >>> [producer_of("group", g, i, 4, 3) for g in range(2) for i in range(4)]
        [0, 0, 0, 0, 1, 1, 1, 1]
    """
    if Placement(placement) is Placement.GROUP:
        return group_index % num_producers
    return (group_index * group_size + sample) % num_producers


@dataclass
class MMTransferWorkload:
    """Shape of the multimodal transfer workload (``workload=multimodal``)."""

    scale: str = "default"
    """Label of the size preset; ``scale=paper`` (the Hydra group of ``repro.transfer``) sets the fields below."""
    prompts_per_batch: int = 32
    """P: prompts per training batch (a multiple of num_minibatches x num_ranks keeps groups whole per rank)."""
    group_size: int = 8
    """n: samples per prompt (GRPO group size)."""
    images_per_prompt: int = 1
    """Images per prompt."""
    image_side: int = 224
    """Nominal image side in pixels; prompts draw from side x side and the two side x 3/4 side rectangles.
    224 x 224 = 256 patches x 1176 fp32 = 1.2 MB of pixel_values; 448 x 448 = 1024 patches = 4.8 MB."""
    placement: str = "spread"
    """A ``Placement``: "spread" (verl's agent loop: a group's samples over the least-loaded engines, the default)
    or "group" (each group on one engine)."""

    def __post_init__(self) -> None:
        if self.placement not in {p.value for p in Placement} and not isinstance(self.placement, Placement):
            raise ValueError(f"MMTransferWorkload.placement: unknown {self.placement!r}; choose from "
                             f"{[p.value for p in Placement]}")


def workload_config(w: MMTransferWorkload, seed: int, vlm: TinyVLMConfig | None = None) -> MMWorkloadConfig:
    s = w.image_side
    r = (s * 3 // 4) // 28 * 28
    cfg = MMWorkloadConfig(prompts_per_batch=w.prompts_per_batch, n=w.group_size,
                           images_per_prompt=w.images_per_prompt, image_sizes=((s, s), (r, s), (s, r)), seed=seed)
    return cfg if vlm is None else dataclasses.replace(cfg, vlm=vlm)


def prompt_len(s: MMSample) -> int:
    """Leading prompt tokens of a sample (its loss mask is False exactly on them)."""
    return int((~s.loss_mask).sum())


def trajectory_fields(s: MMSample, seed: int = 0) -> dict[str, np.ndarray]:
    """What the rollout engine writes for one sample: ``input_ids`` (prompt + response, int64), and per response
    token ``old_logprobs`` (fp32, seeded stand-ins for the engine's logprobs), ``advantages`` (fp32, the sample's
    GRPO advantage) and ``loss_mask`` (bool)."""
    lp = prompt_len(s)
    r = int(s.token_ids.shape[0]) - lp
    rng = np.random.default_rng(seed * 1_000_003 + s.traj_id)
    return {"input_ids": s.token_ids.numpy().astype(np.int64, copy=False),
            "old_logprobs": -rng.exponential(1.0, r).astype(np.float32),
            "advantages": np.full(r, s.advantage, dtype=np.float32),
            "loss_mask": np.ones(r, dtype=np.bool_)}
