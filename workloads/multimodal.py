"""Multimodal GRPO workload: prompts with images of shapes drawn with PIL, a verifiable counting task, and the
Qwen2-VL preprocessing (patchify, image-pad placeholders, ``mm_token_type_ids``) done here without torchvision.

Task: each prompt shows ``images_per_prompt`` images, each with 1-5 filled shapes (circle, square, triangle) in
one of five colours, and asks "how many <colour> shapes?" over all its images. The answer is a number whose ground
truth comes from the drawing spec, so rewards are exact (1.0 for the exact answer followed by EOS, else 0.0).
Image sides are drawn per prompt from ``image_sizes`` so sizes vary across prompts (mixed grids in a batch).

Preprocessing follows ``Qwen2VLImageProcessorPil`` (transformers 5.24): resize to sides divisible by
patch x merge (28) within [min_pixels, max_pixels] (``smart_resize``), rescale to [0, 1], normalise with CLIP's
mean/std, repeat the still image over ``temporal_patch_size`` frames, and flatten to ``pixel_values`` of
``[grid_h * grid_w, 3 * 2 * 14 * 14]`` in the (merge-block-major) patch order the vision tower expects. A 448 x 448
image gives 32 x 32 = 1024 patches x 1176 values (4.8 MB in fp32) and 256 image tokens.

Example::

    >>> cfg = MMWorkloadConfig(prompts_per_batch=2, n=4, images_per_prompt=1, image_sizes=((56, 84),))
    >>> wl = MultimodalWorkload(cfg)
    >>> groups = wl.sample_batch(0)
    >>> len(groups), len(groups[0].samples), groups[0].images[0].pixel_values.shape
    (2, 4, torch.Size([24, 1176]))
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
import torch

from workloads.vlm import TinyVLMConfig, VLMVocab

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
           "purple": (150, 60, 190)}
KINDS = ("circle", "square", "triangle")


class ImageInputError(ValueError):
    """An image the workload cannot turn into ``pixel_values`` (wrong channel count, zero size, wrong dtype) or
    a prompt whose image-token count does not match its grid."""


# -- images: drawing and preprocessing ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """One filled shape of the drawing spec (the ground truth the reward is computed from)."""

    kind: str
    colour: str
    cx: int
    cy: int
    r: int


@dataclass(frozen=True)
class PatchedImage:
    """One preprocessed image as the vision tower consumes it: ``pixel_values`` float32 ``[t*h*w, patch_dim]``
    and its ``grid_thw`` = (t, h, w) in patches. ``num_tokens`` is the number of image-pad tokens it fills."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    merge: int = 2

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (self.merge * self.merge)

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()


