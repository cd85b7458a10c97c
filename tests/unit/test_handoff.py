"""The handoff as a user imports it: admission, data plane, prefetching consumers, acks and versions together."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from baselines.admission import make_policy
from knittrans.admission.base import AdmissionError
from knittrans.dataplane.types import AdmissionStateError, DuplicatePutError, SchemaMismatchError
from knittrans.handoff import Handoff, HandoffConfig, Rollout
from knittrans.types import AdmissionKind, BatchPlan, GroupSpec, Trajectory

P, N, M, L = 4, 2, 2, 8


def cfg(**kw) -> HandoffConfig:
    return HandoffConfig.grpo(prompts_per_batch=P, group_size=N, num_minibatches=M, max_response_len=L, **kw)


def plan(b: int) -> BatchPlan:
    return BatchPlan(b, tuple(GroupSpec(b * P + g, b, N) for g in range(P)))


def rollout(t: int, b: int = 0, v_gen: int = 0, resp: int = 3) -> Rollout:
    return Rollout(Trajectory(traj_id=t, group_id=t // N, batch_id=b, num_tokens=resp, v_gen=v_gen),
                   {"input_ids": np.arange(4 + resp) + t, "old_logprobs": np.full(resp, -0.5, np.float32),
                    "advantages": np.ones(resp, np.float32), "loss_mask": np.ones(resp, bool)})


def test_every_trajectory_is_delivered_exactly_once_in_admission_order_with_its_version():
    h = Handoff(cfg())
    for b in range(3):
        h.add_batch(plan(b))
    h.seal()
    h.put([rollout(t, t // (P * N)) for t in range(3 * P * N)])
    c = h.consumer()
    seen = []
    for share in c:
        assert share.seq == len(seen) == h.version  # trained at the version it is handed at
        seen.append(share.traj_ids)
        # the packed tensors are this share's: cu_seqlens delimit each trajectory's ids
        cu = share.fields["input_ids"].cu_seqlens.tolist()
        assert [int(share["input_ids"][cu[i]]) for i in range(len(cu) - 1)] == list(share.traj_ids)
        c.ack(share)
    ids = [t for s in seen for t in s]
    assert sorted(ids) == list(range(3 * P * N)) and len(seen) == 3 * M
    assert h.version == 3 * M
    recs = h.records()
    step_of = {t: s for s, ts in enumerate(seen) for t in ts}
    assert all(r.v_train == step_of[r.traj_id] for r in recs) and len(recs) == len(ids)
    assert all(r.released for r in recs)


def test_the_version_advances_only_when_every_rank_acknowledged_the_step():
    h = Handoff(cfg(rank_nodes=("n0", "n0")))
    h.add_batch(plan(0))
    h.seal()
    h.put([rollout(t) for t in range(P * N)])
    r0, r1 = h.consumer(0), h.consumer(1)
    a0, a1 = r0.take(1)[0], r1.take(1)[0]
    assert a0.seq == a1.seq == 0 and set(a0.traj_ids).isdisjoint(a1.traj_ids)
    r0.ack(a0)
    assert h.version == 0  # rank 1 has not stepped yet
    r1.ack(a1)
    assert h.wait_version(1, timeout=5) == 1


def test_knittrans_admits_a_minibatch_as_soon_as_its_groups_complete_train_batch_waits_for_the_batch():
    kt = Handoff(cfg())
    tb = Handoff(cfg(), policy=make_policy(AdmissionKind.TRAIN_BATCH, cfg().constraints))
    for h in (kt, tb):
        h.add_batch(plan(0))
        h.put([rollout(t) for t in range(N * P // M)])  # the first mini-batch's worth of groups
    assert kt.plane.controller_stats().admitted == 1
    assert tb.plane.controller_stats().admitted == 0
    tb.put([rollout(t) for t in range(N * P // M, N * P)])
    assert tb.plane.controller_stats().admitted == M


def test_staleness_is_recorded_from_v_gen_and_the_training_step():
    h = Handoff(cfg())
    h.add_batch(plan(0))
    h.add_batch(plan(1))
    h.seal()
    h.put([rollout(t, 0, v_gen=0) for t in range(P * N)])
    c = h.consumer()
    for share in c.take(M):
        c.ack(share)
    h.put([rollout(t, 1, v_gen=1) for t in range(P * N, 2 * P * N)])  # generated after one sync
    for share in c:
        c.ack(share)
    s = sorted(r.staleness for r in h.records())
    # batch 0: steps 0, 1 from v0 -> 0, 1; batch 1: steps 2, 3 from v1 -> 1, 2 (each mini-batch is 4 trajectories)
    assert s == [0] * 4 + [1] * 8 + [2] * 4
    assert h.staleness().mean == pytest.approx(1.0)


def test_rejected_puts_change_nothing_and_name_the_problem():
    h = Handoff(cfg())
    h.add_batch(plan(0))
    with pytest.raises(AdmissionStateError, match=r"group 99 of batch 0 was never announced"):
        h.put([rollout(0), Rollout(Trajectory(1, 99, 0, 3, 0), rollout(1).tensors)])
    with pytest.raises(SchemaMismatchError, match=r"'old_logprobs'"):
        bad = rollout(1)
        h.put([Rollout(bad.traj, {**bad.tensors, "old_logprobs": np.full(3, np.nan, np.float32)})])
    with pytest.raises(ValueError, match="text-only"):
        h.put([Rollout(rollout(2).traj, rollout(2).tensors, images=(torch.zeros(4, 8),))])
    with pytest.raises(AdmissionStateError, match="max_response_len=8"):
        h.put([rollout(3, resp=9)])
    assert h.stats()[0].trajectories == 0 and all(u.num_trajectories == 0 for u in h.stats()[1])
    h.put([rollout(t) for t in range(P * N)])  # the same ids are still accepted: nothing half-written
    before = h.stats()
    h.put([rollout(0)])  # a retried put of identical content (its reply was lost) is a no-op
    assert h.stats() == before
    with pytest.raises(DuplicatePutError, match="different content"):
        h.put([rollout(0, resp=2)])
    with pytest.raises(ValueError, match="built for"):
        Handoff(cfg(), policy=make_policy("knittrans", HandoffConfig.grpo(2, 2, 2, 8).constraints))
    h.add_batch(plan(0))  # a retried announcement (its reply was lost, e.g. across a controller restart): a no-op
    with pytest.raises(AdmissionError, match="already added"):
        h.add_batch(BatchPlan(0, plan(0).groups[:2]))  # another plan under the same id


def test_concurrent_producers_and_prefetching_ranks_lose_and_duplicate_nothing():
    batches = 6
    h = Handoff(cfg(units=(("u0", "n0"), ("u1", "n1")), rank_nodes=("n0", "n1"), prefetch_depth=2))
    for b in range(batches):
        h.add_batch(plan(b))
    h.seal()
    got: dict[int, list[int]] = {0: [], 1: []}
    consumers = [h.consumer(r) for r in range(2)]

    def train(r: int) -> None:
        for share in consumers[r]:
            got[r] += share.traj_ids
            consumers[r].ack(share)

    def produce(unit: str, parity: int) -> None:
        p = h.producer(unit)
        for b in range(batches):
            ids = [t for t in range(b * P * N, (b + 1) * P * N) if (t // N) % 2 == parity]
            p.put([rollout(t, b) for t in ids])

    threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
    threads += [threading.Thread(target=produce, args=(u, i)) for i, u in enumerate(("u0", "u1"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert sorted(got[0] + got[1]) == list(range(batches * P * N))
    assert h.version == batches * M
    assert all(u.num_trajectories == 0 for u in h.stats()[1])  # every released trajectory was dropped


def test_a_policy_that_cannot_split_a_batch_fails_every_waiter_instead_of_hanging():
    class Broken:
        name = "broken"

        def __init__(self, c):
            self.constraints = c
            self.inner = make_policy("knittrans", c)

        def add_batch(self, p):
            self.inner.add_batch(p)

        def on_complete(self, t):
            self.inner.on_complete(t)
            self.seen = True

        def on_trainer_ready(self, now):
            if getattr(self, "seen", False):
                raise AdmissionError("no split into 2 mini-batches was found")
            return []

        stats = property(lambda self: self.inner.stats)

    h = Handoff(cfg(), policy=Broken(cfg().constraints))
    h.add_batch(plan(0))
    with pytest.raises(AdmissionError, match="no split"):
        h.put([rollout(t) for t in range(N)])
    with pytest.raises(AdmissionError, match="no split"):
        h.consumer().take(1)


def test_a_consumer_with_a_count_stops_there_and_the_next_one_resumes_without_losing_a_share():
    h = Handoff(cfg())
    for b in range(2):
        h.add_batch(plan(b))
    h.put([rollout(t, t // (P * N)) for t in range(2 * P * N)])  # not sealed: the stream has no end yet
    first = h.consumer(count=M)
    assert [s.seq for s in first] == list(range(M))  # ends after M shares instead of waiting for more
    second = h.consumer(start_seq=M, count=M)  # its prefetcher never claimed past its count: nothing is taken
    assert [s.seq for s in second] == list(range(M, 2 * M))
    with pytest.raises(ValueError, match="count"):
        h.consumer(count=-1)


def test_a_consumer_read_in_steps_reads_nothing_past_them_and_the_next_steps_go_on_without_a_gap():
    h = Handoff(cfg())
    for b in range(2):
        h.add_batch(plan(b))
    h.put([rollout(t, t // (P * N)) for t in range(2 * P * N)])  # every mini-batch admitted
    c = h.consumer()
    seen = []
    for share in c.steps(M):
        seen.append(share)
        c.ack(share)
    assert [s.seq for s in seen] == list(range(M))
    time.sleep(0.3)  # a prefetcher not bounded by the steps would have claimed and read the next ones by now
    assert h.plane.controller.stats().claims == M
    for share in c.steps(M):
        seen.append(share)
        c.ack(share)
    assert [s.seq for s in seen] == list(range(2 * M))
    assert sorted(t for s in seen for t in s.traj_ids) == list(range(2 * P * N))
    assert list(c.steps(0)) == []
    c.close()


def test_close_from_another_thread_ends_a_consumer_that_is_waiting_for_a_minibatch():
    # A rollout thread that fails closes the handoff; the trainer blocked on its next share must wake (the
    # prefetch worker is stopped before it can enqueue its end marker), not wait for ever.
    h = Handoff(HandoffConfig.grpo(2, 2, 1, 8))
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(list(h.consumer(0))), daemon=True)
    t.start()
    t.join(timeout=0.3)
    assert t.is_alive()  # nothing admitted yet: it waits
    h.close()
    t.join(timeout=5.0)
    assert not t.is_alive() and got == [[]]
