"""batched_pack: ragged trajectories -> packed micro-batch buffers, cu_seqlens and position_ids.

Dispatch: ``impl="auto"`` runs the Triton kernel for CUDA tensors and the torch path otherwise;
``impl="triton"`` / ``impl="reference"`` force one; "triton" on CPU needs ``TRITON_INTERPRET=1``. The torch path
is ``slices.py`` (one slice copy per sequence); ``reference.py``'s per-token scatter (``pack_field_reference``,
``position_ids_reference``) is the specification both are tested against.

Outputs: fresh tensors by default; ``out=`` writes into the caller's (a ``PackedBatch`` from an earlier call with
the same plan shape, or a ``PackBuffers`` that hands out reused buffers of any shape), bit for bit the same
result. In a training loop that saves the first-touch page faults of fresh outputs (see buffers.py).

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
from ..traffic import Traffic
from .buffers import PackBuffers
from .planner import MicrobatchPlan, first_fit_decreasing, karmarkar_karp, plan_microbatches
from .reference import (PackPlan, check_field, check_out, check_pack, check_placement, cu_seqlens_from_plan,
                        first_clash, pack_field_reference, position_ids_reference)
from .slices import copy_field, pack_field_slices, position_ids_slices, slice_copies

Impl = Literal["auto", "triton", "reference"]

__all__ = ["PackPlan", "PackedBatch", "PackBuffers", "MicrobatchPlan", "batched_pack", "pack_field",
           "plan_microbatches", "karmarkar_karp", "first_fit_decreasing", "check_pack", "pack_field_reference",
           "position_ids_reference", "pack_field_slices", "position_ids_slices", "pack_traffic", "check_placement",
           "check_field", "cu_seqlens_from_plan", "copy_field", "slice_copies"]


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
               *, impl: Impl = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """One field, [num_rows, row_len], ``pad_value`` where no sequence is placed. ``out``: a contiguous
    [num_rows, row_len] tensor of values' dtype and device, rewritten in full and returned (ValueError/TypeError
    on a wrong shape, dtype, device or layout, or one overlapping ``values``)."""
    if resolve_impl(impl, values.device) == "reference":
        return pack_field_slices(values, seq_offsets, plan, pad_value, out=out)
    from .kernel import pack_field_triton  # lazy: the reference path never needs triton

    return pack_field_triton(values, seq_offsets, plan, pad_value, out=out)


def batched_pack(fields: Mapping[str, torch.Tensor], seq_offsets: torch.Tensor, plan: PackPlan,
                 pad_values: Mapping[str, float | int | bool] | None = None, *, impl: Impl = "auto",
                 out: PackedBatch | PackBuffers | None = None) -> PackedBatch:
    """Pack every field (one launch each) and derive position_ids and cu_seqlens from the plan. Pads default
    to 0 / 0.0 / False; override per field with ``pad_values``.

    ``out``: where the fields and position_ids go instead of fresh tensors. A ``PackBuffers`` hands out its
    reused buffers; a ``PackedBatch`` (same field names, shapes and dtypes, e.g. the previous step's) is
    overwritten and returned, with cu_seqlens, seq_counts and plan replaced (those are small, and cu_seqlens'
    width follows the plan). Every output is validated before anything is written."""
    if not fields:
        raise ValueError("fields is empty: pass at least one per-token field")
    pads = dict(pad_values or {})
    unknown = set(pads) - set(fields)
    if unknown:
        raise ValueError(f"pad_values names fields that were not given: {sorted(unknown)}")
    device = next(iter(fields.values())).device
    outs, pos_out = _resolve_out(out, fields, plan, device)
    if resolve_impl(impl, device) == "reference":
        copies = slice_copies(seq_offsets, plan)  # validates the placement, once for all fields
        for v in fields.values():
            check_field(v, copies.end)
        packed = {}
        for name, v in fields.items():
            dst = outs[name]
            if dst is None:
                dst = torch.empty(plan.num_rows, plan.row_len, dtype=v.dtype, device=device)
            packed[name] = copy_field(v, copies, pads.get(name, 0), dst)
        pos = position_ids_slices(seq_offsets, plan, device, copies=copies, out=pos_out)
    else:
        packed = {name: pack_field(v, seq_offsets, plan, pads.get(name, 0), impl=impl, out=outs[name])
                  for name, v in fields.items()}
        from .kernel import position_ids_triton

        pos = position_ids_triton(seq_offsets, plan, device, out=pos_out)
    cu, counts = cu_seqlens_from_plan(seq_offsets, plan)
    if isinstance(out, PackedBatch):
        out.fields, out.position_ids, out.plan = packed, pos, plan
        out.cu_seqlens, out.seq_counts = cu.to(device), counts.to(device)
        return out
    return PackedBatch(fields=packed, position_ids=pos, cu_seqlens=cu.to(device), seq_counts=counts.to(device),
                       plan=plan)


def pack_traffic(fields: Mapping[str, torch.Tensor], seq_offsets: torch.Tensor, plan: PackPlan) -> Traffic:
    """The bytes ``batched_pack(fields, seq_offsets, plan)`` must move, on any path (what the slice path moves).

    Reads, each once: every field's tokens ``T * b`` (T = seq_offsets[-1] - seq_offsets[0], itemsize b), the int64
    ``seq_offsets`` and the plan's ``row`` and ``offset``. Writes, each once: every field's
    ``num_rows * row_len * b`` (sequences and pads), int64 ``position_ids`` (generated: a write only), int32
    ``cu_seqlens`` [num_rows, max_seqs_per_row + 1] and int64 ``seq_counts`` [num_rows]. Not counted: the pad and
    position sources (cache resident), the Triton path's fill before its copy, validation rereading the offsets.

    >>> plan = PackPlan(row=torch.tensor([0, 0, 1]), offset=torch.tensor([0, 2, 0]), num_rows=2, row_len=4)
    >>> pack_traffic({"ids": torch.arange(6)}, torch.tensor([0, 2, 3, 6]), plan)
    Traffic(read=128, written=168)
    """
    off = seq_offsets.to("cpu", torch.int64)
    tokens = int(off[-1] - off[0]) if off.numel() else 0
    slots = plan.num_rows * plan.row_len
    per_token = sum(v.element_size() for v in fields.values())
    width = int(torch.bincount(plan.row.cpu().to(torch.int64)).max()) if plan.num_sequences else 0
    read = tokens * per_token + 8 * off.numel() + plan.num_sequences * (plan.row.element_size()
                                                                      + plan.offset.element_size())
    written = slots * (per_token + 8) + plan.num_rows * ((width + 1) * 4 + 8)
    return Traffic(read=read, written=written)


def _resolve_out(out: PackedBatch | PackBuffers | None, fields: Mapping[str, torch.Tensor], plan: PackPlan,
                 device: torch.device) -> tuple[dict[str, torch.Tensor | None], torch.Tensor | None]:
    """(an output buffer or None per field, the position_ids buffer or None), all checked: right shape, dtype,
    device and layout, no two sharing memory, none sharing memory with an input field."""
    if out is None:
        return dict.fromkeys(fields), None
    if isinstance(out, PackBuffers):
        outs = {name: out.field(name, plan, v.dtype, v.device) for name, v in fields.items()}
        pos = out.position_ids(plan, device)
    elif isinstance(out, PackedBatch):
        if set(out.fields) != set(fields):
            raise ValueError(f"out has fields {sorted(out.fields)}, the batch has {sorted(fields)}")
        outs, pos = dict(out.fields), out.position_ids
    else:
        raise TypeError(f"out must be a PackedBatch, a PackBuffers or None, got {type(out).__name__}")
    for name, v in fields.items():
        check_out(outs[name], plan, v.dtype, v.device, name)
    check_out(pos, plan, torch.int64, device, "position_ids")
    clash = first_clash([*outs.items(), ("position_ids", pos)], tuple(fields.values()))
    if clash:
        raise ValueError(clash)
    return outs, pos
