"""encoding_hash reference: the spec in pure Python, the invariants the dedup store relies on, statistics."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from triton_kernels.encoding_hash import encoding_hash, key_bytes, key_hex, ragged_bytes
from triton_kernels.encoding_hash import reference as R

M = 0xFFFFFFFF


def _fmix(x: int) -> int:
    x &= M
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M
    return x ^ (x >> 16)


def _py_key(data: bytes) -> bytes:
    """The construction in reference.py's docstring, written again with Python integers (no torch)."""
    kmat = [[0] * R.LANES for _ in range(R.BLOCK_BYTES)]
    for i in range(R.BLOCK_BYTES):
        for j in range(R.LANES):
            b = _fmix(i * R.LANES + j + R.MATRIX_SEED) & 0xFF
            kmat[i][j] = b - 256 if b >= 128 else b
    seeds = [_fmix(j + R.LANE_SEED) for j in range(R.LANES)]
    c = [0] * R.LANES
    for r in range(-(-len(data) // R.BLOCK_BYTES)):
        block = data[r * R.BLOCK_BYTES:(r + 1) * R.BLOCK_BYTES]
        for j in range(R.LANES):
            v = sum((b - 256 if b >= 128 else b) * kmat[i][j] for i, b in enumerate(block) if b)
            c[j] = (c[j] + _fmix((v & M) ^ ((r * R.GOLDEN + seeds[j]) & M))) & M
    n = len(data)
    h = []
    for k in range(4):
        x = _fmix(_fmix((n & M) ^ _fmix(k + R.LEN_SEED)) ^ (n >> 32))
        for t in range(4):
            x = _fmix(x ^ c[4 * t + k])
        h.append(x)
    for _ in range(2):
        h[0] = (h[0] + h[1] + h[2] + h[3]) & M
        h = [_fmix(h[0])] + [_fmix((x + h[0]) & M) for x in h[1:]]
    return struct.pack("<IIII", *h)


@pytest.mark.parametrize("n", [0, 1, 3, 5, 4095, 4096, 4097])
def test_reference_matches_python_integer_spec(n):
    data = bytes(random.Random(n).randrange(256) for _ in range(n))
    key = encoding_hash_bytes(data)
    assert key == _py_key(data)


def encoding_hash_bytes(data: bytes) -> bytes:
    buf = torch.tensor(list(data), dtype=torch.uint8)
    return key_bytes(encoding_hash(buf, torch.tensor([0, len(data)]), impl="reference")[0])


def test_int32_wraparound_matches_uint32():
    x = torch.tensor([0, 1, 2**31 - 1, -2**31, -1, 123456789, -987654321], dtype=torch.int32)
    got = [v & M for v in R.fmix32(x).tolist()]
    assert got == [_fmix(v & M) for v in x.tolist()]


def test_mixing_matrix_is_fixed_and_full():
    k = R.mixing_matrix("cpu")
    assert k.shape == (R.BLOCK_BYTES, R.LANES) and k.dtype == torch.int8
    assert bool((k != 0).any(dim=1).all()), "a byte that no lane sees could change without changing the key"
    rows = {tuple(r) for r in k.tolist()}
    assert len(rows) == R.BLOCK_BYTES, "two equal rows would make swapping those two bytes invisible to step 1"


def test_position_sensitive_swapping_two_words_changes_key():
    x = torch.arange(64, dtype=torch.int32)
    y = x.clone()
    y[[3, 40]] = y[[40, 3]]
    keys = encoding_hash([x, y])
    assert key_bytes(keys[0]) != key_bytes(keys[1])


def test_position_sensitive_swapping_two_blocks_changes_key():
    a = torch.randint(0, 256, (2 * R.BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    b = torch.cat([a[R.BLOCK_BYTES:], a[:R.BLOCK_BYTES]])
    keys = encoding_hash([a, b])
    assert key_bytes(keys[0]) != key_bytes(keys[1])


def test_length_sensitive_zero_padded_copy_hashes_differently():
    x = torch.randn(100)
    keys = encoding_hash([x, torch.cat([x, torch.zeros(1)]), torch.zeros(0), torch.zeros(1, dtype=torch.uint8)])
    assert len({key_bytes(k) for k in keys}) == 4
    zeros = encoding_hash([torch.zeros(n, dtype=torch.uint8) for n in range(0, 5000, 7)])
    assert len({key_bytes(k) for k in zeros}) == zeros.shape[0]


def test_dtype_agnostic_over_the_same_bytes():
    x = torch.randn(3, 5)
    keys = encoding_hash([x, x.view(torch.uint8), x.view(torch.int32), x.view(torch.bfloat16), x.flatten()])
    assert len({key_bytes(k) for k in keys}) == 1


def test_flat_api_equals_list_api_and_offsets_select_segments():
    parts = [torch.randn(7), torch.arange(5, dtype=torch.int64), torch.zeros(0)]
    buf, off = ragged_bytes(parts)
    assert off.tolist() == [0, 28, 68, 68]
    assert torch.equal(encoding_hash(buf, off), encoding_hash(parts))


def test_non_contiguous_flat_input_is_rejected_list_input_is_copied():
    x = torch.randn(8, 8).t()
    with pytest.raises(ValueError, match="contiguous"):
        encoding_hash(x, torch.tensor([0, 256]))
    assert torch.equal(encoding_hash([x]), encoding_hash([x.contiguous()]))


@pytest.mark.parametrize("offsets, match", [([0, 5, 3], "non-decreasing"), ([0, 100], "out of range"),
                                            ([-1, 2], "out of range")])
def test_bad_offsets_are_rejected(offsets, match):
    with pytest.raises(ValueError, match=match):
        encoding_hash(torch.zeros(10, dtype=torch.uint8), torch.tensor(offsets))


def test_bad_arguments_are_rejected():
    with pytest.raises(TypeError):
        encoding_hash(torch.zeros(4), torch.tensor([0.0, 4.0]))
    with pytest.raises(ValueError, match="impl"):
        encoding_hash([torch.zeros(4)], impl="cuda")
    with pytest.raises(TypeError):
        encoding_hash(torch.zeros(4))


def test_key_helpers():
    keys = encoding_hash([torch.zeros(3)])
    assert len(key_bytes(keys[0])) == 16 and key_hex(keys[0]) == key_bytes(keys[0]).hex()
    with pytest.raises(TypeError):
        key_bytes(keys)


def _bits(keys: torch.Tensor) -> torch.Tensor:
    """[S, 128] bool: the bits of each key."""
    b = keys.contiguous().view(torch.uint8)
    return ((b[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().reshape(keys.shape[0], 128)


@pytest.mark.parametrize("size", [64, 5000])
def test_one_input_bit_flip_flips_half_the_output_bits(size):
    g = torch.Generator().manual_seed(size)
    trials = 1000 if size == 64 else 200
    base = torch.randint(0, 256, (trials, size), dtype=torch.uint8, generator=g)
    flipped = base.clone()
    pos = torch.randint(0, size * 8, (trials,), generator=g)
    rows = torch.arange(trials)
    flipped[rows, pos // 8] ^= (1 << (pos % 8)).to(torch.uint8)
    step = torch.arange(0, 2 * trials * size + 1, size)
    keys = encoding_hash(torch.cat([base.flatten(), flipped.flatten()]), step, impl="reference")
    diff = _bits(keys[:trials]) ^ _bits(keys[trials:])
    per_trial = diff.sum(1).double()
    assert 60 < per_trial.mean() < 68  # ideal 64, sd of the mean 5.7 / sqrt(trials)
    assert per_trial.min() > 30
    per_bit = diff.double().mean(0)
    assert per_bit.min() > 0.35 and per_bit.max() < 0.65  # every output bit takes part


def test_no_collisions_among_many_random_inputs():
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(0, 48, (20000,), generator=g)
    buf = torch.randint(0, 256, (int(lengths.sum()),), dtype=torch.uint8, generator=g)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    keys = encoding_hash(buf, off)
    segs = {bytes(buf[off[i]:off[i + 1]].tolist()) for i in range(lengths.numel())}
    assert len({key_bytes(k) for k in keys}) == len(segs)  # distinct inputs -> distinct keys


def test_no_collisions_among_all_two_byte_inputs_and_single_bit_images():
    two = torch.arange(65536, dtype=torch.int64).to(torch.int16).view(torch.uint8)
    keys = encoding_hash(two, torch.arange(0, 2 * 65536 + 1, 2))
    assert torch.unique(keys, dim=0).shape[0] == 65536
    img = torch.zeros(448 * 448 * 3 // 64, dtype=torch.uint8)  # one bit set anywhere in a zero image
    flips = [img] + [img.clone().index_fill_(0, torch.tensor([i]), 1 << (i % 8)) for i in range(0, img.numel(), 97)]
    keys = encoding_hash(flips)
    assert torch.unique(keys, dim=0).shape[0] == len(flips)


def test_the_float32_block_sums_are_exact_even_at_the_int8_extremes():
    """The CPU path without an int8 dot product: chunked fp32 GEMM, exact because every chunk's dot product stays
    within 2^24; compared with the exact float64 product on random rows and on rows of -128 against K."""
    from triton_kernels.encoding_hash.reference import BLOCK_BYTES, block_sums_f32, mixing_matrix

    k = mixing_matrix()
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(-128, 128, (8, BLOCK_BYTES), generator=g, dtype=torch.int8)
    extremes = torch.stack([torch.full((BLOCK_BYTES,), -128, dtype=torch.int8),
                            torch.where(k[:, 0] < 0, -128, 127).to(torch.int8)])  # |dot| as large as it gets
    for r in (rows, extremes):
        exact = (r.to(torch.float64) @ k.to(torch.float64)).to(torch.int32)
        assert torch.equal(block_sums_f32(r, k), exact)
