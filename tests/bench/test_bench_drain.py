"""The handoff's own drain on Ray (pytest-benchmark; run with --benchmark-enable; issue 25).

Every trajectory of a batch put and every mini-batch admitted before the clock starts; then both trainer ranks
drain their shares with acks and no compute (``knittrans-ray-drain``, the transfer table's system). Beside it, in
the same session and on the same shares, the engine ceiling (``engine-ceiling``: the shares' object refs handed
over, one ``ray.get`` and one pack per share). The figure is one drain's wall time; ``extra_info`` has the slowest
rank's GB/s (its bytes over its first ask -> last share), the ceiling's, and both as fractions of this process's
single-thread memcpy measured just before (the issue's goal: the drain >= 0.2 of memcpy per rank; the table row is
``drain_fraction_of_memcpy``). Default size: the transfer table's text batch (32 x 16, ~42 MB of fields); without
--benchmark-enable one drain of an 8-prompt batch runs as a smoke test (a benchmark is not a timed test: nothing
here asserts a time).

    .venv/bin/python -m pytest tests/bench/test_bench_drain.py --benchmark-enable --benchmark-columns=median
"""

from __future__ import annotations

import itertools
import statistics

import pytest

pytest.importorskip("ray")

from knittrans.bench import BenchLayout  # noqa: E402
from knittrans.bench.ray_ranks import RaySession  # noqa: E402
from knittrans.dataplane.harness import memcpy_gbps  # noqa: E402
from repro.transfer import TextWorkload, TransferConfig, passes_of  # noqa: E402
from repro.transfer_systems import System, make_system  # noqa: E402


def test_bench_drain_ray(benchmark):
    prompts = 8 if benchmark.disabled else TextWorkload().prompts_per_batch
    cfg = TransferConfig(workload="text", text=TextWorkload(prompts_per_batch=prompts))
    layout = BenchLayout(cfg.num_ranks, cfg.num_units, cfg.lead_steps, cfg.warmup_batches, cfg.prefetch_depth)
    src = passes_of(cfg)
    uid = itertools.count()
    with RaySession(cfg.num_ranks, cfg.ray_num_cpus) as session:
        session.warm_object_store()  # as the tables: the whole store, the ranks' pages mapped
        drain = make_system(System.KNITTRANS_RAY_DRAIN, cfg, layout, session)
        ceiling = make_system(System.ENGINE_CEILING, cfg, layout, session)
        drained, ceil = [], []

        def one():
            res = drain.run_raw(src.make(next(uid), 0))
            drained.append(res)
            ceil.append(ceiling.run_raw(src.make(next(uid), 0)))  # interleaved: the same moment's ceiling
            return res

        rounds = 1 if benchmark.disabled else 5
        benchmark.pedantic(one, rounds=rounds, iterations=1, warmup_rounds=0 if benchmark.disabled else 1)
        mc = memcpy_gbps()
    res = drained[-1]
    assert res.bytes_moved > 0 and len(res.rank_gbps) == cfg.num_ranks and min(res.rank_gbps) > 0
    rank = statistics.median(r.slowest_rank_gbps for r in drained)
    top = statistics.median(r.get_gbps for r in ceil)
    benchmark.extra_info.update(
        memcpy_gbps=round(mc, 3), drain_slowest_rank_gbps=round(rank, 3), drain_fraction_of_memcpy=round(rank / mc, 4),
        ceiling_get_gbps=round(top, 3), ceiling_fraction_of_memcpy=round(top / mc, 4),
        drain_bytes_per_batch=res.bytes_moved)
