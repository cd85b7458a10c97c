"""Cross-unit dedup in the multimodal plane (knittrans/mmdedup/plane.py): with a group's samples spread over units
(verl's agent loop placement), a consumer still moves each distinct encoding once (not once per unit that holds a
copy), every occurrence keeps its entry in the per-sample index map, the grid stays part of the content key, and
a forced collision of the fast hash never aliases two units' images."""

from __future__ import annotations

import numpy as np
import torch

from knittrans.dataplane.types import MiniBatchKey
from knittrans.mmdedup.keys import ImageKey
from knittrans.mmdedup.plane import MMPayload, MMShareLocation, build_mm_inprocess, image_sources
from knittrans.types import MiniBatch
from workloads.multimodal import MMWorkloadConfig, MultimodalWorkload
from workloads.multimodal_data import producer_of, trajectory_fields

UNITS = {"u0": "n0", "u1": "n1", "u2": "n2"}
RANKS = ("n0", "n1")


def _groups(n=6, prompts=4, k=2, seed=0):
    wl = MultimodalWorkload(MMWorkloadConfig(prompts_per_batch=prompts, n=n, images_per_prompt=k,
                                             image_sizes=((56, 56), (56, 84)), seed=seed))
    return wl.sample_batch(0)


def _put_spread(dp, groups, placement="spread"):
    by_unit: dict[str, list[MMPayload]] = {}
    for gi, g in enumerate(groups):
        for i, s in enumerate(g.samples):
            u = f"u{producer_of(placement, gi, i, len(g.samples), len(UNITS))}"
            by_unit.setdefault(u, []).append(MMPayload(
                s.traj_id, trajectory_fields(s), group=gi, encodings=tuple(g.images[j].pixel_values for j in
                                                                         s.image_index),
                grids=tuple(g.images[j].grid_thw for j in s.image_index)))
    for u, ps in by_unit.items():
        dp.client(u).put(ps)
    return by_unit


def _distinct_bytes(groups):
    return sum(im.nbytes for g in groups for im in g.images)


def _check_index_map(share, group_of):
    """Every occurrence of every trajectory points at its own pixels and grid (nothing lost, nothing swapped)."""
    occurrences = 0
    for t, ids in share.image_ids.items():
        g, s = group_of[t]
        assert len(ids) == len(s.image_index)
        for j, i in zip(s.image_index, ids):
            assert torch.equal(share.images.pixels[i], g.images[j].pixel_values)
            assert share.images.grids[i] == g.images[j].grid_thw
            occurrences += 1
    return occurrences


def test_spread_copies_are_moved_once_per_consumer_and_every_occurrence_is_indexed():
    groups = _groups()
    dp = build_mm_inprocess(UNITS, RANKS)
    by_unit = _put_spread(dp, groups)
    assert len(by_unit) == 3  # each group's 6 samples sit on all three units
    assert dp.live_bytes() == 3 * _distinct_bytes(groups)  # each unit stores its own copy
    group_of = {s.traj_id: (g, s) for g in groups for s in g.samples}
    mb = MiniBatch(0, 0, tuple(group_of), tuple(range(len(groups))), 0)
    dp.controller.admit(mb)
    moved = occ = 0
    for r in range(len(RANKS)):
        share = dp.client().fetch(mb, rank=r)
        mine = {id(group_of[t][0]): group_of[t][0] for t in share.traj_ids}
        assert share.pixel_nbytes == _distinct_bytes(mine.values())  # distinct x size, not per unit
        assert len(share.images.pixels) == sum(len(g.images) for g in mine.values())
        occ += _check_index_map(share, group_of)
        moved += share.pixel_nbytes
    assert moved == _distinct_bytes(groups)
    assert occ == sum(len(s.image_index) for g in groups for s in g.samples)
    assert dp.live_bytes() == 0


