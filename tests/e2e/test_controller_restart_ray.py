"""A Ray controller actor killed mid-run under load is restarted by Ray and rebuilt from its journal and the units
(``knittrans.dataplane.recovery``): producers and ranks in other processes go on without noticing, every
trajectory is trained exactly once, versions and records are whole. Also: ``HandoffConfig.read_timeout_s`` reaches
the Ray transport's reads."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("ray")
import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402

from e2e_helpers import wait_until  # noqa: E402
from knittrans.handoff import Handoff, HandoffConfig, Rollout, Transport  # noqa: E402
from knittrans.types import BatchPlan, GroupSpec, Trajectory  # noqa: E402

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(__import__(__name__))  # Ray workers cannot import this module
P, N, M, L, BATCHES = 4, 2, 2, 8, 4


def plan(b: int) -> BatchPlan:
    return BatchPlan(b, tuple(GroupSpec(b * P + g, b, N) for g in range(P)))


def rollout(t: int, b: int) -> Rollout:
    resp = 1 + t % 4
    return Rollout(Trajectory(t, t // N, b, resp, v_gen=b), {
        "input_ids": np.arange(4 + resp) + t, "old_logprobs": np.full(resp, -0.5, np.float32),
        "advantages": np.ones(resp, np.float32), "loss_mask": np.ones(resp, bool)})


@ray.remote(num_cpus=0)
def produce(producer, groups: list[tuple[int, list[int]]], pace_s: float) -> int:
    for b, ids in groups:  # one GRPO group per put, paced: the run lasts long enough to be killed mid-way
        producer.put([rollout(t, b) for t in ids])
        time.sleep(pace_s)
    return sum(len(ids) for _, ids in groups)


@ray.remote(num_cpus=0)
def train(consumer) -> list[tuple[int, tuple[int, ...], bool]]:
    out = []
    for share in consumer:
        cu = share.fields["input_ids"].cu_seqlens.tolist()
        ok = all(int(share["input_ids"][cu[i]]) == t for i, t in enumerate(share.traj_ids))  # bytes are its own
        out.append((share.seq, share.traj_ids, ok))
        consumer.ack(share)
    return out


def test_a_killed_controller_actor_is_restarted_and_every_trajectory_is_trained_exactly_once(ray_local):
    h = Handoff(HandoffConfig.grpo(P, N, M, L, transport=Transport.RAY, units=(("u0", "n0"), ("u1", "n1")),
                                   rank_nodes=("n0", "n1"), admit_timeout_s=60))
    try:
        for b in range(BATCHES):
            h.add_batch(plan(b))
        h.seal()
        ranks = [train.remote(h.consumer(r)) for r in range(2)]
        work = {u: [(b, [g * N + k for k in range(N)]) for b in range(BATCHES) for g in range(b * P, (b + 1) * P)
                    if g % 2 == i] for i, u in enumerate(("u0", "u1"))}
        prods = [produce.remote(h.producer(u), w, 0.15) for u, w in work.items()]
        kills = 0
        for at_version in (1, 3, 5):  # kill it three times while producers put and ranks fetch and ack
            wait_until(lambda: h.version >= at_version)
            ray.kill(h.plane.controller_actor, no_restart=False)
            kills += 1
            wait_until(lambda: h.stats()[0].restarts == kills)  # Ray restarted it and it rebuilt itself
        assert sum(ray.get(prods, timeout=120)) == BATCHES * P * N
        got = ray.get(ranks, timeout=120)
        for shares in got:
            assert [s for s, _, _ in shares] == list(range(BATCHES * M))  # every step once per rank, in order
            assert all(ok for _, _, ok in shares)
        trained = sorted(t for shares in got for _, ids, _ in shares for t in ids)
        assert trained == list(range(BATCHES * P * N))  # each trajectory exactly once
        assert h.version == BATCHES * M and h.stats()[0].restarts == 3
        recs = h.records()
        assert [r.traj_id for r in recs] == trained and all(r.released for r in recs)  # records survived too
        step = {t: s for shares in got for s, ids, _ in shares for t in ids}
        assert all(r.v_train == step[r.traj_id] for r in recs)
        h.wait_drained(timeout=30)
        from workloads.reliability_faults import units_empty

        assert units_empty(h.plane)
    finally:
        h.close()


def test_handoff_read_timeout_reaches_the_ray_reads(ray_local):
    h = Handoff(HandoffConfig.grpo(2, 2, 1, 8, transport=Transport.RAY, read_timeout_s=0.5))
    try:
        getter = h.consumer(0).client.getter
        assert h.plane.read_timeout_s == 0.5 and getter.read_timeout_s == 0.5
        assert all(u.read_timeout_s == 0.5 for u in getter.units.values())
    finally:
        h.close()
