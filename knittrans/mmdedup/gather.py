"""Trainer path: run the vision encoder once per distinct image of a mini-batch and gather its output into every
sample that shows it, with the gradients of the undeduplicated computation.

Why the gradients are intact: the encoder output of a distinct image is one tensor in the autograd graph; handing
that same tensor object to every occurrence (``mm_encoder_outputs``) makes autograd *sum* the occurrences'
upstream gradients into it before the single backward through the encoder, which is exactly the sum the
baseline's n separate encodings produce (encoder parameters and inputs alike). Observed on the tiny Qwen2-VL:
language-model gradients bitwise equal, vision gradients within ~1e-6 relative in fp32 (summation order only).

Two transformers pitfalls this module guards (transformers 5.24, Qwen2-VL / Qwen2.5-VL):

- ``mm_encoder_outputs["image"].pooler_output`` must list one tensor per placeholder run of the *flattened*
  batch, in order; the model checks only the total token count, so a swapped order of two equal-size images
  would silently train on the wrong pixels. Here the occurrence list and the tokens are built from the same
  per-sample ``image_ids`` and every run is checked against its image's grid (``check_placeholders``).
- M-RoPE needs 3-D ``position_ids`` from ``get_rope_index`` with one grid row per image *occurrence* (not per
  distinct image), and ``mm_token_type_ids`` = 1 on image-pad tokens; otherwise positions silently fall back
  to 1-D. ``mrope_positions`` computes them once for both paths and checks the shape.

Example (``baseline`` encodes 2 occurrences, ``dedup`` 1 distinct image)::

    >>> import torch
    >>> imgs = ImageSet(pixels=(torch.randn(16, 1176),), grids=((1, 4, 4),))
    >>> s = [TrainSample(i, torch.tensor([1, 3] + [5] * 4 + [4, 9, 9]), torch.tensor([0] * 8 + [1]).bool(), 1.0,
    ...                  (0,)) for i in range(2)]
    >>> b = collate(s, imgs, BatchTokens(pad_id=0, image_token_id=5))
    >>> b.encoder_patches(dedup=True), b.encoder_patches(dedup=False)
    (16, 32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from knittrans.mmdedup.keys import EncodingInputError, check_encoding


class ImageTokenMismatchError(ValueError):
    """A sample's image-pad runs do not match the grids of the images it lists (count, order or length)."""


@dataclass(frozen=True)
class BatchTokens:
    """Token ids the collator needs."""

    pad_id: int
    """Right-padding id (masked out of attention and loss)."""
    image_token_id: int
    """The image-pad placeholder id (``config.image_token_id``)."""
    merge: int = 2
    """Spatial merge size: an image of grid (t, h, w) fills t*h*w/merge^2 placeholders."""


@dataclass(frozen=True)
class TrainSample:
    """What the trainer needs of one trajectory. ``image_ids`` index the mini-batch's ``ImageSet`` (distinct
    images), one per image-pad run of ``token_ids``, in order."""

    traj_id: int
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantage: float
    image_ids: tuple[int, ...]


@dataclass(frozen=True)
class ImageSet:
    """The distinct images of a mini-batch: ``pixels[i]`` is ``[t*h*w, patch_dim]`` for grid ``grids[i]``."""

    pixels: tuple[torch.Tensor, ...]
    grids: tuple[tuple[int, int, int], ...]

    def __post_init__(self) -> None:
        if len(self.pixels) != len(self.grids):
            raise EncodingInputError(f"ImageSet: {len(self.pixels)} pixel tensors but {len(self.grids)} grids")
        dim = None
        for i, (p, g) in enumerate(zip(self.pixels, self.grids)):
            check_encoding(p)
            if len(g) != 3 or min(g) < 1 or g[0] * g[1] * g[2] != p.shape[0]:
                raise EncodingInputError(f"image {i}: grid_thw {g} needs {g[0] * g[1] * g[2] if len(g) == 3 else '?'}"
                                         f" patches, pixel values have {p.shape[0]}")
            if (dim is not None and p.shape[1] != dim) or p.dtype != self.pixels[0].dtype:
                raise EncodingInputError(f"image {i}: pixel values {p.dtype} x {p.shape[1]} differ from image 0's "
                                         f"{self.pixels[0].dtype} x {self.pixels[0].shape[1]}")
            dim = p.shape[1]