def test_spread_within_unit_dedup_moves_once_per_unit_and_the_plain_twin_every_occurrence():
    """The two plain twins of the claim above: dedup within each unit only (``cross_unit=False``) moves each image
    once per unit holding it; no dedup (no keys either) moves every occurrence."""
    groups = _groups(n=4, prompts=2, k=1)
    group_of = {s.traj_id: (g, s) for g in groups for s in g.samples}
    mb = MiniBatch(0, 0, tuple(group_of), (0, 1), 0)
    for kw, copies in (({"cross_unit": False}, 3), ({"dedup": False}, 4)):  # 4 samples over 3 units
        dp = build_mm_inprocess(UNITS, RANKS, **kw)
        _put_spread(dp, groups)
        dp.controller.admit(mb)
        total = 0
        for r in range(len(RANKS)):
            share = dp.client().fetch(mb, rank=r)
            _check_index_map(share, group_of)
            total += share.pixel_nbytes
        assert total == copies * _distinct_bytes(groups)
        assert dp.live_bytes() == 0


def test_same_bytes_with_another_grid_on_another_unit_stay_two_images():
    img = torch.randn(24, 1176)
    f = {"input_ids": np.arange(6), "old_logprobs": np.zeros(2, np.float32), "advantages": np.ones(2, np.float32),
         "loss_mask": np.ones(2, bool)}
    dp = build_mm_inprocess(UNITS, ("n0",))
    dp.client("u0").put([MMPayload(0, f, group=0, encodings=(img,), grids=((1, 4, 6),)),
                         MMPayload(1, f, group=0, encodings=(img,), grids=((1, 6, 4),))])
    dp.client("u1").put([MMPayload(2, f, group=0, encodings=(img.clone(),), grids=((1, 6, 4),)),
                         MMPayload(3, f, group=0, encodings=(img.clone(),), grids=((1, 4, 6),))])
    mb = MiniBatch(0, 0, (0, 1, 2, 3), (0,), 24)
    dp.controller.admit(mb)
    share = dp.client().fetch(mb, rank=0)
    assert sorted(share.images.grids) == [(1, 4, 6), (1, 6, 4)]  # keyed apart by grid, once each
    ids = share.image_ids
    assert ids[0] == ids[3] and ids[1] == ids[2] and ids[0] != ids[1]
    assert share.images.grids[ids[0][0]] == (1, 4, 6) and share.images.grids[ids[1][0]] == (1, 6, 4)
    assert share.pixel_nbytes == 2 * img.numel() * 4  # same bytes, two grids: moved twice, never per unit


def test_a_forced_fast_hash_collision_across_units_never_aliases():
    def weak(tensors):
        return [b"\0" * 16 for _ in tensors]

    a, b = torch.randn(16, 1176), torch.randn(16, 1176)
    f = {"input_ids": np.arange(6), "old_logprobs": np.zeros(2, np.float32), "advantages": np.ones(2, np.float32),
         "loss_mask": np.ones(2, bool)}
    dp = build_mm_inprocess(UNITS, ("n0",), hash_fn=weak)
    dp.client("u0").put([MMPayload(0, f, group=0, encodings=(a,), grids=((1, 4, 4),))])
    dp.client("u1").put([MMPayload(1, f, group=0, encodings=(b,), grids=((1, 4, 4),)),
                         MMPayload(2, f, group=0, encodings=(a,), grids=((1, 4, 4),))])
    mb = MiniBatch(0, 0, (0, 1, 2), (0,), 18)
    dp.controller.admit(mb)
    share = dp.client().fetch(mb, rank=0)
    px = share.images.pixels
    assert torch.equal(px[share.image_ids[0][0]], a) and torch.equal(px[share.image_ids[2][0]], a)
    assert torch.equal(px[share.image_ids[1][0]], b)
    assert len(px) == 2


def _one_image_admitted():
    """A plane (units on n0 and n1, its rank on n1) holding four samples of one image, two on each unit, admitted
    as one mini-batch."""
    dp = build_mm_inprocess({"u0": "n0", "u1": "n1"}, ("n1",))
    img = torch.randn(16, 1176)
    f = {"input_ids": np.arange(6), "old_logprobs": np.zeros(2, np.float32), "advantages": np.ones(2, np.float32),
         "loss_mask": np.ones(2, bool)}
    for t in range(4):
        dp.client(f"u{t % 2}").put([MMPayload(t, f, group=0, encodings=(img,), grids=((1, 4, 4),))])
    dp.controller.admit(MiniBatch(0, 0, (0, 1, 2, 3), (0,), 24))
    return dp


