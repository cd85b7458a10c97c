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
from typing import NamedTuple

import numpy as np
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


@functools.cache
def cpu_has_int8_dot() -> bool:
    """Whether this CPU has an int8 dot-product instruction (AVX512-VNNI, AVX-VNNI or AMX), which
    ``torch._int_mm`` uses; without one torch's int8 GEMM is a slow scalar loop (measured on an AVX2-only EPYC:
    0.04 GB/s, slower than the float paths below)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:  # pragma: no cover - not Linux: assume a modern CPU
        return True
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


F32_EXACT_WIDTH = 1024  # 1024 * 128 * 128 = 2^24: every fp32 partial sum of a chunk this wide is an exact integer


def block_sums_f32(rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Exact int32 rows @ K on a float32 GEMM: K is split into chunks of ``F32_EXACT_WIDTH`` rows, whose dot
    products (|x| <= 2^24) fp32 holds exactly in any summation order; the chunk sums add in int32."""
    m, w = rows.shape
    out = torch.zeros(m, LANES, dtype=torch.int32, device=rows.device)
    for c in range(0, w, F32_EXACT_WIDTH):
        out += (rows[:, c:c + F32_EXACT_WIDTH].float() @ k[c:c + F32_EXACT_WIDTH].float()).to(torch.int32)
    return out


