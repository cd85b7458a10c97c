"""The planner's default sweep at DAPO size (pytest-benchmark; run with --benchmark-enable).

512 prompts x 16 samples, M = 16, 20 batches (163,840 trajectories per setting), the default grid of every
policy (17 settings with the colocated reference), the default time model: on one core (``workers=1``, what
"a laptop core" means) and on every core. The issue's goal is "well under a minute" on one core; the figure is
the benchmark's median wall time, with the CPU seconds it took (this process and its workers) and CPU seconds per
setting in ``extra_info``: on a shared machine the wall time includes waiting for a core, the CPU time does not. Without --benchmark-enable each runs once at
32 prompts as a smoke test (a benchmark is not a timed test: nothing here asserts a time).

    .venv/bin/python -m pytest tests/bench/test_bench_plan.py --benchmark-enable --benchmark-columns=median
"""

from __future__ import annotations

import resource
import time

import pytest

from baselines.admission import make_policy
from knittrans.plan import PlanConfig, plan

FACTORIES = {k: (lambda c, k=k: make_policy(k, c)) for k in ("knittrans", "train_batch", "greedy", "bounded_async")}


@pytest.mark.parametrize("workers", [1, 0], ids=["one_core", "all_cores"])
def test_bench_plan_dapo_default_sweep(benchmark, workers, tmp_path):
    prompts = 32 if benchmark.disabled else 512
    cfg = PlanConfig(dist="light", prompts_per_batch=prompts, group_size=16, num_minibatches=16, num_batches=20,
                     workers=workers, out_dir=str(tmp_path))
    cpu = []

    def timed():
        c0 = time.process_time() + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        out = plan(cfg, FACTORIES, progress=False)
        cpu.append(time.process_time() + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - c0)
        return out

    result = benchmark.pedantic(timed, rounds=1, iterations=1, warmup_rounds=0)
    assert len(result.points) == 17 and all(p.ok for p in result.points)
    assert result.recommendation is not None
    benchmark.extra_info.update(settings=len(result.points), trajectories_per_setting=prompts * 16 * 20,
                                cpu_s=cpu[0], cpu_s_per_setting=cpu[0] / len(result.points))
