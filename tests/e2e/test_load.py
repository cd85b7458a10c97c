"""Load through the data plane: concurrent producers and consumers, exact accounting (no loss, no duplicate),
storage freed after consumption and bounded during the run. The fast variant runs in ``make test``; the 100k
variant on both transports is marked slow (``python -m repro.reliability`` runs it too). The fast Ray variant
lives in tests/e2e/test_reliability_ray.py, with that file's Ray cluster."""

from __future__ import annotations

import pytest

from workloads.reliability_load import LoadConfig, load_inprocess, load_ray, ray_init


def _exact(res, n):
    assert res.delivered == n and res.lost == 0 and res.duplicated == 0
    assert res.final_unit_bytes == 0, "storage not freed after consumption"
    assert res.peak_unit_trajectories <= res.bound_trajectories, "unit occupancy not bounded by the window"


def test_small_load_in_process_is_exact_and_frees_storage():
    cfg = LoadConfig(load_trajectories=6000, load_minibatch=300, producers=3, ranks=2, window=2)
    _exact(load_inprocess(cfg), 6000)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["inprocess", "ray"])
def test_100k_trajectories_with_concurrent_producers_and_consumers_lose_nothing(transport):
    cfg = LoadConfig(load_trajectories=100_000)
    if transport == "ray":
        import ray

        ray_init()
        try:
            res = load_ray(cfg)
        finally:
            ray.shutdown()
    else:
        res = load_inprocess(cfg)
    _exact(res, 100_000)
    assert res.throughput > 0
