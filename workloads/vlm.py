"""A tiny Qwen2-VL (or Qwen2.5-VL) policy and its character vocabulary, built from configs (never downloaded).

The full Qwen2-VL processor needs torchvision (which breaks beside the pinned CPU torch), so this module builds
what the processor would: a vocabulary with the four vision special tokens, and (in ``workloads.multimodal``) the
patchified ``pixel_values``, ``image_grid_thw``, the image-pad placeholders and ``mm_token_type_ids``.

The model is ``transformers``' own ``Qwen2VLForConditionalGeneration`` (or ``Qwen2_5_VLForConditionalGeneration``)
with random init: the real vision tower (Conv3d patch embedding over 2 x 14 x 14 x 3 = 1176 values per patch,
2-D rotary ViT blocks, 2 x 2 patch merger) and the real M-RoPE language model, only narrow and shallow.

Example::

    >>> vocab = VLMVocab()
    >>> vocab.decode(vocab.encode("3 red"))
    '3 red'
    >>> model = build_tiny_vlm(TinyVLMConfig(), vocab, seed=0)
    >>> model.config.image_token_id == vocab.image_pad_id
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

VLM_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz ?:,.+="
"""Characters the tiny vocabulary covers (the prompts and answers of ``workloads.multimodal`` use only these)."""

SPECIALS = ("<pad>", "<bos>", "<eos>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


class VLMConfigError(ValueError):
    """An invalid tiny-VLM config or a vocabulary that does not match the model."""


@dataclass(frozen=True)
class VLMVocab:
    """A character vocabulary with Qwen2-VL's vision special tokens; ids 0..6 are the specials in ``SPECIALS``
    order, then one id per character of ``alphabet``. Plain Python (no tokenizer files): the trainer and the
    workload only ever exchange token ids."""

    alphabet: str = VLM_ALPHABET
    """Characters with one token each."""

    def __post_init__(self) -> None:
        if not self.alphabet or len(set(self.alphabet)) != len(self.alphabet):
            raise VLMConfigError(f"VLMVocab.alphabet must be non-empty with distinct characters, got "
                                 f"{self.alphabet!r}")

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    vision_start_id: int = 3
    vision_end_id: int = 4
    image_pad_id: int = 5
    video_pad_id: int = 6

    def __len__(self) -> int:
        return len(SPECIALS) + len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        """One id per character; an unknown character is an error that names it (never a silent <pad>)."""
        base = len(SPECIALS)
        out = []
        for ch in text:
            i = self.alphabet.find(ch)
            if i < 0:
                raise VLMConfigError(f"character {ch!r} in {text!r} is not in the vocabulary {self.alphabet!r}")
            out.append(base + i)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Characters of the alphabet ids; specials are dropped (EOS ends the text)."""
        base = len(SPECIALS)
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= base:
                out.append(self.alphabet[i - base])
        return "".join(out)


@dataclass(frozen=True)
class TinyVLMConfig:
    """A Qwen2-VL-architecture policy small enough to train on a CPU core (~170K parameters at the defaults,
    ~80K of them in the vision tower)."""

    arch: Literal["qwen2_vl", "qwen2_5_vl"] = "qwen2_vl"
    """Which transformers class to build: Qwen2-VL or Qwen2.5-VL (windowed vision attention, RMSNorm, SwiGLU)."""
    hidden_size: int = 64
    """Language-model width (also the vision merger's output width)."""
    num_layers: int = 2
    """Language-model decoder layers."""
    num_heads: int = 2
    """Language-model attention heads; head dim = hidden_size / num_heads must be 32 with the default
    ``mrope_section`` (4 + 6 + 6 = 16 rotary pairs)."""
    intermediate_size: int = 128
    """Language-model MLP width."""
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    """Rotary pairs given to the temporal, height and width position rows; must sum to head_dim / 2."""
    vision_depth: int = 2
    """Vision transformer blocks."""
    vision_embed_dim: int = 32
    """Vision transformer width."""
    vision_heads: int = 2
    """Vision attention heads."""
    vision_mlp_ratio: int = 2
    """Vision MLP width / vision width (Qwen2-VL: 4)."""
    patch_size: int = 14
    """Spatial patch size in pixels (Qwen2-VL: 14)."""
    temporal_patch_size: int = 2
    """Frames per patch; a still image is repeated to fill them (Qwen2-VL: 2, hence 2 x 3 x 14 x 14 = 1176)."""
    spatial_merge_size: int = 2
    """Patches merged per side into one language token (Qwen2-VL: 2, so 4 patches per image token)."""
    max_positions: int = 4096
    """Longest sequence the rotary embedding is configured for."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vision_depth",
                     "vision_embed_dim", "vision_heads", "vision_mlp_ratio", "patch_size", "temporal_patch_size", "spatial_merge_size",
                     "max_positions"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise VLMConfigError(f"TinyVLMConfig.{name} must be an int >= 1, got {v!r}")
        if self.arch not in ("qwen2_vl", "qwen2_5_vl"):
            raise VLMConfigError(f"TinyVLMConfig.arch must be 'qwen2_vl' or 'qwen2_5_vl', got {self.arch!r}")
        if self.hidden_size % self.num_heads or self.vision_embed_dim % self.vision_heads:
            raise VLMConfigError("TinyVLMConfig: hidden_size / vision_embed_dim must be multiples of their heads")
        half = self.hidden_size // self.num_heads // 2
        if sum(self.mrope_section) != half:
            raise VLMConfigError(f"TinyVLMConfig.mrope_section {tuple(self.mrope_section)} sums to "
                                 f"{sum(self.mrope_section)}, but head dim {2 * half} has {half} rotary pairs")

    @property
    def patch_dim(self) -> int:
        """Values per patch row of ``pixel_values``: channels x temporal x patch x patch (1176 for Qwen2-VL)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def factor(self) -> int:
        """Image sides must be multiples of this (patch x merge = 28 for Qwen2-VL)."""
        return self.patch_size * self.spatial_merge_size


