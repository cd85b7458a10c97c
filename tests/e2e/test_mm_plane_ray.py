"""The multimodal data plane on the Ray transport: 2 multimodal storage-unit actors, 2 producer tasks, 2 trainer-rank
actors with prefetchers. Each rank receives exactly its share, each distinct image of it once (bytes moved = the
distinct images' bytes), the right pixels behind its per-sample index map, and the units' refcounts return to zero."""

from __future__ import annotations

import hashlib
import sys

import pytest

ray = pytest.importorskip("ray")

from knittrans.dataplane import PrefetchConfig, Prefetcher  # noqa: E402
from knittrans.mmdedup.plane import MMPayload  # noqa: E402
from knittrans.mmdedup.plane_ray import MMRayDataPlane, build_mm_ray  # noqa: E402
from knittrans.types import MiniBatch  # noqa: E402
from workloads.multimodal import MMWorkloadConfig, MultimodalWorkload  # noqa: E402
from workloads.multimodal_data import trajectory_fields  # noqa: E402

pytestmark = pytest.mark.ray

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

UNITS = {"u0": "n0", "u1": "n1"}
RANKS = ("n0", "n1")


@pytest.fixture(scope="module")
def dp(ray_local):
    plane = build_mm_ray(UNITS, RANKS)
    yield plane
    plane.close()


def _digest(t) -> str:
    return hashlib.sha1(t.contiguous().numpy().tobytes()).hexdigest()


@ray.remote(num_cpus=0)
def produce(dp: MMRayDataPlane, unit: str, payloads: list[MMPayload]) -> int:
    dp.client(unit).put(payloads)
    return len(payloads)


@ray.remote(num_cpus=0)
class Rank:
    """A trainer rank: prefetches its shares; reports ids, pixel bytes and, per trajectory, its images' digests."""

    def __init__(self, dp: MMRayDataPlane, rank: int) -> None:
        self.client, self.rank = dp.client(), rank

    def consume(self, count: int):  # noqa: ANN201
        pf = Prefetcher(self.client, self.rank, None, PrefetchConfig(depth=1, admit_timeout_s=60), count=count)
        out = []
        for share in pf:
            ids = share.image_ids
            out.append((share.traj_ids, share.pixel_nbytes, share.occurrence_nbytes,
                        {t: [_digest(share.images.pixels[i]) for i in ids[t]] for t in share.traj_ids}))
        return out


def test_ray_ranks_fetch_each_distinct_image_of_their_share_once(dp):
    wl = MultimodalWorkload(MMWorkloadConfig(prompts_per_batch=4, n=4, images_per_prompt=2,
                                             image_sizes=((56, 56), (56, 84))))
    groups = wl.sample_batch(0)
    group_of = {s.traj_id: g for g in groups for s in g.samples}
    payloads = {gi: [MMPayload(s.traj_id, trajectory_fields(s), group=gi,
                               encodings=tuple(g.images[j].pixel_values for j in s.image_index),
                               grids=tuple(g.images[j].grid_thw for j in s.image_index)) for s in g.samples]
                for gi, g in enumerate(groups)}
    ranks = [Rank.remote(dp, r) for r in range(2)]
    runs = [r.consume.remote(2) for r in ranks]  # waiting on admission before any data exists
    ray.get([produce.remote(dp, f"u{u}", [p for gi in range(u, 4, 2) for p in payloads[gi]]) for u in range(2)])
    distinct = sum(im.nbytes for g in groups for im in g.images)
    assert dp.live_bytes() == distinct  # one stored copy per distinct image, n references each
    driver = dp.client()
    for k in range(2):
        gs = groups[2 * k:2 * k + 2]
        driver.admit(MiniBatch(0, k, tuple(s.traj_id for g in gs for s in g.samples), (2 * k, 2 * k + 1), 0))
    results = ray.get(runs, timeout=120)
    moved, seen = 0, []
    for got in results:
        for traj_ids, pix, occ, digests in got:
            mine = {id(group_of[t]): group_of[t] for t in traj_ids}
            assert pix == sum(im.nbytes for g in mine.values() for im in g.images)  # distinct, once
            assert occ == 4 * pix
            for t in traj_ids:
                assert digests[t] == [_digest(im.pixel_values) for im in group_of[t].images]
            moved += pix
            seen += traj_ids
    assert moved == distinct
    assert sorted(seen) == sorted(group_of)  # every trajectory delivered once, none twice
    dp.controller.wait_released(2, timeout=30)  # the ranks' acks are fire-and-forget: both mini-batches released
    dp.wait_drained(timeout=30)  # ... and every drop the controller sent confirmed by its unit (no polling)
    assert dp.live_bytes() == 0
    assert all(s.live_refs == 0 for s in dp.store_stats().values())


