"""Deterministic checks of the kernels, as counts: the kernels table logs them and its CI gate decides on them.

Each check runs the product's dispatch (``encoding_hash``, ``batched_pack``) on small awkward inputs and counts
what differs from the specification, bit for bit: the Triton kernels against the torch references (on CPU under
Triton's interpreter: ask ``backend.triton_unavailable`` first), the torch pack path against the per-token scatter
(``pack_field_reference``, ``position_ids_reference``), and the hash's length sensitivity (segments and their
zero-padded copies must not collide). The tests in tests/unit and tests/equivalence cover more cases; these are
the ones a table run and the gate repeat on every run.

Example::

    >>> hash_pad_collisions().mismatches
    0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batched_pack import (PackBuffers, PackedBatch, batched_pack, cu_seqlens_from_plan, pack_field_reference,
                           plan_microbatches, position_ids_reference)
from .encoding_hash import BLOCK_BYTES, encoding_hash


@dataclass(frozen=True)
class CheckResult:
    cases: int
    mismatches: int
    detail: str = ""


HASH_SIZES = (0, 1, 2, 5, 31, 33, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 0, 3 * BLOCK_BYTES + 7)
PACK_LENGTHS = (0, 1, 7, 16, 3, 0, 11, 16, 1, 250, 255, 64)  # empty, single, odd, a full row (budget 256)
PACK_PADS = {"input_ids": -1, "old_logprobs": float("nan"), "advantages": 0.0, "loss_mask": False}


def hash_kernel_vs_reference(device: torch.device, seed: int = 0) -> CheckResult:
    """Keys of the Triton kernel on ``device`` vs the torch reference on CPU, segments of ``HASH_SIZES`` bytes
    starting at an unaligned address."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (sum(HASH_SIZES) + 5,), dtype=torch.uint8, generator=g)[5:]
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(HASH_SIZES), 0)])
    ref = encoding_hash(buf, off, impl="reference")
    tri = encoding_hash(buf.to(device), off.to(device), impl="triton").cpu()
    return CheckResult(len(HASH_SIZES), int((ref != tri).any(dim=1).sum()), f"segments of {list(HASH_SIZES)} bytes")


def pack_case(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor, object]:
    """Four RL fields (int64, fp32 with NaN pads, fp32, bool) of ``PACK_LENGTHS`` sequences and a 2-rank plan with
    256-token rows (empty and one-token sequences, a full row)."""
    g = torch.Generator().manual_seed(seed)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(PACK_LENGTHS), 0)])
    t = int(off[-1])
    fields = {"input_ids": torch.randint(0, 150000, (t,), generator=g), "old_logprobs": torch.randn(t, generator=g),
              "advantages": torch.randn(t, generator=g), "loss_mask": torch.rand(t, generator=g) > 0.3}
    plan = plan_microbatches(list(PACK_LENGTHS), num_ranks=2, max_tokens_per_microbatch=256, method="kk").pack
    return fields, off, plan


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def _pack_mismatches(got: PackedBatch, fields: dict[str, torch.Tensor], off: torch.Tensor, plan) -> int:
    """Outputs (each field, position_ids, cu_seqlens, seq_counts) that differ bit for bit from the specification."""
    want = {name: pack_field_reference(v, off, plan, PACK_PADS[name]) for name, v in fields.items()}
    cu, counts = cu_seqlens_from_plan(off, plan)
    bad = sum(not torch.equal(_bits(got.fields[n]), _bits(w)) for n, w in want.items())
    bad += not torch.equal(got.position_ids.cpu(), position_ids_reference(off, plan))
    return bad + (not torch.equal(got.cu_seqlens.cpu(), cu)) + (not torch.equal(got.seq_counts.cpu(), counts))


def pack_kernel_vs_spec(device: torch.device, seed: int = 0) -> CheckResult:
    """The Triton pack on ``device`` (fresh outputs) vs the per-token scatter specification."""
    fields, off, plan = pack_case(seed)
    got = batched_pack({k: v.to(device) for k, v in fields.items()}, off.to(device), plan, PACK_PADS, impl="triton")
    return CheckResult(len(fields) + 3, _pack_mismatches(got, fields, off, plan),
                       f"{len(PACK_LENGTHS)} sequences, {plan.num_rows} rows of {plan.row_len}")


def pack_path_vs_spec(device: torch.device, seed: int = 0) -> CheckResult:
    """The torch pack path on ``device`` vs the per-token scatter specification, into fresh outputs and into
    ``PackBuffers`` full of random bytes (nothing a reused buffer held may survive, pads included)."""
    fields, off, plan = pack_case(seed)
    dev = {k: v.to(device) for k, v in fields.items()}
    bufs = PackBuffers()
    g = torch.Generator().manual_seed(seed + 1)
    for buf in [*(bufs.field(k, plan, v.dtype, device) for k, v in fields.items()), bufs.position_ids(plan, device)]:
        raw = buf.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))
    bad = sum(_pack_mismatches(batched_pack(dev, off.to(device), plan, PACK_PADS, impl="reference", out=out),
                               fields, off, plan) for out in (None, bufs))
    return CheckResult(2 * (len(fields) + 3), bad, "fresh outputs and PackBuffers full of random bytes")


def hash_pad_collisions(seed: int = 0) -> CheckResult:
    """Keys (by the dispatch: the reference on CPU) of segments, their copies padded with 1 and 4 zero bytes, and
    an empty segment; counts keys that equal another's."""
    g = torch.Generator().manual_seed(seed)
    segs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (1, 3, 64, 1000, BLOCK_BYTES - 1,
                                                                                  BLOCK_BYTES, BLOCK_BYTES + 1)]
    padded = [torch.cat([s, torch.zeros(k, dtype=torch.uint8)]) for s in segs for k in (1, 4)]
    keys = encoding_hash(segs + padded + [torch.zeros(0, dtype=torch.uint8)]).tolist()
    return CheckResult(len(keys), len(keys) - len({tuple(k) for k in keys}), "originals, +1 and +4 zero bytes, empty")
