"""Small completing puts ride with their registration (``client.INLINE_PUT_BYTES``,
``ray_transport.ControllerHost.register_inline``): the ranks read their bytes from the claim, the unit still holds a
copy before the producer is told the put is stored, a controller killed in between is rebuilt from those copies,
and nothing is trained twice or lost."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("ray")
import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402

from e2e_helpers import wait_until  # noqa: E402
from knittrans.dataplane import MiniBatchKey, TrajectoryPayload  # noqa: E402
from knittrans.dataplane.types import InlineSource  # noqa: E402
from knittrans.handoff import Handoff, HandoffConfig, Rollout, Transport  # noqa: E402
from knittrans.types import BatchPlan, GroupSpec, Trajectory  # noqa: E402

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(__import__(__name__))  # Ray workers cannot import this module
P, N, M, L = 4, 2, 2, 8
FIELDS = ("input_ids", "old_logprobs", "advantages", "loss_mask")


def plan(b: int) -> BatchPlan:
    return BatchPlan(b, tuple(GroupSpec(b * P + g, b, N) for g in range(P)))


def rollout(t: int, b: int) -> Rollout:
    resp = 1 + t % 4
    return Rollout(Trajectory(t, t // N, b, resp, v_gen=b), {
        "input_ids": np.arange(4 + resp) + t, "old_logprobs": np.full(resp, -0.5, np.float32),
        "advantages": np.arange(resp, dtype=np.float32) + t, "loss_mask": np.ones(resp, bool)})


def stream_then_complete(h_plane, producer, unit: str, rs: list[Rollout]) -> None:  # noqa: ANN001
    """What a rollout engine does: every field but the advantages while it generates, then the advantages with
    the trajectory's metadata once its group is scored (the completing put: small)."""
    h_plane.client(unit).put([TrajectoryPayload(r.traj.traj_id, {k: v for k, v in r.tensors.items()
                                                                  if k != "advantages"}) for r in rs])
    producer.put([Rollout(r.traj, {"advantages": r.tensors["advantages"]}) for r in rs])


@ray.remote(num_cpus=0)
def produce(plane, producer, unit: str, groups: list[tuple[int, list[int]]], pace_s: float) -> int:  # noqa: ANN001
    for b, ids in groups:
        stream_then_complete(plane, producer, unit, [rollout(t, b) for t in ids])
        time.sleep(pace_s)
    return sum(len(ids) for _, ids in groups)


@ray.remote(num_cpus=0)
def train(consumer) -> list[tuple[int, tuple[int, ...], bool]]:  # noqa: ANN001
    out = []
    for share in consumer:
        adv, ids = share.fields["advantages"], share.fields["input_ids"]
        ok = True
        for i, t in enumerate(share.traj_ids):
            a = adv.values[adv.cu_seqlens[i]:adv.cu_seqlens[i + 1]].numpy()
            resp = 1 + t % 4
            ok &= np.array_equal(a, np.arange(resp, dtype=np.float32) + t)
            ok &= int(ids.values[ids.cu_seqlens[i]]) == t
        out.append((share.seq, share.traj_ids, bool(ok)))
        consumer.ack(share)
    return out


def test_a_small_completing_put_rides_with_its_claim_and_its_unit_keeps_a_copy_until_consumed(ray_local):
    h = Handoff(HandoffConfig.grpo(P, N, 1, L, transport=Transport.RAY, units=(("u0", "n0"),),
                                   rank_nodes=("n0",)))
    try:
        h.add_batch(plan(0))
        h.seal()
        rs = [rollout(t, 0) for t in range(P * N)]
        stream_then_complete(h.plane, h.producer("u0"), "u0", rs)
        # the unit holds the completing put's copy before the producer's put returned
        held = {r.traj_id: {f.name for f in r.fields} for r in ray.get(h.plane.unit_actors["u0"].manifest.remote())}
        assert held == {t: set(FIELDS) for t in range(P * N)}
        loc = h.plane.controller.claim(MiniBatchKey(0, 0), 0, FIELDS)
        inline = [s for s in loc.runs.sources if isinstance(s, InlineSource)]
        assert len(inline) == 1 and len(loc.runs.sources) == 2  # the streamed fields' object, the advantages' bytes
        h.plane.controller.unclaim(loc.key, 0, FIELDS)
        got = ray.get(train.remote(h.consumer(0)), timeout=120)
        assert [(s, sorted(ids), ok) for s, ids, ok in got] == [(0, list(range(P * N)), True)]
        assert h.wait_version(1, timeout=30) == 1
        h.wait_drained(timeout=30)  # the drop waited for the copy; the unit ends empty
        assert all(u.num_trajectories == 0 and u.nbytes == 0 for u in h.stats()[1])
    finally:
        h.close()


