"""A rollout engine for vision-language policies (transformers' Qwen2-VL / Qwen2.5-VL), the multimodal twin of
``HFRolloutEngine``.

Per ``generate`` call:

1. **Distinct images, encoded once.** The requests' images are keyed by content (``knittrans.mmdedup.keys``:
   128-bit hash + dtype + shape, bytes compared on every key hit, so a collision cannot alias two images) and
   grid; the vision tower runs once over the distinct ones, however many groups and samples show them.
2. **Prefill once per group.** One left-padded row per request (its prompt) goes through the model with the
   encoder outputs scattered into its placeholders (``mm_encoder_outputs``) and 3-D M-RoPE positions from
   ``get_rope_index`` (one grid row per occurrence). The KV cache is then expanded to one row per sample
   (``reorder_cache``): the n samples of a group share the prompt's keys and values instead of recomputing them.
3. **Decode** one token per forward for every sample, with a KV cache. A decoded token's M-RoPE position is the
   same on all three rows: one past the largest position of its prompt (text after the images continues from
   there, ``get_rope_index``'s ``rope_deltas``), plus the tokens decoded before it.

**Action space.** The vision special tokens (image/video pad, vision start/end) are never sampled: their logits
are masked (``vision_special_ids``; the caller may pass another ``suppress_token_ids``), because a response that
contained an image-pad token would no longer match its prompt's images. The learner masks the same ids
(``knittrans.runtime.vlm_learner.token_logprobs``), so behaviour and training log-probs are of one distribution.

Behaviour log-probs are exact: each sampled token's log-probability under the softmax (at ``temperature``) of the
logits the engine sampled it from, with the weights loaded when the call started (``v_gen``). A teacher-forced
forward of the same weights over prompt + response reproduces them to ~1e-5 (fp32; the padded layouts differ, so
summation order does; tested). A finished sequence keeps its slot with masked tokens, so a sample's tokens do not
depend on what else shares the batch beyond the random stream.

Example (a random tiny Qwen2-VL; one image of 4 x 4 patches, a group of 2)::

    >>> import torch
    >>> from workloads.vlm import TinyVLMConfig, VLMVocab, build_tiny_vlm
    >>> vocab = VLMVocab(); model = build_tiny_vlm(TinyVLMConfig(), vocab, seed=0)
    >>> eng = VLMRolloutEngine(model, eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id)
    >>> prompt = (vocab.bos_id, vocab.vision_start_id, *[vocab.image_pad_id] * 4, vocab.vision_end_id, 9)
    >>> req = GroupRequest(0, 0, prompt, (0, 1), images=(torch.randn(16, 1176),), grids=((1, 4, 4),))
    >>> out = eng.generate([req], SamplingConfig(max_new_tokens=3), seed=0)
    >>> [(s.traj_id, s.v_gen, len(s.response_ids) == len(s.logprobs)) for s in out], eng.stats.encoded_patches
    ([(0, 0, True), (1, 0, True)], 16)
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from knittrans.mmdedup.gather import check_placeholders
from knittrans.mmdedup.keys import EncodingInputError, HashFn, check_encoding, content_keys, encoding_hash_fn
from knittrans.runtime.engine import EngineStats, GroupRequest, Sample, SamplingConfig


@dataclass
class VLMEngineStats(EngineStats):
    """``EngineStats`` plus what the vision tower did: patches it encoded (its FLOPs are proportional) against
    the patches of every image occurrence (one per sample, what an engine without dedup would encode)."""

    encoded_patches: int = 0
    """Patches the vision tower ran over (distinct images of each call)."""
    occurrence_patches: int = 0
    """Patches of every (sample, image) pair requested."""
    distinct_images: int = 0
    image_occurrences: int = 0


@dataclass(frozen=True)
class DistinctImages:
    """The distinct images of a set of requests: ``pixels[i]`` / ``grids[i]``; ``ids[r]`` lists request r's
    images (placeholder order) as indices into them."""

    pixels: tuple[torch.Tensor, ...]
    grids: tuple[tuple[int, int, int], ...]
    ids: tuple[tuple[int, ...], ...]


def vision_special_ids(config) -> tuple[int, ...]:
    """The vision special token ids of a Qwen2-VL-family config (image/video pad, vision start/end): never part
    of a response."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return tuple(sorted({int(v) for v in (getattr(config, n, None) for n in names) if v is not None}))


