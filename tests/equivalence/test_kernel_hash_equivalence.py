"""encoding_hash: the Triton kernel (interpreted on CPU, compiled on a GPU) gives the reference's keys bit for bit."""

from __future__ import annotations

import pytest
import torch

from triton_kernels.encoding_hash import BLOCK_BYTES, encoding_hash, ragged_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _both(buf, off):
    ref = encoding_hash(buf.cpu(), off.cpu(), impl="reference")
    tri = encoding_hash(buf.to(DEVICE), off.to(DEVICE), impl="triton").cpu()
    return ref, tri


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64])
def test_kernel_equals_reference_for_every_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    parts = [(torch.randn(n, generator=g) * 50).to(dtype) for n in (0, 1, 3, 1023, 1025, 2049)]
    buf, off = ragged_bytes(parts)
    ref, tri = _both(buf, off)
    assert torch.equal(ref, tri)


def test_kernel_equals_reference_on_awkward_segment_sizes():
    sizes = [0, 1, 2, 3, 4, 5, 7, 31, 33, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 0, 16 * BLOCK_BYTES + 3, 0]
    g = torch.Generator().manual_seed(1)
    buf = torch.randint(0, 256, (sum(sizes) + 5,), dtype=torch.uint8, generator=g)[5:]  # unaligned start
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(sizes), 0)])
    ref, tri = _both(buf, off)
    assert torch.equal(ref, tri)


def test_kernel_equals_reference_on_a_large_segment():
    n = 1_000_003 if DEVICE == "cpu" else 3312 * 1176 * 4 + 1
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    ref, tri = _both(buf, torch.tensor([0, n // 3, n]))
    assert torch.equal(ref, tri)


def test_kernel_block_sizes_change_speed_not_keys():
    from triton_kernels.encoding_hash.kernel import encoding_hash_triton

    buf = torch.randint(0, 256, (3 * BLOCK_BYTES * 17,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(3)).to(DEVICE)
    off = torch.tensor([0, 5, BLOCK_BYTES * 20, buf.numel()], device=DEVICE)
    a = encoding_hash_triton(buf, off, block_m=16, block_k=256)
    b = encoding_hash_triton(buf, off, block_m=32, block_k=1024)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="block_m"):
        encoding_hash_triton(buf, off, block_m=8)


def test_kernel_with_no_segments_and_empty_buffer():
    ref, tri = _both(torch.zeros(0, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64))
    assert ref.shape == tri.shape == (0, 2)
    ref, tri = _both(torch.zeros(0, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(ref, tri) and bool((ref[0] == ref[1]).all())


def test_kernel_rejects_what_the_reference_rejects():
    x = torch.randn(8, 8, device=DEVICE).t()
    with pytest.raises(ValueError, match="contiguous"):
        encoding_hash(x, torch.tensor([0, 4], device=DEVICE), impl="triton")
    with pytest.raises(ValueError, match="out of range"):
        encoding_hash(torch.zeros(4, device=DEVICE), torch.tensor([0, 17], device=DEVICE), impl="triton")


def test_streamed_and_gathered_blocks_give_the_same_keys():
    """The reference reads long runs of whole blocks in place and gathers the rest into a zero-padded matrix;
    where the line between the two falls changes speed, never keys (huge min_stream_blocks = gather all)."""
    from triton_kernels.encoding_hash.reference import STREAM_MIN_BLOCKS, encoding_hash_reference

    b = BLOCK_BYTES
    sizes = [3 * b, 0, 2 * b, b + 5, 70 * b, 64 * b, 0, 64 * b - 1, 1, 130 * b + 77, 33, 5 * b]  # runs and breaks
    g = torch.Generator().manual_seed(4)
    buf = torch.randint(0, 256, (sum(sizes) + 3,), dtype=torch.uint8, generator=g)[3:]  # unaligned start
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(sizes), 0)])
    gathered = encoding_hash_reference(buf, off, min_stream_blocks=2**62)
    for m in (1, 2, STREAM_MIN_BLOCKS):
        assert torch.equal(encoding_hash_reference(buf, off, min_stream_blocks=m), gathered), m
    assert torch.equal(encoding_hash(buf, off, impl="reference"), gathered)
    assert torch.unique(gathered, dim=0).shape[0] == len(sizes) - 1  # the two empty segments share a key


def test_numpy_and_torch_mixing_give_the_same_keys():
    """The CPU path mixes in numpy uint32; other devices (and this twin) in torch int32/int64."""
    from triton_kernels.encoding_hash.reference import encoding_hash_reference

    sizes = [0, 1, 5, BLOCK_BYTES, BLOCK_BYTES + 1, 70 * BLOCK_BYTES, 70 * BLOCK_BYTES + 3, 0, 5000 * 16 + 1]
    g = torch.Generator().manual_seed(3)
    buf = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=g)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(sizes), 0)])
    for stream in (1, 64, 2**62):
        assert torch.equal(encoding_hash_reference(buf, off, min_stream_blocks=stream, numpy_mix=True),
                           encoding_hash_reference(buf, off, min_stream_blocks=stream, numpy_mix=False))
