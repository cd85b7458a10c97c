"""pytest-benchmark: the CPU (reference) paths in GB/s beside this machine's memcpy, measured in the same run.

Run with ``make bench`` (``--benchmark-enable``); by default each benchmark runs once as a smoke test. GB/s
(bytes read + written per second) and the fraction of memcpy go to ``extra_info``; no absolute time is asserted.
The pack is benchmarked into fresh outputs and into reused ones (``PackBuffers``, a training loop's steady
state); with benchmarks enabled, each also records both fractions from ``repro.kernels.pack_timing``, which times
fresh, reused and a memcpy of the output bytes interleaved in this process (medians), so the two are comparable.
"""

from __future__ import annotations

import pytest
import torch

from repro.kernels import IMAGE_BYTES, hash_inputs, memcpy_gbps, pack_bytes, pack_inputs, pack_timing
from triton_kernels.batched_pack import PackBuffers, batched_pack
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


PACK_TOKENS = 262144


@pytest.fixture(scope="module")
def pack_case():
    return pack_inputs(PACK_TOKENS, torch.Generator().manual_seed(0), CPU)


def _report_pack(benchmark, pack_case) -> None:
    """Both fractions, fresh and reused, against a memcpy of the output bytes timed interleaved with them."""
    if getattr(benchmark, "disabled", True):
        return
    fields, off, plan = pack_case
    t, nbytes = pack_timing(fields, off, plan, "reference", CPU, repeats=11), pack_bytes(fields, plan)
    benchmark.extra_info.update({
        "interleaved_memcpy_gbps": t.memcpy_gbps,
        "interleaved_fresh_fraction_of_memcpy": nbytes / t.fresh_s / 1e9 / t.memcpy_gbps,
        "interleaved_reused_fraction_of_memcpy": nbytes / t.reused_s / 1e9 / t.memcpy_gbps})


def test_bench_pack_reference(benchmark, memcpy, pack_case):
    fields, off, plan = pack_case
    out = benchmark(batched_pack, fields, off, plan, impl="reference")
    _report(benchmark, pack_bytes(fields, plan), memcpy)
    _report_pack(benchmark, pack_case)
    assert int(out.fields["loss_mask"].sum()) == int(fields["loss_mask"].sum())


def test_bench_pack_reference_reused_outputs(benchmark, memcpy, pack_case):
    fields, off, plan = pack_case
    bufs = PackBuffers()
    out = benchmark(batched_pack, fields, off, plan, impl="reference", out=bufs)
    _report(benchmark, pack_bytes(fields, plan), memcpy)
    _report_pack(benchmark, pack_case)
    fresh = batched_pack(fields, off, plan, impl="reference")
    assert all(torch.equal(out.fields[k], fresh.fields[k]) for k in fields)
    assert torch.equal(out.position_ids, fresh.position_ids)