@dataclass(frozen=True)
class MMBatch:
    """A right-padded multimodal mini-batch. ``occurrence[j]`` is the ``images`` index of the j-th placeholder
    run of the flattened batch (row-major), and ``occurrence_grid_thw[j]`` its grid."""

    traj_ids: tuple[int, ...]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mm_token_type_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    images: ImageSet
    occurrence: tuple[int, ...]
    occurrence_grid_thw: torch.Tensor

    def encoder_patches(self, dedup: bool) -> int:
        """Patches the vision tower encodes (its FLOPs are proportional): distinct images with dedup, every
        occurrence without."""
        ids = sorted(set(self.occurrence)) if dedup else self.occurrence
        return sum(self.images.pixels[i].shape[0] for i in ids)

    def pixel_bytes(self, dedup: bool) -> int:
        """Pixel bytes the trainer holds: one copy per distinct image with dedup, per occurrence without."""
        ids = sorted(set(self.occurrence)) if dedup else self.occurrence
        return sum(self.images.pixels[i].numel() * self.images.pixels[i].element_size() for i in ids)


def check_placeholders(row: torch.Tensor, grids: Sequence[tuple[int, int, int]], image_token_id: int, merge: int,
                       where: str = "") -> None:
    """Raise ``ImageTokenMismatchError`` unless the image-pad runs of ``row`` match ``grids`` one to one, in
    order, each run t*h*w/merge^2 tokens long."""
    pad = (row == image_token_id).to(torch.int8)
    edges = torch.diff(torch.cat([pad.new_zeros(1), pad, pad.new_zeros(1)]))
    starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
    runs = (ends - starts).tolist()
    want = [t * h * w // (merge * merge) for t, h, w in grids]
    bad = [(t, h, w) for t, h, w in grids if h % merge or w % merge]
    if bad:
        raise ImageTokenMismatchError(f"{where}grid(s) {bad} are not divisible by the merge size {merge}")
    if runs != want:
        raise ImageTokenMismatchError(f"{where}image-pad runs of lengths {runs} do not match the listed images' "
                                      f"grids {list(grids)} (tokens per image {want}): one run per image, in order, "
                                      f"t*h*w/{merge * merge} tokens each")


def collate(samples: Sequence[TrainSample], images: ImageSet, tokens: BatchTokens) -> MMBatch:
    """Right-pad ``samples`` into one batch and build the occurrence list from each sample's ``image_ids``
    (the same source as its placeholders), checking every placeholder run against its image's grid."""
    if not samples:
        raise ValueError("collate: empty mini-batch")
    width = max(int(s.token_ids.numel()) for s in samples)
    B = len(samples)
    input_ids = torch.full((B, width), tokens.pad_id, dtype=torch.int64)
    attn = torch.zeros(B, width, dtype=torch.int64)
    loss_mask = torch.zeros(B, width, dtype=torch.bool)
    occurrence: list[int] = []
    for b, s in enumerate(samples):
        if s.token_ids.ndim != 1 or s.loss_mask.shape != s.token_ids.shape:
            raise ValueError(f"trajectory {s.traj_id}: token_ids {tuple(s.token_ids.shape)} and loss_mask "
                             f"{tuple(s.loss_mask.shape)} must be equal-length 1-D tensors")
        for i in s.image_ids:
            if not 0 <= i < len(images.pixels):
                raise EncodingInputError(f"trajectory {s.traj_id}: image id {i} is not in the mini-batch's "
                                         f"{len(images.pixels)} images")
        check_placeholders(s.token_ids, [images.grids[i] for i in s.image_ids], tokens.image_token_id,
                           tokens.merge, where=f"trajectory {s.traj_id}: ")
        L = s.token_ids.numel()
        input_ids[b, :L] = s.token_ids
        attn[b, :L] = 1
        loss_mask[b, :L] = s.loss_mask
        occurrence.extend(s.image_ids)
    return MMBatch(
        traj_ids=tuple(s.traj_id for s in samples), input_ids=input_ids, attention_mask=attn,
        mm_token_type_ids=(input_ids == tokens.image_token_id).to(torch.int32), loss_mask=loss_mask,
        advantages=torch.tensor([float(s.advantage) for s in samples]), images=images,
        occurrence=tuple(occurrence),
        occurrence_grid_thw=torch.tensor([images.grids[i] for i in occurrence], dtype=torch.int64).reshape(-1, 3))


def mrope_positions(model, batch: MMBatch) -> torch.Tensor:
    """3-D M-RoPE ``position_ids`` [3, B, L] from ``get_rope_index``, one grid row per image occurrence."""
    pos, _ = model.model.get_rope_index(batch.input_ids, batch.mm_token_type_ids,
                                        image_grid_thw=batch.occurrence_grid_thw,
                                        attention_mask=batch.attention_mask)
    if pos.ndim != 3 or pos.shape[0] != 3 or tuple(pos.shape[1:]) != tuple(batch.input_ids.shape):
        raise RuntimeError(f"get_rope_index returned positions of shape {tuple(pos.shape)}, expected "
                           f"[3, {batch.input_ids.shape[0]}, {batch.input_ids.shape[1]}]")
    return pos


def encode_distinct(model, batch: MMBatch) -> list[torch.Tensor]:
    """Run the vision tower once over the distinct images the batch uses; one output tensor per distinct image
    (indexed like ``batch.images``; unused images are skipped and left as None-free gaps by construction)."""
    used = sorted(set(batch.occurrence))
    pixels = torch.cat([batch.images.pixels[i] for i in used])
    grids = torch.tensor([batch.images.grids[i] for i in used], dtype=torch.int64)
    out = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
    by_id = dict(zip(used, out))
    return [by_id.get(i) for i in range(len(batch.images.pixels))]


def policy_logits(model, batch: MMBatch, dedup: bool, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, L, V] of the batch.

    ``dedup=False`` is the baseline trainer (verl's): ``pixel_values`` of every occurrence, concatenated, so the
    vision tower encodes each image n times. ``dedup=True`` encodes each distinct image once and hands the same
    output tensor to each of its occurrences through ``mm_encoder_outputs``."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    pos = mrope_positions(model, batch) if positions is None else positions
    common = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos,
                  mm_token_type_ids=batch.mm_token_type_ids, image_grid_thw=batch.occurrence_grid_thw,
                  use_cache=False)
    if not dedup:
        pixels = torch.cat([batch.images.pixels[i] for i in batch.occurrence])
        return model(pixel_values=pixels, **common).logits
    enc = encode_distinct(model, batch)
    per_occurrence = [enc[i] for i in batch.occurrence]  # the same tensor object per occurrence: autograd sums
    return model(mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=per_occurrence)},
                 **common).logits


def grpo_loss(logits: torch.Tensor, batch: MMBatch) -> torch.Tensor:
    """On-policy GRPO surrogate: -mean over response tokens of advantage x ratio, ratio = exp(logp - logp.detach())
    (value 1, gradient of logp), so its gradient is the policy gradient."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    tok = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.loss_mask[:, 1:].to(tok.dtype)
    ratio = torch.exp(tok - tok.detach())
    return -(batch.advantages[:, None].to(tok.dtype) * ratio * mask).sum() / mask.sum().clamp_min(1.0)
