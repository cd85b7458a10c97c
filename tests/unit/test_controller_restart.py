"""A controller that dies and restarts is rebuilt from its journal and the storage units
(``knittrans.dataplane.recovery``): nothing lost, nothing trained twice, the same admissions as without the
restart. In process (``InProcessDataPlane.restart_controller``: the same rebuild a restarted Ray actor runs)."""

from __future__ import annotations

import numpy as np
import pytest

from knittrans.admission.minibatch import KnitTransAdmission
from knittrans.constraints import BatchConstraints
from knittrans.dataplane import TrajectoryPayload, build_inprocess
from knittrans.dataplane.faults import StepLedger
from knittrans.dataplane.types import AdmissionStateError, AlreadyConsumedError, DataLostError, MiniBatchKey
from knittrans.types import BatchPlan, GroupSpec, MiniBatch, Trajectory
from workloads.text_data import TEXT_SCHEMA

UNITS = {"u0": "n0", "u1": "n1"}
BATCHES, P, N, M = 4, 4, 2, 2


def _payload(t: int, meta: Trajectory | None = None) -> TrajectoryPayload:
    resp = 1 + t % 5
    return TrajectoryPayload(t, {"input_ids": np.arange(3 + resp, dtype=np.int64) + t,
                                 "old_logprobs": np.full(resp, -t / 10, np.float32),
                                 "advantages": np.ones(resp, np.float32), "loss_mask": np.ones(resp, bool)}, meta=meta)


