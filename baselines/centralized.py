"""Centralized single-controller transfer: the verl DataProto path, as a careful verl user runs it.

What verl does between rollout and the actor update (``RayPPOTrainer.fit`` -> ``update_actor``):

1. **Gather**: every rollout worker's output returns to the single driver (``ray.get``).
2. **Build the batch**: ``DataProto.concat`` of the chunks; the prompt batch (held by the driver's dataloader)
   is repeated n times, interleaved (``batch.repeat(n, interleave=True)``), and joined with the responses into
   dense, padded tensors: ``input_ids``, ``attention_mask``, ``position_ids`` ``[B, Lp + Lr]`` (prompts
   left-padded, responses right-padded) and the response-side ``old_log_probs``, ``advantages``,
   ``response_mask`` ``[B, Lr]``.
3. **Balance**: ``_balance_batch`` reorders rows so each DP rank gets a balanced token count.
4. **Scatter**: ``dp_compute_proto`` chunks the batch into one piece per DP rank and ships each through the Ray
   object store; each rank then splits its piece into mini-batches (``data.split``), one optimizer step each.

So mini-batch 0 cannot start before the whole batch went through the driver. Padding (``CentralizedConfig.pad_to``):
verl's agent loop pads every prompt to ``rollout.prompt_length`` (left) and every response to
``rollout.response_length`` (right, ``padding="max_length"``), so ``pad_to="max"`` is what verl ships;
``pad_to="longest"`` pads to the batch's longest prompt and response, a stronger baseline than verl (the
headline claims use it). Other choices in the baseline's favour (not a strawman): outputs travel as numpy arrays
(zero-copy reads from the object store, no torch pickling); balancing uses the same token balancer as KnitTrans
(without locality).

Across batches (verl's one-step-off and fully-async recipes): generation of batch b+1 overlaps training of batch
b, but the driver assembles and scatters batch b+1 only after batch b's (synchronous) ``update_actor`` returns
-- one-step-off's asyncio task can at best concat and balance b+1 at an ``await`` point inside batch b's step,
fully-async's trainer pulls its samples from the queue at the top of the next step. ``repro.transfer`` models
both (``central_overlap``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from knittrans.dataplane.assign import ShareItem, assign_shares
from knittrans.dataplane.types import TrajectoryPayload
from knittrans.types import MiniBatch


@dataclass(frozen=True)
class CentralizedConfig:
    """Knobs of the single-controller path."""

    pad_token_id: int = 0
    """Id written into padding positions of ``input_ids``."""
    pad_to: str = "longest"
    """"longest": pad prompts and responses to the batch's longest (stronger than verl); "max": pad them to
    ``max_prompt_len`` / ``max_response_len`` as verl's rollout does (``padding="max_length"``)."""
    max_prompt_len: int = 2048
    """verl's ``data.max_prompt_length`` / ``rollout.prompt_length`` (used when ``pad_to="max"``)."""
    max_response_len: int = 8192
    """verl's ``data.max_response_length`` / ``rollout.response_length`` (used when ``pad_to="max"``)."""

    def __post_init__(self) -> None:
        if self.pad_to not in ("longest", "max"):
            raise ValueError(f"CentralizedConfig.pad_to must be 'longest' or 'max', got {self.pad_to!r}")
        if self.max_prompt_len < 1 or self.max_response_len < 1:
            raise ValueError("CentralizedConfig.max_prompt_len and max_response_len must be >= 1")


