"""The multimodal GRPO learner: one optimizer step per ``MMShare`` handed over by a multimodal ``Handoff``, with
the vision encoder run once per distinct image of the share (``knittrans.mmdedup.gather.policy_logits``).

A step, in named stages:

1. ``share_batch``: unpack the share (varlen fields, ``cu_seqlens``) into a right-padded ``MMBatch`` (``collate``:
   each sample's placeholders checked against the grids of the images its ``image_ids`` name) and the per-token
   targets aligned with next-token log-probs (``TokenTargets``, ``[B, L-1]``: column j scores token j+1):
   behaviour log-probs, advantages and loss mask of every response token, zeros / False on prompt and padding.
2. ``token_logprobs``: the policy's log-probability of each next token, from ``policy_logits(model, batch,
   dedup)``. ``dedup=True`` encodes each distinct image once and hands the same output tensor to each of its
   occurrences, so autograd sums every sample's gradient into one backward through the encoder; ``dedup=False``
   (the baseline) encodes every occurrence. Both give the same loss and gradients (fp32: LM bitwise, vision
   within ~1e-6 relative; tests/equivalence/test_mm_grad_equivalence.py) and the encoder runs over n times fewer
   patches with dedup on GRPO groups of n.
3. ``clipped_surrogate``: PPO-clipped importance ratios ``exp(logp - old_logprobs)`` against the engine's behaviour
   log-probs (what corrects for staleness), times the share's advantages, token-mean over the loss mask; plus the
   optional k3 KL to a frozen reference (``GRPOConfig.kl_coef``).
4. Backward, global-norm clipping, Adam step; ``version`` + 1.

Hyperparameters come from ``knittrans.runtime.trainer.GRPOConfig`` (``lr``, ``clip_eps``, ``kl_coef``,
``max_grad_norm``; its ``packing`` / ``row_tokens`` concern the text trainer and are ignored: the multimodal batch is
right-padded, because M-RoPE positions and placeholder scatter are per row). One learner is one trainer rank; with
several ranks a data-parallel all-reduce of gradients (not done here) would sit between backward and step.

Example (the learner steps on whatever a multimodal handoff's consumer yields)::

    learner = MMGRPOLearner(model, GRPOConfig(lr=1e-3), BatchTokens(vocab.pad_id, vocab.image_pad_id), dedup=True)
    for share in handoff.consumer(rank=0):
        result = learner.step(share)          # result.version == share.seq + 1
        consumer.ack(share)
        engine.load_weights(learner.weights(), learner.version)
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import torch

from knittrans.handoff import Rollout
from knittrans.mmdedup.gather import BatchTokens, MMBatch, TrainSample, collate, policy_logits
from knittrans.mmdedup.plane import IMAGE_FIELD, MMShare
from knittrans.runtime.trainer import GRPOConfig, StepResult, TrainItem
from knittrans.runtime.vlm_engine import suppress_logits, vision_special_ids
from knittrans.types import Trajectory


class ShareOrderError(RuntimeError):
    """A share was stepped on out of admission order (its ``seq`` is not the learner's version)."""


@dataclass(frozen=True)
class TokenTargets:
    """Per next-token position of an ``MMBatch`` (``[B, L-1]``; column j scores token j+1)."""

    old_logprobs: torch.Tensor
    """Behaviour log-prob of each response token under the generating weights; 0 elsewhere."""
    advantages: torch.Tensor
    """The share's per-token advantage on response tokens; 0 elsewhere."""
    mask: torch.Tensor
    """True on response tokens the loss counts (the share's ``loss_mask``); False on prompt and padding."""


def _ragged(share: MMShare, name: str) -> tuple[torch.Tensor, list[int]]:
    f = share.fields[name]
    if f.cu_seqlens is None:
        raise ValueError(f"share {share.key}: field {name!r} is not a per-token (ragged) field")
    return f.values, f.cu_seqlens.tolist()


def share_batch(share: MMShare, tokens: BatchTokens) -> tuple[MMBatch, TokenTargets]:
    """Unpack ``share`` into a right-padded batch and its per-token targets (see the module doc, stage 1).
    Raises ``ValueError`` naming the trajectory if its response fields disagree in length or exceed its ids."""
    if not isinstance(share, MMShare):
        raise TypeError(f"share_batch takes an MMShare (a multimodal handoff's share), got {type(share).__name__}")
    ids, cu_ids = _ragged(share, "input_ids")
    resp = {name: _ragged(share, name) for name in ("old_logprobs", "advantages", "loss_mask")}
    image_ids = share.image_ids if IMAGE_FIELD in share.fields else {}
    samples, spans = [], []
    for i, t in enumerate(share.traj_ids):
        row = ids[cu_ids[i]:cu_ids[i + 1]].long()
        lens = {name: cu[i + 1] - cu[i] for name, (_, cu) in resp.items()}
        r = lens["old_logprobs"]
        if len(set(lens.values())) != 1 or not 1 <= r < row.numel():
            raise ValueError(f"trajectory {t}: response fields of lengths {lens} for {row.numel()} ids (each must "
                             f"be the response length, 1 <= r < len(input_ids))")
        p = row.numel() - r
        lm = torch.zeros(row.numel(), dtype=torch.bool)
        lm[p:] = resp["loss_mask"][0][resp["loss_mask"][1][i]:resp["loss_mask"][1][i + 1]].bool()
        samples.append(TrainSample(t, row, lm, 0.0, tuple(image_ids.get(t, ()))))
        spans.append((p, r))
    batch = collate(samples, share.images, tokens)
    B, L = batch.input_ids.shape
    old = torch.zeros(B, L - 1)
    adv = torch.zeros(B, L - 1)
    for b, (p, r) in enumerate(spans):  # response token k sits at p + k; its log-prob is in column p + k - 1
        vo, cu_o = resp["old_logprobs"]
        va, cu_a = resp["advantages"]
        old[b, p - 1:p - 1 + r] = vo[cu_o[b]:cu_o[b + 1]].float()
        adv[b, p - 1:p - 1 + r] = va[cu_a[b]:cu_a[b + 1]].float()
    return batch, TokenTargets(old, adv, batch.loss_mask[:, 1:].clone())


def token_logprobs(model: torch.nn.Module, batch: MMBatch, dedup: bool,
                   suppress: torch.Tensor | None = None) -> torch.Tensor:
    """Log-prob of each next token, ``[B, L-1]`` (fp32), through the dedup or the baseline encoder path, with the
    ids ``suppress`` (default: the model's vision special tokens, as the engine) out of the softmax."""
    if suppress is None:
        suppress = torch.tensor(vision_special_ids(model.config), dtype=torch.long)
    logits = suppress_logits(policy_logits(model, batch, dedup=dedup)[:, :-1].float(), suppress)
    return torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


@dataclass(frozen=True)
class Surrogate:
    loss: torch.Tensor
    ratio: torch.Tensor
    tokens: torch.Tensor


def clipped_surrogate(logp: torch.Tensor, targets: TokenTargets, clip_eps: float) -> Surrogate:
    """PPO-clipped GRPO surrogate, token-mean over ``targets.mask``: ``-mean(min(r A, clip(r, 1-eps, 1+eps) A))``
    with ``r = exp(logp - old)`` (the exponent clamped at 20 so a wildly stale token cannot overflow)."""
    m = targets.mask
    ratio = torch.exp((logp - targets.old_logprobs).clamp(max=20.0)) * m
    adv = targets.advantages
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    n_tok = m.sum().clamp(min=1)
    return Surrogate(-(surr * m).sum() / n_tok, ratio, n_tok)


def mm_rollout(item: TrainItem, images: tuple[torch.Tensor, ...], grids: tuple[tuple[int, int, int], ...]) -> Rollout:
    """One scored sample as a multimodal handoff takes it (``MM_SCHEMA``; what ``share_batch`` unpacks):
    ``input_ids`` = prompt + response, and per response token the behaviour log-prob, the sample's group advantage
    and a True loss mask; plus its prompt's images in placeholder order (every sample of a group passes the same
    tensors; the storage unit keeps one copy)."""
    s = item.sample
    r = len(s.response_ids)
    tensors = {"input_ids": np.asarray(s.prompt_ids + s.response_ids, dtype=np.int64),
               "old_logprobs": np.asarray(s.logprobs, dtype=np.float32),
               "advantages": np.full(r, item.advantage, dtype=np.float32),
               "loss_mask": np.ones(r, dtype=np.bool_)}
    traj = Trajectory(s.traj_id, s.group_id, s.batch_id, r, s.v_gen, prompt_tokens=len(s.prompt_ids))
    return Rollout(traj, tensors, images=tuple(images), grids=tuple(tuple(g) for g in grids))


class MMGRPOLearner:
    """Owns the trainable vision-language policy, its optimizer and the policy version; steps on ``MMShare``\\ s.

    ``dedup``: True encodes each distinct image of a share once (KnitTrans); False every occurrence (the
    baseline trainer). ``encoded_patches`` / ``occurrence_patches`` count what the encoder ran over and what it
    would have without dedup, summed over steps."""

    def __init__(self, model: torch.nn.Module, cfg: GRPOConfig, tokens: BatchTokens, dedup: bool = True,
                 version: int = 0) -> None:
        if not isinstance(tokens, BatchTokens):
            raise TypeError(f"tokens must be a BatchTokens (pad and image-pad ids), got {type(tokens).__name__}")
        self.model = model
        self.model.train()
        self.cfg = cfg
        self.tokens = tokens
        self.dedup = bool(dedup)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = copy.deepcopy(model).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.version = version
        self.encoded_patches = 0
        self.occurrence_patches = 0

    def loss(self, share: MMShare) -> tuple[Surrogate, torch.Tensor, MMBatch]:
        """The step's objective on ``share`` (surrogate, KL, batch), with the graph attached; no step taken."""
        batch, targets = share_batch(share, self.tokens)
        # off the loss mask (prompt, padding) a suppressed next token (an image pad) has log-prob -inf: zero it
        # so that no inf reaches the ratio or the KL
        logp = token_logprobs(self.model, batch, self.dedup).masked_fill(~targets.mask, 0.0)
        surr = clipped_surrogate(logp, targets, self.cfg.clip_eps)
        kl = torch.zeros(())
        if self.ref is not None:
            with torch.no_grad():
                ref = token_logprobs(self.ref, batch, self.dedup).masked_fill(~targets.mask, 0.0)
            d = ref - logp
            kl = ((torch.exp(d) - d - 1) * targets.mask).sum() / surr.tokens
        return surr, kl, batch

    def step(self, share: MMShare) -> StepResult:
        """One optimizer step on ``share`` (trained at version ``share.seq``); increments ``version``."""
        if share.seq >= 0 and share.seq != self.version:
            raise ShareOrderError(f"share of mini-batch {share.key} was admitted as step {share.seq} but the learner "
                                  f"is at version {self.version}: shares must be stepped on in admission order")
        t0 = time.perf_counter()
        surr, kl, batch = self.loss(share)
        loss = surr.loss + self.cfg.kl_coef * kl
        if not torch.isfinite(loss):
            raise FloatingPointError(f"GRPO loss is {loss.item()} at version {self.version}; check rewards and lr")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        self.version += 1
        encoded, occurring = batch.encoder_patches(dedup=self.dedup), batch.encoder_patches(dedup=False)
        self.encoded_patches += encoded
        self.occurrence_patches += occurring
        eps, m, n_tok = self.cfg.clip_eps, batch.loss_mask[:, 1:], surr.tokens
        with torch.no_grad():
            clipped = (((surr.ratio < 1 - eps) | (surr.ratio > 1 + eps)) & m).sum() / n_tok
            mean_ratio = (surr.ratio * m).sum() / n_tok
        return StepResult(version=self.version, loss=float(loss.detach()), clip_frac=float(clipped),
                          mean_ratio=float(mean_ratio), kl=float(kl.detach()), tokens=int(m.sum()),
                          step_s=time.perf_counter() - t0, encoder_patches=encoded, occurrence_patches=occurring)

    def weights(self) -> dict[str, torch.Tensor]:
        """A detached copy of the current weights (what a sync point sends to the rollout engines)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
