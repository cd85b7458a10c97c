"""batched_pack's fast torch path (what ``impl="reference"`` and CPU ``"auto"`` run): one slice copy per sequence.

Why
---
The per-token scatter in ``reference.py`` is the specification, but it builds an int64 index per token
(8 bytes of index per moved value) and scatters through it, ~5% of a memcpy on a CPU. A sequence is a contiguous
run in the ragged source and in its row, so the packed buffer, read in destination order, is just a list of
pieces: a source slice per sequence and pad runs between them. One concatenation of the pieces per field
writes every output element exactly once (no pad fill to overwrite, no index) and moves each token once, at
memcpy speed for long sequences. ``tests/equivalence/test_kernel_pack_equivalence.py`` checks it against the
scatter and the Triton kernel, bit for bit.

On CPU the concatenation is ``np.concatenate(pieces, out=...)`` over numpy views of the same memory: one tight
single-threaded copy loop. ``torch.cat(out=)`` runs such a loop only with one torch thread; with more it copies
piece by piece through TensorIterator (several us each, and pieces under its 32k-element grain never run in
parallel anyway), which made ~1000 pieces per field cost more than the bytes. Other devices keep ``torch.cat``.

Bytes moved, per field of itemsize b: reads T * b, writes num_rows * row_len * b (pads included): less than the
scatter's fill + T * b that ``repro.kernels.pack_bytes`` counts, so GB/s figures stay comparable.

Example::

    >>> import torch
    >>> from triton_kernels.batched_pack.reference import PackPlan
    >>> plan = PackPlan(row=torch.tensor([0, 0, 1]), offset=torch.tensor([0, 2, 0]), num_rows=2, row_len=4)
    >>> pack_field_slices(torch.arange(1, 7), torch.tensor([0, 2, 3, 6]), plan, pad_value=0)
    tensor([[1, 2, 3, 0],
            [4, 5, 6, 0]])
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence, Union

import numpy as np
import torch

from .reference import PackPlan, check_out, check_pack

_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class SliceCopies:
    """The flattened packed buffer [num_rows * row_len] as pieces in destination order; computed once per batch
    and shared by every field and by position_ids. A piece is a whole sequence or a pad run; no pad run crosses
    a row end, so a pad source of row_len elements serves them all."""

    seq_lengths: list[int]
    """Length of every sequence, in source order (empty ones included): split sizes of values[first:last]."""
    first: int
    """seq_offsets[0]: where the ragged source starts."""
    pad_lengths: list[int]
    """Length of every pad run (each <= row_len)."""
    order: list[int]
    """Destination order: i < num_sequences is sequence i, num_sequences + j is pad run j."""
    total: int
    """num_rows * row_len."""


def slice_copies(seq_offsets: torch.Tensor, plan: PackPlan) -> SliceCopies:
    """Sequences sorted by destination start, with the pad runs between them (placements are assumed valid:
    ``check_pack`` rejects overlaps and out-of-range placements first)."""
    off = seq_offsets.to("cpu", torch.int64)
    lengths = off[1:] - off[:-1]
    nz = torch.nonzero(lengths > 0).flatten()  # empty sequences occupy nothing
    dst = plan.row.to("cpu", torch.int64)[nz] * plan.row_len + plan.offset.to("cpu", torch.int64)[nz]
    order = torch.argsort(dst)
    total, num_seqs = plan.num_rows * plan.row_len, lengths.numel()
    pad_lengths, dest_order, cursor = [], [], 0
    for start, n, i in zip(dst[order].tolist() + [total], lengths[nz][order].tolist() + [0], nz[order].tolist()
                           + [-1]):
        while cursor < start:  # pad runs, cut at row ends
            run = min(start, (cursor // plan.row_len + 1) * plan.row_len) - cursor
            dest_order.append(num_seqs + len(pad_lengths))
            pad_lengths.append(run)
            cursor += run
        if n:
            dest_order.append(i)
            cursor = start + n
    return SliceCopies(lengths.tolist(), int(off[0]), pad_lengths, dest_order, total)


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a same-width integer tensor: copies move bits, never values (NaN payloads, bools)."""
    as_int = _SAME_WIDTH_INT[t.element_size()]
    return t.view(torch.uint8).view(as_int) if t.dtype == torch.bool else t.view(as_int)


