"""encoding_hash, the readable torch reference: 128-bit content keys for a ragged batch of byte segments.

Why
---
``knittrans.mmdedup`` keys each image encoding by its content so that a GRPO group's n copies of one image are
stored, moved and encoded once. The rollout side (CPU) and the trainer side (GPU) must compute the *same* key
for the same bytes, so this file is the specification and ``kernel.py`` must match it bit for bit.

Construction (a parallel-friendly linear-then-mix hash)
-------------------------------------------------------
A segment is a run of ``n`` bytes, read as signed int8 and zero-padded at the tail to whole *blocks* of
``BLOCK_BYTES`` (4096) bytes.

1. Block sums (linear, exact). Each block ``x`` (4096 int8) is multiplied by a fixed pseudo-random int8 matrix
   ``K`` of shape [4096, 16]: ``v = x @ K``, 16 exact int32 sums (|v| <= 2^26, so no overflow anywhere, in any
   summation order). This is an int8 GEMM: tensor cores on a GPU, VNNI ``torch._int_mm`` on a CPU, and exactly
   reproducible on both. Any change confined to one block changes ``v`` unless the change vector lies in the
   kernel of ``K`` (it cannot for a change of one or two bytes; see the tests).
2. Block mix (non-linear, positional). Each of the 16 lanes of block ``r`` is mixed with its position:
   ``m_j = fmix32(v_j ^ (r * GOLDEN + seed_j))`` (murmur3's finalizer, uint32 arithmetic that wraps).
3. Reduce (order-free). ``c_j = sum_r m_j(r) mod 2^32``: a wrapping sum, so any tree or atomic order on the GPU
   gives the same bits. Addition, not xor, so two equal terms do not cancel.
4. Finalize with the length. The byte length ``n`` (both 32-bit halves) seeds four lanes, each absorbs four of
   the 16 sums through fmix32, and two murmur3-style cross-lane rounds spread every bit over all 128 output bits.

What it promises, and what it does not
--------------------------------------
- Same bytes -> same key, on any device, for any dtype: the hash reads bytes, so an fp32 tensor and a uint8
  view of the same memory hash the same (dtype-agnostic over the same bytes; include the dtype and shape in the
  dedup key if they matter to you).
- Position sensitive (swapping two words changes the key), length sensitive (a zero-padded copy hashes
  differently, because ``n`` is mixed in), and good avalanche (one flipped bit flips ~64 of 128 output bits).
- It is NOT cryptographic: ``K`` and the constants are public, so collisions can be constructed on purpose.
  The encoding store must compare the stored bytes on a hit (as nano-vllm's prefix cache does), so a
  collision costs a miss, never a wrong encoding.

Bytes moved: reads ``n`` bytes per segment (plus the 16 KiB key matrix, cache resident), writes 16 bytes per
segment. Throughput is reported as bytes read + written per second, like a memcpy's.

Example::

    >>> import torch
    >>> buf = torch.arange(10, dtype=torch.uint8)
    >>> keys = encoding_hash_reference(buf, torch.tensor([0, 4, 4, 10]))
    >>> keys.shape, keys.dtype
    (torch.Size([3, 2]), torch.int64)
"""

from __future__ import annotations

import functools

import torch

BLOCK_BYTES = 4096  # bytes per block row; 4096 * 128 * 128 = 2^26 bounds every exact int32 block sum
LANES = 16  # exact sums per block (columns of K); >= 16 so the GPU can use one tensor-core tile
KEY_WORDS = 4  # output lanes of 32 bits: a 128-bit key
MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1  # 2^32 / phi, odd: spreads block positions
FMIX_C1 = 0x85EBCA6B  # murmur3 fmix32 multipliers
FMIX_C2 = 0xC2B2AE35
LANE_SEED = 0x5BD1E995  # seeds the per-lane position offsets: seed_j = fmix32(j + LANE_SEED)
LEN_SEED = 0x27D4EB2F  # seeds the four output lanes: fmix32(k + LEN_SEED)
MATRIX_SEED = 0x165667B1  # K[i, j] = low byte of fmix32(i * LANES + j + MATRIX_SEED), as int8


def _signed(c: int) -> int:
    """A uint32 constant as the int32 value with the same bits (what an int32 tensor op needs)."""
    c &= MASK32
    return c - (1 << 32) if c >= (1 << 31) else c