QWEN2_VL_7B_BALANCE = TinyVLMConfig(hidden_size=256, num_layers=4, num_heads=8, intermediate_size=1344,
                                    vision_depth=3, vision_embed_dim=96, vision_heads=2, vision_mlp_ratio=4)
"""The tiny policy with Qwen2-VL-7B's vision / language cost balance (what ``repro.speedup`` trains).

Compute per token is ~2 x the weights a token passes through (forward; backward 2x that), so the balance is the
ratio of vision weights per *patch* to language weights per *token* (attention's quadratic terms are small at
these lengths and ignored):

- Qwen2-VL-7B: ViT 32 blocks x (4 + 8) x 1280^2 = 629M, patch embedding 1176 x 1280 = 1.5M, merger
  (5120^2 + 5120 x 3584 = 44.6M, once per 4 patches: 11.1M per patch) -> 642M per patch. LM 28 layers x
  (2 x 3584^2 + 2 x 3584 x 512 (GQA k, v) + 3 x 3584 x 18944) = 6.53B, plus the 3584 x 152064 head (0.55B) ->
  7.08B per token. Ratio 0.091 per patch; with 4 patches per image token (2 x 2 merge), one image costs its
  vision tower 0.36x what its image tokens cost the LM (a 448 x 448 image: 1024 patches -> 1.3 TFLOP in the ViT
  vs 3.6 TFLOP for its 256 tokens in the LM, forward).
- This config: ViT 3 blocks x 12 x 96^2 = 332K, patch embedding 1176 x 96 = 113K, merger (384^2 + 384 x 256) / 4
  = 61K -> 506K per patch. LM 4 layers x (4 x 256^2 + 3 x 256 x 1344) = 5.19M per token (the 50-token
  vocabulary's head is negligible; the 7B's head is in its count above, so the tiny LM is 8% light, which
  favours dedup slightly). Ratio 0.097 per patch (0.39x per image token vs 0.36x).
- Depth/width shapes follow the 7B's: LM MLP ratio 1344 / 256 = 5.25 (7B: 5.29), head dim 32; ViT MLP ratio 4,
  ViT width / LM width 0.375 (7B: 0.357).

``vision_lm_flop_ratio`` computes the per-patch / per-token ratio for any config.
"""


def vision_lm_flop_ratio(cfg: TinyVLMConfig) -> float:
    """Vision weights per patch / language weights per token (the forward-FLOP ratio; see
    ``QWEN2_VL_7B_BALANCE``). Linear layers only; embeddings of the tiny vocabulary ignored."""
    d, m = cfg.vision_embed_dim, cfg.spatial_merge_size ** 2
    vit = cfg.vision_depth * (4 + 2 * cfg.vision_mlp_ratio) * d * d + cfg.patch_dim * d
    merger = ((m * d) ** 2 + m * d * cfg.hidden_size) / m
    h = cfg.hidden_size
    lm = cfg.num_layers * (4 * h * h + 3 * h * cfg.intermediate_size)
    return (vit + merger) / lm


def build_tiny_vlm(cfg: TinyVLMConfig, vocab: VLMVocab, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised Qwen2-VL / Qwen2.5-VL for conditional generation, sized for ``vocab``."""
    text = dict(vocab_size=len(vocab), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_heads, max_position_embeddings=cfg.max_positions,
                rope_parameters={"rope_type": "default", "mrope_section": list(cfg.mrope_section),
                                 "rope_theta": 10000.0},
                bos_token_id=vocab.bos_id, eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id)
    vision = dict(depth=cfg.vision_depth, num_heads=cfg.vision_heads, in_channels=3, patch_size=cfg.patch_size,
                  spatial_merge_size=cfg.spatial_merge_size, temporal_patch_size=cfg.temporal_patch_size)
    ids = dict(image_token_id=vocab.image_pad_id, video_token_id=vocab.video_pad_id,
               vision_start_token_id=vocab.vision_start_id, vision_end_token_id=vocab.vision_end_id)
    torch.manual_seed(seed)
    if cfg.arch == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        vision.update(embed_dim=cfg.vision_embed_dim, hidden_size=cfg.hidden_size, mlp_ratio=cfg.vision_mlp_ratio)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **ids))
    else:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        vision.update(hidden_size=cfg.vision_embed_dim, out_hidden_size=cfg.hidden_size,
                      intermediate_size=cfg.vision_mlp_ratio * cfg.vision_embed_dim, window_size=cfg.factor * 4,
                      fullatt_block_indexes=[cfg.vision_depth - 1])
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))
    model = model.to(dtype)
    if model.config.text_config.vocab_size < len(vocab):
        raise VLMConfigError(f"model vocab_size {model.config.text_config.vocab_size} < vocabulary {len(vocab)}")
    return model


def vision_tower(model) -> torch.nn.Module:
    """The vision encoder (``model.model.visual``): what deduplication runs once per distinct image."""
    return model.model.visual
