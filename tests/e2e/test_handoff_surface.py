"""The Handoff's own surface (issue 29), on both transports: nothing lost, nothing silently wrong, every bad argument
refused where it is given. Each test is named after its invariant; the reliability table runs the same faults through
``workloads.chaos.run_handoff_chaos`` and the bad inputs through ``workloads.reliability_catalogue``."""

from __future__ import annotations

import threading
from dataclasses import astuple

import numpy as np
import pytest
import torch

from knittrans.dataplane import TrajectoryPayload
from knittrans.dataplane.faults import FaultPlan, UnitLoss
from knittrans.dataplane.types import (AdmissionStateError, AlreadyConsumedError, CorruptPayloadError,
                                       DataPlaneClosedError, FieldNotProducedError, SchemaMismatchError)
from knittrans.handoff import Handoff, HandoffConfig, Rollout, Transport
from knittrans.staleness import StalenessStats
from knittrans.types import BatchPlan, GroupSpec, Trajectory
from workloads.chaos import (HANDOFF_KINDS, HandoffChaosConfig, _stalled_fetch, expected, handoff_rollout,
                             run_handoff_chaos)

P, N, M, L = 4, 2, 2, 16
UNITS2 = (("u0", "n0"), ("u1", "n1"))


@pytest.fixture(params=["inprocess", pytest.param("ray", marks=pytest.mark.ray)])
def transport(request) -> Transport:  # noqa: ANN001
    if request.param == "ray":
        pytest.importorskip("ray")
        request.getfixturevalue("ray_local")
    return Transport(request.param)


def handoff(transport: Transport, **kw) -> Handoff:
    kw.setdefault("units", UNITS2)
    kw.setdefault("rank_nodes", ("n0", "n1"))
    return Handoff(HandoffConfig.grpo(kw.pop("prompts", P), N, M, L, transport=transport, admit_timeout_s=60.0, **kw))


def plan(b: int, prompts: int = P) -> BatchPlan:
    return BatchPlan(b, tuple(GroupSpec(g, b, N) for g in range(b * prompts, (b + 1) * prompts)))


def train_all(h: Handoff, ranks: int = 2, count: int | None = None, start_seq: int = 0,
              seqs: dict[int, int] | None = None) -> list[int]:
    """Every rank's consumer in a thread, acking each share after checking its bytes; the trained ids (``seqs``:
    filled with each trajectory's ``v_train``)."""
    got: list[int] = []
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            c = h.consumer(r, count=count, start_seq=start_seq)
            for share in c:
                for name, f in share.fields.items():
                    cu = f.cu_seqlens.tolist()
                    for i, t in enumerate(share.traj_ids):
                        assert np.array_equal(f.values[cu[i]:cu[i + 1]].numpy(), expected(t)[name]), (t, name)
                got.extend(share.traj_ids)
                if seqs is not None:
                    seqs.update({t: share.seq for t in share.traj_ids})
                c.ack(share)
            c.close()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    if errors:
        raise errors[0]
    return got


# -- 1. a rejected put's rollback never takes a re-put with it ------------------------------------------------------


def test_a_rejected_put_rerun_at_once_leaves_no_trajectory_registered_but_gone(transport):
    batches, prompts = 5, 30  # 300 trajectories, every put call rejected once and re-put at once
    h = handoff(transport, prompts=prompts)
    try:
        for b in range(batches):
            h.add_batch(plan(b, prompts))
        h.seal()
        for b in range(batches):
            for i, unit in enumerate(("u0", "u1")):
                groups = [g for g in range(b * prompts, (b + 1) * prompts) if g % 2 == i]
                for j in range(0, len(groups), 5):
                    good = [handoff_rollout(g * N + k, g, b) for g in groups[j:j + 5] for k in range(N)]
                    stray = handoff_rollout(10_000 + b, 10**6, b)  # a group never announced: the call is refused
                    with pytest.raises(AdmissionStateError, match="never announced"):
                        h.producer(unit).put(good + [stray])
                    h.producer(unit).put(good)  # the producer re-puts the good ones at once
        got = train_all(h)
        assert sorted(got) == list(range(batches * prompts * N))  # FieldNotProducedError here before the fix
        h.wait_drained(timeout=30)
        assert all(u.nbytes == 0 for u in h.stats()[1])
    finally:
        h.close()


