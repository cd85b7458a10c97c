"""The multimodal plane's Ray controller actor (``build_mm_ray``: an ``MMController`` journaling to a
``JournalActor``), killed mid-run while producers put GRPO groups spread over two unit actors and two ranks fetch,
is restarted by Ray and rebuilt from its journal and the units' manifests (groups and content keys included):
every trajectory is trained exactly once, every image occurrence resolves to its own bytes and grid, each distinct
image of a share moves once however many units hold copies, and the encoding stores end empty."""

from __future__ import annotations

import hashlib
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from e2e_helpers import wait_until  # noqa: E402
from knittrans.admission.minibatch import KnitTransAdmission  # noqa: E402
from knittrans.constraints import BatchConstraints  # noqa: E402
from knittrans.mmdedup.plane import MMPayload  # noqa: E402
from knittrans.mmdedup.plane_ray import MMRayDataPlane, build_mm_ray  # noqa: E402
from knittrans.types import BatchPlan, GroupSpec, Trajectory  # noqa: E402
from workloads.multimodal import MMWorkloadConfig, MultimodalWorkload  # noqa: E402
from workloads.multimodal_data import producer_of, trajectory_fields  # noqa: E402

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this module

UNITS = {"u0": "n0", "u1": "n1"}
RANKS = ("n0", "n1")
BATCHES, P, N, M = 3, 4, 4, 2


def _digest(t) -> str:  # noqa: ANN001
    return hashlib.sha1(t.contiguous().numpy().tobytes()).hexdigest()


@ray.remote(num_cpus=0)
def produce(dp: MMRayDataPlane, puts: list[dict[str, list[MMPayload]]], pace_s: float) -> int:
    """One process for both units' producers (a worker process per producer costs seconds to start on a loaded
    machine): one GRPO group at a time, its samples to their units, paced so the run lasts past the kills."""
    clients = {u: dp.client(u) for u in UNITS}
    for by_unit in puts:
        for u, payloads in by_unit.items():
            clients[u].put(payloads)
        time.sleep(pace_s)
    return sum(len(p) for by_unit in puts for p in by_unit.values())


@ray.remote(num_cpus=0)
def train(dp: MMRayDataPlane, steps: int, step_s: float):  # noqa: ANN201
    """Both ranks in one process, in turn at each step (their claims and acks are separate controller calls); an
    optimizer step takes ``step_s``, so claims are still to come when the driver sees a version and kills."""
    client, out = dp.client(), {r: [] for r in range(len(RANKS))}
    for seq in range(steps):
        time.sleep(step_s)
        for rank in out:
            share = client.fetch_next(seq, rank, timeout=60)
            ids = share.image_ids
            out[rank].append((share.seq, share.traj_ids, share.pixel_nbytes,
                              {t: [(_digest(share.images.pixels[i]), share.images.grids[i]) for i in ids[t]]
                               for t in share.traj_ids}))
    return list(out.values())


def test_a_killed_mm_controller_actor_is_rebuilt_and_every_trajectory_trains_once_with_its_images(ray_local):
    wl = MultimodalWorkload(MMWorkloadConfig(prompts_per_batch=P, n=N, images_per_prompt=2,
                                             image_sizes=((56, 56), (56, 84)), seed=0))
    groups = [g for b in range(BATCHES) for g in wl.sample_batch(b)]
    sample = {s.traj_id: (g, s) for g in groups for s in g.samples}
    fields = {t: trajectory_fields(s) for t, (_, s) in sample.items()}
    c = BatchConstraints(batch_size=P * N, num_minibatches=M, group_size=N,
                         max_response_len=max(len(f["advantages"]) for f in fields.values()))
    dp = build_mm_ray(UNITS, RANKS, policy=KnitTransAdmission(c))
    try:
        assert dp.restartable  # restartable by default, as build_ray
        for b in range(BATCHES):
            dp.controller.add_batch(BatchPlan(b, tuple(GroupSpec(b * P + g, b, N) for g in range(P))))
        dp.controller.seal()
        puts: list[dict[str, list[MMPayload]]] = []
        for g in groups:  # spread (verl's agent loop): every group's samples on both units
            by_unit: dict[str, list[MMPayload]] = {}
            for i, s in enumerate(g.samples):
                meta = Trajectory(s.traj_id, s.prompt_id, s.prompt_id // P, len(fields[s.traj_id]["advantages"]), 0)
                by_unit.setdefault(f"u{producer_of('spread', s.prompt_id, i, N, len(UNITS))}", []).append(MMPayload(
                    s.traj_id, fields[s.traj_id], meta=meta, group=s.prompt_id,
                    encodings=tuple(g.images[j].pixel_values for j in s.image_index),
                    grids=tuple(g.images[j].grid_thw for j in s.image_index)))
            puts.append(by_unit)
        ranks = train.remote(dp, BATCHES * M, 0.8)
        prods = produce.remote(dp, puts, 0.05)
        # 1: mid-run (producers putting, ranks stepping); 2: every put done, so the rebuilt controller knows the
        # groups and image keys of the steps still to come only from the units' manifests. Two kills: each restart
        # starts a new actor process (10-25 s at a load average of 30 on the shared cores)
        wait_until(lambda: dp.controller.version >= 1)
        dp.restart_controller()
        assert ray.get(prods, timeout=60) == len(sample)
        wait_until(lambda: dp.controller.version >= 2)
        before = dp.controller.version
        restarts = dp.restart_controller()
        assert restarts == 2 and before < BATCHES * M  # the last kill came before the last step
        got = ray.get(ranks, timeout=60)
        trained = []
        for shares in got:
            assert [s for s, *_ in shares] == list(range(BATCHES * M))  # every step once per rank, in order
            for _, ids, moved, occ in shares:
                trained += ids
                mine = {id(sample[t][0]): sample[t][0] for t in ids}
                assert moved == sum(im.nbytes for g in mine.values() for im in g.images)  # each distinct once
                for t in ids:
                    g, s = sample[t]
                    assert occ[t] == [(_digest(g.images[j].pixel_values), g.images[j].grid_thw)
                                      for j in s.image_index], f"trajectory {t}: wrong bytes or grid"
        assert sorted(trained) == sorted(sample)  # each trajectory exactly once
        st = dp.controller_stats()
        assert (st.released_minibatches, st.restarts, st.missing) == (BATCHES * M, 2, 0)
        dp.wait_drained(timeout=30)
        assert dp.live_bytes() == 0 and all(u.nbytes == 0 for u in dp.unit_stats())  # encoding stores empty
    finally:
        dp.close()
