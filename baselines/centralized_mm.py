"""Centralized multimodal transfer: verl's DataProto path for a VLM, as a careful verl user runs it.

What verl does with images (``RLHFDataset`` -> ``RayPPOTrainer.fit`` -> ``update_actor``): the dataloader hands the
driver each prompt with its ``multi_modal_inputs`` (``pixel_values`` ``[patches, 1176]`` and ``image_grid_thw``);
``batch.repeat(n, interleave=True)`` gives every one of the prompt's n samples its own entry; after rollout the
driver unions the responses with that repeated batch, balances rows over the data-parallel ranks, chunks and
scatters the batch through Ray; each rank splits its chunk into mini-batches and, per micro-batch, concatenates
the rows' ``pixel_values`` and runs the vision tower over every occurrence (``model(pixel_values=...)``). With the
agent-loop rollout (one-step-off, fully-async) every sample's ``multi_modal_inputs`` are computed per sample, so the
n copies are distinct arrays from the start.

Here (``build_mm_dense_batch``): the token tensors are built exactly as the text baseline
(``baselines.centralized.build_dense_batch``: gather, repeat prompts, pad, balance) and the images of every row,
in the balanced row order, are concatenated into one ``pixel_values`` buffer per batch (one copy per occurrence,
what the trainer's micro-batch ``torch.cat`` materialises anyway), then chunked per rank with the rows.
Choices in the baseline's favour: one contiguous numpy buffer per chunk (one object-store copy, zero-copy reads;
verl ships per-row dicts of tensors), 2-D ``position_ids`` (Qwen2-VL's are 3-D M-RoPE rows, 3x the bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from baselines.centralized import CentralizedConfig, DenseBatch, RankPlan, build_dense_batch
from knittrans.dataplane.types import TrajectoryPayload


@dataclass
class MMDenseBatch(DenseBatch):
    """A ``DenseBatch`` plus the images of its rows: ``pixel_values`` holds every row's images back to back (one
    copy per occurrence), ``row_patches[i]`` / ``row_images[i]`` how many patch rows / images row i owns,
    ``image_grid_thw`` one (t, h, w) per occurrence."""

    pixel_values: np.ndarray = field(default_factory=lambda: np.zeros((0, 1176), np.float32))
    image_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    row_patches: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    row_images: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def nbytes(self) -> int:
        return (super().nbytes + int(self.pixel_values.nbytes) + int(self.image_grid_thw.nbytes)
                + int(self.row_patches.nbytes) + int(self.row_images.nbytes))

    @property
    def pixel_nbytes(self) -> int:
        return int(self.pixel_values.nbytes)

    def split(self, size: int) -> list["MMDenseBatch"]:
        """Consecutive pieces of ``size`` rows (views, as ``DataProto.split``), images sliced with their rows."""
        pcum = np.concatenate([[0], np.cumsum(self.row_patches)])
        icum = np.concatenate([[0], np.cumsum(self.row_images)])
        out = []
        for piece, i in zip(super().split(size), range(0, len(self), size)):
            j = min(i + size, len(self))
            out.append(MMDenseBatch(piece.traj_ids, piece.tensors, self.pixel_values[pcum[i]:pcum[j]],
                                    self.image_grid_thw[icum[i]:icum[j]], self.row_patches[i:j],
                                    self.row_images[i:j]))
        return out


def build_mm_dense_batch(gathered: Sequence[Sequence[TrajectoryPayload]], prompts: Sequence[np.ndarray],
                         prompt_of: dict[int, int], group_size: int, plan: RankPlan,
                         images: Mapping[int, Sequence[np.ndarray]], grids: Mapping[int, Sequence[tuple[int, int, int]]],
                         config: CentralizedConfig = CentralizedConfig()) -> MMDenseBatch:
    """The driver's work at t0: the text baseline's dense token batch, then every row's images (``images[g]`` of
    its group g, repeated for each of the group's n rows) concatenated in the balanced row order."""
    batch = build_dense_batch(gathered, prompts, prompt_of, group_size, plan, config)
    groups = [prompt_of[int(t)] for t in batch.traj_ids]
    occ = [a for g in groups for a in images[g]]  # DataProto.repeat + union: one entry per occurrence
    pixel_values = np.concatenate(occ) if occ else np.zeros((0, 1176), np.float32)
    grid = np.asarray([gr for g in groups for gr in grids[g]], dtype=np.int64).reshape(-1, 3)
    row_patches = np.asarray([sum(int(a.shape[0]) for a in images[g]) for g in groups], dtype=np.int64)
    row_images = np.asarray([len(images[g]) for g in groups], dtype=np.int64)
    return MMDenseBatch(batch.traj_ids, batch.tensors, pixel_values, grid, row_patches, row_images)