# -- 2. the multimodal handoff checks what the text handoff checks, and keeps checksums -----------------------------


def mm_rollout(t: int, tensors: dict | None = None, num_tokens: int | None = None) -> Rollout:
    arrs = tensors or {"input_ids": np.arange(8) + t, "old_logprobs": np.full(3, -0.5, np.float32),
                       "advantages": np.ones(3, np.float32), "loss_mask": np.ones(3, bool)}
    img = torch.arange(16 * 12, dtype=torch.float32).reshape(16, 12) / 7 + t // N
    return Rollout(Trajectory(t, t // N, 0, 3 if num_tokens is None else num_tokens, 0), arrs,
                   images=(img,), grids=((1, 4, 4),))


def _bad_mm(kind: str) -> Rollout:
    good = mm_rollout(3).tensors
    if kind == "nan_logprobs":
        return mm_rollout(3, {**good, "old_logprobs": np.array([-0.5, np.nan, -0.5], np.float32)})
    if kind == "inf_advantages":
        return mm_rollout(3, {**good, "advantages": np.array([1.0, np.inf, 1.0], np.float32)})
    if kind == "mismatched_lengths":
        return mm_rollout(3, {**good, "loss_mask": np.ones(5, bool)})
    return mm_rollout(3, num_tokens=1)  # num_tokens disagrees with its 3-token response


@pytest.mark.parametrize("kind, pattern", [
    ("nan_logprobs", r"trajectory 3: field 'old_logprobs' holds 1 non-finite"),
    ("inf_advantages", r"trajectory 3: field 'advantages' holds 1 non-finite"),
    ("mismatched_lengths", r"trajectory 3: fields of mismatched length"),
    ("num_tokens", r"trajectory 3: Trajectory.num_tokens=1 disagrees with its tensors"),
])
def test_the_multimodal_handoff_refuses_what_the_text_handoff_refuses(transport, kind, pattern):
    h = handoff(transport, multimodal=True, units=(("u0", "n0"),), rank_nodes=("n0",))
    try:
        h.add_batch(BatchPlan(0, tuple(GroupSpec(g, 0, N) for g in range(P))))
        h.seal()
        h.put([mm_rollout(t) for t in range(3)])
        with pytest.raises(SchemaMismatchError, match=pattern):
            h.put([_bad_mm(kind)])
        h.put([mm_rollout(t) for t in range(3, P * N)])  # the rejected call changed nothing: 3 is put fresh
        shares = h.consumer(0).take(M)
        assert sorted(t for s in shares for t in s.traj_ids) == list(range(P * N))
        assert all(torch.equal(s["old_logprobs"], torch.full((3 * len(s.traj_ids),), -0.5)) for s in shares)
    finally:
        h.close()


def test_multimodal_checksums_are_kept_not_dropped(transport):
    h = handoff(transport, multimodal=True, checksums=True, units=(("u0", "n0"),), rank_nodes=("n0",))
    try:
        assert h.plane.checksums and h.plane.client().checksums
        h.add_batch(BatchPlan(0, tuple(GroupSpec(g, 0, N) for g in range(P))))
        h.put([mm_rollout(t) for t in range(P * N)])
        loc = h.plane.controller.claim_next(0, 0, h.plane.schema.names, 30.0)
        sums = dict(zip(loc.fields, loc.checksums))
        assert all(s is not None for n, col in sums.items() if n != "image_index" for s in col)  # every field's CRC
    finally:
        h.close()


@pytest.mark.parametrize("what", ["field", "image"])
def test_a_multimodal_byte_corrupted_in_storage_is_caught_at_fetch(what):
    h = handoff(Transport.INPROCESS, multimodal=True, checksums=True, units=(("u0", "n0"),), rank_nodes=("n0",))
    try:
        h.add_batch(BatchPlan(0, tuple(GroupSpec(g, 0, N) for g in range(P))))
        h.put([mm_rollout(t) for t in range(P * N)])
        unit = h.plane.units["u0"]
        if what == "field":  # the stored row is a read-only view of its put's run: flip a bit through the run
            row = unit._data[0]["advantages"]
            base = row.base
            base.flags.writeable = True
            at = row.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            base.reshape(-1).view(np.uint8)[at + 1] ^= 0x20
        else:  # the encoding store's copy of trajectory 0's image
            px = unit.store.get(unit._occ[0][0][0])
            px.reshape(-1).view(torch.uint8)[1] ^= 0x20
        with pytest.raises(CorruptPayloadError, match="corrupt on fetch"):
            h.plane.client().fetch_next(0, 0, timeout=30.0)
    finally:
        h.close()


# -- 3. metadata that disagrees with the tensors is refused by name ------------------------------------------------


def test_num_tokens_that_disagrees_with_the_tensors_is_refused_naming_the_trajectory(transport):
    h = handoff(transport)
    try:
        h.add_batch(plan(0))
        h.seal()
        n = len(expected(2)["old_logprobs"])
        with pytest.raises(SchemaMismatchError, match=rf"trajectory 2: Trajectory.num_tokens=1 disagrees .*"
                                                      rf"'old_logprobs' has {n} rows"):
            h.put([handoff_rollout(2, 1, 0, num_tokens=1)])
        # fields first, the completing put later with only part of them: the controller checks what it knows
        fields = expected(4)
        h.plane.client("u0").put([TrajectoryPayload(4, {k: fields[k] for k in ("input_ids", "old_logprobs")})])
        with pytest.raises(SchemaMismatchError, match=r"trajectory 4: Trajectory.num_tokens=1 disagrees"):
            h.put([Rollout(Trajectory(4, 2, 0, 1, 0), {"advantages": fields["advantages"][:1],
                                                       "loss_mask": fields["loss_mask"][:1]})])
        h.put([Rollout(Trajectory(4, 2, 0, len(fields["old_logprobs"]), 0),
                       {k: fields[k] for k in ("advantages", "loss_mask")})])
        h.put([handoff_rollout(t, t // N, 0) for t in range(P * N) if t != 4])
        got = train_all(h)
        assert sorted(got) == list(range(P * N))
        assert {r.traj_id: r.num_tokens for r in h.records()} == {
            t: len(expected(t)["old_logprobs"]) for t in range(P * N)}  # what token budgets counted
    finally:
        h.close()


# -- 5. a put after close is refused, never dropped ---------------------------------------------------------------


def test_a_put_after_close_is_refused_never_dropped(transport):
    h = handoff(transport)
    producer = h.producer("u0")
    h.add_batch(plan(0))
    h.close()
    with pytest.raises(DataPlaneClosedError, match="closed"):
        producer.put([handoff_rollout(0, 0, 0)])
    with pytest.raises(DataPlaneClosedError, match="closed"):
        h.put([handoff_rollout(1, 0, 0)])


def test_a_plane_put_after_close_is_refused_and_rolled_back_at_its_unit():
    h = handoff(Transport.INPROCESS)
    h.close()
    with pytest.raises(DataPlaneClosedError, match="put of trajectories \\[0\\] refused"):
        h.plane.client("u0").put([TrajectoryPayload(0, expected(0))])
    assert h.plane.units["u0"].stats().nbytes == 0  # not kept by the unit either


# -- 6. every bad argument is refused where it is given ----------------------------------------------------------


@pytest.mark.parametrize("kw, error, pattern", [
    ({"balance_slack": -1}, ValueError, r"HandoffConfig.balance_slack must be a finite number >= 0.0, got -1"),
    ({"balance_slack": float("nan")}, ValueError, r"HandoffConfig.balance_slack"),
    ({"admit_timeout_s": -5}, ValueError, r"HandoffConfig.admit_timeout_s must be a finite number > 0.0 or None"),
    ({"admit_timeout_s": 0}, ValueError, r"HandoffConfig.admit_timeout_s"),
    ({"prefetch_depth": 2.5}, TypeError, r"HandoffConfig.prefetch_depth must be an int, got float 2.5"),
    ({"prefetch_depth": 0}, ValueError, r"HandoffConfig.prefetch_depth must be >= 1"),
    ({"prefetch_depth": True}, TypeError, r"HandoffConfig.prefetch_depth"),
    ({"records_window": -1}, ValueError, r"HandoffConfig.records_window must be >= 0 or None"),
    ({"checksums": "yes"}, TypeError, r"HandoffConfig.checksums must be a bool"),
    ({"faults": FaultPlan((UnitLoss("u0", 1),)), "multimodal": True}, ValueError, r"HandoffConfig.faults"),
])
def test_a_bad_handoff_config_is_refused_at_construction_naming_the_argument(kw, error, pattern):
    with pytest.raises(error, match=pattern):
        HandoffConfig.grpo(P, N, M, L, **kw)


BAD_CONSUMER_ARGS = [
    ({"fields": "input_ids"}, TypeError, r"consumer fields must be a sequence of field names.*got the str"),
    ({"fields": ["input_ids", 3]}, TypeError, r"consumer fields must be field names"),
    ({"fields": []}, FieldNotProducedError, r"consumer fields must name at least one field"),
    ({"fields": ["input_ids", "input_ids"]}, FieldNotProducedError, r"each once"),
    ({"fields": ["pixels"]}, FieldNotProducedError, r"consumer fields \['pixels'\] are not in the schema"),
    ({"start_seq": -1}, ValueError, r"Consumer.start_seq must be >= 0"),
    ({"start_seq": 1.5}, TypeError, r"Consumer.start_seq must be an int"),
    ({"count": -1}, ValueError, r"Consumer.count must be >= 0 or None"),
    ({"count": 2.0}, TypeError, r"Consumer.count must be an int or None"),
    ({"rank": 2}, ValueError, r"rank 2 out of range"),
    ({"rank": True}, ValueError, r"rank True out of range"),
]


def test_bad_consumer_arguments_are_refused_at_the_call_naming_them(transport):
    h = handoff(transport)  # one handoff for every case (on Ray each one starts actors)
    try:
        for kw, error, pattern in BAD_CONSUMER_ARGS:
            with pytest.raises(error, match=pattern):
                h.consumer(**kw)
        h.add_batch(plan(0))
        h.seal()
        h.put([handoff_rollout(t, t // N, 0) for t in range(P * N)])
        assert sorted(train_all(h)) == list(range(P * N))  # nothing was claimed by the refused calls
    finally:
        h.close()


def test_every_handoff_bad_input_of_the_catalogue_is_refused_by_name(transport):
    from workloads.reliability_catalogue import handoff_catalogue, try_case

    results = {c.name: try_case(c) for c in handoff_catalogue(transport.value)}
    assert all(ok for ok, _ in results.values()), {k: m for k, (ok, m) in results.items() if not ok}


def test_a_bad_balance_slack_never_reaches_the_first_admission():
    from knittrans.dataplane.controller import ControllerConfig

    with pytest.raises(ValueError, match="ControllerConfig.balance_slack"):
        ControllerConfig(("n0",), balance_slack=-1)


# -- 7. retries and a unit lost under a running consumer ---------------------------------------------------------


def test_a_claim_retried_by_the_same_incarnation_gets_the_same_share(transport):
    h = handoff(transport)
    try:
        h.add_batch(plan(0))
        h.seal()
        h.put([handoff_rollout(t, t // N, 0) for t in range(P * N)])
        ctrl, names = h.plane.controller, h.plane.schema.names
        epoch = ctrl.rank_epoch(0)
        lost = ctrl.claim_next(0, 0, names, 30.0, epoch)  # its reply never reached the rank
        again = ctrl.claim_next(0, 0, names, 30.0, epoch)  # the same incarnation retries
        assert (again.key, again.traj_ids, again.fields) == (lost.key, lost.traj_ids, lost.fields)
        with pytest.raises(AlreadyConsumedError, match="exactly-once"):
            ctrl.claim_next(0, 0, names, 30.0)  # without an epoch: a second fetch, refused
        c = h.consumer(0, count=1)
        share = c.take(1)[0]  # the consumer (same incarnation) gets that very share
        assert share.traj_ids == lost.traj_ids
        c.ack(share)
        c.close()  # its acks reach the controller (on Ray they are sent asynchronously)
        with pytest.raises(AlreadyConsumedError):
            ctrl.claim_next(0, 0, names, 30.0, epoch)  # after the ack: never again
    finally:
        h.close()


def test_a_unit_lost_under_a_running_consumer_needs_only_the_producers_re_put(transport):
    res = run_handoff_chaos(transport.value, HandoffChaosConfig(batches=8, fault_rate=0.0, stall_s=8.0))
    assert res.injected["unit_lost_under_consumer"] == 1
    assert (res.lost, res.duplicated, res.corrupted, res.final_unit_bytes) == (0, 0, 0, 0)
    assert res.survived == res.injected  # every kind, the lost unit included, with no consumer rebuilt


def test_fetch_next_timeout_bounds_the_whole_call_while_a_unit_stalls(transport):
    from collections import Counter

    inj, ok = Counter(), Counter()
    _stalled_fetch(transport.value, HandoffChaosConfig(stall_s=8.0), inj, ok)
    assert inj["fetch_timeout_under_stall"] == ok["fetch_timeout_under_stall"] == 1


def test_every_handoff_fault_kind_is_survived_on_a_seeded_run(transport):
    res = run_handoff_chaos(transport.value, HandoffChaosConfig(batches=10, seed=1, stall_s=8.0))
    assert set(res.injected) == set(HANDOFF_KINDS)
    assert res.survived == res.injected and (res.lost, res.duplicated, res.corrupted) == (0, 0, 0)


# -- 4. a long run keeps no finished batch and a bounded window of records -----------------------------------------


def test_a_long_run_keeps_no_finished_batch_and_a_bounded_record_window_with_exact_staleness(transport):
    batches, window = 12, 10
    h = handoff(transport, records_window=window)
    try:
        vgen: dict[int, int] = {}
        vtrain: dict[int, int] = {}
        for b in range(batches):
            h.add_batch(plan(b))
            v = max(0, h.version - b % 3)  # some rollouts sampled with older weights
            rollouts = [Rollout(Trajectory(t, t // N, b, len(expected(t)["old_logprobs"]), v), expected(t))
                        for t in range(b * P * N, (b + 1) * P * N)]
            vgen.update({r.traj.traj_id: v for r in rollouts})
            h.put(rollouts)
            got = train_all(h, count=M, start_seq=b * M, seqs=vtrain)  # one batch per round
            assert sorted(got) == sorted(vgen)[-P * N:]
            if transport is Transport.INPROCESS:
                assert len(h.plane.controller.policy.ledger.batches) == 0  # the finished batch is forgotten
        h.wait_version(batches * M, timeout=30)
        recs = h.records()
        assert len(recs) <= window  # every record released, only the last ``window`` kept
        assert all(r.v_train == vtrain[r.traj_id] and r.v_gen == vgen[r.traj_id] for r in recs)
        exact = StalenessStats.of(np.array([vtrain[t] - vgen[t] for t in vgen]))
        assert astuple(h.staleness()) == pytest.approx(astuple(exact))  # over all 96 trajectories, not the window
        st = h.stats()[0]
        assert (st.held, st.held_groups, st.released_minibatches) == (0, 0, batches * M)
        if transport is Transport.RAY:
            import ray

            size = h.plane.journal_size()
            assert size["rows"] <= 2 * window and size["events"] == 0  # the journal is bounded the same way
            before = h.staleness()
            h.plane.restart_controller()
            assert h.staleness() == before and len(h.records()) <= window  # the histogram survives a restart
    finally:
        h.close()
