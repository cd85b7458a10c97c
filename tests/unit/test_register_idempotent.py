"""Issue 13: the standalone encoding plane and store take a retried register as a no-op (same trajectory, same
content: the same handles back, no second reference) and refuse a conflicting one by name."""

from __future__ import annotations

import pytest
import torch

from knittrans.mmdedup import EncodingConflictError, EncodingPlane, EncodingStore
from knittrans.mmdedup.store import EncodingStoreError


def test_an_identical_second_register_is_a_noop_returning_the_same_handles():
    store = EncodingStore()
    a, b = torch.randn(4, 8), torch.randn(6, 8)
    first = store.register(0, [a, b])
    before = store.stats()
    assert store.register(0, [a.clone(), b.clone()]) == first  # equal bytes, other tensors: a retry
    assert store.stats() == before and store.refcount(first[0]) == 1  # no second reference taken
    plane = EncodingPlane(["u0", "u1"])
    occ = plane.register("u0", 7, [a, b], [(1, 2, 2), (1, 2, 3)])
    before = plane.stats()
    assert plane.register("u0", 7, [a.clone(), b.clone()], [(1, 2, 2), (1, 2, 3)]) == occ
    assert plane.stats() == before
    plane.consume([7])  # one reference per occurrence: consuming once frees everything
    assert all(s.live_slots == 0 for s in plane.stats().values())


def test_a_conflicting_second_register_is_refused_by_name_and_changes_nothing():
    store = EncodingStore()
    a = torch.randn(4, 8)
    store.register(0, [a])
    before = store.stats()
    other = a.clone()
    other[0, 0] += 1
    for bad, what in (([other], "encoding 0"), ([a, a], "1 encodings"), ([a.double()], "encoding 0")):
        with pytest.raises(EncodingConflictError, match=f"trajectory 0 is already registered.*{what}"):
            store.register(0, bad)
    assert store.stats() == before
    plane = EncodingPlane(["u0", "u1"])
    plane.register("u0", 1, [a], [(1, 2, 2)])
    with pytest.raises(EncodingConflictError, match="grids"):
        plane.register("u0", 1, [a], [(1, 1, 4)])  # same bytes, other grid: another image to M-RoPE
    with pytest.raises(EncodingConflictError, match="on unit 'u0'"):
        plane.register("u1", 1, [a], [(1, 2, 2)])
    with pytest.raises(EncodingConflictError, match="encoding 0"):
        plane.register("u0", 1, [other], [(1, 2, 2)])
    plane.consume([1])
    with pytest.raises(EncodingStoreError, match="already registered \\(and consumed\\)"):
        plane.register("u0", 1, [a], [(1, 2, 2)])  # consumed: a register now would train it twice
