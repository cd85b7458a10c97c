"""The multimodal data plane in process (knittrans/mmdedup/plane.py): each distinct image stored once per unit and
moved once per rank share, the per-sample index map, refcounts back to zero after consumption and never early,
forced hash collisions that never alias, exactly-once delivery and bad input that changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from knittrans.dataplane import AlreadyConsumedError, DuplicatePutError, SchemaMismatchError
from knittrans.mmdedup import EncodingInputError
from knittrans.mmdedup.plane import IMAGE_FIELD, MMPayload, MMShare, build_mm_inprocess
from knittrans.types import MiniBatch
from workloads.multimodal import MMWorkloadConfig, MultimodalWorkload
from workloads.multimodal_data import trajectory_fields

UNITS = {"u0": "n0", "u1": "n1"}
RANKS = ("n0", "n1")


def _groups(n=4, prompts=4, k=2, seed=0):
    wl = MultimodalWorkload(MMWorkloadConfig(prompts_per_batch=prompts, n=n, images_per_prompt=k,
                                             image_sizes=((56, 56), (56, 84)), seed=seed))
    return wl.sample_batch(0)


def _payloads(g, gi):
    return [MMPayload(s.traj_id, trajectory_fields(s), group=gi,
                      encodings=tuple(g.images[j].pixel_values for j in s.image_index),
                      grids=tuple(g.images[j].grid_thw for j in s.image_index)) for s in g.samples]


def _put_all(dp, groups):
    for gi, g in enumerate(groups):
        dp.client(f"u{gi % 2}").put(_payloads(g, gi))


def _minibatches(groups, m):
    per = len(groups) // m
    return [MiniBatch(0, k, tuple(s.traj_id for g in groups[k * per:(k + 1) * per] for s in g.samples),
                      tuple(range(k * per, (k + 1) * per)), 0) for k in range(m)]


def _distinct_bytes(groups):
    return sum(im.nbytes for g in groups for im in g.images)


def test_each_distinct_image_is_stored_once_and_moved_once_per_share():
    groups = _groups()
    dp = build_mm_inprocess(UNITS, RANKS)
    _put_all(dp, groups)
    assert dp.live_bytes() == _distinct_bytes(groups)  # n samples, one stored copy
    group_of = {s.traj_id: g for g in groups for s in g.samples}
    moved = 0
    for mb in _minibatches(groups, 2):
        dp.controller.admit(mb)
        for r in range(len(RANKS)):
            share = dp.client().fetch(mb, rank=r)
            assert isinstance(share, MMShare)
            mine = {id(group_of[t]): group_of[t] for t in share.traj_ids}
            assert all(len([t for t in share.traj_ids if group_of[t] is g]) == len(g.samples) for g in mine.values())
            assert share.pixel_nbytes == _distinct_bytes(mine.values())  # each distinct image once
            assert share.occurrence_nbytes == len(groups[0].samples) * share.pixel_nbytes
            for t, ids in share.image_ids.items():  # the per-sample index map points at the right pixels
                g = group_of[t]
                assert len(ids) == len(g.images)
                for j, i in enumerate(ids):
                    assert torch.equal(share.images.pixels[i], g.images[j].pixel_values)
                    assert share.images.grids[i] == g.images[j].grid_thw
            moved += share.pixel_nbytes
    assert moved == _distinct_bytes(groups)  # bytes moved with dedup = the distinct images' bytes
    assert dp.live_bytes() == 0  # every reference released with its consumed trajectory


def test_refcounts_release_with_the_last_consumer_and_never_early():
    groups = _groups()
    dp = build_mm_inprocess(UNITS, RANKS)
    _put_all(dp, groups)
    mb0, mb1 = _minibatches(groups, 2)
    dp.controller.admit(mb0)
    dp.controller.admit(mb1)
    total = dp.live_bytes()
    dp.client().fetch(mb0, rank=0)
    assert dp.live_bytes() == total  # rank 1 has not consumed mb0: nothing freed early
    dp.client().fetch(mb0, rank=1)
    assert dp.live_bytes() == _distinct_bytes(groups[2:])  # mb0's images freed, mb1's held
    for r in range(2):
        dp.client().fetch(mb1, rank=r)
    assert dp.live_bytes() == 0
    stats = dp.store_stats()
    assert sum(s.live_refs for s in stats.values()) == 0
    assert sum(s.hits for s in stats.values()) == sum(len(g.samples) - 1 for g in groups) * len(groups[0].images)


def test_forced_collisions_never_alias_through_the_plane():
    groups = _groups()
    dp = build_mm_inprocess(UNITS, RANKS, hash_fn=lambda ts: [b"\0" * 16 for _ in ts])  # every key collides
    _put_all(dp, groups)
    assert dp.live_bytes() == _distinct_bytes(groups)
    mb = _minibatches(groups, 1)[0]
    dp.controller.admit(mb)
    group_of = {s.traj_id: g for g in groups for s in g.samples}
    for r in range(2):
        share = dp.client().fetch(mb, rank=r)
        for t, ids in share.image_ids.items():
            for j, i in enumerate(ids):
                assert torch.equal(share.images.pixels[i], group_of[t].images[j].pixel_values)
    assert sum(s.collisions for s in dp.store_stats().values()) > 0
    assert dp.live_bytes() == 0


def test_delivery_is_exactly_once_and_bad_input_changes_nothing():
    groups = _groups(prompts=2)
    dp = build_mm_inprocess(UNITS, RANKS)
    good = _payloads(groups[0], 0)
    bad_grid = MMPayload(good[0].traj_id, good[0].tensors, group=0, encodings=good[0].encodings,
                         grids=((1, 2, 2),) * len(good[0].grids))
    with pytest.raises(EncodingInputError):
        dp.client("u0").put([*good[1:], bad_grid])  # all or nothing
    with pytest.raises(SchemaMismatchError):
        dp.client("u0").put([MMPayload(99, {**good[0].tensors, IMAGE_FIELD: np.zeros(1, np.int64)}, group=0)])
    raw = MMPayload(good[0].traj_id, good[0].tensors, group=0,
                    encodings=(torch.zeros(4, 1176, dtype=torch.uint8),), grids=((1, 2, 2),))
    with pytest.raises(EncodingInputError):
        dp.client("u0").put([raw])
    assert dp.live_bytes() == 0 and dp.units["u0"].stats().num_trajectories == 0
    dp.client("u0").put(good)
    with pytest.raises(Exception):  # a trajectory's images are put exactly once; the unit rolls back
        dp.client("u1").put(good[:1])
    assert dp.units["u1"].stats().num_trajectories == 0 and dp.store_stats()["u1"].live_bytes == 0
    mb = MiniBatch(0, 0, tuple(p.traj_id for p in good), (0,), 0)
    dp.controller.admit(mb)
    dp.client().fetch(mb, rank=0)
    with pytest.raises(AlreadyConsumedError):
        dp.client().fetch(mb, rank=0)


def test_the_plain_twin_stores_and_moves_every_occurrence_and_still_releases_everything():
    groups = _groups(n=4, prompts=2, k=1)
    dp = build_mm_inprocess(UNITS, RANKS, dedup=False)
    _put_all(dp, groups)
    assert dp.live_bytes() == 4 * _distinct_bytes(groups)  # one stored copy per sample
    moved = 0
    for mb in _minibatches(groups, 1):
        dp.controller.admit(mb)
        for r in range(len(RANKS)):
            share = dp.client().fetch(mb, rank=r)
            moved += share.pixel_nbytes
            assert share.pixel_nbytes == share.occurrence_nbytes  # nothing deduplicated on the way
    assert moved == 4 * _distinct_bytes(groups) and dp.live_bytes() == 0


def test_fields_put_after_the_images_complete_a_trajectory_and_images_are_put_once():
    (g,) = _groups(n=2, prompts=1, k=1)
    dp = build_mm_inprocess({"u0": "n0"}, ("n0",))
    c = dp.client("u0")
    first = [MMPayload(p.traj_id, {k: v for k, v in p.tensors.items() if k != "advantages"}, group=0,
                       encodings=p.encodings, grids=p.grids) for p in _payloads(g, 0)]
    c.put(first)
    later = [MMPayload(p.traj_id, {"advantages": p.tensors["advantages"]}, group=0) for p in _payloads(g, 0)]
    other = tuple(e + 1 for e in first[0].encodings)  # images come with the first put, once (a retry of the
    with pytest.raises(DuplicatePutError, match="already written with different content"):  # same ones: no-op)
        c.put([MMPayload(later[0].traj_id, later[0].tensors, group=0, encodings=other, grids=first[0].grids)])
    assert dp.units["u0"].store.stats().live_refs == 2  # the refused put changed nothing
    c.put(later)  # fields that exist only at completion, without images: a plain field put
    mb = MiniBatch(0, 0, tuple(p.traj_id for p in first), (0,), 0)
    dp.controller.admit(mb)
    share = dp.client().fetch(mb, rank=0)
    assert set(share.fields) == {"input_ids", "old_logprobs", "advantages", "loss_mask", IMAGE_FIELD}
    assert len(share.images.pixels) == 1 and dp.live_bytes() == 0


def test_a_shares_pixels_are_its_own_while_it_lives_even_with_reused_pack_buffers():
    """Pixels are packed into reused buffers: editing a live share's images never reaches the stored encodings,
    and a later share never lands on a live one's pixel memory."""
    groups = _groups()
    dp = build_mm_inprocess(UNITS, RANKS)
    _put_all(dp, groups)
    mbs = _minibatches(groups, 2)
    for mb in mbs:
        dp.controller.admit(mb)
    c = dp.client()
    first = c.fetch(mbs[0], rank=0, ack=False)
    for p in first.images.pixels:
        p.fill_(0)  # the consumer edits its images in place
    later = [c.fetch(mb, rank=r) for mb, r in ((mbs[0], 1), (mbs[1], 0), (mbs[1], 1))]
    ptrs = {p.data_ptr() for p in first.images.pixels}
    assert all(p.data_ptr() not in ptrs for s in later for p in s.images.pixels)
    assert all(float(p.abs().sum()) == 0 for p in first.images.pixels)  # still this consumer's own bytes
    t = first.traj_ids[0]  # its mini-batch is not released (rank 0 has not acked): its unit still holds it
    g = next(g for g in groups for s in g.samples if s.traj_id == t)
    sample = next(s for s in g.samples if s.traj_id == t)
    held = [u.get((t,), (IMAGE_FIELD,)) for u in dp.units.values() if t in u._data]  # noqa: SLF001
    assert len(held) == 1
    distinct = list(dict.fromkeys(sample.image_index))
    assert len(held[0].pixels) == len(distinct)
    for px, j in zip(held[0].pixels, distinct):
        np.testing.assert_array_equal(px, g.images[j].pixel_values.numpy())