def _policy_run(seed: int, restart_p: float) -> tuple[list[tuple[int, ...]], list[int], int, object]:
    """Batches of GRPO groups completing in a random order over two units, two ranks stepping as mini-batches are
    admitted; the controller restarts at random points (between puts, between a rank's fetch and its ack).
    Returns the admitted trajectories per step, every trained id, the restarts and the data plane."""
    rng, chaos = np.random.default_rng(seed), np.random.default_rng(seed + 100)
    c = BatchConstraints(batch_size=P * N, num_minibatches=M, max_response_len=8, group_size=N)
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0", "n1"), policy=KnitTransAdmission(c), recoverable=True)
    client, ctrl = dp.client(), dp.controller
    restarts = 0

    def maybe_restart() -> None:
        nonlocal restarts
        if chaos.random() < restart_p:
            restarts = dp.restart_controller()

    for b in range(BATCHES):
        ctrl.add_batch(BatchPlan(b, tuple(GroupSpec(b * P + g, b, N) for g in range(P))))
    ctrl.seal()
    ids = list(rng.permutation(BATCHES * P * N))
    seqs, ledgers, steps, trained = [0, 0], [StepLedger(), StepLedger()], {}, []
    while ids or min(seqs) < BATCHES * M:
        k = int(rng.integers(1, 4))
        chunk, ids = [int(t) for t in ids[:k]], ids[k:]
        for t in chunk:
            meta = Trajectory(traj_id=t, group_id=t // N, batch_id=t // (P * N), num_tokens=1 + t % 5, v_gen=0)
            dp.client(f"u{t % 2}").put([_payload(t, meta)])
        maybe_restart()
        for r in (0, 1):
            while seqs[r] < ctrl.stats().admitted:
                share = client.fetch_next(seqs[r], r, timeout=5, ack=False)
                out, new = ledgers[r].apply(share.key, lambda: list(share.traj_ids))
                trained += out if new else []
                steps.setdefault(share.seq, []).extend(share.traj_ids)
                maybe_restart()
                client.ack(share)
                seqs[r] += 1
        assert chunk or min(seqs) >= BATCHES * M, "every trajectory is put and a step is still not admitted"
    return [tuple(sorted(steps[s])) for s in sorted(steps)], trained, restarts, dp


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_restarted_controller_admits_the_same_minibatches_and_trains_each_trajectory_once(seed):
    ref_steps, ref_trained, _, ref_dp = _policy_run(seed, 0.0)
    steps, trained, restarts, dp = _policy_run(seed, 0.35)
    assert restarts >= 5  # the controller really restarted, many times, between every kind of call
    assert steps == ref_steps  # the replayed policy made exactly the decisions it made without restarts
    assert sorted(trained) == sorted(ref_trained) == list(range(BATCHES * P * N))  # each once
    st = dp.controller.stats()
    assert (st.released_minibatches, st.restarts, st.missing, st.held, st.held_groups) == (BATCHES * M, restarts,
                                                                                            0, 0, 0)
    assert [(r.traj_id, r.v_train) for r in dp.controller.records()] == [(r.traj_id, r.v_train)
                                                                         for r in ref_dp.controller.records()]
    assert all(u.stats().nbytes == 0 for u in dp.units.values())  # storage freed
    assert dp.journal.size()["events"] == 0 and dp.journal.size()["admitted"] == 0  # nothing left in flight


def test_acks_releases_and_incarnations_survive_a_restart_and_claims_may_be_redone():
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0", "n1"), recoverable=True)
    c = dp.client()
    dp.client("u0").put([_payload(t) for t in range(0, 12, 2)])
    dp.client("u1").put([_payload(t) for t in range(1, 12, 2)])
    mbs = [MiniBatch(0, k, tuple(range(4 * k, 4 * k + 4)), (k,), 0) for k in range(3)]
    for mb in mbs:
        c.admit(mb)
    c.fetch(mbs[0], 0)  # acked
    s1 = c.fetch(mbs[0], 1, ack=False)  # claimed, not acked
    c.fetch(mbs[1], 0)
    c.fetch(mbs[1], 1)  # mini-batch 1 released
    assert dp.controller.recover_rank(0) == 2  # rank 0 restarts: a new incarnation, resuming at step 2
    assert dp.restart_controller() == 1
    st = dp.controller.stats()
    assert (st.released_minibatches, st.admitted, st.restarts) == (1, 3, 1)
    assert dp.controller.rank_epoch(0) == 1  # the incarnation survives: a zombie of the old one stays fenced
    assert c.admit(mbs[2]) == dp.controller.admitted(MiniBatchKey(0, 2))  # a retried admission: the same one
    with pytest.raises(AlreadyConsumedError):
        c.fetch(mbs[0], 0)  # acked before the restart: never delivered twice
    s1b = c.fetch(mbs[0], 1, ack=False)  # the claim was not journaled: the same rank may claim it again
    assert s1b.traj_ids == s1.traj_ids
    c.ack(s1)  # the ack of the share claimed before the restart is accepted
    assert dp.controller.stats().released_minibatches == 2
    with pytest.raises(AlreadyConsumedError):
        c.fetch(mbs[1], 0)
    assert c.fetch(mbs[2], 0).traj_ids and c.fetch(mbs[2], 1).traj_ids
    assert dp.controller.stats().released_minibatches == 3
    assert all(u.stats().nbytes == 0 for u in dp.units.values())


def test_a_unit_lost_while_the_controller_was_down_is_missing_after_the_restart_until_reput():
    from knittrans.dataplane.faults import FaultPlan, UnitLoss

    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0", "n1"), recoverable=True,
                         faults=FaultPlan((UnitLoss("u1", on_put=99),)))
    c = dp.client()
    dp.client("u0").put([_payload(t) for t in range(4)])
    dp.client("u1").put([_payload(t) for t in range(4, 8)])
    mb = MiniBatch(0, 0, tuple(range(8)), (0,), 0)
    c.admit(mb)
    dp.units["u1"].lose()  # the unit died with the controller: its payloads are gone, nobody reported it
    dp.restart_controller()
    assert dp.controller.missing() == (4, 5, 6, 7)
    shares = {}
    for r in (0, 1):
        try:
            shares[r] = c.fetch(mb, r).traj_ids
        except DataLostError:  # never a partial share
            pass
    assert len(shares) < 2
    dp.client("u0").put([_payload(t) for t in range(4, 8)])  # the producers re-put them to a live unit
    for r in (0, 1):
        if r not in shares:
            shares[r] = c.fetch(mb, r).traj_ids
    assert sorted(shares[0] + shares[1]) == list(range(8))
    assert dp.controller.stats().released_minibatches == 1


