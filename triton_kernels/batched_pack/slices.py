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

Per batch, the placement is validated once (``check_placement``) and turned into pieces once (``slice_copies``,
numpy bookkeeping); per field only the field itself is checked and the piece views built (``map`` over
precomputed ``slice`` objects). Multi-threaded torch ops are avoided on CPU: on a busy 2-core machine each can wait
milliseconds at its barrier.

Bytes moved (``batched_pack.pack_traffic``, what this path moves): per field of itemsize b, reads T * b and writes
num_rows * row_len * b (pads included); position_ids writes num_rows * row_len * 8 from a cache-resident ramp.

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
from typing import Sequence, Union

import numpy as np
import torch

from .reference import PackPlan, check_field, check_out, check_pack, check_placement

_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class SliceCopies:
    """The flattened packed buffer [num_rows * row_len] as pieces in destination order; computed once per batch
    (from a validated placement) and shared by every field and by position_ids. A piece is a whole non-empty
    sequence or a pad run; no pad run crosses a row end, so a pad source of ``max_pad`` elements serves them all.
    Pieces are kept as ``slice`` objects so that a field's views are built by ``map`` (no Python loop body)."""

    seq_slices: list[slice]
    """The non-empty sequences in destination order: their slices of the ragged source from seq_offsets[0]."""
    ramp_slices: list[slice]
    """The same sequences' position ramps: slice(None, length)."""
    pad_slices: list[slice]
    """The pad runs in destination order: slice(None, run length)."""
    order: list[int]
    """Destination order of all pieces: i < len(seq_slices) is sequence piece i, else pad run i - len(seq_slices)."""
    first: int
    """seq_offsets[0]: where the ragged source starts."""
    end: int
    """seq_offsets[-1]: every field must hold at least this many tokens."""
    max_len: int
    """Longest sequence (the position ramp's length)."""
    max_pad: int
    """Longest pad run."""
    total: int
    """num_rows * row_len."""


