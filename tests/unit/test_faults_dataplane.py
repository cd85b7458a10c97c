"""Data-plane faults (in-process): corrupted messages, a lost storage unit, a crashed trainer rank.

Invariants, named in the tests: a corrupted field is named and never delivered; a share is never handed out
partially; nothing is lost and nothing delivered twice; each optimizer step is applied once; storage is freed once
everything is consumed. Semantics: docs/reliability.md.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from knittrans.dataplane import (AlreadyConsumedError, MiniBatchKey, Prefetcher, PrefetchConfig, StorageUnit,
                                 TrajectoryPayload, build_inprocess)
from knittrans.dataplane.faults import (CorruptGet, CorruptPut, FaultPlan, FaultyUnit, InjectedCrash,
                                        ProducerBuffer, RankCrash, StepLedger, UnitLoss, field_checksum, run_rank)
from knittrans.dataplane.types import CorruptPayloadError, DataLostError, UnitLostError
from knittrans.types import MiniBatch
from workloads.text_data import TEXT_SCHEMA, TextDataConfig, make_text_batch

UNITS = {"u0": "n0", "u1": "n1"}
RANKS = ("n0", "n1")
FIELDS = TEXT_SCHEMA.names


def _batch(prompts=8, n=4, seed=0):
    return make_text_batch(TextDataConfig(num_prompts=prompts, group_size=n, response_len_median=16,
                                          max_response_len=64, prompt_len_mean=8, seed=seed))


def _rows(share, name):
    f = share.fields[name]
    cu = f.cu_seqlens.tolist()
    return {t: f.values[cu[i]:cu[i + 1]].numpy() for i, t in enumerate(share.traj_ids)}


def _check_bytes(share, by_id):
    for name in share.fields:
        for t, arr in _rows(share, name).items():
            np.testing.assert_array_equal(arr, getattr(by_id[t], name))


def test_no_fault_plan_builds_no_wrapper():
    assert all(type(u) is StorageUnit for u in build_inprocess(TEXT_SCHEMA, UNITS, RANKS, faults=FaultPlan()).units.values())
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS, faults=FaultPlan((UnitLoss("u1", 1),)))
    assert type(dp.units["u0"]) is StorageUnit and isinstance(dp.units["u1"], FaultyUnit)


def test_checksum_covers_dtype_shape_and_bytes():
    a = np.arange(6, dtype=np.int64)
    assert field_checksum(a) == field_checksum(a.copy())
    assert field_checksum(a) != field_checksum(a.reshape(2, 3))
    assert field_checksum(a) != field_checksum(a.view(np.float64))
    b = a.copy()
    b[3] ^= 1
    assert field_checksum(a) != field_checksum(b)
    assert field_checksum(np.zeros(0, np.float32)) == field_checksum(np.zeros(0, np.float32))


def test_checksum_value_is_the_documented_crc_of_description_then_bytes():
    """Checksums are kept by the controller, its journal and the units' manifests: the cached description and the
    buffer read must give exactly crc32(bytes, crc32(f"{dtype.str}{shape}")) for any layout."""
    import zlib

    rng = np.random.default_rng(0)
    for arr in (np.arange(10), np.array(2.5), np.zeros(0, np.float32), rng.random((5, 4))[:, ::2], rng.random((3, 4)).T,
                np.arange(6, dtype=">i4"), np.array([True, False]), rng.random((2, 3)).astype(np.float16)):
        a = np.ascontiguousarray(arr)
        want = zlib.crc32(a.tobytes(), zlib.crc32(f"{a.dtype.str}{a.shape}".encode()))
        assert field_checksum(arr) == field_checksum(arr) == want
    with pytest.raises(TypeError):
        field_checksum(np.array([1, "a"], dtype=object))


def test_corrupted_fetch_is_named_never_delivered_and_a_retry_reads_the_good_bytes():
    batch = _batch()
    by_id = {t.traj_id: t for t in batch.trajectories}
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS, checksums=True,
                         faults=FaultPlan((CorruptGet("u0", on_get=1, field="old_logprobs"),)))
    dp.client("u0").put([t.payload() for t in batch.trajectories])
    mb = batch.minibatches(2)[0]
    c = dp.client()
    c.admit(mb)
    with pytest.raises(CorruptPayloadError, match=r"trajectory \d+: field 'old_logprobs' is corrupt on fetch"):
        c.fetch(mb, 0, FIELDS)
    assert dp.units["u0"].stats().num_trajectories == len(by_id)  # nothing stored changed
    share = c.fetch(mb, 0, FIELDS)  # the claim was undone: the retry gets the share, intact
    _check_bytes(share, by_id)
    with pytest.raises(AlreadyConsumedError):
        c.fetch(mb, 0, FIELDS)


def test_corrupted_put_is_refused_and_nothing_is_stored():
    batch = _batch()
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS, checksums=True,
                         faults=FaultPlan((CorruptPut("u0", on_put=2, field="input_ids"),)))
    c = dp.client("u0")
    c.put([t.payload() for t in batch.trajectories[:4]])
    before = dp.units["u0"].stats()
    bad = batch.trajectories[4]
    with pytest.raises(CorruptPayloadError, match=rf"trajectory {bad.traj_id}: field 'input_ids' is corrupt on put"):
        c.put([t.payload() for t in batch.trajectories[4:8]])
    assert dp.units["u0"].stats() == before and dp.controller.stats().trajectories == 4
    c.put([t.payload() for t in batch.trajectories[4:8]])  # the producer's retry goes through


def test_lost_unit_never_yields_a_partial_share_and_reput_restores_it_exactly_once():
    batch = _batch()
    by_id = {t.traj_id: t for t in batch.trajectories}
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS, faults=FaultPlan((UnitLoss("u1", on_put=2),)))
    producers = {u: ProducerBuffer(dp.client(u), fallback_units=[v for v in UNITS if v != u]) for u in UNITS}
    odd = [t.payload() for t in batch.trajectories if t.traj_id % 2]
    even = [t.payload() for t in batch.trajectories if not t.traj_id % 2]
    producers["u0"].put(even)
    producers["u1"].put(odd[:8])
    mbs = batch.minibatches(2)
    c = dp.client()
    c.admit(mbs[0])
    with pytest.raises(UnitLostError, match="storage unit u1 is lost"):
        dp.client("u1").put(odd[8:])  # the unit dies during its second put, with what it held
    lost = dp.controller.missing()
    assert lost and all(t % 2 for t in lost) and dp.controller.stats().units_lost == 1
    share_ranks = [r for r, s in enumerate(dp.controller.admitted(MiniBatchKey(0, 0)).shares) if set(s) & set(lost)]
    for r in share_ranks:
        with pytest.raises(DataLostError, match="never handed out partially"):
            c.fetch(mbs[0], r, FIELDS)
    assert producers["u1"].put(odd[8:]) == "u0"  # the producer falls back to a live unit ...
    assert set(producers["u1"].reput_missing()) == set(lost)  # ... and re-puts what was lost
    assert dp.controller.missing() == ()
    c.admit(mbs[1])
    delivered = []
    for mb in mbs:
        for r in range(len(RANKS)):
            share = c.fetch(mb, r, FIELDS)
            _check_bytes(share, by_id)
            delivered += share.traj_ids
    assert sorted(delivered) == sorted(by_id)  # nothing lost, nothing twice
    assert all(p.prune() == 0 for p in producers.values())
    assert sum(u.stats().nbytes for u in dp.units.values()) == 0


def test_a_prefetcher_waits_for_the_reput_instead_of_failing():
    batch = _batch(prompts=4, n=2)
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS)
    c = dp.client("u1")
    c.put([t.payload() for t in batch.trajectories])
    dp.controller.lose_unit("u1")
    dp.units["u1"].clear()
    mb = batch.minibatches(1)[0]
    c.admit(mb)
    pf = Prefetcher(dp.client(), 0, FIELDS, PrefetchConfig(admit_timeout_s=30), count=1).start()
    got = []
    th = threading.Thread(target=lambda: got.extend(pf))
    th.start()
    th.join(0.3)
    assert th.is_alive() and not got  # waiting, not failing, not partial
    dp.client("u0").put([t.payload() for t in batch.trajectories])
    th.join(10)
    assert len(got) == 1 and set(got[0].traj_ids) == set(dp.controller.admitted(MiniBatchKey(0, 0)).shares[0])


def test_reput_of_a_trajectory_consumed_before_its_unit_died_is_ignored_and_freed():
    batch = _batch(prompts=4, n=2)
    dp = build_inprocess(TEXT_SCHEMA, {"u0": "n0"}, ("n0",))
    c = dp.client("u0")
    c.put([t.payload() for t in batch.trajectories])
    mb = batch.minibatches(1)[0]
    c.admit(mb)
    share = c.fetch(mb, 0, FIELDS, ack=False)  # read, not yet acked
    lost = dp.controller.lose_unit("u0")
    dp.units["u0"].clear()  # it died and came back empty
    assert set(lost) == set(share.traj_ids)
    c.ack(share)  # the rank holds every field: consumed, nothing to re-put
    assert dp.controller.missing() == () and dp.controller.stats().released_minibatches == 1
    c.put([t.payload() for t in batch.trajectories])  # a late re-put
    assert dp.units["u0"].stats().nbytes == 0


@pytest.mark.parametrize("after_step", [False, True])
def test_crashed_rank_gets_its_share_again_and_each_step_counts_once(after_step):
    batch = _batch()
    by_id = {t.traj_id: t for t in batch.trajectories}
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS)
    for u in UNITS:
        dp.client(u).put([t.payload() for t in batch.trajectories if (t.traj_id % 2 == 0) == (u == "u0")])
    mbs = batch.minibatches(4)
    c = dp.client()
    for mb in mbs:
        c.admit(mb)
    seen: dict[int, list[int]] = {0: [], 1: []}
    ledgers = {0: StepLedger(), 1: StepLedger()}

    def step_of(rank):
        def step(share):
            _check_bytes(share, by_id)
            seen[rank].extend(share.traj_ids)
            return share.key
        return step

    run_rank(dp.client(), 1, ledgers[1], 0, len(mbs), step_of(1))
    crash = RankCrash(rank=0, at_seq=2, after_step=after_step)
    with pytest.raises(InjectedCrash):
        run_rank(dp.client(), 0, ledgers[0], 0, len(mbs), step_of(0), crash=crash)
    resume = dp.controller.recover_rank(0)
    assert resume == 2  # its first mini-batch not acked
    ran = run_rank(dp.client(), 0, ledgers[0], resume, len(mbs), step_of(0))
    assert ran == [mb_key for mb_key in (MiniBatchKey(0, k) for k in range(4))][2 + after_step:]
    assert ledgers[0].version == ledgers[1].version == len(mbs)  # one step per mini-batch, none twice
    assert ledgers[0].replays == int(after_step)
    assert sorted(seen[0] + seen[1]) == sorted(by_id)
    assert dp.controller.stats().released_minibatches == len(mbs)
    assert sum(u.stats().nbytes for u in dp.units.values()) == 0


def test_recovery_calls_reject_bad_arguments():
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS)
    with pytest.raises(ValueError, match="unknown unit 'u9'"):
        dp.controller.lose_unit("u9")
    with pytest.raises(ValueError, match="rank 5 out of range"):
        dp.controller.recover_rank(5)
    with pytest.raises(ValueError, match="never admitted"):
        dp.controller.unclaim(MiniBatchKey(3, 0), 0, FIELDS)
    with pytest.raises(ValueError, match="call number >= 1"):
        FaultPlan((UnitLoss("u0", 0),))
    dp.client("u0").put([TrajectoryPayload(0, {"input_ids": np.arange(3)})])
    dp.controller.admit(MiniBatch(0, 0, (0,), (0,), 3))
    dp.units["u0"].clear()
    dp.controller.lose_unit("u0")
    with pytest.raises(ValueError, match="re-put must be the same trajectory"):
        dp.client("u1").put([TrajectoryPayload(0, {"input_ids": np.arange(4)})])