def test_the_claim_names_one_unit_per_image_local_first():
    k1 = ImageKey(b"1" * 16, "float32", (16, 1176), (1, 4, 4))
    k2 = ImageKey(b"2" * 16, "float32", (16, 1176), (1, 4, 4))
    nodes = {"u0": "n0", "u1": "n1"}
    src = dict(image_sources(["u0", "u1", "u1"], [[k1], [k1, k2], [k2]], "n1", nodes))
    assert src == {"u0": (), "u1": (k1, k2)}  # the rank's node holds both: nothing crosses the network
    src = dict(image_sources(["u0", "u1", "u0", "u1"], [[k1], [k1], [k2], [k2]], "n9", nodes))
    assert sorted(len(v) for v in src.values()) == [1, 1]  # remote holders share the load
    dp = _one_image_admitted()

    loc = dp.controller.claim(MiniBatchKey(0, 0), 0, ("input_ids", "image_index"))
    assert isinstance(loc, MMShareLocation)
    assert {u: len(ks) for u, ks in loc.image_sources} == {"u0": 0, "u1": 1}
    # read straight from the sources: the one distinct image once, from the copy on the rank's node
    assert len(loc.runs.images) == 1 and loc.runs.source_units[int(loc.runs.images[0][0])] == "u1"


def test_the_encoding_plane_reads_a_copy_held_by_two_units_once():
    from knittrans.mmdedup import EncodingPlane

    img, other = torch.randn(16, 1176), torch.randn(16, 1176)
    plane = EncodingPlane(["u0", "u1"], hash_fn=lambda ts: [b"\0" * 16 for _ in ts])  # fast keys all collide
    plane.register("u0", 0, [img], [(1, 4, 4)])
    plane.register("u1", 1, [img.clone()], [(1, 4, 4)])
    plane.register("u1", 2, [other], [(1, 4, 4)])
    plane.register("u1", 3, [img.clone()], [(1, 2, 8)])  # same bytes, another grid: another image
    f = plane.fetch([0, 1, 2, 3])
    assert f.image_ids[0] == f.image_ids[1] and len(f.images.pixels) == 3
    assert f.nbytes == 3 * img.numel() * 4 and f.occurrence_nbytes == 4 * img.numel() * 4
    assert torch.equal(f.images.pixels[f.image_ids[2][0]], other)
    assert f.images.grids[f.image_ids[3][0]] == (1, 2, 8)


def test_a_multimodal_claim_makes_no_torch_call_at_the_controller(monkeypatch):
    """The controller weighs each distinct image of a claim by its bytes (``image_sources``); a torch call there
    drops the GIL, and on the controller actor's threads, beside a registration or an admission running Python,
    each re-acquisition waits out the 5 ms switch interval (``ImageKey.nbytes`` made one per image per claim).
    The element size is asked of torch once per dtype; after that a claim calls no torch at all."""
    k = ImageKey(b"3" * 16, "bfloat16", (7, 5), (1, 1, 1))
    assert k.nbytes == 70  # primes bfloat16 (float32 is primed by the plane's put below, or here)
    assert ImageKey(b"4" * 16, "float32", (2, 3), (1, 1, 1)).nbytes == 24
    dp = _one_image_admitted()

    def no_torch(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a torch call at the controller")

    monkeypatch.setattr(torch, "empty", no_torch)
    loc = dp.controller.claim(MiniBatchKey(0, 0), 0, ("input_ids", "image_index"))
    assert {u: len(ks) for u, ks in loc.image_sources} == {"u0": 0, "u1": 1}
    assert ImageKey(b"5" * 16, "bfloat16", (4,), (1, 1, 1)).nbytes == 8