Buf = Union[torch.Tensor, np.ndarray]


def _host(t: torch.Tensor) -> Buf:
    """A CPU tensor as a numpy array over the same memory (see the module doc: why numpy); others unchanged."""
    return t.detach().numpy() if t.device.type == "cpu" else t


def _split(src: Buf, lengths: list[int]) -> list[Buf]:
    """Consecutive views of ``src`` of the given lengths (which sum to its length)."""
    if isinstance(src, np.ndarray):  # numpy slicing is ~0.2 us a view; np.split ~1.7 us
        ends = list(accumulate(lengths))
        return [src[a:b] for a, b in zip([0] + ends[:-1], ends)]
    return list(src.split(lengths))


def _assemble(copies: SliceCopies, sequences: Sequence[Buf], pad: Buf, out: Buf) -> None:
    """out[:] = the pieces in destination order, in one concatenation that copies each piece into place. All
    numpy (CPU) or all torch (a torch view costs ~0.5 us of Python, so ``split``, not slices, there)."""
    if copies.total:
        views = list(sequences) + [pad[:n] for n in copies.pad_lengths]
        pieces = [views[i] for i in copies.order]
        if isinstance(out, np.ndarray):
            np.concatenate(pieces, out=out)
        else:
            torch.cat(pieces, out=out)


def pack_field_slices(values: torch.Tensor, seq_offsets: torch.Tensor, plan: PackPlan,
                      pad_value: float | int | bool = 0, copies: SliceCopies | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """out[row[i], offset[i] + t] = values[seq_offsets[i] + t]; everything else ``pad_value`` (as the reference).
    ``out``: a contiguous [num_rows, row_len] buffer of values' dtype and device to write instead of a fresh one;
    every element is rewritten (the pad runs are pieces of the cat), so what it held before cannot leak."""
    check_pack(values, seq_offsets, plan)
    if copies is None:
        copies = slice_copies(seq_offsets, plan)
    if out is None:
        out = torch.empty(plan.num_rows, plan.row_len, dtype=values.dtype, device=values.device)
    else:
        check_out(out, plan, values.dtype, values.device, "field", sources=(values,))
    pad = torch.full((max(copies.pad_lengths, default=0),), pad_value, dtype=values.dtype, device=values.device)
    src = _host(_as_int(values))[copies.first:copies.first + sum(copies.seq_lengths)]
    _assemble(copies, _split(src, copies.seq_lengths), _host(_as_int(pad)), _host(_as_int(out).view(-1)))
    return out


def position_ids_slices(seq_offsets: torch.Tensor, plan: PackPlan, device: torch.device | str = "cpu",
                        copies: SliceCopies | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [num_rows, row_len]: 0, 1, ... within each sequence, 0 on padding (as the reference). ``out``: a
    buffer to rewrite in full instead of a fresh one (as in ``pack_field_slices``)."""
    if copies is None:
        copies = slice_copies(seq_offsets, plan)
    if out is None:
        out = torch.empty(plan.num_rows, plan.row_len, dtype=torch.int64, device=device)
    else:
        check_out(out, plan, torch.int64, torch.device(device), "position_ids")
    device = out.device
    ramp = _host(torch.arange(max(copies.seq_lengths, default=0), dtype=torch.int64, device=device))
    pad = _host(torch.zeros(max(copies.pad_lengths, default=0), dtype=torch.int64, device=device))
    _assemble(copies, [ramp[:n] for n in copies.seq_lengths], pad, _host(out.view(-1)))
    return out
