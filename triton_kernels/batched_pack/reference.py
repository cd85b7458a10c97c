"""batched_pack, the readable torch reference: ragged per-token fields -> packed micro-batch rows.

Why
---
A trainer step consumes micro-batches of packed rows (no padding between sequences, varlen attention). The
rollout side hands over ragged trajectories: for each field (token ids, old logprobs, advantages, loss masks)
one flat buffer of all tokens plus ``seq_offsets`` (token offsets, num_sequences + 1, shared by every field).
A ``PackPlan`` says where each sequence goes: row ``row[i]`` (a micro-batch of one rank), starting at token
``offset[i]`` of that row. Packing is a pure copy, so the kernel must produce identical buffers.

Bytes moved, per field of itemsize b: reads ``T * b`` (T = total tokens), writes ``num_rows * row_len * b``
(the pad fill, then the T tokens again): what a memcpy of the output would move, plus T * b.

Outputs besides the fields (computed from the plan alone, shared by both paths):
- ``position_ids`` int64 [num_rows, row_len]: 0, 1, ... within each sequence, resetting at every sequence
  start; 0 on padding.
- ``cu_seqlens`` int32 [num_rows, max_sequences_per_row + 1]: per row, 0 then each sequence's end offset in
  offset order, padded by repeating the row's last end (zero-length tail entries are harmless to varlen
  attention). For gapless rows (what ``plan_microbatches`` builds) these are the cumulative sequence lengths.

Example::

    >>> import torch
    >>> plan = PackPlan(row=torch.tensor([0, 0, 1]), offset=torch.tensor([0, 2, 0]), num_rows=2, row_len=4)
    >>> pack_field_reference(torch.arange(1, 7), torch.tensor([0, 2, 3, 6]), plan, pad_value=0)
    tensor([[1, 2, 3, 0],
            [4, 5, 6, 0]])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PackPlan:
    """Where each sequence lands: ``row[i]``, ``offset[i]`` (int64 [num_sequences] each) in a
    [num_rows, row_len] buffer. Rows are rank-major when built by ``plan_microbatches``: row = rank * M + m."""

    row: torch.Tensor
    offset: torch.Tensor
    num_rows: int
    row_len: int

    def __post_init__(self) -> None:
        for name in ("row", "offset"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"PackPlan.{name} must be a 1-D int64 tensor, got {type(t).__name__} "
                                f"{getattr(t, 'dtype', '')}")
        if self.row.numel() != self.offset.numel():
            raise ValueError(f"PackPlan.row and .offset differ in length: {self.row.numel()} != "
                             f"{self.offset.numel()}")
        if self.num_rows < 0 or self.row_len < 0:
            raise ValueError(f"num_rows and row_len must be >= 0, got {self.num_rows}, {self.row_len}")

    @property
    def num_sequences(self) -> int:
        return self.row.numel()


def check_field(values: torch.Tensor, tokens_end: int) -> None:
    """A field is a contiguous 1-D tensor holding at least ``tokens_end`` (= seq_offsets[-1]) tokens."""
    if not isinstance(values, torch.Tensor) or values.dim() != 1:
        raise TypeError(f"a field must be a 1-D tensor of per-token values, got {getattr(values, 'shape', values)}")
    if not values.is_contiguous():
        raise ValueError("a field must be contiguous; call .contiguous() first")
    if tokens_end > values.numel():
        raise ValueError(f"seq_offsets out of range: they end at {tokens_end} but the field has {values.numel()} "
                         "tokens")


def check_placement(seq_offsets: torch.Tensor, plan: PackPlan) -> np.ndarray:
    """Validate seq_offsets against a plan, once for all fields of a batch; returns the per-sequence lengths
    (numpy int64). Clear errors for: negative lengths, a negative first offset, a sequence longer than the row (the
    token budget), rows or offsets out of range, and overlapping placements. Bookkeeping in numpy: a few us per
    op on one thread, where small torch ops cost ~10 us each."""
    if not isinstance(seq_offsets, torch.Tensor) or seq_offsets.dim() != 1 or \
            seq_offsets.numel() != plan.num_sequences + 1 or seq_offsets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"seq_offsets must be 1-D int64 with num_sequences + 1 = {plan.num_sequences + 1} entries, "
                        f"got {getattr(seq_offsets, 'dtype', type(seq_offsets).__name__)} "
                        f"{tuple(getattr(seq_offsets, 'shape', ()))}")
    off = seq_offsets.to("cpu", torch.int64).numpy()
    lengths = off[1:] - off[:-1]
    if (lengths < 0).any():
        i = int(np.flatnonzero(lengths < 0)[0])
        raise ValueError(f"negative length: sequence {i} has seq_offsets {int(off[i])} -> {int(off[i + 1])}")
    if int(off[0]) < 0:
        raise ValueError(f"seq_offsets out of range: they start at {int(off[0])}")
    if (lengths > plan.row_len).any():
        i = int(np.flatnonzero(lengths > plan.row_len)[0])
        raise ValueError(f"sequence {i} has {int(lengths[i])} tokens, longer than the budget row_len="
                         f"{plan.row_len}")
    row, start = plan.row.to("cpu", torch.int64).numpy(), plan.offset.to("cpu", torch.int64).numpy()
    bad = (row < 0) | (row >= plan.num_rows) | (start < 0) | (start + lengths > plan.row_len)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"placement out of range: sequence {i} ({int(lengths[i])} tokens) at row {int(row[i])}, "
                         f"offset {int(start[i])} does not fit {plan.num_rows} rows x {plan.row_len} tokens")
    nz = np.flatnonzero(lengths > 0)  # empty sequences occupy nothing, so they cannot overlap
    if nz.size > 1:
        order = nz[np.argsort(row[nz] * (plan.row_len + 1) + start[nz], kind="stable")]
        r, s, e = row[order], start[order], start[order] + lengths[order]
        clash = (r[1:] == r[:-1]) & (s[1:] < e[:-1])
        if clash.any():
            j = int(np.flatnonzero(clash)[0])
            raise ValueError(f"overlapping placements: sequences {int(order[j])} and {int(order[j + 1])} both "
                             f"cover row {int(r[j])} tokens [{int(s[j + 1])}, {int(min(e[j], e[j + 1]))})")
    return lengths


def check_pack(values: torch.Tensor, seq_offsets: torch.Tensor, plan: PackPlan) -> torch.Tensor:
    """Validate a field against a plan (``check_field`` + ``check_placement``); returns the per-sequence lengths
    (CPU int64 tensor)."""
    check_field(values, 0)
    if isinstance(seq_offsets, torch.Tensor) and seq_offsets.dim() == 1 and seq_offsets.numel():
        check_field(values, int(seq_offsets[-1]))
    return torch.from_numpy(check_placement(seq_offsets, plan))


def check_out(out: torch.Tensor, plan: PackPlan, dtype: torch.dtype, device: torch.device, what: str,
              sources: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """Validate a caller's output buffer for ``what`` (a field name or "position_ids"): a contiguous
    [num_rows, row_len] tensor of ``dtype`` on ``device`` that shares no byte with ``sources`` (the inputs it is
    packed from: a copy into its own source would read what it has already overwritten). Returns ``out``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out for {what!r} must be a tensor, got {type(out).__name__}")
    shape = (plan.num_rows, plan.row_len)
    if tuple(out.shape) != shape:
        raise ValueError(f"out for {what!r} has shape {tuple(out.shape)}, the plan needs {shape}")
    if out.dtype != dtype:
        raise TypeError(f"out for {what!r} is {out.dtype}, the packed values are {dtype}")
    if out.device.type != device.type or (device.index is not None and out.device.index != device.index):
        raise ValueError(f"out for {what!r} is on {out.device}, the packed values are on {device}")
    if not out.is_contiguous():
        raise ValueError(f"out for {what!r} must be contiguous (the copies write it as one flat buffer)")
    for src in sources:
        if overlaps(out, src):
            raise ValueError(f"out for {what!r} overlaps the memory it is packed from")
    return out


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share a byte (by address range; empty tensors share nothing)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def first_clash(outputs: list[tuple[str, torch.Tensor]], sources: tuple[torch.Tensor, ...]) -> str:
    """"" if no output shares a byte with another output or with a source (sources may share among themselves),
    else what clashes. One sort of the address ranges instead of a check per pair: sorted by start, a range that
    overlaps any earlier one overlaps the earlier one of that kind reaching furthest."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name, t.device)
             for name, t in outputs if t.numel()]
    spans += [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), None, t.device) for t in sources
              if t.numel()]
    reach: dict[tuple[bool, torch.device], tuple[int, str | None]] = {}
    for start, end, name, device in sorted(spans, key=lambda s: (s[0], s[2] is None)):
        out_end, out_name = reach.get((True, device), (-1, None))
        if start < out_end:
            if name is None:
                return f"out for {out_name!r} overlaps the memory it is packed from"
            return f"out for {out_name!r} and out for {name!r} share memory"
        if name is not None and start < reach.get((False, device), (-1, None))[0]:
            return f"out for {name!r} overlaps the memory it is packed from"
        key = (name is not None, device)
        if end > reach.get(key, (-1, None))[0]:
            reach[key] = (end, name)
    return ""


def _token_index(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, index within the sequence) of every token, in ragged order."""
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    return seq, torch.arange(seq.numel()) - first[seq]


