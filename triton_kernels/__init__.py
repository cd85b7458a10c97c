"""Triton kernels of KnitTrans, one folder each: reference.py (torch), kernel.py (Triton), __init__.py (dispatch).

- ``encoding_hash``: 128-bit content keys of a ragged batch of tensors (mmdedup's keys), CPU == GPU bit for bit.
- ``batched_pack``: ragged per-token fields -> packed micro-batch rows, plus the token-balanced planner.

Importing this package never imports triton; the kernels load on first use of a Triton path.
"""

from .batched_pack import MicrobatchPlan, PackedBatch, PackPlan, batched_pack, pack_field, plan_microbatches
from .encoding_hash import encoding_hash, key_bytes, key_hex, ragged_bytes

__all__ = ["encoding_hash", "key_bytes", "key_hex", "ragged_bytes", "batched_pack", "pack_field",
           "plan_microbatches", "PackPlan", "PackedBatch", "MicrobatchPlan"]
