"""batched_pack: ragged trajectories -> packed micro-batch buffers, cu_seqlens and position_ids.

Dispatch: ``impl="auto"`` runs the Triton kernel for CUDA tensors and the torch path otherwise;
``impl="triton"`` / ``impl="reference"`` force one; "triton" on CPU needs ``TRITON_INTERPRET=1``. The torch path
is ``slices.py`` (one slice copy per sequence); ``reference.py``'s per-token scatter (``pack_field_reference``,
``position_ids_reference``) is the specification both are tested against.

Example::

    >>> import torch
    >>> plan = plan_microbatches([3, 2, 2], num_ranks=1, max_tokens_per_microbatch=4)
    >>> out = batched_pack({"ids": torch.arange(7)}, torch.tensor([0, 3, 5, 7]), plan.pack)
    >>> out.fields["ids"].tolist(), out.position_ids.tolist()
    ([[3, 4, 5, 6], [0, 1, 2, 0]], [[0, 1, 0, 1], [0, 1, 2, 0]])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import torch

from ..encoding_hash import resolve_impl
from .planner import MicrobatchPlan, first_fit_decreasing, karmarkar_karp, plan_microbatches
from .reference import PackPlan, check_pack, cu_seqlens_from_plan, pack_field_reference, position_ids_reference
from .slices import pack_field_slices, position_ids_slices, slice_copies

Impl = Literal["auto", "triton", "reference"]

__all__ = ["PackPlan", "PackedBatch", "MicrobatchPlan", "batched_pack", "pack_field", "plan_microbatches",
           "karmarkar_karp", "first_fit_decreasing", "check_pack", "pack_field_reference",
           "position_ids_reference", "pack_field_slices", "position_ids_slices"]


@dataclass
class PackedBatch:
    """The packed micro-batches: one [num_rows, row_len] buffer per field (same name, same dtype),
    ``position_ids`` int64 [num_rows, row_len], ``cu_seqlens`` int32 [num_rows, max_seqs + 1] and
    ``seq_counts`` int64 [num_rows] (see reference.py for the conventions)."""

    fields: dict[str, torch.Tensor]
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_counts: torch.Tensor
    plan: PackPlan


def pack_field(values: torch.Tensor, seq_offsets: torch.Tensor, plan: PackPlan, pad_value: float | int | bool = 0,
               *, impl: Impl = "auto") -> torch.Tensor:
    """One field, [num_rows, row_len], ``pad_value`` where no sequence is placed."""
    if resolve_impl(impl, values.device) == "reference":
        return pack_field_slices(values, seq_offsets, plan, pad_value)
    from .kernel import pack_field_triton  # lazy: the reference path never needs triton

    return pack_field_triton(values, seq_offsets, plan, pad_value)


def batched_pack(fields: Mapping[str, torch.Tensor], seq_offsets: torch.Tensor, plan: PackPlan,
                 pad_values: Mapping[str, float | int | bool] | None = None, *, impl: Impl = "auto") -> PackedBatch:
    """Pack every field (one launch each) and derive position_ids and cu_seqlens from the plan. Pads default
    to 0 / 0.0 / False; override per field with ``pad_values``."""
    if not fields:
        raise ValueError("fields is empty: pass at least one per-token field")
    pads = dict(pad_values or {})
    unknown = set(pads) - set(fields)
    if unknown:
        raise ValueError(f"pad_values names fields that were not given: {sorted(unknown)}")
    device = next(iter(fields.values())).device
    if resolve_impl(impl, device) == "reference":
        copies = slice_copies(seq_offsets, plan)  # once for all fields
        packed = {name: pack_field_slices(v, seq_offsets, plan, pads.get(name, 0), copies=copies)
                  for name, v in fields.items()}
        pos = position_ids_slices(seq_offsets, plan, device, copies=copies)
    else:
        packed = {name: pack_field(v, seq_offsets, plan, pads.get(name, 0), impl=impl) for name, v in fields.items()}
        from .kernel import position_ids_triton

        pos = position_ids_triton(seq_offsets, plan, device)
    cu, counts = cu_seqlens_from_plan(seq_offsets, plan)
    return PackedBatch(fields=packed, position_ids=pos, cu_seqlens=cu.to(device), seq_counts=counts.to(device),
                       plan=plan)
