"""Encoding store and dedup-aware fetch: refcounts, collisions, bytes moved, bad input (issue 6)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans.mmdedup import (EncodingInputError, EncodingPlane, EncodingStore, EncodingStoreError,
                               content_keys, encoding_hash_fn)


def weak_hash(tensors):
    """A deliberately terrible hash: one bit of the first byte, so of any three inputs two collide."""
    return [bytes([t.contiguous().view(-1).view(torch.uint8)[0].item() & 1]) * 16 for t in tensors]


def constant_hash(tensors):
    return [b"\0" * 16 for _ in tensors]


def img(seed: int, patches: int = 8, dim: int = 12) -> torch.Tensor:
    return torch.randn(patches, dim, generator=torch.Generator().manual_seed(seed))


def test_keys_include_dtype_and_shape_because_the_hash_is_bytes_only():
    a = torch.zeros(4, 6)
    ka, kb, kc = content_keys([a, a.reshape(6, 4), a.to(torch.bfloat16)])
    assert ka.digest == kb.digest and ka != kb
    assert ka != kc


def test_group_images_are_stored_once_and_freed_with_the_last_consumer():
    s = EncodingStore()
    x = img(0)
    refs = [s.register(t, [x.clone()])[0] for t in range(8)]
    assert len({r.slot for r in refs}) == 1 and s.refcount(refs[0]) == 8
    st_ = s.stats()
    assert st_.live_bytes == x.numel() * 4 and st_.logical_bytes == 8 * x.numel() * 4 and st_.hits == 7
    s.consume(range(7))
    assert s.refcount(refs[0]) == 1 and torch.equal(s.get(refs[0]), x)  # nothing freed early
    s.consume([7])
    assert len(s) == 0 and s.stats().live_bytes == 0 and s.stats().frees == 1  # no leak


def test_a_trajectory_showing_an_image_twice_holds_two_references():
    s = EncodingStore()
    x = img(1)
    r = s.register(0, [x, x.clone()])
    assert r[0].slot == r[1].slot and s.refcount(r[0]) == 2
    s.consume([0])
    assert len(s) == 0


@pytest.mark.parametrize("hash_fn", [weak_hash, constant_hash])
def test_forced_collisions_never_alias_two_inputs(hash_fn):
    s = EncodingStore(hash_fn=hash_fn)
    xs = [img(i) for i in range(6)]
    xs.append(xs[0].clone())  # a true duplicate must still be found behind the colliding ones
    refs = [s.register(t, [x])[0] for t, x in enumerate(xs)]
    assert len({r.slot for r in refs[:6]}) == 6
    assert refs[6].slot == refs[0].slot
    for r, x in zip(refs, xs):
        assert torch.equal(s.get(r), x)
    assert s.stats().collisions > 0
    s.consume([0, 6])  # free the first slot of the collision chain; the others stay reachable
    for r, x in zip(refs[1:6], xs[1:6]):
        assert torch.equal(s.get(r), x)
    s.consume(range(1, 6))
    assert len(s) == 0


def test_bitwise_comparison_separates_negative_zero_and_equates_nan():
    s = EncodingStore(hash_fn=constant_hash)
    a, b = torch.zeros(2, 2), -torch.zeros(2, 2)
    n1, n2 = torch.full((2, 2), float("nan")), torch.full((2, 2), float("nan"))
    ra, rb, r1, r2 = (s.put([t])[0] for t in (a, b, n1, n2))
    assert ra.slot != rb.slot and r1.slot == r2.slot


def test_rejected_calls_change_nothing():
    s = EncodingStore()
    x = img(2)
    s.register(0, [x])
    before = s.stats()
    with pytest.raises(EncodingStoreError, match="already registered"):
        s.register(0, [img(3)])
    with pytest.raises(EncodingStoreError, match="not registered"):
        s.consume([0, 99])  # one unknown id: none is consumed
    with pytest.raises(EncodingStoreError, match="duplicate"):
        s.consume([0, 0])
    assert s.stats() == before
    (stale,) = s.refs_of(0)
    s.consume([0])
    with pytest.raises(EncodingStoreError, match="already consumed"):
        s.consume([0])
    with pytest.raises(EncodingStoreError, match="not live"):
        s.get(stale)  # freed
    s.put([x])  # the same content again gets a new slot: a stale ref never reaches it
    with pytest.raises(EncodingStoreError, match="not live"):
        s.get(stale)
    with pytest.raises(EncodingStoreError, match="not live"):
        s.release([stale])


@pytest.mark.parametrize("bad, msg", [
    (torch.zeros(4, 6, dtype=torch.uint8), "dtype"),
    (torch.zeros(4, 6, dtype=torch.float64), "dtype"),
    (torch.zeros(0, 6), "shape"),
    (torch.zeros(24), "shape"),
])
def test_bad_pixel_values_are_rejected_by_name(bad, msg):
    s = EncodingStore()
    with pytest.raises(EncodingInputError, match=msg):
        s.register(0, [img(0), bad])
    assert len(s) == 0 and s.stats().puts == 0
    s.register(0, [img(0)])  # the id was not taken by the failed call


def test_fetch_moves_each_distinct_encoding_once():
    plane = EncodingPlane(["u0", "u1"])
    a, b, c = img(0, 8), img(1, 12), img(2, 8)
    grid = {8: (1, 2, 4), 12: (1, 3, 4)}
    # group 0 (image a + b) on unit u0, group 1 (image c) on u1, n = 4 each
    for t in range(4):
        plane.register("u0", t, [a.clone(), b.clone()], [grid[8], grid[12]])
        plane.register("u1", 4 + t, [c.clone()], [grid[8]])
    f = plane.fetch(list(range(8)))
    distinct = sum(x.numel() * 4 for x in (a, b, c))
    assert f.nbytes == distinct  # bytes moved with dedup = the distinct images' bytes
    assert f.occurrence_nbytes == 4 * distinct and f.num_occurrences == 12
    assert len(f.images.pixels) == 3 and f.image_ids[0] == (0, 1) and f.image_ids[5] == (2,)
    assert torch.equal(f.images.pixels[f.image_ids[6][0]], c)
    plane.consume(range(8))
    assert plane.live_bytes() == 0


def test_same_content_on_two_units_is_moved_once():
    """Issue 14: copies on two units (a group spread over engines) are one image to the consumer (content keys
    with a strong digest across units; tests/unit/test_mmdedup_spread.py has the collision and grid cases)."""
    plane = EncodingPlane(["u0", "u1"])
    a = img(0)
    plane.register("u0", 0, [a], [(1, 2, 4)])
    plane.register("u1", 1, [a.clone()], [(1, 2, 4)])
    f = plane.fetch([0, 1])
    assert f.nbytes == a.numel() * 4 and f.image_ids[0] == f.image_ids[1]


def test_plane_rejects_grid_mismatch_and_unknown_trajectories():
    plane = EncodingPlane(["u0"])
    with pytest.raises(EncodingInputError, match="grid_thw"):
        plane.register("u0", 0, [img(0, 8)], [(1, 4, 4)])
    with pytest.raises(EncodingStoreError, match="no registered images"):
        plane.fetch([0])
    with pytest.raises(EncodingStoreError, match="unknown unit"):
        plane.register("u9", 0, [img(0, 8)], [(1, 2, 4)])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.booleans()), min_size=1, max_size=30), st.booleans())
def test_live_slots_equal_distinct_contents_of_live_trajectories(ops, weak):
    """Invariant: after any interleaving of registers and consumes, the store holds exactly one slot per
    distinct content referenced by a live trajectory, with refcount = its occurrences, and nothing else."""
    s = EncodingStore(hash_fn=constant_hash if weak else encoding_hash_fn)
    pool = [img(i, 4, 4) for i in range(5)]
    live: dict[int, int] = {}
    next_id = 0
    for content, do_consume in ops:
        if do_consume and live:
            t = min(live)
            s.consume([t])
            del live[t]
        else:
            s.register(next_id, [pool[content].clone()])
            live[next_id] = content
            next_id += 1
        st_ = s.stats()
        assert st_.live_slots == len(set(live.values()))
        assert st_.live_refs == len(live)
        assert st_.live_bytes == 64 * len(set(live.values()))
        for t, c in live.items():
            (r,) = s.refs_of(t)
            assert torch.equal(s.get(r), pool[c]) and s.refcount(r) == sum(v == c for v in live.values())


def test_the_plain_twin_gives_every_occurrence_its_own_slot_and_frees_them_all():
    s = EncodingStore(dedup=False)
    img = torch.ones(4, 6)
    refs = s.put([img, img, img.clone()])
    assert len({r.slot for r in refs}) == 3 and len({r.key for r in refs}) == 3
    assert s.stats().live_bytes == 3 * 96 and s.stats().hits == 0
    s.release(refs)
    assert len(s) == 0 and s.stats().live_bytes == 0


def test_one_put_hashes_each_shared_view_once():
    calls = []

    def counting_hash(ts):
        calls.append(len(ts))
        return encoding_hash_fn(ts)

    s = EncodingStore(hash_fn=counting_hash)
    img = torch.randn(4, 6)
    refs = s.put([img] * 8 + [img.clone()])  # a group's 8 samples share one tensor; a copy has other memory
    assert calls == [2] and len({r.slot for r in refs}) == 1 and s.refcount(refs[0]) == 9