def _block_sums(rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Exact int32 [m, LANES] = rows (int8 [m, w]) @ K[:w]. torch._int_mm where it is fast (an int8 dot-product CPU,
    cuBLASLt on GPU), else the exact chunked float32 GEMM (``block_sums_f32``)."""
    if rows.shape[0] == 0:
        return torch.zeros(0, LANES, dtype=torch.int32, device=rows.device)
    fast_int8 = cpu_has_int8_dot() if rows.device.type == "cpu" else rows.shape[0] > 16
    if fast_int8 and hasattr(torch, "_int_mm"):
        try:
            return torch._int_mm(rows, k)
        except RuntimeError:  # pragma: no cover - backend without int8 GEMM
            pass
    return block_sums_f32(rows, k)


STREAM_MIN_BLOCKS = 64  # a run of >= 64 whole blocks (256 KiB) is read in place; shorter ones are gathered


def _stream_runs(lengths: torch.Tensor, min_blocks: int) -> list[tuple[int, int, int]]:
    """Maximal runs of segments whose whole blocks lie back to back in ``buf``: (first segment, last segment,
    whole blocks). Segments are adjacent byte ranges, so the whole blocks of segments a..b form one block-aligned
    range starting at off[a] exactly when none of a..b-1 has a tail; such a range is a zero-copy [rows, 4096]
    view (one GEMM for the run). Runs with fewer than ``min_blocks`` blocks are left to the gather."""
    if lengths.numel() == 0:
        return []
    has_tail = (lengths % BLOCK_BYTES > 0).to(torch.int64)
    run = torch.cumsum(has_tail, 0) - has_tail  # a run ends at (and includes) each segment with a tail
    blocks = torch.zeros(int(run[-1]) + 1, dtype=torch.int64).index_add_(0, run, lengths // BLOCK_BYTES)
    first = torch.nonzero(torch.diff(run, prepend=run[:1] - 1)).flatten()
    last = torch.cat([first[1:] - 1, torch.tensor([lengths.numel() - 1])])
    keep = torch.nonzero(blocks >= max(1, min_blocks)).flatten()
    return list(zip(first[keep].tolist(), last[keep].tolist(), blocks[keep].tolist()))


def _gather_padded(data: torch.Tensor, starts: list[int], sizes: list[int], width: int) -> torch.Tensor:
    """Byte ranges data[start:start+size], each zero-padded to whole rows of ``width``, stacked as int8
    [rows, width]: one ``torch.cat`` into the output (each byte copied once, the padding written once)."""
    rows = sum(-(-n // width) for n in sizes)
    out = torch.empty(rows * width, dtype=torch.int8, device=data.device)
    zeros = torch.zeros(width, dtype=torch.int8, device=data.device)
    pieces = []
    for start, n in zip(starts, sizes):
        pieces.append(data[start:start + n])
        if n % width:
            pieces.append(zeros[:width - n % width])
    torch.cat(pieces, out=out)
    return out.view(rows, width)


class BlockSums(NamedTuple):
    """Block sums of some blocks: row i of ``v`` is block row[i] of segment seg[i]."""

    v: torch.Tensor  # int32 [rows, LANES]
    seg: torch.Tensor  # int64 [rows], CPU
    row: torch.Tensor  # int64 [rows], CPU


def _label_rows(v: torch.Tensor, seg: torch.Tensor, rows: torch.Tensor, first: torch.Tensor) -> BlockSums:
    """Rows of ``v`` come in groups: rows[g] rows that are blocks first[g], first[g] + 1, ... of segment seg[g].
    Index bookkeeping in numpy: single-threaded, so no thread barrier per op (16 bytes per 4 KiB block)."""
    seg, rows, first = seg.numpy(), rows.numpy(), first.numpy()
    start = np.cumsum(rows) - rows
    row = np.arange(int(rows.sum()), dtype=np.int64) - np.repeat(start - first, rows)
    return BlockSums(v, torch.from_numpy(np.repeat(seg, rows)), torch.from_numpy(row))


def block_sums(flat: torch.Tensor, off: torch.Tensor, k: torch.Tensor,
               min_stream_blocks: int = STREAM_MIN_BLOCKS) -> list[BlockSums]:
    """Step 1 for every block of every segment, by two routes to the same sums (the row order differs, which the
    order-free reduce ignores):

    - streamed: each run of at least ``min_stream_blocks`` whole blocks is multiplied in place (zero copies,
      one GEMM per run);
    - gathered: everything else (the tails, short segments) is copied once into a zero-padded matrix, one GEMM.
      When every piece fits one block, the matrix is only as wide as the longest piece (rounded to 32): the zero
      columns beyond it would add nothing."""
    lengths = off[1:] - off[:-1]
    full = lengths // BLOCK_BYTES
    data = flat.view(torch.int8)
    out = []
    streamed = torch.zeros(lengths.numel(), dtype=torch.bool)  # whole blocks already summed in place
    for first, last, blocks in _stream_runs(lengths, min_stream_blocks):
        start = int(off[first])
        v = _block_sums(data[start:start + blocks * BLOCK_BYTES].view(blocks, BLOCK_BYTES), k)
        out.append(_label_rows(v, torch.arange(first, last + 1), full[first:last + 1],
                               torch.zeros(last + 1 - first, dtype=torch.int64)))
        streamed[first:last + 1] = True
    # Gathered pieces: the tail of a streamed segment, or all of any other non-empty segment.
    skip = torch.where(streamed, full * BLOCK_BYTES, 0)
    size = lengths - skip
    segs = torch.nonzero(size > 0).flatten()
    if segs.numel():
        sizes = size[segs]
        longest = int(sizes.max())
        width = BLOCK_BYTES if longest > BLOCK_BYTES else min(BLOCK_BYTES, -(-longest // 32) * 32)
        v = _block_sums(_gather_padded(data, (off[segs] + skip[segs]).tolist(), sizes.tolist(), width),
                        k[:width].contiguous())
        out.append(_label_rows(v, segs, -(-sizes // width), skip[segs] // BLOCK_BYTES))  # a tail is block full[s]
    return out


def block_mix(v: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Step 2: m_j = fmix32(v_j ^ (row * GOLDEN + seed_j)) on int32 [rows, LANES] (uint32 bits)."""
    seeds = wrap32(torch.tensor(lane_seeds(), dtype=torch.int64)).to(v.device)
    pos = wrap32(row).to(v.device)[:, None] * _signed(GOLDEN) + seeds[None, :]
    return fmix32(v ^ pos)


CHUNK_ROWS = 1024  # 16384 int32 lanes: below torch's parallel grain (32768), so no thread barrier, and in L2


def mix_and_sum(c: torch.Tensor, part: BlockSums) -> None:
    """Steps 2 and 3: c[seg] += m(row) for every block of ``part``. ``c`` is int64 [S, LANES] and accumulates the
    mixed lanes as signed int32 values: congruent to their uint32 bits mod 2^32, so wrap32(c) is the wrapping
    uint32 sum (and |c| < rows * 2^31 cannot overflow). Runs in chunks of CHUNK_ROWS rows: small ops stay on one
    thread (a barrier per op costs milliseconds on a busy machine) and every temporary stays in cache."""
    rows = part.v.shape[0]
    for a in range(0, rows, CHUNK_ROWS):
        mixed = block_mix(part.v[a:a + CHUNK_ROWS], part.row[a:a + CHUNK_ROWS])
        c.index_add_(0, part.seg[a:a + CHUNK_ROWS].to(c.device), mixed.to(torch.int64))


NUMPY_CHUNK_ROWS = 4096  # 64K uint32 lanes (256 KiB): every temporary of a chunk stays in L2


def mix_and_sum_numpy(c: np.ndarray, part: BlockSums) -> None:
    """Steps 2 and 3 on CPU, the same bits as ``mix_and_sum``: ``c`` is uint32 [S, LANES] and c[seg] += m(row)
    wraps mod 2^32. numpy's uint32 multiply, add and shifts are exactly the uint32 arithmetic of the spec (no
    masking, no int64 widening) and run on one thread; a block's rows of one segment are consecutive, so each
    chunk's per-segment sums are one ``reduceat`` (uint32, wrapping) and one ``add.at``."""
    v = part.v.numpy().view(np.uint32)
    seg, row = part.seg.numpy(), part.row.numpy()
    seeds = np.array(lane_seeds(), dtype=np.uint32)
    for a in range(0, v.shape[0], NUMPY_CHUNK_ROWS):
        b = a + NUMPY_CHUNK_ROWS
        x = row[a:b].astype(np.uint32)[:, None] * np.uint32(GOLDEN) + seeds
        x ^= v[a:b]
        x ^= x >> np.uint32(16)
        x *= np.uint32(FMIX_C1)
        x ^= x >> np.uint32(13)
        x *= np.uint32(FMIX_C2)
        x ^= x >> np.uint32(16)
        s = seg[a:b]
        starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
        np.add.at(c, s[starts], np.add.reduceat(x, starts, axis=0, dtype=np.uint32))


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


def _fmix32_numpy(x: np.ndarray) -> np.ndarray:
    """fmix32 on a uint32 array (numpy's uint32 multiply wraps and its shifts are logical: the spec as written)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(FMIX_C1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(FMIX_C2)
    return x ^ (x >> np.uint32(16))


def finalize_numpy(c: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """``finalize`` on CPU in numpy uint32 (the same bits): c uint32 [S, LANES], nbytes int64 [S] -> uint32 [S, 4].
    A handful of tiny torch ops costs more than the whole computation here."""
    lo = (nbytes & MASK32).astype(np.uint32)[:, None]
    hi = ((nbytes >> 32) & MASK32).astype(np.uint32)[:, None]
    h = _fmix32_numpy(_fmix32_numpy(lo ^ np.array(len_seeds(), dtype=np.uint32)[None, :]) ^ hi)
    for t in range(LANES // KEY_WORDS):
        h = _fmix32_numpy(h ^ c[:, t * KEY_WORDS:(t + 1) * KEY_WORDS])
    for _ in range(2):
        h0 = h.sum(axis=1, dtype=np.uint32)[:, None]  # h0 + h1 + h2 + h3, wrapping
        h = _fmix32_numpy(np.concatenate([h0, h[:, 1:] + h0], axis=1))
    return h


def encoding_hash_reference(buf: torch.Tensor, offsets: torch.Tensor, *,
                             min_stream_blocks: int = STREAM_MIN_BLOCKS,
                             numpy_mix: bool | None = None) -> torch.Tensor:
    """128-bit keys of the byte segments of ``buf``: int64 [num_segments, 2] (the four uint32 lanes, little-endian).

    Runs on any device; the result is on ``buf``'s device. ``min_stream_blocks`` changes speed, never keys:
    runs of at least that many whole blocks are read in place, the rest is gathered (a huge value gathers
    everything, the plain twin the tests compare against; 1 streams every whole block). ``numpy_mix`` (default:
    on CPU) runs steps 2-4 in numpy uint32 (``mix_and_sum_numpy``, ``finalize_numpy``) instead of the torch
    ``mix_and_sum`` and ``finalize`` (the twins other devices run); the keys are the same."""
    flat, off = check_segments(buf, offsets)
    k = mixing_matrix(str(flat.device))
    use_numpy = flat.device.type == "cpu" if numpy_mix is None else numpy_mix
    if use_numpy and flat.device.type != "cpu":
        raise ValueError(f"numpy_mix=True needs a CPU buffer, got {flat.device}")
    lengths = (off[1:] - off[:-1]).to(flat.device)
    parts = block_sums(flat, off, k, min_stream_blocks)
    if use_numpy:
        acc = np.zeros((off.numel() - 1, LANES), dtype=np.uint32)
        for part in parts:
            mix_and_sum_numpy(acc, part)
        keys = finalize_numpy(acc, (off[1:] - off[:-1]).numpy())
        return torch.from_numpy(np.ascontiguousarray(keys).view(np.int64))
    c = torch.zeros(off.numel() - 1, LANES, dtype=torch.int64, device=flat.device)
    for part in parts:
        mix_and_sum(c, part)
    return finalize(wrap32(c), lengths).view(torch.int64)