def suppress_logits(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``logits`` with the vocabulary entries ``ids`` set to -inf (out of place: autograd-safe)."""
    return logits if ids.numel() == 0 else logits.index_fill(-1, ids, float("-inf"))


def distinct_images(requests: Sequence[GroupRequest], hash_fn: HashFn = encoding_hash_fn) -> DistinctImages:
    """Key every image of ``requests`` by content and grid; equal keys are confirmed by comparing the bytes (a
    hash collision gets its own entry, never an alias)."""
    flat = [(x, tuple(int(v) for v in g)) for r in requests for x, g in zip(r.images, r.grids)]
    for x, _ in flat:
        check_encoding(x)
    keys = content_keys([x for x, _ in flat], hash_fn) if flat else []
    pixels: list[torch.Tensor] = []
    grids: list[tuple[int, int, int]] = []
    by_key: dict[tuple, list[int]] = {}
    occ: list[int] = []
    for (x, g), k in zip(flat, keys):
        hit = next((i for i in by_key.get((k, g), []) if torch.equal(pixels[i], x)), None)
        if hit is None:
            hit = len(pixels)
            pixels.append(x)
            grids.append(g)
            by_key.setdefault((k, g), []).append(hit)
        occ.append(hit)
    ids, at = [], 0
    for r in requests:
        ids.append(tuple(occ[at:at + len(r.images)]))
        at += len(r.images)
    return DistinctImages(tuple(pixels), tuple(grids), tuple(ids))


class VLMRolloutEngine:
    """Rollout engine over a ``transformers`` Qwen2-VL-family model (see the module doc). The engine owns a private
    replica of the policy; weights arrive only through ``load_weights`` (copied)."""

    def __init__(self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int, version: int = 0,
                 hash_fn: HashFn = encoding_hash_fn, suppress_token_ids: Sequence[int] | None = None) -> None:
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.image_token_id = int(model.config.image_token_id)
        self.merge = int(model.config.vision_config.spatial_merge_size)
        self.hash_fn = hash_fn
        ids = vision_special_ids(model.config) if suppress_token_ids is None else tuple(suppress_token_ids)
        if eos_token_id in ids:
            raise ValueError(f"suppress_token_ids {ids} contains EOS ({eos_token_id}): responses could never end")
        self.suppress = torch.tensor(sorted(set(ids)), dtype=torch.long)
        self._version = version
        self.stats = VLMEngineStats()

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)
        self._version = version
        self.stats.weight_loads += 1
        self.stats.load_s += time.perf_counter() - t0

    # -- stages ------------------------------------------------------------------------------------------------

    def _check(self, requests: Sequence[GroupRequest]) -> None:
        for r in requests:
            try:
                check_placeholders(torch.tensor(r.prompt_ids), r.grids, self.image_token_id, self.merge,
                                   where=f"group {r.group_id}: ")
            except ValueError as e:
                raise EncodingInputError(str(e)) from None

    def _encode(self, images: DistinctImages) -> list[torch.Tensor]:
        """Vision tower once over the distinct images: one [tokens, hidden] tensor per image."""
        if not images.pixels:
            return []
        grids = torch.tensor(images.grids, dtype=torch.int64)
        out = self.model.model.get_image_features(torch.cat(images.pixels), grids, return_dict=True).pooler_output
        self.stats.encoded_patches += sum(int(x.shape[0]) for x in images.pixels)
        return list(out)

    def _prefill(self, requests: Sequence[GroupRequest], images: DistinctImages, enc: list[torch.Tensor]):
        """One left-padded row per request -> (last-token logits [G, V], cache, mask [G, W], next position [G])."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        G, width = len(requests), max(len(r.prompt_ids) for r in requests)
        ids = torch.full((G, width), self.pad, dtype=torch.long)
        mask = torch.zeros((G, width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        occurrence = [i for row in images.ids for i in row]  # row-major: the order of the placeholder runs
        kw: dict = {}
        if occurrence:
            grid_rows = torch.tensor([images.grids[i] for i in occurrence], dtype=torch.int64)
            mm_type = (ids == self.image_token_id).to(torch.int32)
            pos, _ = self.model.model.get_rope_index(ids, mm_type, image_grid_thw=grid_rows, attention_mask=mask)
            kw["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(
                pooler_output=[enc[i] for i in occurrence])}
        else:
            pos = (mask.cumsum(-1) - 1).clamp(min=0).view(1, G, width).expand(3, G, width)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
        nxt = (pos * mask).amax(dim=(0, 2)) + 1  # one past each prompt's largest position (pad columns are 0)
        return suppress_logits(out.logits[:, -1].float(), self.suppress), out.cache, mask, nxt

    @torch.no_grad()
    def generate(self, requests: Sequence[GroupRequest], sampling: SamplingConfig, seed: int) -> list[Sample]:
        t0 = time.perf_counter()
        version = self._version
        if not requests:
            return []
        self._check(requests)
        images = distinct_images(requests, self.hash_fn)
        enc = self._encode(images)
        logits, cache, mask, nxt = self._prefill(requests, images, enc)
        rows = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor([len(r.traj_ids) for r in requests]))
        cache.reorder_cache(rows)  # the n samples of a group share its prompt's keys and values
        logits, mask, nxt = logits[rows], mask[rows], nxt[rows]
        n = len(rows)
        gen = torch.Generator().manual_seed(seed)
        out_tok = torch.full((n, sampling.max_new_tokens), self.pad, dtype=torch.long)
        out_lp = torch.zeros((n, sampling.max_new_tokens))
        done = torch.zeros(n, dtype=torch.bool)
        lengths = torch.zeros(n, dtype=torch.long)
        for k in range(sampling.max_new_tokens):
            logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
            if sampling.greedy:
                tok = logits.argmax(-1)
            else:
                tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            tok = torch.where(done, torch.full_like(tok, self.pad), tok)
            out_tok[:, k] = tok
            out_lp[:, k] = logp.gather(-1, tok[:, None]).squeeze(-1)
            lengths += (~done).long()
            done = done | (tok == self.eos)
            if bool(done.all()) or k + 1 == sampling.max_new_tokens:
                break
            # a finished row's pad token only affects that row's own later logits, which are never read
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=1)
            pos = (nxt + k).view(1, n, 1).expand(3, n, 1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, cache=cache,
                             use_cache=True)
            cache, logits = out.cache, suppress_logits(out.logits[:, -1].float(), self.suppress)
        t1 = time.perf_counter()
        samples, i = [], 0
        for r in requests:
            for tid in r.traj_ids:
                L = int(lengths[i])
                samples.append(Sample(traj_id=tid, group_id=r.group_id, batch_id=r.batch_id, prompt_ids=r.prompt_ids,
                                      response_ids=tuple(out_tok[i, :L].tolist()),
                                      logprobs=tuple(out_lp[i, :L].tolist()), v_gen=version, t_start=t0, t_end=t1))
                i += 1
        occ_patches = sum(int(images.pixels[j].shape[0]) * len(r.traj_ids) for r, ids in zip(requests, images.ids)
                          for j in ids)
        self.stats.occurrence_patches += occ_patches
        self.stats.distinct_images += len(images.pixels)
        self.stats.image_occurrences += sum(len(r.images) * len(r.traj_ids) for r in requests)
        self.stats.generate_calls += 1
        self.stats.generated_tokens += int(lengths.sum())
        self.stats.generate_s += t1 - t0
        return samples