@dataclass
class DenseBatch:
    """A DataProto-like container: equal-length rows, one numpy array per field (field names key ``tensors``,
    as in a TensorDict), ``traj_ids`` naming each row."""

    traj_ids: np.ndarray
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.traj_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.tensors.values()) + self.traj_ids.nbytes)

    def take(self, rows: np.ndarray) -> "DenseBatch":
        """Rows in ``rows`` order (a copy, as ``DataProto.reorder``)."""
        return DenseBatch(self.traj_ids[rows], {k: v[rows] for k, v in self.tensors.items()})

    def chunk(self, k: int) -> list["DenseBatch"]:
        """``k`` equal pieces (views), as ``DataProto.chunk``; the length must divide."""
        if len(self) % k:
            raise ValueError(f"DenseBatch.chunk: {len(self)} rows do not split into {k} equal chunks")
        return self.split(len(self) // k)

    def split(self, size: int) -> list["DenseBatch"]:
        """Consecutive pieces of ``size`` rows (views), as ``DataProto.split``."""
        return [DenseBatch(self.traj_ids[i:i + size], {k: v[i:i + size] for k, v in self.tensors.items()})
                for i in range(0, len(self), size)]


@dataclass(frozen=True)
class RankPlan:
    """Row order of the balanced batch: ``rows_per_rank[r]`` lists (mini-batch by mini-batch) the trajectory ids
    rank ``r`` trains on; every rank gets ``per_minibatch`` rows of each mini-batch."""

    rows_per_rank: tuple[tuple[int, ...], ...]
    per_minibatch: int


def balance_plan(minibatches: Sequence[MiniBatch], tokens: dict[int, int], num_ranks: int) -> RankPlan:
    """verl's ``_balance_batch`` at mini-batch granularity: equal counts, balanced tokens, no locality."""
    per = None
    rows: list[list[int]] = [[] for _ in range(num_ranks)]
    for mb in minibatches:
        if len(mb.traj_ids) % num_ranks:
            raise ValueError(f"mini-batch {mb.index} has {len(mb.traj_ids)} rows, not a multiple of "
                             f"{num_ranks} DP ranks (DataProto.chunk needs equal pieces)")
        if per is not None and per != len(mb.traj_ids) // num_ranks:
            raise ValueError("DataProto.split needs equal mini-batch sizes")
        per = len(mb.traj_ids) // num_ranks
        shares = assign_shares([ShareItem(t, tokens[t], "driver") for t in mb.traj_ids], ["driver"] * num_ranks)
        for r, s in enumerate(shares):
            rows[r] += s
    return RankPlan(tuple(tuple(r) for r in rows), per or 0)


def _pad(rows: Sequence[np.ndarray], width: int, dtype: np.dtype, left: bool, fill: int = 0) -> np.ndarray:
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        n = r.shape[0]
        if n:
            if left:
                out[i, width - n:] = r
            else:
                out[i, :n] = r
    return out


def _dense_len(longest: int, cap: int, what: str, config: CentralizedConfig) -> int:
    """Columns of the dense layout: the batch's longest (pad_to="longest") or the configured cap ("max", as verl
    pads), which nothing may exceed."""
    if config.pad_to != "max":
        return longest
    if longest > cap:
        raise ValueError(f"a {what} of {longest} tokens exceeds max_{what}_len={cap}")
    return cap


def build_dense_batch(gathered: Sequence[Sequence[TrajectoryPayload]], prompts: Sequence[np.ndarray],
                      prompt_of: dict[int, int], group_size: int, plan: RankPlan,
                      config: CentralizedConfig = CentralizedConfig()) -> DenseBatch:
    """Step 2 and 3 on the driver: concat the gathered outputs, repeat the prompts n times, pad, reorder rows
    into the balanced plan. ``prompt_of[traj]`` is the group (prompt index) of each trajectory."""
    by_id = {p.traj_id: p for chunk in gathered for p in chunk}  # DataProto.concat
    # The prompt batch repeated n times, interleaved: row g*n + i is prompt g (verl repeats before generation).
    lp = _dense_len(max(int(p.shape[0]) for p in prompts), config.max_prompt_len, "prompt", config)
    prompt_dense = _pad(prompts, lp, np.dtype(np.int64), left=True, fill=config.pad_token_id)
    repeated = np.repeat(prompt_dense, group_size, axis=0)
    order = np.array([t for rows in plan.rows_per_rank for t in rows], dtype=np.int64)
    first_row = {}  # the repeated row that holds each trajectory's prompt (first unused row of its group)
    used: dict[int, int] = {}
    for t in order:
        g = prompt_of[int(t)]
        first_row[int(t)] = g * group_size + used.get(g, 0)
        used[g] = used.get(g, 0) + 1
    prompt_rows = repeated[[first_row[int(t)] for t in order]]  # DataProto.reorder (a copy)
    prompt_lens = np.array([prompts[prompt_of[int(t)]].shape[0] for t in order])
    responses = [by_id[int(t)].tensors["input_ids"][prompt_lens[i]:] for i, t in enumerate(order)]
    lr = _dense_len(max(int(r.shape[0]) for r in responses), config.max_response_len, "response", config)
    resp = _pad(responses, lr, np.dtype(np.int64), left=False, fill=config.pad_token_id)
    input_ids = np.concatenate([prompt_rows, resp], axis=1)
    resp_lens = np.array([r.shape[0] for r in responses])
    cols = np.arange(lp + lr)
    attention_mask = ((cols >= (lp - prompt_lens)[:, None]) & (cols < (lp + resp_lens)[:, None])).astype(np.int64)
    position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None).astype(np.int64)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    for name, dtype in (("old_logprobs", np.float32), ("advantages", np.float32), ("loss_mask", np.bool_)):
        tensors[name] = _pad([by_id[int(t)].tensors[name] for t in order], lr, np.dtype(dtype), left=False)
    return DenseBatch(order, tensors)


def rank_minibatches(chunk: DenseBatch, per_minibatch: int) -> list[DenseBatch]:
    """Step 4 on a rank: split its chunk into mini-batches (views, no copy)."""
    return chunk.split(per_minibatch)


def real_tokens(mb: DenseBatch) -> int:
    """Tokens the model computes on with remove-padding (what compute emulation charges, as for KnitTrans)."""
    return int(mb.tensors["attention_mask"].sum())
