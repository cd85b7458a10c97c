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


def test_a_handoff_load_trains_every_trajectory_once_and_holds_only_what_is_in_flight():
    """Through ``knittrans.Handoff`` (admission policy, records and acks included): exact, storage freed, and the
    controller, the admission ledger and the records bounded by what the announcement window lets be in flight."""
    from workloads.reliability_load import HandoffLoadConfig, load_handoff

    cfg = HandoffLoadConfig(trajectories=8192, records_window=1000)
    res = load_handoff(cfg)
    assert (res.lost, res.duplicated, res.final_unit_bytes) == (0, 0, 0)
    assert res.version == res.trajectories // (cfg.prompts * cfg.group_size) * cfg.num_minibatches
    assert res.held_max <= res.bound_trajectories and 0 <= res.ledger_batches_max <= cfg.window + 1
    assert res.records_kept <= cfg.records_window