def wrap32(x: torch.Tensor) -> torch.Tensor:
    """Any integer tensor -> int32 with the same low 32 bits (exact; no reliance on overflow behaviour)."""
    x = x.to(torch.int64) & MASK32
    return torch.where(x >= (1 << 31), x - (1 << 32), x).to(torch.int32)


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int32 tensors read as uint32.

    int32 multiply wraps mod 2^32 in two's complement, giving the same bits as the uint32 product (torch's CPU and
    CUDA kernels wrap; ``tests/unit/test_kernel_encoding_hash.py`` checks this against pure-Python integers).
    Right shifts of int32 are arithmetic, so each logical shift is masked to the bits a uint32 shift keeps."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _signed(FMIX_C1)
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * _signed(FMIX_C2)
    return x ^ ((x >> 16) & 0xFFFF)


def _fmix32_int(x: int) -> int:
    x &= MASK32
    x ^= x >> 16
    x = (x * FMIX_C1) & MASK32
    x ^= x >> 13
    x = (x * FMIX_C2) & MASK32
    return x ^ (x >> 16)


def lane_seeds() -> list[int]:
    """seed_j for the 16 block lanes (the kernel computes the same values in-register)."""
    return [_fmix32_int(j + LANE_SEED) for j in range(LANES)]


@functools.lru_cache(maxsize=8)
def mixing_matrix(device: str = "cpu") -> torch.Tensor:
    """The fixed int8 matrix K [BLOCK_BYTES, LANES]: low bytes of fmix32 of a counter (no RNG library involved,
    so it never changes with a numpy or torch version)."""
    idx = wrap32(torch.arange(BLOCK_BYTES * LANES, dtype=torch.int64) + MATRIX_SEED)
    low = fmix32(idx) & 0xFF
    k = torch.where(low >= 128, low - 256, low).to(torch.int8).view(BLOCK_BYTES, LANES)
    return k.to(device)


