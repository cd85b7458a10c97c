"""PackBuffers: output buffers that ``batched_pack(..., out=buffers)`` reuses from one training step to the next.

Why
---
A fresh output lands on freshly mapped pages, and on a CPU the first write to each 4 KiB page faults: for the
~27 MB of outputs of a 1M-token batch (4 fields + position_ids, 25 bytes per slot) that is ~11 ms, more than the
copies themselves, while a memcpy into an already-touched buffer pays none of it. A trainer packs every step
into buffers of the same (or nearly the same) shape, so it can keep them. On a GPU the caching allocator already
recycles freed blocks; reuse there saves only the allocator call.

One flat buffer per (field name, dtype, device), grown to the largest shape asked for (the number of micro-batches,
hence of rows, changes from step to step); each call hands out a contiguous [num_rows, row_len] view of its first
num_rows * row_len elements. The name is part of the key because two fields of one dtype (old log-probs and
advantages) need two buffers; ``position_ids`` has its own slot, so a field may be called "position_ids" too.

Contract: every call hands out the same memory, so the batch packed at step k is overwritten by the call at step
k + 1: consume it (or ``.clone()`` what you keep) before packing the next one. Every element of a handed-out
buffer is rewritten by the pack (pads included), so stale data never leaks.

Example::

    >>> import torch
    >>> from triton_kernels.batched_pack import batched_pack, plan_microbatches
    >>> bufs = PackBuffers()
    >>> plan = plan_microbatches([3, 2, 2], num_ranks=1, max_tokens_per_microbatch=4).pack
    >>> off = torch.tensor([0, 3, 5, 7])
    >>> a = batched_pack({"ids": torch.arange(7)}, off, plan, out=bufs)
    >>> a_ptr = a.fields["ids"].data_ptr()
    >>> b = batched_pack({"ids": torch.arange(7) + 10}, off, plan, out=bufs)  # a's memory, rewritten
    >>> b.fields["ids"].data_ptr() == a_ptr, b.fields["ids"].tolist()
    (True, [[13, 14, 15, 16], [10, 11, 12, 0]])
"""

from __future__ import annotations

import torch

from .reference import PackPlan

_POSITION_IDS = object()  # position_ids' key: distinct from every field name


class PackBuffers:
    """Reusable outputs for ``batched_pack(..., out=self)``; see the module doc for the contract."""

    def __init__(self) -> None:
        self._flat: dict[tuple[object, torch.dtype, torch.device], torch.Tensor] = {}

    def field(self, name: str, plan: PackPlan, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The [num_rows, row_len] buffer of field ``name``: the memory handed out last time when big enough."""
        return self._view(name, plan, dtype, torch.device(device))

    def position_ids(self, plan: PackPlan, device: torch.device | str) -> torch.Tensor:
        """The int64 [num_rows, row_len] position_ids buffer."""
        return self._view(_POSITION_IDS, plan, torch.int64, torch.device(device))

    @property
    def nbytes(self) -> int:
        """Bytes held (the largest buffer of every key)."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())

    def clear(self) -> None:
        """Drop every buffer (memory returns once no handed-out view is alive)."""
        self._flat.clear()

    def _view(self, key: object, plan: PackPlan, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" must find the same buffer
            device = torch.device("cuda", torch.cuda.current_device())
        n = plan.num_rows * plan.row_len
        flat = self._flat.get((key, dtype, device))
        if flat is None or flat.numel() < n:
            flat = torch.empty(n, dtype=dtype, device=device)
            self._flat[(key, dtype, device)] = flat
        return flat[:n].view(plan.num_rows, plan.row_len)
