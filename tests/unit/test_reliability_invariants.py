"""Issue 13: nothing lost, nothing corrupted. One test per invariant the issue's red-team probes broke (lost data,
silent corruption); each fails on the code before the fix."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from knittrans.dataplane import (DuplicatePutError, PrefetchConfig, Prefetcher, TrajectoryPayload,
                                 build_inprocess)
from knittrans.dataplane.client import PrepareConfig, cu_seqlens_int32
from knittrans.dataplane.faults import FaultPlan, ProducerBuffer, UnitLoss
from knittrans.dataplane.types import MiniBatchKey, ShareLocation, ShareTooLargeError
from knittrans.types import MiniBatch
from workloads.text_data import TEXT_SCHEMA

UNITS = {"u0": "n0", "u1": "n1"}


def _traj(t: int, resp: int = 3) -> TrajectoryPayload:
    return TrajectoryPayload(t, {"input_ids": np.arange(4 + resp, dtype=np.int64) + t,
                                 "old_logprobs": np.full(resp, -0.5, np.float32),
                                 "advantages": np.ones(resp, np.float32), "loss_mask": np.ones(resp, bool)})


def _rows(share, name):
    f = share.fields[name]
    cu = f.cu_seqlens.tolist()
    return {t: f.values[cu[i]:cu[i + 1]].numpy() for i, t in enumerate(share.traj_ids)}


# -- lost data ------------------------------------------------------------------------------------------------------


def test_a_retried_put_of_identical_content_is_a_no_op_and_different_content_is_a_duplicate():
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",))
    c = dp.client("u0")
    c.put([_traj(0), _traj(1)])
    before = (dp.controller.stats(), dp.units["u0"].stats())
    c.put([_traj(0), _traj(1)])  # the first call's reply was lost: the producer retries
    assert (dp.controller.stats(), dp.units["u0"].stats()) == before
    with pytest.raises(DuplicatePutError, match="field 'input_ids' of trajectory 0 was already written with "
                                                "different content"):
        c.put([_traj(0, resp=4)])
    mb = MiniBatch(0, 0, (0, 1), (0,), 0)
    c.admit(mb)
    share = c.fetch(mb, 0)
    for t, arr in _rows(share, "input_ids").items():
        np.testing.assert_array_equal(arr, _traj(t).tensors["input_ids"])


def test_a_put_whose_register_reply_was_lost_is_admitted_on_retry():
    """The unit stored the fields but the controller never registered them (the register call timed out before
    it arrived): the retry registers them instead of failing as a duplicate, and the trajectory is trained."""
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",))
    dp.units["u0"].put([_traj(5)])  # what reached the unit before the lost register
    dp.client("u0").put([_traj(5)])
    assert dp.controller.stats().trajectories == 1
    mb = MiniBatch(0, 0, (5,), (0,), 0)
    dp.client().admit(mb)
    assert dp.client().fetch(mb, 0).traj_ids == (5,)


def test_producer_buffer_reputs_every_field_of_a_trajectory_put_field_by_field():
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",), faults=FaultPlan((UnitLoss("u0", on_put=3),)))
    prod = ProducerBuffer(dp.client("u0"), ["u1"])
    full = _traj(7).tensors
    prod.put([TrajectoryPayload(7, {"input_ids": full["input_ids"]})])
    prod.put([TrajectoryPayload(7, {k: v for k, v in full.items() if k != "input_ids"})])
    with pytest.raises(Exception, match="u0 is lost"):
        dp.client("u0").put([_traj(8)])
    assert dp.controller.missing() == (7,)
    assert prod.reput_missing() == (7,)
    mb = MiniBatch(0, 0, (7,), (0,), 0)
    dp.client().admit(mb)
    share = dp.client().fetch(mb, 0)  # every field came back with the re-put, not only the last put's
    for name in TEXT_SCHEMA.names:
        np.testing.assert_array_equal(_rows(share, name)[7], full[name])


def test_the_default_prefetcher_never_loses_a_share_to_a_rank_crash():
    assert PrefetchConfig().ack_on_fetch is False
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",))
    dp.client("u0").put([_traj(t) for t in range(4)])
    for k in range(2):
        dp.client().admit(MiniBatch(0, k, (2 * k, 2 * k + 1), (k,), 0))
    pf = Prefetcher(dp.client(), 0, None, PrefetchConfig(depth=2, admit_timeout_s=10), count=2)
    first = pf.next(timeout=10)
    assert first.seq == 0
    pf.close()  # the rank crashes during the step of mini-batch 0 (prefetched: 0 and maybe 1)
    assert dp.controller.recover_rank(0) == 0  # it resumes at 0: nothing it had prefetched is lost
    pf2 = Prefetcher(dp.client(), 0, None, PrefetchConfig(depth=1, admit_timeout_s=10), count=2)
    got = [s.traj_ids for s in pf2]  # asking for the next share (or ending the loop) acks the previous one
    assert got == [(0, 1), (2, 3)]
    assert dp.controller.stats().released_minibatches == 2
    assert all(u.stats().nbytes == 0 for u in dp.units.values())


def test_orphans_of_a_dead_producer_are_discarded_and_their_ids_can_be_regenerated():
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",))
    c = dp.client("u0")
    c.put([TrajectoryPayload(t, {"input_ids": np.arange(3)}) for t in (10, 11)])  # the producer died here
    c.discard([10, 11])
    assert dp.controller.stats().trajectories == 0 and dp.units["u0"].stats().nbytes == 0
    dp.client("u1").put([_traj(10), _traj(11)])  # regenerated elsewhere, same ids
    mb = MiniBatch(0, 0, (10, 11), (0,), 0)
    c.admit(mb)
    assert set(_rows(c.fetch(mb, 0), "input_ids")) == {10, 11}
    with pytest.raises(Exception, match="trajectory 10 was trained and released"):
        c.discard([10])  # an admitted trajectory will be trained: never discarded


# -- silent corruption ----------------------------------------------------------------------------------------------


def test_producer_mutation_after_put_cannot_change_stored_bytes():
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",))
    p = _traj(0)
    want = {k: v.copy() for k, v in p.tensors.items()}
    dp.client("u0").put([p])
    p.tensors["old_logprobs"][:] = np.nan  # the producer reuses its buffer
    p.tensors["input_ids"][:] = -1
    mb = MiniBatch(0, 0, (0,), (0,), 0)
    dp.client().admit(mb)
    share = dp.client().fetch(mb, 0)
    for name in TEXT_SCHEMA.names:
        np.testing.assert_array_equal(_rows(share, name)[0], want[name])


def test_a_consumer_edit_in_place_never_reaches_the_stored_copy():
    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0", "n0"))
    dp.client("u0").put([_traj(t) for t in range(2)])
    for arrs in dp.units["u0"]._data.values():  # noqa: SLF001 - the stored copies themselves
        assert all(not a.flags.writeable for a in arrs.values())
    mb = MiniBatch(0, 0, (0, 1), (0,), 0)
    dp.client().admit(mb)
    share = dp.client().fetch(mb, 0)
    share["input_ids"].fill_(-7)  # a trainer edits its batch in place
    other = dp.client().fetch(mb, 1)
    assert (other["input_ids"] >= 0).all()


def test_identical_bytes_under_two_grids_are_two_images_each_with_its_own_grid():
    from knittrans.mmdedup.fetch import EncodingPlane

    plane = EncodingPlane(["u0"])
    px = torch.randn(24, 8)  # 4x6 patches (56x84) or 6x4 (84x56): the same bytes
    plane.register("u0", 0, [px], [(1, 4, 6)])
    plane.register("u0", 1, [px], [(1, 6, 4)])
    f = plane.fetch([0, 1])
    assert f.images.grids == ((1, 4, 6), (1, 6, 4))
    assert f.image_ids == {0: (0,), 1: (1,)}
    f.images.pixels[0].zero_()  # a private copy: the stored encoding is untouched
    assert torch.equal(plane.fetch([1]).images.pixels[0], px)


def test_cu_seqlens_past_int32_raise_a_typed_error_instead_of_wrapping():
    loc = ShareLocation(MiniBatchKey(0, 0), 0, (0,), ("u0",), ("input_ids",), 0)
    ok = cu_seqlens_int32(np.array([0, 5, 2**31 - 1]), "input_ids", loc)
    assert ok.dtype == np.int32 and ok[-1] == 2**31 - 1
    with pytest.raises(ShareTooLargeError, match=r"field 'input_ids' has 2147483648 rows, past int32"):
        cu_seqlens_int32(np.array([0, 2**31]), "input_ids", loc)


# -- baselines never hang -------------------------------------------------------------------------------------------


def test_greedy_baseline_ends_a_used_up_batch_instead_of_hanging_and_counts_it():
    """Slack lets greedy put the whole of batch 0 (one group of 2) into its first mini-batch; its second step can
    never fill. It must end the batch (counted) and go on with batch 1, not wait for ever."""
    from baselines.admission import make_policy
    from knittrans.constraints import BatchConstraints
    from knittrans.types import BatchPlan, GroupSpec, Trajectory

    c = BatchConstraints(batch_size=4, num_minibatches=2, max_response_len=16, size_slack=1, whole_groups=False)
    p = make_policy("greedy", c)
    p.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2),)))
    p.add_batch(BatchPlan(1, (GroupSpec(1, 1, 2), GroupSpec(2, 1, 2))))
    for t in range(2):
        p.on_complete(Trajectory(t, 0, 0, num_tokens=3, v_gen=0))
    for t in range(2, 6):
        p.on_complete(Trajectory(t, 1 + (t - 2) // 2, 1, num_tokens=3, v_gen=0))
    out = []
    for _ in range(10):  # bounded: a hang shows as a missing mini-batch, never as a stuck test
        mbs = p.on_trainer_ready(0.0)
        if not mbs:
            break
        out += mbs
    assert sorted(t for mb in out for t in mb.traj_ids) == list(range(6))  # nothing lost, nothing twice
    assert [mb.batch_id for mb in out] == [0, 1, 1]
    assert p.stats.ended_short == 1 and p.ledger.current() is None


# -- bounded state --------------------------------------------------------------------------------------------------


def test_controller_memory_is_flat_after_warm_up():
    """Released mini-batches and their trajectories are compacted: after warm-up, the controller's Python heap
    does not grow with the number of trajectories put through it (before: ~520 B per trajectory for ever)."""
    import tracemalloc

    from knittrans.dataplane import FieldSpec, TrajectorySchema

    schema = TrajectorySchema((FieldSpec("ids", "int64"),), token_field="ids")
    dp = build_inprocess(schema, {"u0": "n0"}, ("n0",))
    c = dp.client("u0")
    mb_size, ids = 100, np.arange(3, dtype=np.int64)

    def run(k0: int, k1: int) -> None:
        for k in range(k0, k1):
            ts = range(k * mb_size, (k + 1) * mb_size)
            c.put([TrajectoryPayload(t, {"ids": ids}) for t in ts])
            mb = MiniBatch(0, k, tuple(ts), (k,), 0)
            c.admit(mb)
            c.fetch(mb, 0)

    tracemalloc.start()
    try:
        run(0, 20)  # warm-up
        base = tracemalloc.get_traced_memory()[0]
        run(20, 120)  # 10,000 more trajectories
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    st = dp.controller.stats()
    assert st.trajectories == 12_000 and st.held == 0 and st.held_minibatches == 0 and st.released_id_ranges == 1
    assert grown / 10_000 < 40, f"controller state grew {grown / 10_000:.0f} B per trajectory after warm-up"
    with pytest.raises(DuplicatePutError, match="trajectory 5 was consumed and released"):
        c.put([TrajectoryPayload(5, {"ids": ids})])  # a compacted id still refuses a second training


# -- hangs and fencing ----------------------------------------------------------------------------------------------


def test_a_zombie_prefetcher_of_a_recovered_rank_can_neither_claim_nor_ack():
    from knittrans.dataplane.types import FencedError

    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",))
    dp.client("u0").put([_traj(t) for t in range(4)])
    for k in range(2):
        dp.client().admit(MiniBatch(0, k, (2 * k, 2 * k + 1), (k,), 0))
    old = dp.client()
    epoch = dp.controller.rank_epoch(0)
    held = old.fetch_next(0, 0, timeout=5, ack=False, epoch=epoch)  # the old incarnation, then it "crashes"
    assert dp.controller.recover_rank(0) == 0
    with pytest.raises(FencedError, match="rank 0 incarnation 0"):
        old.fetch_next(1, 0, timeout=5, ack=False, epoch=epoch)  # the zombie's next claim is refused
    with pytest.raises(FencedError):
        old.ack(held)  # and so is its ack of the share it held
    new = dp.client()
    e1 = dp.controller.rank_epoch(0)
    got = [new.fetch_next(k, 0, timeout=5, epoch=e1).traj_ids for k in range(2)]
    assert got == [(0, 1), (2, 3)] and dp.controller.stats().released_minibatches == 2


def test_encoding_store_remembers_consumed_ids_in_flat_memory():
    from knittrans.mmdedup.store import EncodingStore, EncodingStoreError

    store = EncodingStore()
    px = torch.randn(4, 8)
    for t in range(2000):
        store.register(t, [px])
    for lo in range(0, 2000, 100):
        store.consume(range(lo + 99, lo - 1, -1))  # any order within a mini-batch
    assert store._consumed.ranges == [(0, 2000)]  # noqa: SLF001 - one range, not 2000 set entries
    with pytest.raises(EncodingStoreError, match="already registered \\(and consumed\\)"):
        store.register(5, [px])


def test_a_sealed_greedy_handoff_ends_after_a_batch_ended_short_instead_of_waiting():
    from baselines.admission import make_policy
    from knittrans.handoff import Handoff, HandoffConfig, Rollout
    from knittrans.types import BatchPlan, GroupSpec, Trajectory

    cfg = HandoffConfig.grpo(prompts_per_batch=2, group_size=2, num_minibatches=2, max_response_len=8, size_slack=1,
                             whole_groups=False, admit_timeout_s=10.0)
    h = Handoff(cfg, policy=make_policy("greedy", cfg.constraints))
    try:
        h.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2),)))  # one group of 2 in a batch of 4: greedy uses it up
        h.seal()
        h.put([Rollout(Trajectory(t, 0, 0, num_tokens=2, v_gen=0), _traj(t, resp=2).tensors) for t in range(2)])
        consumer = h.consumer(0)
        got = []
        for share in consumer:  # ends (EndOfStream) instead of waiting 10 s for a step that never comes
            got.append(share.traj_ids)
            consumer.ack(share)
        assert got == [(0, 1)]
    finally:
        h.close()


def test_a_retried_multimodal_put_of_identical_images_is_a_no_op_and_different_images_are_a_duplicate():
    """Idempotent puts cover images too: a producer retrying an ``MMPayload`` whose first reply was lost (same
    fields, same pixel bytes, same grids) changes nothing -- no new image reference, no new slot, the trajectory
    trained once; different pixels or a different grid under the same id still raise ``DuplicatePutError`` and
    leave the unit as it was."""
    from knittrans.mmdedup.plane import MMPayload, build_mm_inprocess

    dp = build_mm_inprocess({"u0": "n0"}, ("n0",))
    c = dp.client("u0")
    px = torch.randn(16, 8)

    def mm(t, pixels=px, grid=(1, 4, 4)):
        return MMPayload(t, dict(_traj(t).tensors), group=0, encodings=(pixels,), grids=(grid,))

    c.put([mm(0), mm(1)])
    before = (dp.controller.stats(), dp.units["u0"].stats(), dp.units["u0"].store.stats().live_refs,
              dp.units["u0"].store.stats().live_slots)
    c.put([mm(0), mm(1, px.clone())])  # lost reply: the producer retries (its own copy of the same bytes)
    dp.units["u0"].put([mm(1)])  # ... or the unit got it but the register call was lost: the unit's no-op
    c.put([mm(1)])
    after = (dp.controller.stats(), dp.units["u0"].stats(), dp.units["u0"].store.stats().live_refs,
             dp.units["u0"].store.stats().live_slots)
    assert after == before and before[2:] == (2, 1)
    for bad in (mm(0, px + 1), mm(0, grid=(1, 2, 8)), MMPayload(0, dict(_traj(0).tensors), group=0,
                                                                  encodings=(px, px), grids=((1, 4, 4),) * 2)):
        with pytest.raises(DuplicatePutError, match="images of trajectory 0 were already written with different"):
            c.put([bad])
    assert (dp.controller.stats(), dp.units["u0"].stats(), dp.units["u0"].store.stats().live_refs) == before[:3]
    mb = MiniBatch(0, 0, (0, 1), (0,), 0)
    c.admit(mb)
    share = dp.client().fetch(mb, 0)
    assert share.traj_ids == (0, 1) and share.image_ids == {0: (0,), 1: (0,)}
    assert torch.equal(share.images.pixels[0], px) and share.images.grids == ((1, 4, 4),)
    assert dp.live_bytes() == 0  # every reference released once: none leaked by the retries


# -- hangs ----------------------------------------------------------------------------------------------------------


class _HangingUnit:
    """A storage unit stuck in every ``get`` until ``release`` is set (bounded, so it never outlives the test)."""

    def __init__(self, unit) -> None:
        self.unit = unit
        self.release = threading.Event()

    def put(self, payloads):
        return self.unit.put(payloads)

    def get(self, traj_ids, fields):
        self.release.wait(timeout=60.0)
        return self.unit.get(traj_ids, fields)

    def drop(self, traj_ids, fields=None):
        return self.unit.drop(traj_ids, fields)


def test_a_unit_hung_in_get_cannot_block_an_in_process_fetch_or_prefetcher_close():
    """In-process reads have a deadline (``read_timeout_s``, as on Ray): a unit hung in ``get`` makes
    ``fetch_next`` raise ``ReadTimeoutError`` naming the unit, with the claim undone, and a prefetcher's worker
    ends with that error, so ``close`` returns; once the unit answers, the same share is read whole."""
    from knittrans.dataplane.types import ReadTimeoutError

    # reads through the unit (a direct read from the put's sources never waits on it: test_dataplane_buffers)
    dp = build_inprocess(TEXT_SCHEMA, {"u0": "n0"}, ("n0",), read_timeout_s=0.2,
                         prepare=PrepareConfig(direct_reads=False))
    dp.client("u0").put([_traj(0), _traj(1)])
    dp.client().admit(MiniBatch(0, 0, (0, 1), (0,), 0))
    hung = dp.units["u0"] = _HangingUnit(dp.units["u0"])
    try:
        got: list[BaseException] = []

        def fetch() -> None:
            try:
                dp.client().fetch_next(0, 0, timeout=5.0)
            except BaseException as e:  # noqa: BLE001 - checked below
                got.append(e)

        th = threading.Thread(target=fetch, daemon=True)
        th.start()
        th.join(timeout=30.0)  # generous: the deadline is 0.2 s; without one this thread never ends
        assert not th.is_alive(), "fetch_next blocked on a hung unit"
        assert len(got) == 1 and isinstance(got[0], ReadTimeoutError) and "unit u0" in str(got[0])
        pf = Prefetcher(dp.client(), 0, config=PrefetchConfig(admit_timeout_s=5.0)).start()
        with pytest.raises(ReadTimeoutError, match="unit u0"):  # it could claim again: the claim was undone
            pf.next(timeout=30.0)
        closer = threading.Thread(target=pf.close, daemon=True)
        closer.start()
        closer.join(timeout=30.0)
        assert not closer.is_alive() and not any(t.is_alive() for t in pf._threads)  # the workers ended
    finally:
        hung.release.set()
    dp.units["u0"] = hung.unit
    share = dp.client().fetch_next(0, 0, timeout=5.0)
    assert share.traj_ids == (0, 1)
    for t, arr in _rows(share, "input_ids").items():
        np.testing.assert_array_equal(arr, _traj(t).tensors["input_ids"])


# -- inputs ---------------------------------------------------------------------------------------------------------


def test_a_zero_length_response_error_names_only_the_empty_fields():
    """The message names the field that is empty, not every field of its same-length group (a producer that
    forgot its advantages must not be told its log-probs are empty)."""
    from knittrans.dataplane import SchemaMismatchError

    dp = build_inprocess(TEXT_SCHEMA, UNITS, ("n0",))
    bad = _traj(0)
    bad.tensors["advantages"] = np.zeros(0, np.float32)
    with pytest.raises(SchemaMismatchError, match=r"zero-length response \(field\(s\) \['advantages'\] have 0 rows "
                                                  r"of \{'old_logprobs': 3, 'advantages': 0, 'loss_mask': 3\}"):
        dp.client("u0").put([bad])
    empty = _traj(1, resp=0)
    with pytest.raises(SchemaMismatchError, match=r"\(field\(s\) \['advantages', 'loss_mask', 'old_logprobs'\] "
                                                  r"have 0 rows;"):
        dp.client("u0").put([empty])
    assert dp.controller.stats().trajectories == 0 and dp.units["u0"].stats().num_trajectories == 0