def test_a_register_retried_across_a_restart_is_a_noop_and_never_rolls_back_stored_bytes():
    """The unit stored the put, the controller died before registering (or answering), the rebuild learnt the
    trajectory from the unit's manifest, and the register is retried: a no-op, not a duplicate error whose
    rollback would drop the bytes the controller now points at."""
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",), recoverable=True, checksums=True)
    from knittrans.dataplane.faults import with_checksums

    records = dp.units["u0"].put(with_checksums([_payload(t) for t in range(4)]))  # the register never arrived
    dp.restart_controller()
    assert dp.controller.stats().trajectories == 4  # known from the manifest
    assert dp.controller.register(records) == ()  # the retried register
    dp.client("u0").put([_payload(t) for t in range(4)])  # and a retried put: no-ops both
    c = dp.client()
    c.admit(MiniBatch(0, 0, (0, 1, 2, 3), (0,), 0))
    share = c.fetch(MiniBatch(0, 0, (0, 1, 2, 3), (0,), 0), 0)
    assert share.traj_ids == (0, 1, 2, 3) and all(u.stats().nbytes == 0 for u in dp.units.values())


def test_a_stream_that_ended_a_batch_short_still_ends_after_a_restart_forgot_that_batch():
    """The greedy baseline ends a used-up batch with fewer mini-batches (``skipped_minibatches``); once that batch
    is released its policy inputs leave the journal, so a replayed policy never sees the skip. The sealed stream
    must still end after the right number of steps (EndOfStream), not wait for a step that never comes."""
    from baselines.admission import make_policy
    from knittrans.dataplane.types import EndOfStream

    c = BatchConstraints(batch_size=4, num_minibatches=2, max_response_len=8, group_size=2, size_slack=1,
                         whole_groups=False)
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",), policy=make_policy("greedy", c), recoverable=True)
    ctrl, client = dp.controller, dp.client()
    ctrl.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2),)))  # one group of 2 in a batch of 4: ended after 1 step
    ctrl.add_batch(BatchPlan(1, (GroupSpec(1, 1, 2), GroupSpec(2, 1, 2))))
    ctrl.seal()
    meta = {t: Trajectory(traj_id=t, group_id=t // 2, batch_id=min(1, t // 2), num_tokens=1 + t % 5, v_gen=0)
            for t in range(6)}
    dp.client("u0").put([_payload(t, meta[t]) for t in range(2)])
    got = [client.fetch_next(0, 0, timeout=5).traj_ids]
    dp.restart_controller()  # batch 0 is released: the replay no longer sees it, nor its skipped step
    dp.client("u1").put([_payload(t, meta[t]) for t in range(2, 6)])
    dp.restart_controller()
    seq = 1
    with pytest.raises(EndOfStream):
        while True:
            got.append(client.fetch_next(seq, 0, timeout=5).traj_ids)
            seq += 1
    assert sorted(t for ids in got for t in ids) == list(range(6)) and ctrl.stats().restarts == 2


def test_a_replay_that_decides_differently_from_the_journal_is_a_typed_error():
    """Recovery replays the admission policy: one whose decisions differ on replay (not deterministic) must not
    silently re-split a mini-batch some rank may already hold."""
    import dataclasses

    from knittrans.dataplane.recovery import RecoveryError

    class Flaky(KnitTransAdmission):
        flip = False  # set between the run and its replay: the replay then orders a mini-batch differently

        def on_trainer_ready(self, now):  # noqa: ANN001, ANN201
            mbs = super().on_trainer_ready(now)
            return [dataclasses.replace(m, traj_ids=m.traj_ids[::-1]) if Flaky.flip else m for m in mbs]

    c = BatchConstraints(batch_size=4, num_minibatches=2, max_response_len=8, group_size=2)
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",), policy=Flaky(c), recoverable=True)
    dp.controller.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2), GroupSpec(1, 0, 2))))
    dp.client("u0").put([_payload(t, Trajectory(t, t // 2, 0, 1 + t % 5, 0)) for t in range(2)])
    assert dp.controller.stats().admitted == 1
    Flaky.flip = True
    with pytest.raises(RecoveryError, match=r"replayed admission of .* the admission policy is not deterministic"):
        dp.restart_controller()


def test_restore_needs_a_journal():
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",))
    with pytest.raises(RuntimeError, match="recoverable=True"):
        dp.restart_controller()
    with pytest.raises(AdmissionStateError, match="journal"):
        dp.controller.restore(None, {})