def check_segments(buf: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a ragged byte batch and return (flat uint8 view of buf, offsets as CPU int64).

    ``buf``: any dtype, contiguous (a non-contiguous tensor is rejected, not silently copied: the caller decides
    whether a copy is acceptable). ``offsets``: 1-D integer tensor of byte offsets, length num_segments + 1,
    non-decreasing, offsets[0] >= 0 and offsets[-1] <= buf's byte size; segment s is bytes
    [offsets[s], offsets[s+1])."""
    if not isinstance(buf, torch.Tensor) or not isinstance(offsets, torch.Tensor):
        raise TypeError(f"buf and offsets must be torch.Tensors, got {type(buf).__name__}, {type(offsets).__name__}")
    if not buf.is_contiguous():
        raise ValueError("buf must be contiguous (hashing reads raw bytes); call .contiguous() first, or pass a list "
                         "of tensors to encoding_hash, which copies each one into a contiguous buffer")
    if offsets.dtype not in (torch.int64, torch.int32) or offsets.dim() != 1 or offsets.numel() < 1:
        raise TypeError(f"offsets must be a 1-D int64/int32 tensor of num_segments + 1 byte offsets, got "
                        f"dtype={offsets.dtype}, shape={tuple(offsets.shape)}")
    flat = buf.reshape(-1).view(torch.uint8) if buf.numel() else buf.new_empty(0, dtype=torch.uint8)
    off = offsets.to("cpu", torch.int64)
    if off.numel() > 1 and bool((off[1:] < off[:-1]).any()):
        raise ValueError("offsets must be non-decreasing (segment lengths cannot be negative)")
    if int(off[0]) < 0 or int(off[-1]) > flat.numel():
        raise ValueError(f"offsets out of range: segments span [{int(off[0])}, {int(off[-1])}) but buf has "
                         f"{flat.numel()} bytes")
    return flat, off


def _block_sums(rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Exact int32 [m, LANES] = rows (int8 [m, w]) @ K[:w]. torch._int_mm where it runs (VNNI on CPU,
    cuBLASLt on GPU), else an exact float64 matmul (every partial sum is an integer below 2^53)."""
    if rows.shape[0] == 0:
        return torch.zeros(0, LANES, dtype=torch.int32, device=rows.device)
    if hasattr(torch, "_int_mm") and (rows.device.type == "cpu" or rows.shape[0] > 16):
        try:
            return torch._int_mm(rows, k)
        except RuntimeError:  # pragma: no cover - backend without int8 GEMM
            pass
    return (rows.to(torch.float64) @ k.to(torch.float64)).to(torch.int32)


def _segment_rows(flat: torch.Tensor, off: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    """Block sums of every block of every segment: (v int32 [rows, LANES], segment id [rows], row-in-segment)."""
    lengths = off[1:] - off[:-1]
    sums, seg_ids, row_ids = [], [], []
    data = flat.view(torch.int8)
    # Whole blocks read straight from buf (no copy): one int8 GEMM per segment that has any.
    for s in torch.nonzero(lengths >= BLOCK_BYTES).flatten().tolist():
        start, full = int(off[s]), int(lengths[s]) // BLOCK_BYTES
        sums.append(_block_sums(data[start:start + full * BLOCK_BYTES].view(full, BLOCK_BYTES), k))
        seg_ids.append(torch.full((full,), s, dtype=torch.int64))
        row_ids.append(torch.arange(full, dtype=torch.int64))
    # Tails (the last partial block of each segment), zero-padded into one matrix: one GEMM for all of them.
    tail_len = lengths % BLOCK_BYTES
    tail_segs = torch.nonzero(tail_len > 0).flatten()
    if tail_segs.numel():
        tl_len = tail_len[tail_segs]
        tail_start = off[tail_segs] + lengths[tail_segs] - tl_len
        which = torch.repeat_interleave(torch.arange(tail_segs.numel()), tl_len)
        col = torch.arange(int(tl_len.sum())) - torch.repeat_interleave(torch.cumsum(tl_len, 0) - tl_len, tl_len)
        # Only as wide as the longest tail (rounded to 32): the zero columns beyond it would add nothing.
        width = min(BLOCK_BYTES, -(-int(tl_len.max()) // 32) * 32)
        tails = torch.zeros(tail_segs.numel(), width, dtype=torch.int8, device=flat.device)
        src = (tail_start[which] + col).to(flat.device)
        tails[which.to(flat.device), col.to(flat.device)] = data[src]
        sums.append(_block_sums(tails, k[:width].contiguous()))
        seg_ids.append(tail_segs)
        row_ids.append(lengths[tail_segs] // BLOCK_BYTES)
    if not sums:
        empty = torch.zeros(0, dtype=torch.int64)
        return torch.zeros(0, LANES, dtype=torch.int32, device=flat.device), empty, empty
    return torch.cat(sums), torch.cat(seg_ids), torch.cat(row_ids)


def block_mix(v: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Step 2: m_j = fmix32(v_j ^ (row * GOLDEN + seed_j)) on int32 [rows, LANES] (uint32 bits)."""
    seeds = wrap32(torch.tensor(lane_seeds(), dtype=torch.int64)).to(v.device)
    pos = wrap32(row).to(v.device)[:, None] * _signed(GOLDEN) + seeds[None, :]
    return fmix32(v ^ pos)


def len_seeds() -> list[int]:
    """Seeds of the four output lanes: fmix32(k + LEN_SEED)."""
    return [_fmix32_int(k + LEN_SEED) for k in range(KEY_WORDS)]


def finalize(c: torch.Tensor, nbytes: torch.Tensor) -> torch.Tensor:
    """Step 4: lane sums c (int32 [S, LANES], uint32 bits) and byte lengths (int64 [S]) -> int32 [S, 4].

    Output lane k starts from the length (both halves) and absorbs block lanes k, k+4, k+8, k+12 through fmix32;
    then two murmur3_x86_128-style cross-lane rounds make every output bit depend on every lane."""
    lo, hi = wrap32(nbytes)[:, None], wrap32(nbytes >> 32)[:, None]
    seeds = wrap32(torch.tensor(len_seeds(), dtype=torch.int64)).to(c.device)
    h = fmix32(fmix32(lo ^ seeds[None, :]) ^ hi)  # [S, 4]
    for t in range(LANES // KEY_WORDS):
        h = fmix32(h ^ c[:, t * KEY_WORDS:(t + 1) * KEY_WORDS])
    for _ in range(2):
        h0 = wrap32(h.to(torch.int64).sum(1))[:, None]  # h0 + h1 + h2 + h3
        h = fmix32(torch.cat([h0, h[:, 1:] + h0], dim=1))  # h_k += h0 for k > 0
    return h


def encoding_hash_reference(buf: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """128-bit keys of the byte segments of ``buf``: int64 [num_segments, 2] (the four uint32 lanes, little-endian).

    Runs on any device; the result is on ``buf``'s device."""
    flat, off = check_segments(buf, offsets)
    num_segments = off.numel() - 1
    k = mixing_matrix(str(flat.device))
    v, seg, row = _segment_rows(flat, off, k)
    mixed = block_mix(v, row)
    c = torch.zeros(num_segments, LANES, dtype=torch.int64, device=flat.device)
    if seg.numel() == mixed.shape[0] and num_segments == 1:
        c[0] = (mixed.to(torch.int64) & MASK32).sum(0)  # one segment: a plain column sum
    else:
        c.index_add_(0, seg.to(flat.device), mixed.to(torch.int64) & MASK32)  # exact: < 2^31 rows < 2^32 each
    lengths = (off[1:] - off[:-1]).to(flat.device)
    return finalize(wrap32(c), lengths).view(torch.int64)
