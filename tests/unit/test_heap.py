"""The data plane's actors exempt their start-up heap from full garbage collections (``knittrans.dataplane.heap``):
the function does what it says, and every long-lived actor body calls it at the end of its constructor."""

from __future__ import annotations

import gc

import pytest

from knittrans.dataplane import heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session collects as before


def _collected() -> set[int]:
    """ids of the objects in the collected generations (``gc.get_objects`` leaves out the permanent one)."""
    return {id(o) for o in gc.get_objects()}


def test_freeze_moves_what_is_alive_into_the_permanent_generation(unfrozen):
    """Checked per object, not by ``gc.get_freeze_count``: that count also drops whenever a frozen object is freed,
    which any other thread of the test process may do at any moment (the exact-count version of this test failed
    now and then for that reason)."""
    keep = [[i] for i in range(1000)]  # tracked containers alive at the call
    assert heap.freeze_startup_heap() >= len(keep)
    ids = _collected()
    assert not any(id(x) in ids for x in keep)
    later = [[i] for i in range(10)]
    ids = _collected()
    assert all(id(x) in ids for x in later)  # what comes after is collected as usual
    heap.freeze_startup_heap()  # a second call freezes the newcomers too
    ids = _collected()
    assert not any(id(x) in ids for x in later) and not any(id(x) in ids for x in keep)


def test_every_actor_body_freezes_its_start_up_heap(monkeypatch, unfrozen):
    pytest.importorskip("ray")
    from knittrans.bench import ray_ranks
    from knittrans.dataplane import ray_transport
    from knittrans.dataplane.types import TEXT_SCHEMA
    from knittrans.mmdedup import plane_ray
    from knittrans.mmdedup.keys import encoding_hash_fn
    from knittrans.mmdedup.plane import MM_SCHEMA

    calls: list[str] = []
    for mod in (ray_transport, plane_ray, ray_ranks):
        monkeypatch.setattr(mod, "freeze_startup_heap", lambda mod=mod: calls.append(mod.__name__))
    ray_transport.UnitHost("u0", "n0", TEXT_SCHEMA)
    plane_ray.MMUnitHost("u0", "n0", MM_SCHEMA, encoding_hash_fn)
    ray_transport.ControllerHost(TEXT_SCHEMA, {"u0": "n0"}, ray_transport.ControllerConfig(("n0",)), {})
    ray_ranks.RankActor.__ray_actor_class__(0)  # the body, without starting an actor
    assert calls == ["knittrans.dataplane.ray_transport", "knittrans.mmdedup.plane_ray",
                     "knittrans.dataplane.ray_transport", "knittrans.bench.ray_ranks"]
