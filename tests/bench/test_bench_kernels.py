"""pytest-benchmark: the CPU (reference) paths in GB/s beside this machine's memcpy of the same bytes.

Run with ``make bench`` (``--benchmark-enable``); by default each benchmark runs once as a smoke test. Bytes are
the ops' own counts (``hash_traffic``, ``pack_traffic``: each input byte read once, each output byte written once);
GB/s and the fraction of memcpy go to ``extra_info``; no absolute time is asserted. pytest-benchmark times each
function alone, so with benchmarks enabled the pack benchmarks also record fractions from
``triton_kernels.bench.interleaved_passes`` (fresh and reused outputs timed right after a memcpy of the same bytes,
CPU time, medians over passes), which are the comparable ones.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from triton_kernels.batched_pack import PackBuffers, batched_pack, pack_traffic
from triton_kernels.bench import Case, Memcpy, hash_inputs, interleaved_passes, pack_inputs
from triton_kernels.encoding_hash import encoding_hash, hash_traffic

CPU = torch.device("cpu")
HASH_IMAGES = 16
PACK_TOKENS = 262144


def _report(benchmark, nbytes: int, memcpy_s: float | None = None) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:
        gbps = nbytes / stats.stats.median / 1e9
        benchmark.extra_info["gbps"] = gbps
        if memcpy_s is not None:
            benchmark.extra_info["fraction_of_memcpy"] = memcpy_s / stats.stats.median


@pytest.fixture(scope="module")
def hash_case():
    return hash_inputs(HASH_IMAGES, torch.Generator().manual_seed(0), CPU)


@pytest.fixture(scope="module")
def pack_case():
    return pack_inputs(PACK_TOKENS, torch.Generator().manual_seed(0), CPU)


def test_bench_memcpy(benchmark, hash_case):
    """A memcpy moving the hash's bytes (reads and writes half each)."""
    nbytes = hash_traffic(hash_case[1]).memcpy_bytes
    mc = Memcpy(nbytes, CPU)
    benchmark(mc.calls(nbytes)["torch"])
    _report(benchmark, 2 * nbytes)
    assert torch.equal(mc.dst, mc.src)


def test_bench_hash_reference(benchmark, hash_case):
    buf, off = hash_case
    keys = benchmark(encoding_hash, buf, off, impl="reference")
    _report(benchmark, hash_traffic(off).total)
    assert torch.unique(keys, dim=0).shape[0] == HASH_IMAGES


def _interleaved(benchmark, pack_case) -> None:
    """Fresh and reused outputs, each right after a memcpy of the same bytes, CPU time, one thread."""
    if getattr(benchmark, "disabled", True):
        return
    fields, off, plan = pack_case
    traffic, bufs = pack_traffic(fields, off, plan), PackBuffers()
    case = Case("pack", traffic, {"fresh": lambda: batched_pack(fields, off, plan),
                                  "reused": lambda: batched_pack(fields, off, plan, out=bufs)})
    times = interleaved_passes([case], Memcpy(traffic.memcpy_bytes, CPU), passes=11, threads=1)
    for variant in ("fresh", "reused"):
        fractions = [t.memcpy.cpu / t.op.cpu for t in times if t.variant == variant]
        benchmark.extra_info[f"interleaved_{variant}_fraction_of_memcpy"] = statistics.median(fractions)


def test_bench_pack_reference(benchmark, pack_case):
    fields, off, plan = pack_case
    out = benchmark(batched_pack, fields, off, plan, impl="reference")
    _report(benchmark, pack_traffic(fields, off, plan).total)
    _interleaved(benchmark, pack_case)
    assert int(out.fields["loss_mask"].sum()) == int(fields["loss_mask"].sum())


def test_bench_pack_reference_reused_outputs(benchmark, pack_case):
    fields, off, plan = pack_case
    bufs = PackBuffers()
    out = benchmark(batched_pack, fields, off, plan, impl="reference", out=bufs)
    _report(benchmark, pack_traffic(fields, off, plan).total)
    _interleaved(benchmark, pack_case)
    fresh = batched_pack(fields, off, plan, impl="reference")
    assert all(torch.equal(out.fields[k], fresh.fields[k]) for k in fields)
    assert torch.equal(out.position_ids, fresh.position_ids)