def draw_image(shapes: Sequence[Shape], height: int, width: int, background: tuple[int, int, int] = (245, 245, 240)):
    """A PIL RGB image of ``shapes`` on a plain background."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), background)
    d = ImageDraw.Draw(img)
    for s in shapes:
        fill = COLOURS[s.colour]
        box = (s.cx - s.r, s.cy - s.r, s.cx + s.r, s.cy + s.r)
        if s.kind == "circle":
            d.ellipse(box, fill=fill)
        elif s.kind == "square":
            d.rectangle(box, fill=fill)
        else:
            d.polygon([(s.cx, s.cy - s.r), (s.cx - s.r, s.cy + s.r), (s.cx + s.r, s.cy + s.r)], fill=fill)
    return img


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides divisible by ``factor``, area within [min_pixels, max_pixels], aspect
    ratio kept as closely as possible (same arithmetic as transformers' ``smart_resize``)."""
    if height <= 0 or width <= 0:
        raise ImageInputError(f"image has zero size ({height} x {width})")
    if max(height, width) / min(height, width) > 200:
        raise ImageInputError(f"image aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _as_rgb_array(image) -> np.ndarray:
    """uint8 [H, W, 3] from a PIL RGB image or a numpy array; anything else is an ``ImageInputError``."""
    from PIL import Image

    if isinstance(image, Image.Image):
        if image.mode != "RGB":
            raise ImageInputError(f"image has mode {image.mode!r} ({len(image.getbands())} channels); the vision "
                                  f"tower takes 3-channel RGB: convert it with image.convert('RGB') first")
        arr = np.asarray(image)
    elif isinstance(image, np.ndarray):
        arr = image
    else:
        raise ImageInputError(f"image must be a PIL image or a numpy array, got {type(image).__name__}")
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ImageInputError(f"image array has shape {arr.shape}; expected [height, width, 3] (3 RGB channels)")
    if arr.dtype != np.uint8:
        raise ImageInputError(f"image array has dtype {arr.dtype}; expected uint8 pixel values in [0, 255]")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ImageInputError(f"image has zero size ({arr.shape[0]} x {arr.shape[1]})")
    return arr


def preprocess_image(image, vcfg: TinyVLMConfig = TinyVLMConfig(), min_pixels: int = 56 * 56,
                     max_pixels: int = 28 * 28 * 1280) -> PatchedImage:
    """``pixel_values`` and ``grid_thw`` of one image, as Qwen2-VL's processor computes them (see module doc)."""
    from PIL import Image

    arr = _as_rgb_array(image)
    h, w = arr.shape[:2]
    rh, rw = smart_resize(h, w, vcfg.factor, min_pixels, max_pixels)
    if (rh, rw) != (h, w):
        arr = np.asarray(Image.fromarray(arr).resize((rw, rh), resample=Image.BICUBIC))
    x = torch.from_numpy(arr.astype(np.float32) / 255.0).permute(2, 0, 1)  # [C, H, W]
    x = (x - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)
    p, m, tp = vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size
    gh, gw = rh // p, rw // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    x = x.unsqueeze(5).expand(*x.shape[:5], tp, p, p)
    pv = x.reshape(gh * gw, 3 * tp * p * p).contiguous()
    return PatchedImage(pixel_values=pv, grid_thw=(1, gh, gw), merge=m)


# -- prompts and samples --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisualProblem:
    """One prompt: its images (drawing specs and preprocessed pixels), the question and the exact answer."""

    prompt_id: int
    shapes: tuple[tuple[Shape, ...], ...]
    images: tuple[PatchedImage, ...]
    question: str
    answer: str


@dataclass(frozen=True)
class MMSample:
    """One trajectory of a GRPO group: prompt tokens (with image-pad placeholders) followed by the response.

    ``image_index`` lists, in placeholder order, which of the group's images each placeholder run shows (here
    always 0..k-1: every sample of a prompt shows the prompt's images), so the trainer can build the occurrence
    list from the same source as the tokens."""

    traj_id: int
    prompt_id: int
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    reward: float
    advantage: float
    image_index: tuple[int, ...]


@dataclass(frozen=True)
class MMGroup:
    """A prompt's n samples and the prompt's images (one copy: what a dedup-aware producer stores)."""

    problem: VisualProblem
    samples: tuple[MMSample, ...]

    @property
    def images(self) -> tuple[PatchedImage, ...]:
        return self.problem.images


def prompt_token_ids(vocab: VLMVocab, question: str, images: Sequence[PatchedImage]) -> list[int]:
    """[BOS] + per image: <|vision_start|> <|image_pad|> x num_tokens <|vision_end|> + the question."""
    ids = [vocab.bos_id]
    for im in images:
        ids += [vocab.vision_start_id] + [vocab.image_pad_id] * im.num_tokens + [vocab.vision_end_id]
    return ids + vocab.encode(question)


def mm_token_type_ids(token_ids: torch.Tensor, vocab: VLMVocab) -> torch.Tensor:
    """1 on image-pad tokens, 0 elsewhere (what get_rope_index reads to place the 3-D M-RoPE positions)."""
    return (token_ids == vocab.image_pad_id).to(torch.int32)


def check_placeholders(token_ids: torch.Tensor, images: Sequence[PatchedImage], vocab: VLMVocab) -> None:
    """Raise ``ImageInputError`` unless the image-pad runs of ``token_ids`` match ``images`` one to one, in
    order, with each run as long as its image's grid needs."""
    pads = (token_ids == vocab.image_pad_id).to(torch.int8).tolist()
    runs, n = [], 0
    for v in pads + [0]:
        if v:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    want = [im.num_tokens for im in images]
    if runs != want:
        raise ImageInputError(f"image-token runs {runs} do not match the images' grids (tokens per image {want}): "
                              f"each image needs t*h*w/merge^2 image-pad tokens, in image order")


@dataclass(frozen=True)
class MMWorkloadConfig:
    """The multimodal GRPO workload: batch shape, images and the synthetic rollout that answers them."""

    prompts_per_batch: int = 4
    """P: prompts per training batch."""
    n: int = 8
    """Samples per prompt (GRPO group size): each prompt's images recur n times in a batch."""
    images_per_prompt: int = 1
    """Images shown with each prompt."""
    image_sizes: tuple[tuple[int, int], ...] = ((224, 224), (168, 280), (280, 196))
    """(height, width) choices, drawn per prompt, so sizes vary across prompts. The paper-scale config uses
    448 x 448 (1024 patches x 1176 values); the CPU default is smaller."""
    max_shapes: int = 5
    """Shapes per image: uniform in 1..max_shapes."""
    colours: tuple[str, ...] = tuple(sorted(COLOURS))
    """Colours shapes (and the question's target colour) are drawn from (names of ``COLOURS``)."""
    shape_radius_div: int = 12
    """A shape's radius is min(height, width) // shape_radius_div pixels (at least 3)."""
    layout: Literal["random", "cells"] = "random"
    """``random``: shapes anywhere (they may overlap and straddle image tokens). ``cells``: each shape centred in
    its own merge cell (patch x merge = 28 px, one image token), radius capped to fit inside it, so an image token
    shows at most one shape -- what lets a tiny VLM learn to count in a CPU warm start (``workloads.mm_task``)."""
    p_correct: float = 0.5
    """Synthetic rollout: probability that a sample answers exactly (others answer a wrong number), so groups
    have mixed rewards and nonzero GRPO advantages."""
    response_pad: int = 8
    """Synthetic rollout: filler characters appended before the answer (a stand-in reasoning span)."""
    seed: int = 0
    """Seed of prompts, drawings and responses."""
    vlm: TinyVLMConfig = field(default_factory=TinyVLMConfig)
    """The policy the workload's tokens and patches are built for."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_batch", "n", "images_per_prompt", "max_shapes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MMWorkloadConfig.{name} must be an int >= 1, got {v!r}")
        if not self.image_sizes or any(h <= 0 or w <= 0 for h, w in self.image_sizes):
            raise ValueError(f"MMWorkloadConfig.image_sizes must be non-empty positive (h, w), got {self.image_sizes}")
        if not self.colours or set(self.colours) - set(COLOURS) or len(set(self.colours)) != len(self.colours):
            raise ValueError(f"MMWorkloadConfig.colours must be distinct names from {sorted(COLOURS)}, "
                             f"got {self.colours}")
        if not isinstance(self.shape_radius_div, int) or self.shape_radius_div < 2:
            raise ValueError(f"MMWorkloadConfig.shape_radius_div must be an int >= 2, got {self.shape_radius_div!r}")
        if self.layout not in ("random", "cells"):
            raise ValueError(f"MMWorkloadConfig.layout must be 'random' or 'cells', got {self.layout!r}")
        if not 0.0 <= self.p_correct <= 1.0:
            raise ValueError(f"MMWorkloadConfig.p_correct must be in [0, 1], got {self.p_correct}")


def reward(vocab: VLMVocab, response_ids: Sequence[int], answer: str) -> float:
    """Exact-match reward: 1.0 iff the text after the response's last "." (up to EOS) is exactly the answer."""
    final = vocab.decode(response_ids).rsplit(".", 1)[-1].strip()
    return 1.0 if final == answer else 0.0


class MultimodalWorkload:
    """Draws problems and synthetic GRPO groups. The two tables that use it start at "trajectories complete in
    rollout", so responses come from a seeded synthetic rollout (exact answer with probability ``p_correct``)
    rather than from generation; rewards and advantages are computed exactly either way."""

    def __init__(self, cfg: MMWorkloadConfig, vocab: VLMVocab | None = None) -> None:
        self.cfg = cfg
        self.vocab = vocab or VLMVocab()

    def problem(self, prompt_id: int) -> VisualProblem:
        rng = random.Random(self.cfg.seed * 1_000_003 + prompt_id)
        h, w = self.cfg.image_sizes[rng.randrange(len(self.cfg.image_sizes))]
        colours = list(self.cfg.colours)
        target = rng.choice(colours)
        specs, images = [], []
        for _ in range(self.cfg.images_per_prompt):
            shapes = []
            r = max(3, min(h, w) // self.cfg.shape_radius_div)
            if self.cfg.layout == "cells":
                cell = self.cfg.vlm.factor
                cells = [(cy, cx) for cy in range(h // cell) for cx in range(w // cell)]
                r = max(3, min(r, cell // 2 - 2))
                for cy, cx in rng.sample(cells, rng.randint(1, min(self.cfg.max_shapes, len(cells)))):
                    shapes.append(Shape(rng.choice(KINDS), rng.choice(colours), cx * cell + cell // 2,
                                        cy * cell + cell // 2, r))
            for _ in range(rng.randint(1, self.cfg.max_shapes) if self.cfg.layout == "random" else 0):
                shapes.append(Shape(rng.choice(KINDS), rng.choice(colours), rng.randint(r, w - r),
                                    rng.randint(r, h - r), r))
            specs.append(tuple(shapes))
            images.append(preprocess_image(draw_image(shapes, h, w), self.cfg.vlm))
        count = sum(s.colour == target for shapes in specs for s in shapes)
        return VisualProblem(prompt_id, tuple(specs), tuple(images), f"how many {target} shapes?", str(count))

    def group(self, prompt_id: int, first_traj_id: int) -> MMGroup:
        prob = self.problem(prompt_id)
        rng = random.Random(self.cfg.seed * 7_000_001 + prompt_id)
        prompt = prompt_token_ids(self.vocab, prob.question, prob.images)
        rewards, responses = [], []
        for _ in range(self.cfg.n):
            right = rng.random() < self.cfg.p_correct
            ans = prob.answer if right else str(int(prob.answer) + rng.randint(1, 4))
            filler = "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(0, self.cfg.response_pad)))
            resp = self.vocab.encode(f"{filler}. {ans}") + [self.vocab.eos_id]
            responses.append(resp)
            rewards.append(reward(self.vocab, resp, prob.answer))
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        samples = []
        for i, (resp, r) in enumerate(zip(responses, rewards)):
            ids = torch.tensor(prompt + resp, dtype=torch.int64)
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(prompt):] = True
            samples.append(MMSample(first_traj_id + i, prompt_id, ids, mask, r, (r - mean) / (std + 1e-6),
                                    tuple(range(len(prob.images)))))
        return MMGroup(prob, tuple(samples))

    def sample_batch(self, batch_id: int) -> list[MMGroup]:
        """The P groups of training batch ``batch_id`` (trajectory ids are unique across batches)."""
        P, n = self.cfg.prompts_per_batch, self.cfg.n
        return [self.group(batch_id * P + p, (batch_id * P + p) * n) for p in range(P)]
