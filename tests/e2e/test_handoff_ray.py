"""The same handoff API on the Ray transport: producer and trainer handles pickle into actors; multimodal shares
carry each distinct image once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ray")
import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402

from knittrans.handoff import Handoff, HandoffConfig, Rollout, Transport  # noqa: E402
from knittrans.types import BatchPlan, GroupSpec, Trajectory  # noqa: E402

pytestmark = pytest.mark.ray
# Ray workers cannot import this test module: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(__import__(__name__))
P, N, M, L, BATCHES = 4, 2, 2, 8, 3


def plan(b: int) -> BatchPlan:
    return BatchPlan(b, tuple(GroupSpec(b * P + g, b, N) for g in range(P)))


def rollout(t: int, b: int) -> Rollout:
    return Rollout(Trajectory(t, t // N, b, 3, v_gen=b), {
        "input_ids": np.arange(7) + t, "old_logprobs": np.full(3, -0.5, np.float32),
        "advantages": np.ones(3, np.float32), "loss_mask": np.ones(3, bool)})


@ray.remote(num_cpus=0)
def produce(producer, ids_by_batch) -> int:
    for b, ids in ids_by_batch:
        producer.put([rollout(t, b) for t in ids])
    return sum(len(ids) for _, ids in ids_by_batch)


@ray.remote(num_cpus=0)
def train(consumer) -> list[tuple[int, tuple[int, ...]]]:
    out = []
    for share in consumer:
        out.append((share.seq, share.traj_ids))
        consumer.ack(share)
    return out


def test_ray_handoff_delivers_every_trajectory_once_across_producer_and_rank_actors(ray_local):
    h = Handoff(HandoffConfig.grpo(P, N, M, L, transport=Transport.RAY, units=(("u0", "n0"), ("u1", "n1")),
                                   rank_nodes=("n0", "n1")))
    try:
        for b in range(BATCHES):
            h.add_batch(plan(b))
        h.seal()
        ranks = [train.remote(h.consumer(r)) for r in range(2)]
        work = {u: [(b, [t for t in range(b * P * N, (b + 1) * P * N) if (t // N) % 2 == i]) for b in range(BATCHES)]
                for i, u in enumerate(("u0", "u1"))}
        assert sum(ray.get([produce.remote(h.producer(u), w) for u, w in work.items()])) == BATCHES * P * N
        got = ray.get(ranks, timeout=120)
        ids = [t for r in got for _, ts in r for t in ts]
        assert sorted(ids) == list(range(BATCHES * P * N))
        assert [s for s, _ in got[0]] == list(range(BATCHES * M)) == [s for s, _ in got[1]]
        assert h.wait_version(BATCHES * M, timeout=30) == BATCHES * M
        h.wait_drained(timeout=30)  # every released trajectory's drop confirmed by its unit: no polling
        assert all(u.num_trajectories == 0 and u.nbytes == 0 for u in h.stats()[1])
        recs = h.records()
        assert len(recs) == BATCHES * P * N and all(r.staleness == r.v_train - r.batch_id for r in recs)
    finally:
        h.close()


@pytest.mark.parametrize("transport", [Transport.INPROCESS, Transport.RAY])
def test_multimodal_handoff_moves_each_distinct_image_once_with_the_index_map(ray_local, transport):
    h = Handoff(HandoffConfig.grpo(2, 4, 1, 8, transport=transport, multimodal=True))
    try:
        h.add_batch(BatchPlan(0, (GroupSpec(0, 0, 4), GroupSpec(1, 0, 4))))
        h.seal()
        imgs = [torch.randn(16, 1176), torch.randn(4, 1176)]
        grids = [(1, 4, 4), (1, 2, 2)]

        def mm(t: int) -> Rollout:
            g = t // 4
            return Rollout(Trajectory(t, g, 0, 2, 0), {"input_ids": np.arange(6), "old_logprobs": np.zeros(2, np.float32),
                                                       "advantages": np.ones(2, np.float32),
                                                       "loss_mask": np.ones(2, bool)},
                           images=(imgs[g],), grids=(grids[g],))

        h.put([mm(t) for t in range(8)])
        c = h.consumer()
        (share,) = c.take(1)
        assert len(share.images.pixels) == 2  # 8 occurrences, 2 distinct images
        assert share.pixel_nbytes == sum(x.numel() * 4 for x in imgs)
        assert share.occurrence_nbytes == 4 * share.pixel_nbytes
        for t, idx in share.image_ids.items():
            (i,) = idx
            assert torch.equal(share.images.pixels[i], imgs[t // 4]) and share.images.grids[i] == grids[t // 4]
        c.ack(share)
        h.wait_drained(timeout=30)
        assert h.version == 1
    finally:
        h.close()


@pytest.mark.parametrize("transport", [Transport.INPROCESS, Transport.RAY])
def test_a_multimodal_completing_put_travels_as_columns_and_keeps_groups_whole(ray_local, transport, monkeypatch):
    """The rollout engine streams a trajectory's fields and images while it generates; at completion its Producer
    puts the advantages with the metadata (imageless rollouts). That put goes as columns -- no payload-by-payload
    put at the unit -- and still keeps each group whole in one rank's share, each group's image once, and the
    groups a restarted controller would read from the units' manifests. An imageless rollout of a trajectory the
    unit has never seen is still put payload by payload (its empty image index is written)."""
    from knittrans.dataplane.ray_transport import RayUnitProxy
    from knittrans.mmdedup.plane import IMAGE_FIELD, MMPayload, MMStorageUnit

    G, n = 4, 2
    h = Handoff(HandoffConfig.grpo(G, n, 1, 16, transport=transport, multimodal=True,
                                   units=(("u0", "n0"), ("u1", "n1")), rank_nodes=("n0", "n1")))
    per_payload = []
    cls, name = (RayUnitProxy, "put") if transport is Transport.RAY else (MMStorageUnit, "put")
    orig = getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda self, payloads, *a, **k: (per_payload.append(len(payloads)),
                                                                     orig(self, payloads, *a, **k))[1])
    try:
        h.add_batch(BatchPlan(0, tuple(GroupSpec(g, 0, n) for g in range(G))))
        h.seal()
        imgs = [torch.randn(4 * (g + 1), 1176) for g in range(G)]
        grids = [(1, 2, 2 * (g + 1)) for g in range(G)]
        fields = {t: {"input_ids": np.arange(6 + t), "old_logprobs": np.full(2 + t, -0.5, np.float32),
                      "loss_mask": np.ones(2 + t, bool)} for t in range(G * n)}
        for u in ("u0", "u1"):  # generating: every field but the advantages, with the images (group g on u{g%2})
            h.plane.client(u).put([MMPayload(t, fields[t], group=t // n, encodings=(imgs[t // n],),
                                             grids=(grids[t // n],))
                                   for t in range(G * n) if (t // n) % 2 == int(u[1])])
        streamed = len(per_payload)
        for u in ("u0", "u1"):  # completion: the advantages and the metadata, no images
            h.producer(u).put([Rollout(Trajectory(t, t // n, 0, 2 + t, 0),
                                       {"advantages": np.full(2 + t, t, np.float32)})
                               for t in range(G * n) if (t // n) % 2 == int(u[1])])
        assert len(per_payload) == streamed  # the completing puts went as columns
        manifests = ({u: unit.manifest() for u, unit in h.plane.units.items()} if transport is Transport.INPROCESS
                     else dict(zip(h.plane.unit_actors, ray.get([a.manifest.remote()
                                                                 for a in h.plane.unit_actors.values()]))))
        assert {r.traj_id: r.group for rs in manifests.values() for r in rs} == {t: t // n for t in range(G * n)}
        shares = [h.consumer(r).take(1)[0] for r in range(2)]
        got = {}
        for s in shares:
            groups = {t // n for t in s.traj_ids}
            assert {t for t in range(G * n) if t // n in groups} == set(s.traj_ids)  # whole groups
            assert len(s.images.pixels) == len(groups)  # each group's image once
            adv, cu = s.fields["advantages"].values, s.fields["advantages"].cu_seqlens
            for i, t in enumerate(s.traj_ids):
                got[t] = adv[int(cu[i]):int(cu[i + 1])]
                (j,) = s.image_ids[t]
                assert torch.equal(s.images.pixels[j], imgs[t // n])
        assert sorted(got) == list(range(G * n))
        assert all(torch.equal(got[t], torch.full((2 + t,), float(t))) for t in got)
    finally:
        h.close()
    h = Handoff(HandoffConfig.grpo(1, n, 1, 8, transport=transport, multimodal=True))
    try:
        h.add_batch(BatchPlan(0, (GroupSpec(0, 0, n),)))
        h.seal()
        before = len(per_payload)
        h.producer().put([Rollout(Trajectory(t, 0, 0, 2, 0), {"input_ids": np.arange(6),
                                                              "old_logprobs": np.zeros(2, np.float32),
                                                              "loss_mask": np.ones(2, bool),
                                                              "advantages": np.ones(2, np.float32)}) for t in range(n)])
        assert len(per_payload) == before + 1  # new trajectories: payload by payload
        (share,) = h.consumer().take(1)
        assert len(share.images.pixels) == 0 and all(share.image_ids[t] == () for t in range(n))
        assert share.fields[IMAGE_FIELD].values.numel() == 0
    finally:
        h.close()