def test_a_controller_killed_after_inline_puts_serves_them_from_the_units_copies(ray_local):
    h = Handoff(HandoffConfig.grpo(P, N, M, L, transport=Transport.RAY, units=(("u0", "n0"), ("u1", "n1")),
                                   rank_nodes=("n0", "n1")))
    try:
        h.add_batch(plan(0))
        h.seal()
        for i, u in enumerate(("u0", "u1")):
            stream_then_complete(h.plane, h.producer(u), u, [rollout(t, 0) for t in range(P * N) if (t // N) % 2 == i])
        ray.kill(h.plane.controller_actor, no_restart=False)  # its inline sources die with it
        wait_until(lambda: h.stats()[0].restarts == 1)
        got = ray.get([train.remote(h.consumer(r)) for r in range(2)], timeout=120)
        ids = [t for r in got for _, ts, _ in r for t in ts]
        assert sorted(ids) == list(range(P * N)) and all(ok for r in got for _, _, ok in r)
        assert h.wait_version(M, timeout=30) == M
        h.wait_drained(timeout=30)
        assert all(u.num_trajectories == 0 for u in h.stats()[1])
    finally:
        h.close()


def test_controller_kills_under_two_phase_puts_train_every_trajectory_exactly_once(ray_local):
    batches = 4
    h = Handoff(HandoffConfig.grpo(P, N, M, L, transport=Transport.RAY, units=(("u0", "n0"), ("u1", "n1")),
                                   rank_nodes=("n0", "n1")))
    try:
        for b in range(batches):
            h.add_batch(plan(b))
        h.seal()
        ranks = [train.remote(h.consumer(r)) for r in range(2)]
        work = {u: [(b, [t for t in range(b * P * N + g * N, b * P * N + (g + 1) * N)])
                    for b in range(batches) for g in range(P) if g % 2 == i] for i, u in enumerate(("u0", "u1"))}
        prods = [produce.remote(h.plane, h.producer(u), u, w, 0.05) for u, w in work.items()]
        kills = 0
        for at_version in (1, 3, 5):  # kill it while producers stream and complete and ranks fetch and ack
            wait_until(lambda: h.version >= at_version)
            ray.kill(h.plane.controller_actor, no_restart=False)
            kills += 1
            wait_until(lambda: h.stats()[0].restarts == kills)
        assert sum(ray.get(prods, timeout=120)) == batches * P * N
        got = ray.get(ranks, timeout=120)
        ids = [t for r in got for _, ts, _ in r for t in ts]
        assert sorted(ids) == list(range(batches * P * N))  # every trajectory trained, none twice
        assert all(ok for r in got for _, _, ok in r)
        assert h.wait_version(batches * M, timeout=30) == batches * M
        h.wait_drained(timeout=30)
        assert all(u.num_trajectories == 0 for u in h.stats()[1])
    finally:
        h.close()


def test_a_unit_dead_before_its_inline_copy_is_reported_lost_and_its_trajectories_are_put_again(ray_local):
    """The completing put reaches the controller, but its unit died: the copy cannot be written, so the producer's
    put raises ``UnitLostError`` (as a put to a dead unit does), the unit's trajectories are missing, and once their
    producer puts them again elsewhere every trajectory is trained exactly once with its own bytes."""
    from knittrans.dataplane.types import UnitLostError

    h = Handoff(HandoffConfig.grpo(P, N, M, L, transport=Transport.RAY, units=(("u0", "n0"), ("u1", "n1")),
                                   rank_nodes=("n0", "n1")))
    try:
        h.add_batch(plan(0))
        h.seal()
        rs = {u: [rollout(t, 0) for t in range(P * N) if (t // N) % 2 == i] for i, u in enumerate(("u0", "u1"))}
        stream_then_complete(h.plane, h.producer("u0"), "u0", rs["u0"])
        h.plane.client("u1").put([TrajectoryPayload(r.traj.traj_id, {k: v for k, v in r.tensors.items()
                                                                      if k != "advantages"}) for r in rs["u1"]])
        ray.kill(h.plane.unit_actors["u1"])
        with pytest.raises(UnitLostError):
            h.producer("u1").put([Rollout(r.traj, {"advantages": r.tensors["advantages"]}) for r in rs["u1"]])
        assert sorted(h.missing()) == sorted(r.traj.traj_id for r in rs["u1"])
        h.producer("u0").put(rs["u1"])  # the producer puts the lost trajectories again, whole, on a live unit
        assert h.missing() == ()
        got = ray.get([train.remote(h.consumer(r)) for r in range(2)], timeout=120)
        ids = [t for r in got for _, ts, _ in r for t in ts]
        assert sorted(ids) == list(range(P * N)) and all(ok for r in got for _, _, ok in r)
    finally:
        h.close()