def scatter_index(seq_offsets: torch.Tensor, plan: PackPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat destination index, index within the sequence) of every token in ragged order; shared by all fields
    of one batch (compute once, pass to ``pack_field_reference``)."""
    off = seq_offsets.to("cpu", torch.int64)
    seq, idx = _token_index(off[1:] - off[:-1])
    dst = (plan.row.cpu().to(torch.int64) * plan.row_len + plan.offset.cpu().to(torch.int64))[seq] + idx
    return dst, idx


def pack_field_reference(values: torch.Tensor, seq_offsets: torch.Tensor, plan: PackPlan,
                         pad_value: float | int | bool = 0, dst: torch.Tensor | None = None) -> torch.Tensor:
    """out[row[i], offset[i] + t] = values[seq_offsets[i] + t]; everything else ``pad_value``."""
    check_pack(values, seq_offsets, plan)
    out = torch.full((plan.num_rows, plan.row_len), pad_value, dtype=values.dtype, device=values.device)
    if dst is None:
        dst, _ = scatter_index(seq_offsets, plan)
    if dst.numel():
        lo, hi = int(seq_offsets[0]), int(seq_offsets[-1])
        if hi - lo == dst.numel():  # gapless ragged source: the tokens are values[lo:hi] in order, no gather
            src = values[lo:hi]
        else:
            off = seq_offsets.to("cpu", torch.int64)
            seq, idx = _token_index(off[1:] - off[:-1])
            src = values[(off[:-1][seq] + idx).to(values.device)]
        out.view(-1)[dst.to(values.device)] = src
    return out


def position_ids_reference(seq_offsets: torch.Tensor, plan: PackPlan, device: torch.device | str = "cpu",
                           dst: torch.Tensor | None = None, idx: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [num_rows, row_len]: position within the sequence, resetting at every sequence start; 0 on padding."""
    if dst is None or idx is None:
        dst, idx = scatter_index(seq_offsets, plan)
    out = torch.zeros(plan.num_rows, plan.row_len, dtype=torch.int64)
    out.view(-1)[dst] = idx
    return out.to(device)


def cu_seqlens_from_plan(seq_offsets: torch.Tensor, plan: PackPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens int32 [num_rows, max_per_row + 1], sequences per row int64 [num_rows]); see module doc.
    Bookkeeping in numpy (small arrays: one thread, microseconds per op)."""
    off = seq_offsets.to("cpu", torch.int64).numpy()
    lengths = off[1:] - off[:-1]
    row, start = plan.row.to("cpu", torch.int64).numpy(), plan.offset.to("cpu", torch.int64).numpy()
    counts = np.bincount(row, minlength=plan.num_rows).astype(np.int64)
    width = int(counts.max()) if counts.size else 0
    cu = np.zeros((plan.num_rows, width + 1), dtype=np.int64)
    if row.size:
        order = np.argsort(row * (plan.row_len + 1) + start + (lengths > 0), kind="stable")
        r = row[order]
        rank_in_row = np.arange(order.size) - (np.cumsum(counts) - counts)[r]
        cu[r, rank_in_row + 1] = (start + lengths)[order]
        cu = np.maximum.accumulate(cu, axis=1)  # repeat each row's last end into its unused tail
    return torch.from_numpy(cu.astype(np.int32)), torch.from_numpy(counts)