def test_ray_ranks_fetch_each_distinct_image_once_when_a_groups_copies_sit_on_both_units(ray_local):
    """verl's placement: a group's samples alternate between the units, so both hold a copy of every image; the
    claim names one unit per image and a rank still moves each distinct image of its share once."""
    wl = MultimodalWorkload(MMWorkloadConfig(prompts_per_batch=2, n=4, images_per_prompt=1,
                                             image_sizes=((56, 56), (56, 84)), seed=1))
    groups = wl.sample_batch(0)
    group_of = {s.traj_id: g for g in groups for s in g.samples}
    plane = build_mm_ray(UNITS, RANKS)
    try:
        by_unit: dict[int, list[MMPayload]] = {0: [], 1: []}
        for gi, g in enumerate(groups):
            for i, s in enumerate(g.samples):
                by_unit[i % 2].append(MMPayload(s.traj_id, trajectory_fields(s), group=gi,
                                                encodings=tuple(g.images[j].pixel_values for j in s.image_index),
                                                grids=tuple(g.images[j].grid_thw for j in s.image_index)))
        ray.get([produce.remote(plane, f"u{u}", ps) for u, ps in by_unit.items()])
        distinct = sum(im.nbytes for g in groups for im in g.images)
        assert plane.live_bytes() == 2 * distinct  # each unit stores its own copy
        runs = [Rank.remote(plane, r).consume.remote(1) for r in range(2)]
        plane.client().admit(MiniBatch(0, 0, tuple(group_of), (0, 1), 0))
        moved = 0
        for got in ray.get(runs, timeout=120):
            for traj_ids, pix, occ, digests in got:
                mine = {id(group_of[t]): group_of[t] for t in traj_ids}
                assert pix == sum(im.nbytes for g in mine.values() for im in g.images)  # once, not once per unit
                for t in traj_ids:
                    assert digests[t] == [_digest(im.pixel_values) for im in group_of[t].images]
                moved += pix
        assert moved == distinct
        assert [ray.get(a.get_count.remote()) for a in plane.unit_actors.values()] == [0, 0]  # straight from sources
        plane.controller.wait_released(1, timeout=30)
        plane.wait_drained(timeout=30)
        assert plane.live_bytes() == 0
    finally:
        plane.close()


def test_a_share_names_only_its_own_images_objects(ray_local):
    """Ray moves whole objects between nodes: a rank on another node pulls every object its share names. Each
    distinct image is an object of its own (``MMUnitHost._put_views``), so the image objects a share names hold
    exactly its distinct images' bytes -- not the other groups' images of the same put (with one object per put,
    a rank pulled all of them and every further rank pulled them again: 903168 bytes here against 451584)."""
    from knittrans.dataplane.types import MiniBatchKey
    from knittrans.mmdedup.plane import IMAGE_FIELD, MMShareRuns

    wl = MultimodalWorkload(MMWorkloadConfig(prompts_per_batch=4, n=2, images_per_prompt=2,
                                             image_sizes=((56, 56), (56, 84)), seed=2))
    groups = wl.sample_batch(0)
    plane = build_mm_ray(UNITS, RANKS)
    try:
        ray.get(produce.remote(plane, "u0", [  # one put of every group: each rank's share needs half its images
            MMPayload(s.traj_id, trajectory_fields(s), group=gi,
                      encodings=tuple(g.images[j].pixel_values for j in s.image_index),
                      grids=tuple(g.images[j].grid_thw for j in s.image_index))
            for gi, g in enumerate(groups) for s in g.samples]))
        plane.client().admit(MiniBatch(0, 0, tuple(s.traj_id for g in groups for s in g.samples), (0, 1, 2, 3), 0))
        fields = tuple(plane.schema.names)
        for rank in range(2):
            loc = plane.controller.claim(MiniBatchKey(0, 0), rank, fields)
            runs = loc.runs
            assert isinstance(runs, MMShareRuns) and IMAGE_FIELD in loc.fields
            mine = {id(g): g for g in groups if any(s.traj_id in loc.traj_ids for s in g.samples)}
            want = sum(im.nbytes for g in mine.values() for im in g.images)
            assert 0 < want < sum(im.nbytes for g in groups for im in g.images)
            image_sources = sorted({o for o, _, _, _ in runs.images.tolist()})
            field_sources = {o for r in runs.runs for o in r[:, 0].tolist()}
            assert not set(image_sources) & field_sources
            held = sum(a.nbytes for o in image_sources for a in ray.get(runs.sources[o]))
            assert held == sum(b - a for _, _, a, b in runs.images.tolist()) == want
            plane.controller.unclaim(MiniBatchKey(0, 0), rank, fields)
    finally:
        plane.close()
