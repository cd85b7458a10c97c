"""Bounded state (issue 29, class 4): what a long run keeps is what is in flight, however many batches it trained --
and forgetting a finished batch never lets a duplicate or a stale message through."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from knittrans.admission import AdmissionError, KnitTransAdmission
from knittrans.constraints import BatchConstraints
from knittrans.dataplane.records import RecordLog
from knittrans.dataplane.recovery import ControllerJournal, Released
from knittrans.dataplane.types import MiniBatchKey
from knittrans.staleness import StalenessStats
from knittrans.types import BatchPlan, GroupSpec, Trajectory

C = BatchConstraints(batch_size=4, num_minibatches=2, group_size=2, max_response_len=8)


def _run_batches(p: KnitTransAdmission, batches: int) -> list:
    out = []
    for b in range(batches):
        p.add_batch(BatchPlan(b, (GroupSpec(2 * b, b, 2), GroupSpec(2 * b + 1, b, 2))))
        for t in range(4 * b, 4 * b + 4):
            p.on_complete(Trajectory(t, group_id=t // 2, batch_id=b, num_tokens=1 + t % 3, v_gen=0))
            out += p.on_trainer_ready(0.0)
    return out


def test_the_ledger_forgets_every_finished_batch_and_still_refuses_its_ids():
    p = KnitTransAdmission(C)
    mbs = _run_batches(p, 50)
    assert sorted(t for mb in mbs for t in mb.traj_ids) == list(range(200))  # exactly once, every one
    led = p.ledger
    assert not led.batches and not led._group_batch and not led._traj_ids and not led.order  # nothing finished kept
    assert len(led._finished_trajs.ranges) == 1 and len(led._finished_batches.ranges) == 1  # ids as one range each
    with pytest.raises(AdmissionError, match="batch 3 was already added"):
        p.add_batch(BatchPlan(3, (GroupSpec(500, 3, 2),)))
    with pytest.raises(AdmissionError, match="group 7 of batch 50 already belonged to a trained batch"):
        p.add_batch(BatchPlan(50, (GroupSpec(7, 50, 2),)))
    p.add_batch(BatchPlan(50, (GroupSpec(100, 50, 2), GroupSpec(101, 50, 2))))
    with pytest.raises(AdmissionError, match="duplicate trajectory id 5"):
        p.on_complete(Trajectory(5, group_id=100, batch_id=50, num_tokens=2, v_gen=0))
    with pytest.raises(AdmissionError, match="batch 4 is finished"):
        p.on_complete(Trajectory(999, group_id=8, batch_id=4, num_tokens=2, v_gen=0))


def test_a_record_window_bounds_the_rows_and_never_the_staleness_histogram():
    log = RecordLog(window=3)
    for t in range(100):
        log.append((t, 0, 0, 1, t % 4, t % 4 + t % 3, 0.0, 0.0))  # staleness t % 3
    assert [r.traj_id for r in log.rows()] == [97, 98, 99] and log.total == 100
    assert len(log._f) // 2 <= 6  # at most twice the window between trims
    assert log.counts == {0: 34, 1: 33, 2: 33}
    none = RecordLog(window=0)
    none.extend([(1, 0, 0, 1, 0, 2, 0.0, 0.0)])
    assert none.rows() == [] and none.counts == {2: 1} and len(none._i) == 0


@pytest.mark.parametrize("seed", range(5))
def test_staleness_from_the_histogram_equals_staleness_from_every_value(seed):
    s = np.random.default_rng(seed).integers(0, 9, size=int(np.random.default_rng(seed).integers(1, 500)))
    vals, counts = np.unique(s, return_counts=True)
    got = StalenessStats.of_counts(list(zip(vals.tolist(), counts.tolist())))
    want = StalenessStats.of(s)
    assert (got.mean, got.p50, got.p99, got.max) == pytest.approx((want.mean, want.p50, want.p99, want.max))


def test_the_journal_keeps_the_controllers_record_window_and_every_rows_staleness():
    j = ControllerJournal()
    j.attach()
    for k in range(40):  # 40 released mini-batches of 5 trajectories, the controller keeping 8 records
        rows = tuple((5 * k + i, 0, 0, 1, 0, i, 0.0, 0.0) for i in range(5))
        j.ack(MiniBatchKey(0, k), 0, (), Released(MiniBatchKey(0, k), tuple(r[0] for r in rows), rows, (), keep=8))
    assert j.size()["rows"] <= 16
    state = j.attach()
    assert state.staleness == {i: 40 for i in range(5)} and state.rows_total == 200
    log = RecordLog(window=8)
    log.restore(array("q", state.rows_i), array("d", state.rows_f), state.rows_total, state.staleness)
    assert len(log.rows()) == 8 and log.counts == state.staleness and log.total == 200


def test_a_prefetcher_keeps_the_timings_of_its_last_shares_only():
    from knittrans.dataplane.prefetch import EVENTS_KEPT, Prefetcher

    pf = Prefetcher.__new__(Prefetcher)  # only the events field is exercised
    pf.events = Prefetcher.__dataclass_fields__["events"].default_factory()
    for i in range(EVENTS_KEPT + 10):
        pf.events.append(i)
    assert len(pf.events) == EVENTS_KEPT and pf.events[0] == 10 and pf.events[-1] == EVENTS_KEPT + 9
