"""batched_pack, the Triton kernel: one launch per field copies every sequence to its planned place.

Program (i, b) copies tokens [b * BLOCK, (b + 1) * BLOCK) of sequence i from the ragged source to
``dst[row[i] * row_len + offset[i] + t]``. Values are moved as same-width integers (int8/16/32/64), so every
dtype (bf16 NaN payloads, bools) is copied bit for bit. With ``POSITIONS`` the same program writes the token's
index within its sequence instead (``position_ids``). The pad fill is one ``torch.full`` (or, into a
caller's ``out=``, one ``fill_``) before the launch, so a reused buffer is rewritten in full.

Bytes moved per field (itemsize b): reads T * b, writes T * b after the fill's num_rows * row_len * b.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import PackPlan, check_out, check_pack

_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _pack_kernel(src_ptr, src_start_ptr, len_ptr, dst_start_ptr, dst_ptr, BLOCK: tl.constexpr,
                 POSITIONS: tl.constexpr):
    i = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.load(len_ptr + i)
    t = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = t < n
    dst = tl.load(dst_start_ptr + i) + t
    if POSITIONS:
        tl.store(dst_ptr + dst, t, mask=mask)
    else:
        vals = tl.load(src_ptr + tl.load(src_start_ptr + i) + t, mask=mask)
        tl.store(dst_ptr + dst, vals, mask=mask)


def _launch(src: torch.Tensor, seq_offsets: torch.Tensor, lengths: torch.Tensor, plan: PackPlan,
            out: torch.Tensor, positions: bool, block: int) -> None:
    n = lengths.numel()
    max_len = int(lengths.max()) if n else 0
    if n == 0 or max_len == 0:
        return
    device = out.device
    dst_start = (plan.row.to("cpu", torch.int64) * plan.row_len + plan.offset.to("cpu", torch.int64)).to(device)
    grid = (n, triton.cdiv(max_len, block))
    _pack_kernel[grid](src, seq_offsets[:-1].to(device, torch.int64), lengths.to(device), dst_start, out,
                       BLOCK=block, POSITIONS=positions)


def pack_field_triton(values: torch.Tensor, seq_offsets: torch.Tensor, plan: PackPlan,
                      pad_value: float | int | bool = 0, block: int = 1024,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Host wrapper: validates (as the reference), fills the pad, launches one copy. ``block`` is a power of two
    and changes speed only. ``out``: a contiguous [num_rows, row_len] buffer of values' dtype and device to write
    instead of a fresh one; the fill rewrites all of it first, so what it held before cannot leak into pads."""
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    lengths = check_pack(values, seq_offsets, plan)
    if out is None:
        out = torch.full((plan.num_rows, plan.row_len), pad_value, dtype=values.dtype, device=values.device)
    else:
        check_out(out, plan, values.dtype, values.device, "field", sources=(values,)).fill_(pad_value)
    as_int = _SAME_WIDTH_INT[values.element_size()]
    src = values.view(torch.uint8).view(as_int) if values.dtype == torch.bool else values.view(as_int)
    dst = out.view(torch.uint8).view(as_int) if out.dtype == torch.bool else out.view(as_int)
    if src.numel() == 0:
        src = torch.zeros(1, dtype=as_int, device=values.device)
    _launch(src, seq_offsets, lengths, plan, dst, positions=False, block=block)
    return out


def position_ids_triton(seq_offsets: torch.Tensor, plan: PackPlan, device: torch.device | str,
                        block: int = 1024, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [num_rows, row_len] position ids (see reference.position_ids_reference), in one launch; into
    ``out`` (zeroed first) when given."""
    off = seq_offsets.to("cpu", torch.int64)
    lengths = off[1:] - off[:-1]
    if out is None:
        out = torch.zeros(plan.num_rows, plan.row_len, dtype=torch.int64, device=device)
    else:
        check_out(out, plan, torch.int64, torch.device(device), "position_ids").zero_()
    _launch(out, off, lengths, plan, out, positions=True, block=block)
    return out