def slice_copies(seq_offsets: torch.Tensor, plan: PackPlan, lengths: np.ndarray | None = None) -> SliceCopies:
    """Sequences sorted by destination start, with the pad runs between them, vectorized in numpy. ``lengths``:
    the per-sequence lengths ``check_placement`` returned (the placement is validated here when not given)."""
    if lengths is None:
        lengths = check_placement(seq_offsets, plan)
    off = seq_offsets.to("cpu", torch.int64).numpy()
    total, row_len = plan.num_rows * plan.row_len, plan.row_len
    nz = np.flatnonzero(lengths > 0)  # empty sequences occupy nothing
    dst = plan.row.to("cpu", torch.int64).numpy()[nz] * row_len + plan.offset.to("cpu", torch.int64).numpy()[nz]
    order = np.argsort(dst, kind="stable")
    start, n = dst[order], lengths[nz][order]
    src = (off[:-1] - off[0])[nz][order]
    # gap k lies before sequence k (gap len(n) after the last one); each is cut at row ends into pad runs
    g0, g1 = np.concatenate([[0], start + n]), np.concatenate([start, [total]])
    runs = np.where(g1 > g0, (g1 - 1) // max(row_len, 1) - g0 // max(row_len, 1) + 1, 0)
    gap = np.repeat(np.arange(g0.size), runs)
    r = np.arange(int(runs.sum())) - np.repeat(np.cumsum(runs) - runs, runs)
    row0 = g0[gap] // max(row_len, 1) + r
    pads = np.minimum(g1[gap], (row0 + 1) * row_len) - np.maximum(g0[gap], row0 * row_len)
    # destination order: gap 0's runs, sequence 0, gap 1's runs, sequence 1, ..., gap n's runs
    is_seq = np.zeros(n.size + pads.size, dtype=bool)
    is_seq[np.cumsum(runs[:-1]) + np.arange(n.size)] = True
    dest = np.empty(is_seq.size, dtype=np.int64)
    dest[is_seq], dest[~is_seq] = np.arange(n.size), n.size + np.arange(pads.size)
    lens = n.tolist()
    return SliceCopies(list(map(slice, src.tolist(), (src + n).tolist())), list(map(slice, lens)),
                       list(map(slice, pads.tolist())), dest.tolist(), int(off[0]), int(off[-1]),
                       max(lens, default=0), int(pads.max(initial=0)), total)


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a same-width integer tensor: copies move bits, never values (NaN payloads, bools)."""
    as_int = _SAME_WIDTH_INT[t.element_size()]
    return t.view(torch.uint8).view(as_int) if t.dtype == torch.bool else t.view(as_int)


Buf = Union[torch.Tensor, np.ndarray]


def _host(t: torch.Tensor) -> Buf:
    """A CPU tensor as a numpy array over the same memory (see the module doc: why numpy); others unchanged."""
    return t.detach().numpy() if t.device.type == "cpu" else t


def _assemble(copies: SliceCopies, sequences: Sequence[Buf], pads: Sequence[Buf], out: Buf) -> None:
    """out[:] = the pieces in destination order, in one concatenation that copies each piece into place. All
    numpy (CPU) or all torch."""
    if not copies.total:
        return
    pieces = list(map([*sequences, *pads].__getitem__, copies.order))
    if isinstance(out, np.ndarray):
        np.concatenate(pieces, out=out)
    else:
        torch.cat(pieces, out=out)


def _pad_source(pad_value: float | int | bool, dtype: torch.dtype, n: int, device: torch.device) -> Buf:
    """``n`` copies of ``pad_value``'s bits as the field's same-width integers (contiguous: a stride-0 source would
    keep numpy's concatenation off its memmove path for every pad run)."""
    return _host(_as_int(torch.tensor([pad_value], dtype=dtype)).to(device).expand(n).contiguous())


def copy_field(values: torch.Tensor, copies: SliceCopies, pad_value: float | int | bool,
                    out: torch.Tensor) -> torch.Tensor:
    """The copy itself, for a field and an ``out`` already checked against the batch's ``copies``."""
    pad = _pad_source(pad_value, values.dtype, copies.max_pad, values.device)
    src = _host(_as_int(values))[copies.first:copies.end]
    _assemble(copies, list(map(src.__getitem__, copies.seq_slices)), list(map(pad.__getitem__, copies.pad_slices)),
              _host(_as_int(out).view(-1)))
    return out


def pack_field_slices(values: torch.Tensor, seq_offsets: torch.Tensor, plan: PackPlan,
                      pad_value: float | int | bool = 0, copies: SliceCopies | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """out[row[i], offset[i] + t] = values[seq_offsets[i] + t]; everything else ``pad_value`` (as the reference).
    ``copies``: this batch's ``slice_copies`` (its placement already validated; the field is still checked).
    ``out``: a contiguous [num_rows, row_len] buffer of values' dtype and device to write instead of a fresh one;
    every element is rewritten (the pad runs are pieces of the cat), so what it held before cannot leak."""
    if copies is None:
        lengths = check_pack(values, seq_offsets, plan).numpy()
        copies = slice_copies(seq_offsets, plan, lengths)
    else:
        check_field(values, copies.end)
    if out is None:
        out = torch.empty(plan.num_rows, plan.row_len, dtype=values.dtype, device=values.device)
    else:
        check_out(out, plan, values.dtype, values.device, "field", sources=(values,))
    return copy_field(values, copies, pad_value, out)


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
    ramp = _host(torch.arange(copies.max_len, dtype=torch.int64, device=device))
    pad = _pad_source(0, torch.int64, copies.max_pad, device)
    _assemble(copies, list(map(ramp.__getitem__, copies.ramp_slices)), list(map(pad.__getitem__, copies.pad_slices)),
              _host(out.view(-1)))
    return out

