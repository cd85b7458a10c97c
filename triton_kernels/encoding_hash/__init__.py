"""encoding_hash: 128-bit content keys for a ragged batch of tensors, identical on CPU and GPU.

Dispatch: ``impl="auto"`` runs the Triton kernel for CUDA tensors and the torch reference otherwise;
``impl="triton"`` / ``impl="reference"`` force one (nanochat's switch). Forcing "triton" on a CPU tensor works
only under ``TRITON_INTERPRET=1`` (Triton's interpreter, used by the tests).

Example::

    >>> import torch
    >>> keys = encoding_hash([torch.zeros(3, 4), torch.ones(2, dtype=torch.uint8)])
    >>> keys.shape
    torch.Size([2, 2])
    >>> len(key_hex(keys[0]))
    32
"""

from __future__ import annotations

import os
import struct
from typing import Literal, Sequence

import torch

from ..traffic import Traffic
from .reference import BLOCK_BYTES, KEY_WORDS, encoding_hash_reference

Impl = Literal["auto", "triton", "reference"]

__all__ = ["encoding_hash", "encoding_hash_reference", "ragged_bytes", "key_bytes", "key_hex", "resolve_impl",
           "hash_traffic", "BLOCK_BYTES"]


def resolve_impl(impl: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "reference" elsewhere; a forced "triton" on CPU needs TRITON_INTERPRET=1."""
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"impl='triton' on a {device.type} tensor needs Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is first imported (or use impl='reference')")
    return impl


def ragged_bytes(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the bytes of ``tensors`` (each made contiguous: a copy if it was not) into one uint8 buffer.

    Returns (buf uint8 [total_bytes] on the first tensor's device, offsets int64 [len(tensors) + 1])."""
    if not tensors:
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError("all tensors must be on the same device")
    parts = [t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else
             torch.zeros(0, dtype=torch.uint8, device=device) for t in tensors]
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
    return torch.cat(parts), offsets


def encoding_hash(data: torch.Tensor | Sequence[torch.Tensor], offsets: torch.Tensor | None = None, *,
                  impl: Impl = "auto") -> torch.Tensor:
    """128-bit keys, int64 [num_segments, 2], on ``data``'s device.

    ``data`` is either one contiguous tensor of any dtype with ``offsets`` (int64 byte offsets, num_segments + 1
    of them), or a list of tensors (one key each; offsets must then be None). A non-contiguous ``data`` tensor
    is rejected with a ValueError; list items are copied to contiguous memory. Keys depend only on the bytes
    (not dtype or shape) and on their count; see ``reference.py`` for the construction and its guarantees."""
    if isinstance(data, (list, tuple)):
        if offsets is not None:
            raise TypeError("pass offsets only with a single flat tensor, not with a list of tensors")
        data, offsets = ragged_bytes(data)
    if offsets is None:
        raise TypeError("offsets is required with a single tensor (or pass a list of tensors)")
    which = resolve_impl(impl, data.device)
    if which == "reference":
        return encoding_hash_reference(data, offsets)
    from .kernel import encoding_hash_triton  # lazy: the reference path never needs triton

    return encoding_hash_triton(data, offsets.to(torch.int64))


def key_bytes(key: torch.Tensor) -> bytes:
    """One key (int64 [2]) as 16 little-endian bytes: a hashable dict key."""
    if key.shape != (2,) or key.dtype != torch.int64:
        raise TypeError(f"a key is an int64 tensor of shape (2,), got {key.dtype} {tuple(key.shape)}")
    return struct.pack("<qq", *key.tolist())


def key_hex(key: torch.Tensor) -> str:
    """One key as 32 hex digits (the 16 little-endian bytes)."""
    return key_bytes(key).hex()


def hash_traffic(offsets: torch.Tensor) -> Traffic:
    """The bytes ``encoding_hash(buf, offsets)`` must move: reads every segment byte once and the int64 offsets
    (8 bytes each); writes one 16-byte key per segment. The 64 KiB mixing matrix is cache resident and not counted,
    nor is the reference's staging copy of segment tails (implementation traffic, not the op's).

    >>> hash_traffic(torch.tensor([0, 4096, 4100]))
    Traffic(read=4124, written=32)
    """
    off = offsets.to("cpu", torch.int64)
    if off.dim() != 1 or off.numel() < 1:
        raise ValueError(f"offsets must be 1-D with num_segments + 1 entries, got shape {tuple(off.shape)}")
    segments = off.numel() - 1
    return Traffic(read=int(off[-1] - off[0]) + 8 * off.numel(), written=4 * KEY_WORDS * segments)
