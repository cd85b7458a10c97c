"""pytest-benchmark: the CPU (reference) paths in GB/s beside this machine's memcpy, measured in the same run.

Run with ``make bench`` (``--benchmark-enable``); by default each benchmark runs once as a smoke test. GB/s
(bytes read + written per second) and the fraction of memcpy go to ``extra_info``; no absolute time is asserted.
"""

from __future__ import annotations

import pytest
import torch

from repro.kernels import IMAGE_BYTES, hash_inputs, memcpy_gbps, pack_bytes, pack_inputs
from triton_kernels.batched_pack import batched_pack
from triton_kernels.encoding_hash import encoding_hash

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def memcpy() -> float:
    return memcpy_gbps(16 * IMAGE_BYTES, CPU, repeats=5)


def _report(benchmark, nbytes: int, memcpy: float) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:
        gbps = nbytes / stats.stats.median / 1e9
        benchmark.extra_info.update({"gbps": gbps, "memcpy_gbps": memcpy, "fraction_of_memcpy": gbps / memcpy})


def test_bench_memcpy(benchmark, memcpy):
    src = torch.ones(16 * IMAGE_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    benchmark(dst.copy_, src)
    _report(benchmark, 2 * src.numel(), memcpy)
    assert torch.equal(dst, src)


def test_bench_hash_reference(benchmark, memcpy):
    buf, off = hash_inputs(16, torch.Generator().manual_seed(0), CPU)
    keys = benchmark(encoding_hash, buf, off, impl="reference")
    _report(benchmark, buf.numel() + keys.numel() * 8, memcpy)
    assert torch.unique(keys, dim=0).shape[0] == 16


def test_bench_pack_reference(benchmark, memcpy):
    fields, off, plan = pack_inputs(262144, torch.Generator().manual_seed(0), CPU)
    out = benchmark(batched_pack, fields, off, plan, impl="reference")
    _report(benchmark, pack_bytes(fields, plan), memcpy)
    assert int(out.fields["loss_mask"].sum()) == int(fields["loss_mask"].sum())
