"""The GRPO trainer: one optimizer step per packed share, and the policy version it defines (a ``Learner``).

- **Advantages** are group-normalized: ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``, computed once per
  complete group (``group_advantages``, by the orchestrator before the handoff), so a mini-batch of whole groups
  needs nothing from other mini-batches. They travel per token in the share (``advantages``).
- **Input**: ``step(share)`` takes this rank's ``PackedShare`` from the handoff (``knittrans.runtime.protocols``):
  ``input_ids`` packed back to back with ``cu_seqlens``; ``old_logprobs``, ``advantages``, ``loss_mask``
  response-length each. ``VarlenBatch.from_share`` aligns them with the ids (a sequence's prompt is its first
  ``len(input_ids) - len(old_logprobs)`` ids); the loss reads only tokens whose ``loss_mask`` is set.
- **Objective**: PPO-clipped surrogate with importance ratios ``exp(logp_new - logp_behavior)`` against the
  engine's per-token behavior log-probs (this is what corrects for staleness), averaged over response tokens
  (token-mean), plus an optional KL penalty to a frozen reference policy (k3 estimator).
- **Version**: ``version`` counts optimizer steps applied (``knittrans.types``); ``step`` increments it by one.
- **Packing**: the share's varlen sequences go through ``triton_kernels.batched_pack``'s dispatch when that module
  imports (``pack_available()``), padded otherwise; both layouts yield the same per-token log-probs (tested).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from knittrans.dataplane.types import PackedShare
from knittrans.runtime.engine import Sample
from knittrans.runtime.protocols import StepResult


class RewardError(ValueError):
    """A reward that is not a finite number (NaN, inf): GRPO advantages would be undefined."""


def check_reward(value: float, where: str | Callable[[], str]) -> float:
    """Return ``value`` as a float, or raise ``RewardError`` naming ``where`` if it is NaN or infinite. ``where``
    may be a callable that builds the name: it runs only on the error (a reward is checked for every trajectory
    and every evaluation, and formatting a prompt that holds image tensors cost ~1.7 ms a call)."""
    v = float(value)
    if not math.isfinite(v):
        where = where() if callable(where) else where
        raise RewardError(f"non-finite reward {value!r} for {where}; rewards must be finite numbers "
                          f"(GRPO normalizes them within a group)")
    return v


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO hyperparameters."""

    lr: float = 3e-4
    """Adam learning rate."""
    clip_eps: float = 0.2
    """PPO clip range: ratios outside [1 - eps, 1 + eps] stop contributing gradient in the improving direction."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy; 0 disables it and skips the reference forward."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm."""
    packing: str = "auto"
    """``pack``: sequences packed into rows by ``triton_kernels.batched_pack`` (block-diagonal causal mask, positions
    reset per sequence); ``pad``: one right-padded row per sequence; ``auto``: pack when that module imports."""
    row_tokens: int = 64
    """Packed row length (tokens per micro-batch row) for ``pack``. Attention is quadratic in the row, so short
    rows suit short sequences: at 64 a tiny-policy step costs the same as padding (measured), at 256 ~30% more."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"GRPOConfig.lr must be > 0, got {self.lr}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"GRPOConfig.clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.kl_coef < 0:
            raise ValueError(f"GRPOConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.packing not in ("auto", "pack", "pad"):
            raise ValueError(f"GRPOConfig.packing must be auto, pack or pad, got {self.packing!r}")


@dataclass(frozen=True)
class TrainItem:
    """A sample with its reward and group-normalized advantage: what one trajectory contributes to a step."""

    sample: Sample
    reward: float
    advantage: float


def group_advantages(samples: Sequence[Sample], rewards: Sequence[float], eps: float = 1e-6) -> list[TrainItem]:
    """Group-normalized advantages for the samples of ONE group. Raises ``RewardError`` on a NaN/inf reward."""
    if len(samples) != len(rewards) or not samples:
        raise ValueError(f"group_advantages: {len(samples)} samples and {len(rewards)} rewards")
    gids = {s.group_id for s in samples}
    if len(gids) != 1:
        raise ValueError(f"group_advantages takes one group's samples, got groups {sorted(gids)}")
    r = [check_reward(x, f"trajectory {s.traj_id} (group {s.group_id})") for s, x in zip(samples, rewards)]
    mean = sum(r) / len(r)
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
    return [TrainItem(s, x, (x - mean) / (std + eps)) for s, x in zip(samples, r)]


def pack_available() -> bool:
    """Whether ``triton_kernels.batched_pack`` imports (its dispatch picks Triton on GPU, torch on CPU)."""
    try:
        from triton_kernels.batched_pack import batched_pack, plan_microbatches  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken kernel module: the trainer pads instead
        return False
    return True


@dataclass(frozen=True)
class VarlenBatch:
    """A share's sequences back to back (its varlen layout), with per-token training fields aligned to
    ``ids``: behaviour log-prob, advantage and loss flag, zero/False on prompt tokens. Sequence i is
    ``ids[cu_seqlens[i]:cu_seqlens[i + 1]]``."""

    ids: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens.diff()

    @classmethod
    def from_share(cls, share: PackedShare) -> "VarlenBatch":
        """Lay out a share of the text schema: a sequence's prompt is its first ``len(input_ids) -
        len(old_logprobs)`` ids; the response-length fields land on the ids after it, in order."""
        for name in ("input_ids", "old_logprobs", "advantages", "loss_mask"):
            if name not in share.fields or share.fields[name].cu_seqlens is None:
                raise ValueError(f"GRPO step on share {share.key}: ragged field {name!r} missing (fields: "
                                 f"{sorted(share.fields)})")
        ids = share["input_ids"].long()
        cu = share.fields["input_ids"].cu_seqlens.long()
        cu_r = share.fields["old_logprobs"].cu_seqlens.long()
        for name in ("advantages", "loss_mask"):
            if not torch.equal(share.fields[name].cu_seqlens.long(), cu_r):
                raise ValueError(f"share {share.key}: {name!r} and 'old_logprobs' differ in length per sequence")
        L, R = cu.diff(), cu_r.diff()
        if len(L) == 0:
            raise ValueError(f"GRPO step on share {share.key}: empty share")
        bad = torch.nonzero((R < 1) | (R >= L)).flatten()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"share {share.key}: trajectory {share.traj_ids[i]} has {int(L[i])} ids and {int(R[i])} "
                             f"response tokens; a sequence needs >= 1 prompt and >= 1 response token")
        seq = torch.repeat_interleave(torch.arange(len(L)), L)
        resp = (torch.arange(len(ids)) - cu[:-1][seq]) >= (L - R)[seq]  # response tokens, in sequence order
        old = torch.zeros(len(ids))
        adv = torch.zeros(len(ids))
        mask = torch.zeros(len(ids), dtype=torch.bool)
        old[resp] = share["old_logprobs"].float()
        adv[resp] = share["advantages"].float()
        mask[resp] = share["loss_mask"].bool()
        return cls(ids, old, adv, mask, cu)


@dataclass(frozen=True)
class TokenBatch:
    """A mini-batch laid out for one forward: rows of tokens plus per-token training fields.

    ``attention_mask`` is [R, T] (padded layout) or [R, 1, T, T] block-diagonal causal (packed layout). The
    per-token fields are aligned with next-token log-probs ([R, T-1]): column j scores token j+1."""

    ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor | None
    resp: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor


def pad_batch(vb: VarlenBatch, pad_id: int) -> TokenBatch:
    """One right-padded row per sequence."""
    L = vb.lengths
    n, width = len(L), int(L.max())
    row = torch.repeat_interleave(torch.arange(n), L)
    col = torch.arange(len(vb.ids)) - vb.cu_seqlens[:-1][row]
    t_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(t_ids)
    t_old, t_adv = torch.zeros((n, width)), torch.zeros((n, width))
    t_resp = torch.zeros((n, width), dtype=torch.bool)
    t_ids[row, col] = vb.ids
    attn[row, col] = 1
    t_old[row, col] = vb.old_logprobs
    t_adv[row, col] = vb.advantages
    t_resp[row, col] = vb.loss_mask
    return TokenBatch(t_ids, attn, None, t_resp[:, 1:], t_old[:, 1:], t_adv[:, 1:])


def pack_batch(vb: VarlenBatch, pad_id: int, row_tokens: int) -> TokenBatch:
    """Sequences packed into rows of ``row_tokens`` through ``triton_kernels.batched_pack`` (its dispatch: the
    Triton kernel for CUDA tensors, the torch reference on CPU), straight from the share's varlen layout. A
    row's sequences attend only within themselves (block-diagonal causal mask) and their positions restart at
    0, so each sequence's log-probs equal the padded layout's (tested)."""
    from triton_kernels.batched_pack import batched_pack, plan_microbatches

    lens = vb.lengths.tolist()
    plan = plan_microbatches(lens, num_ranks=1, max_tokens_per_microbatch=max(row_tokens, max(lens)))
    packed = batched_pack({"ids": vb.ids, "old": vb.old_logprobs, "adv": vb.advantages, "resp": vb.loss_mask},
                          vb.cu_seqlens, plan.pack, pad_values={"ids": pad_id})
    f = packed.fields
    pos = packed.position_ids
    # Segment id per token: a new sequence starts wherever the position restarts at 0 (padding forms its own
    # one-token segments, which the loss never reads).
    seg = (pos == 0).long().cumsum(-1)
    T = pos.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = (seg[:, :, None] == seg[:, None, :]) & causal
    return TokenBatch(f["ids"], mask[:, None], pos, f["resp"][:, 1:], f["old"][:, 1:], f["adv"][:, 1:])

class GRPOTrainer:
    """Owns the trainable policy, its optimizer and the policy version (a ``knittrans.runtime.protocols.Learner``
    for text)."""

    def __init__(self, model: torch.nn.Module, cfg: GRPOConfig, pad_token_id: int) -> None:
        self.model = model
        self.model.train()
        self.cfg = cfg
        self.pad = pad_token_id
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = copy.deepcopy(model).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.version = 0
        if cfg.packing == "pack" and not pack_available():
            raise ImportError("GRPOConfig.packing='pack' but triton_kernels.batched_pack does not import")
        self.packed = cfg.packing == "pack" or (cfg.packing == "auto" and pack_available())

    def layout(self, vb: VarlenBatch) -> TokenBatch:
        return pack_batch(vb, self.pad, self.cfg.row_tokens) if self.packed else pad_batch(vb, self.pad)

    @staticmethod
    def token_logprobs(model: torch.nn.Module, b: TokenBatch) -> torch.Tensor:
        """Log-prob of each next token, [R, T-1]."""
        kw = {} if b.position_ids is None else {"position_ids": b.position_ids}
        logits = model(input_ids=b.ids, attention_mask=b.attention_mask, **kw).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, b.ids[:, 1:, None]).squeeze(-1)

    def step(self, share: PackedShare) -> StepResult:
        """One optimizer step on this rank's ``share`` of a mini-batch; increments ``version``."""
        t0 = time.perf_counter()
        b = self.layout(VarlenBatch.from_share(share))
        resp, old, adv = b.resp, b.old_logprobs, b.advantages
        new = self.token_logprobs(self.model, b)
        ratio = torch.exp((new - old).clamp(max=20.0)) * resp  # clamp: a wildly stale token must not overflow
        eps = self.cfg.clip_eps
        surr = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        n_tok = resp.sum().clamp(min=1)
        loss = -(surr * resp).sum() / n_tok
        kl = torch.zeros(())
        if self.ref is not None:
            with torch.no_grad():
                ref = self.token_logprobs(self.ref, b)
            d = ref - new
            kl = ((torch.exp(d) - d - 1) * resp).sum() / n_tok
            loss = loss + self.cfg.kl_coef * kl
        if not torch.isfinite(loss):
            raise FloatingPointError(f"GRPO loss is {loss.item()} at version {self.version}; check rewards and lr")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        self.version += 1
        with torch.no_grad():
            clipped = (((ratio < 1 - eps) | (ratio > 1 + eps)) & resp).sum() / n_tok
            mean_ratio = (ratio * resp).sum() / n_tok
        return StepResult(version=self.version, loss=float(loss.detach()), clip_frac=float(clipped),
                          mean_ratio=float(mean_ratio), kl=float(kl.detach()), tokens=int(resp.sum()),
                          step_s=time.perf_counter() - t0)

    def weights(self) -> dict[str, torch.Tensor]:
        """A detached copy of the current weights (what a sync point sends to the rollout engines)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
