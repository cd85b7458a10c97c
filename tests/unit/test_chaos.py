"""The chaos driver (``workloads.chaos``) in process: random faults from every class of issue 13 under load, exact
accounting (every trajectory trained exactly once, every byte checked), and the driver catches a regression."""

from __future__ import annotations

import pytest

from knittrans.dataplane import build_inprocess
from workloads.chaos import CLASSES, KINDS, ChaosConfig, run_chaos
from workloads.text_data import TEXT_SCHEMA

UNITS = {"u0": "n0", "u1": "n1", "u2": "n2"}


def _run(seed: int, n: int = 600):
    return run_chaos("inprocess", lambda plan: build_inprocess(TEXT_SCHEMA, UNITS, ("n0", "n1"), checksums=True,
                                                               faults=plan, recoverable=True),
                     lambda dp, u: dp.units[u].restart(), ChaosConfig(trajectories=n, minibatch=30, seed=seed,
                                                                      fault_rate=0.3, timeout_s=20),
                     restart_controller=lambda dp: dp.restart_controller())


@pytest.mark.parametrize("seed", [0, 1])
def test_under_random_faults_every_trajectory_is_trained_exactly_once_with_its_bytes(seed):
    r = _run(seed)
    assert (r.trained, r.lost, r.duplicated, r.corrupted) == (600, 0, 0, 0)
    assert dict(r.survived) == dict(r.injected), "a fault that fired was not survived"
    assert {CLASSES[k] for k in r.injected} == {"lost_data", "retries", "corruption", "hang"}
    assert len(r.injected) >= 12 and set(r.injected) <= set(KINDS)
    assert r.injected["controller_restart"] >= 3  # the controller was rebuilt mid-run, several times
    assert r.held_max == 0 and r.final_unit_bytes == 0  # controller state compacted, storage freed
    assert r.released_minibatches == 600 // 30


def test_chaos_catches_a_store_that_keeps_the_producers_buffer(monkeypatch):
    """Injected regression: zero-copy put (the store keeps the producer's array). A producer that reuses its
    buffer then changes stored bytes: with checksums the mini-batch is permanently corrupt (never delivered, the
    run fails by its deadline), without them it would be trained on wrong bytes; either way the run must fail."""
    import knittrans.dataplane.storage as storage

    monkeypatch.setattr(storage, "stored_copy", lambda a: a)  # what storage.put did before copy-on-put
    monkeypatch.setattr(storage, "_stored_runs", lambda fresh: None)  # ... instead of copying into the put's runs
    try:
        r = _run(2, n=900)
    except RuntimeError as e:
        assert "not delivered in 10 attempts" in str(e)
    else:
        assert r.corrupted > 0 and r.survived["producer_mutates_after_put"] == 0