def test_a_multimodal_share_read_from_its_sources_equals_the_share_read_through_its_units():
    """Issue 25: the direct read (fields' runs, each distinct image once from its recorded copy, image_index built
    by the rank) hands a rank exactly what the units' reads do: the same fields, the same distinct images (bytes,
    dtypes, grids) in the same per-sample index map, the same byte counts."""
    from knittrans.dataplane import PrepareConfig
    from knittrans.dataplane.types import MiniBatchKey
    from knittrans.mmdedup.plane import MMShareRuns

    groups = _groups(seed=3)
    planes = {d: build_mm_inprocess(UNITS, RANKS, prepare=PrepareConfig(direct_reads=d)) for d in (True, False)}
    for dp in planes.values():
        _put_all(dp, groups)
    for mb in _minibatches(groups, 2):
        for dp in planes.values():
            dp.controller.admit(mb)
        for r in range(len(RANKS)):
            loc = planes[True].controller.claim(MiniBatchKey(mb.batch_id, mb.index), r, planes[True].schema.names)
            assert isinstance(loc.runs, MMShareRuns)
            planes[True].controller.unclaim(loc.key, r, loc.fields)
            a, b = planes[True].client().fetch(mb, rank=r), planes[False].client().fetch(mb, rank=r)
            assert a.traj_ids == b.traj_ids and a.nbytes == b.nbytes and a.pixel_nbytes == b.pixel_nbytes
            assert a.occurrence_nbytes == b.occurrence_nbytes
            for name in a.fields:
                if name != IMAGE_FIELD:
                    assert torch.equal(a[name], b[name]), name
            for t in a.traj_ids:  # the same image behind every occurrence (indices may be numbered differently)
                for i, j in zip(a.image_ids[t], b.image_ids[t]):
                    assert torch.equal(a.images.pixels[i], b.images.pixels[j])
                    assert a.images.grids[i] == b.images.grids[j]
            assert len(a.images.pixels) == len(b.images.pixels)
    assert all(dp.live_bytes() == 0 for dp in planes.values())
