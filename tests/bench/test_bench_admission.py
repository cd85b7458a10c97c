"""Admission decision cost per completed trajectory (pytest-benchmark; run with --benchmark-enable).

One round feeds a whole batch of completions, in random order, to a fresh policy and asks the trainer-ready hook
after every completion (what the simulator and runtime do); the reported figure is the round's time divided by B,
in ``extra_info["us_per_trajectory"]`` (from the round's median). Building the trajectories is setup, not timed.

``test_bench_admission_issue15`` runs every row of issue 15's table (B = 8192, M = 16, max_response_len = 20480,
the instances of ``repro.admission``) and also records, from CPU time, the per-arrival p99 and max in
``extra_info`` (goals: <= 50 us per trajectory, <= 5 ms p99; ``python -m repro.admission`` is the table). Without
--benchmark-enable each runs once at B = 512 as a smoke test.

    .venv/bin/python -m pytest tests/bench/test_bench_admission.py --benchmark-enable --benchmark-columns=median
"""

from __future__ import annotations

import random
import statistics

import pytest

from knittrans.admission import KnitTransAdmission
from knittrans.constraints import BatchConstraints
from knittrans.types import BatchPlan, GroupSpec, Trajectory
from repro.admission import default_cases, make_instance, time_round

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


ISSUE15 = {case.name: case for case in default_cases()}


@pytest.mark.parametrize("name", list(ISSUE15))
def test_bench_admission_issue15(benchmark, name):
    """One row of issue 15's table per case: us per completed trajectory (the benchmark's rounds, wall time; and
    CPU time in extra_info), per-arrival p99 and max (CPU time, from one more round timed per arrival)."""
    b = 512 if benchmark.disabled else 8192
    c, plan, trajs = make_instance(ISSUE15[name], b, 16, 20480, seed=0)
    rounds = []

    def one_round() -> int:
        rounds.append(time_round(c, plan, trajs, deadline_s=100.0, per_arrival=False))
        return rounds[-1].minibatches

    committed = benchmark.pedantic(one_round, rounds=1 if benchmark.disabled else 3, iterations=1, warmup_rounds=0)
    assert committed == 16 and all(r.finished for r in rounds)  # the batch finished, in exactly M mini-batches
    if benchmark.disabled:
        return
    lat = time_round(c, plan, trajs, deadline_s=100.0, per_arrival=True)
    assert lat.finished
    benchmark.extra_info.update(
        B=b, groups=len(plan.groups), us_per_trajectory=statistics.median(r.us_per_traj(b) for r in rounds),
        p99_ms=lat.quantile_ms(0.99), max_ms=lat.quantile_ms(1.0), unknown=max(r.unknown for r in rounds))
