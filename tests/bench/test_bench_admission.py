"""Admission decision cost per completed trajectory (pytest-benchmark; run with --benchmark-enable).

One round feeds a whole batch of completions, in random order, to a fresh policy and asks the trainer-ready hook
after every completion (what the simulator and runtime do); the reported figure is the round's time divided by B,
in ``extra_info["us_per_trajectory"]`` (from the round's median). Building the trajectories is setup, not timed.

    .venv/bin/python -m pytest tests/bench/test_bench_admission.py --benchmark-enable --benchmark-columns=median
"""

from __future__ import annotations

import random

import pytest

from knittrans.admission import KnitTransAdmission
from knittrans.constraints import BatchConstraints
from knittrans.types import BatchPlan, GroupSpec, Trajectory

N = 8  # samples per prompt
M = 16  # mini-batches per batch
L = 1024  # max_response_len


def make_batch(b: int, seed: int = 0) -> tuple[BatchPlan, list[Trajectory]]:
    rng = random.Random(seed)
    groups = tuple(GroupSpec(g, 0, N) for g in range(b // N))
    trajs = [Trajectory(i, i // N, 0, rng.randint(1, L), v_gen=0) for i in range(b)]
    rng.shuffle(trajs)
    return BatchPlan(0, groups), trajs


def run_batch(c: BatchConstraints, plan: BatchPlan, trajs: list[Trajectory]) -> int:
    p = KnitTransAdmission(c)
    p.add_batch(plan)
    admitted = 0
    for t in trajs:
        p.on_complete(t)
        while got := p.on_trainer_ready(0.0):
            admitted += len(got)
    return admitted


def bench(benchmark, c: BatchConstraints, b: int, rounds: int) -> None:
    if benchmark.disabled and b >= 8192 and c.token_budget is not None:
        pytest.skip("the general path at this size takes about a minute; run with --benchmark-enable")
    plan, trajs = make_batch(b)
    admitted = benchmark.pedantic(run_batch, args=(c, plan, trajs), rounds=rounds, iterations=1, warmup_rounds=0)
    assert admitted == M  # the batch finished, in exactly M mini-batches
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # absent under --benchmark-disable
        benchmark.extra_info["us_per_trajectory"] = stats.stats.median / b * 1e6
    benchmark.extra_info["B"] = b


@pytest.mark.parametrize("b", [512, 8192, 65536])
def test_bench_admission_uniform_groups_no_budget(benchmark, b):
    """DAPO-like: uniform groups of 8, whole groups, exact sizes, no token budget (the closed-form path)."""
    c = BatchConstraints(batch_size=b, num_minibatches=M, max_response_len=L, group_size=N)
    bench(benchmark, c, b, rounds={512: 20, 8192: 5, 65536: 3}[b])


@pytest.mark.parametrize("b", [512, 8192])
def test_bench_admission_token_budget_with_slack(benchmark, b):
    """The general path: sizes B/M +- 12.5%, and a token budget of B/M responses at max_response_len, which
    binds for every mini-batch larger than B/M."""
    c = BatchConstraints(batch_size=b, num_minibatches=M, max_response_len=L, group_size=N,
                         size_slack=b // M // 8, token_budget=(b // M) * L)
    bench(benchmark, c, b, rounds={512: 5, 8192: 1}[b])
