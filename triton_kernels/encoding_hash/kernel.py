"""encoding_hash, the Triton kernel: the same 128-bit keys as ``reference.py``, bit for bit, in two launches.

Launch 1 (``_block_kernel``): one program per (segment, run of BLOCK_M blocks). It loads BLOCK_M x 4096 bytes
as int8 tiles, multiplies them by the key matrix K with ``tl.dot`` (int8 x int8 -> exact int32: tensor cores on
a GPU), mixes each block's 16 sums with its position (fmix32, wrapping uint32), sums them over its blocks and
atomically adds the 16 partial sums into the segment's int64 accumulator. Integer addition is associative, so
the result does not depend on which program adds first: the keys are deterministic.
Launch 2 (``_finalize_kernel``): BLOCK_S segments per program, mixes the 16 sums and the length into 4 lanes.

Bytes moved: reads every input byte once (K stays in L1/L2), writes 16 bytes per segment (plus 128 B of
accumulator traffic per program). The number of launches does not grow with the number of segments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import BLOCK_BYTES, GOLDEN, KEY_WORDS, LANE_SEED, LANES, LEN_SEED, check_segments, mixing_matrix


@triton.jit
def _fmix32(x):
    """murmur3 fmix32 on uint32 (multiplies wrap mod 2^32, shifts are logical)."""
    x ^= x >> 16
    x = x * 0x85EBCA6B
    x ^= x >> 13
    x = x * 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def _block_kernel(data_ptr, keys_ptr, prog_seg_ptr, prog_row0_ptr, seg_start_ptr, seg_len_ptr, acc_ptr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_BYTES: tl.constexpr, LANES: tl.constexpr,
                  GOLDEN: tl.constexpr, LANE_SEED: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.load(prog_seg_ptr + pid)
    row0 = tl.load(prog_row0_ptr + pid)
    start = tl.load(seg_start_ptr + seg)
    n = tl.load(seg_len_ptr + seg)
    rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)  # block index within the segment
    cols = tl.arange(0, BLOCK_K)
    lanes = tl.arange(0, LANES)
    acc = tl.zeros((BLOCK_M, LANES), dtype=tl.int32)
    for kk in range(0, BLOCK_BYTES, BLOCK_K):
        byte = rows[:, None] * BLOCK_BYTES + kk + cols[None, :]
        x = tl.load(data_ptr + start + byte, mask=byte < n, other=0)  # zero-padded tail: adds nothing
        k = tl.load(keys_ptr + (kk + cols)[:, None] * LANES + lanes[None, :])
        acc = tl.dot(x, k, acc)  # exact: |sum| <= 4096 * 128 * 128 = 2^26
    seeds = _fmix32(lanes.to(tl.uint32) + tl.full((LANES,), LANE_SEED, tl.uint32))
    pos = rows.to(tl.uint32)[:, None] * tl.full((1, 1), GOLDEN, tl.uint32) + seeds[None, :]
    m = _fmix32(acc.to(tl.uint32, bitcast=True) ^ pos)
    valid = rows * BLOCK_BYTES < n  # blocks past the segment's last byte do not exist
    part = tl.sum(tl.where(valid[:, None], m.to(tl.uint64), 0), axis=0)  # <= BLOCK_M * 2^32: no wrap
    tl.atomic_add(acc_ptr + seg * LANES + lanes, part.to(tl.int64, bitcast=True))


@triton.jit
def _absorb(h, acc_ptr, s, mask, K: tl.constexpr, LANES: tl.constexpr, KEY_WORDS: tl.constexpr):
    """Output lane K absorbs block lanes K, K+4, K+8, K+12 (as reference.finalize)."""
    for t in tl.static_range(LANES // KEY_WORDS):
        c = tl.load(acc_ptr + s * LANES + (t * KEY_WORDS + K), mask=mask, other=0)
        h = _fmix32(h ^ c.to(tl.uint32))  # int64 -> uint32 keeps the low 32 bits: the sum mod 2^32
    return h


@triton.jit
def _start_lane(lo, hi, K: tl.constexpr, LEN_SEED: tl.constexpr):
    seed = _fmix32(tl.full(lo.shape, K + LEN_SEED, tl.uint32))
    return _fmix32(_fmix32(lo ^ seed) ^ hi)


@triton.jit
def _finalize_kernel(acc_ptr, seg_len_ptr, out_ptr, num_segments, BLOCK_S: tl.constexpr, LANES: tl.constexpr,
                     KEY_WORDS: tl.constexpr, LEN_SEED: tl.constexpr):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    mask = s < num_segments
    n = tl.load(seg_len_ptr + s, mask=mask, other=0)
    lo = n.to(tl.uint32)
    hi = (n >> 32).to(tl.uint32)
    h0 = _absorb(_start_lane(lo, hi, 0, LEN_SEED), acc_ptr, s, mask, 0, LANES, KEY_WORDS)
    h1 = _absorb(_start_lane(lo, hi, 1, LEN_SEED), acc_ptr, s, mask, 1, LANES, KEY_WORDS)
    h2 = _absorb(_start_lane(lo, hi, 2, LEN_SEED), acc_ptr, s, mask, 2, LANES, KEY_WORDS)
    h3 = _absorb(_start_lane(lo, hi, 3, LEN_SEED), acc_ptr, s, mask, 3, LANES, KEY_WORDS)
    for _ in tl.static_range(2):
        h0 = h0 + h1 + h2 + h3
        h1 = _fmix32(h1 + h0)
        h2 = _fmix32(h2 + h0)
        h3 = _fmix32(h3 + h0)
        h0 = _fmix32(h0)
    tl.store(out_ptr + s * KEY_WORDS + 0, h0.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + s * KEY_WORDS + 1, h1.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + s * KEY_WORDS + 2, h2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + s * KEY_WORDS + 3, h3.to(tl.int32, bitcast=True), mask=mask)


def encoding_hash_triton(buf: torch.Tensor, offsets: torch.Tensor, block_m: int = 16, block_k: int = 256,
                         block_s: int = 128) -> torch.Tensor:
    """Host wrapper: validates like the reference, plans the programs, launches the two kernels.

    ``buf`` must live where Triton runs (CUDA, or CPU under TRITON_INTERPRET=1). ``block_m`` (>= 16, a power of
    two) and ``block_k`` (a power of two dividing 4096) change speed, never the keys."""
    flat, off = check_segments(buf, offsets)
    if block_m < 16 or block_m & (block_m - 1) or BLOCK_BYTES % block_k or block_k < 32:
        raise ValueError(f"block_m must be a power of two >= 16 and block_k a power of two >= 32 dividing "
                         f"{BLOCK_BYTES}; got block_m={block_m}, block_k={block_k}")
    device = flat.device
    num_segments = off.numel() - 1
    out = torch.empty(num_segments, KEY_WORDS, dtype=torch.int32, device=device)
    if num_segments == 0:
        return out.view(torch.int64)
    lengths = off[1:] - off[:-1]
    blocks = (lengths + BLOCK_BYTES - 1) // BLOCK_BYTES
    progs = (blocks + block_m - 1) // block_m
    num_progs = int(progs.sum())
    first = torch.cumsum(progs, 0) - progs
    prog_seg = torch.repeat_interleave(torch.arange(num_segments), progs)
    prog_row0 = (torch.arange(num_progs) - first[prog_seg]) * block_m
    acc = torch.zeros(num_segments, LANES, dtype=torch.int64, device=device)
    seg_start, seg_len = off[:-1].to(device), lengths.to(device)
    data = flat.view(torch.int8) if flat.numel() else torch.zeros(1, dtype=torch.int8, device=device)
    if num_progs:
        _block_kernel[(num_progs,)](data, mixing_matrix(str(device)), prog_seg.to(device), prog_row0.to(device),
                                    seg_start, seg_len, acc, BLOCK_M=block_m, BLOCK_K=block_k,
                                    BLOCK_BYTES=BLOCK_BYTES, LANES=LANES, GOLDEN=GOLDEN, LANE_SEED=LANE_SEED)
    _finalize_kernel[(triton.cdiv(num_segments, block_s),)](acc, seg_len, out, num_segments, BLOCK_S=block_s,
                                                           LANES=LANES, KEY_WORDS=KEY_WORDS, LEN_SEED=LEN_SEED)
    return out.view(torch.int64)
