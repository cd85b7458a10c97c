"""This session's put/fetch-path changes, each pinned by what breaks without it: the compact wire form of put lists
(same objects back, plain fallback), the prefetcher's concurrent fetches (order, bounds, a failure in the middle),
the Ray journal's group commit (order, one call per flush, write-ahead before drops) and the multimodal unit
actor's packed reads."""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np
import pytest

from knittrans.dataplane import (MiniBatchKey, PrefetchConfig, Prefetcher, PrepareConfig, TrajectoryPayload,
                                 build_inprocess)
from knittrans.dataplane.types import FieldMeta, PutRecord
from knittrans.dataplane.wire import WireList, to_wire, unwrap
from knittrans.types import Trajectory
from workloads.text_data import TEXT_SCHEMA, TextDataConfig, make_text_batch


def _rt(items):
    return pickle.loads(pickle.dumps(WireList(items))).items


def test_put_records_and_payloads_come_back_equal_in_their_wire_form():
    meta = Trajectory(3, 1, 0, 12, 0, 40, 1.5)
    recs = [PutRecord(i, "u0", (FieldMeta("input_ids", 8 * i, i, 7), FieldMeta("advantages", 4, 1)), i or None,
                      meta if i % 2 else None, ("loss_mask",) if i == 2 else ()) for i in range(5)]
    wire = to_wire(recs)
    assert wire[0] is PutRecord  # columns, not the plain list
    back = _rt(recs)
    assert back == recs and all(type(b) is PutRecord for b in back)
    assert isinstance(back[1].meta, Trajectory) and isinstance(back[0].fields[0], FieldMeta)
    pays = [TrajectoryPayload(i, {"advantages": np.full(i + 1, i, np.float32)}, {"advantages": 9} if i else None,
                              meta if i else None) for i in range(4)]
    got = _rt(pays)
    assert [p.traj_id for p in got] == [0, 1, 2, 3] and got[0].meta is None and got[2].meta == meta
    for a, b in zip(pays, got):
        np.testing.assert_array_equal(a.tensors["advantages"], b.tensors["advantages"])
        assert a.checksums == b.checksums


def test_a_list_that_does_not_fit_the_columns_travels_as_it_is():
    a = PutRecord(0, "u0", (FieldMeta("x", 1, 1),), 1)
    mixed = [a, TrajectoryPayload(1, {"x": np.zeros(1)})]
    assert to_wire(mixed)[0] is None
    assert [type(x) for x in _rt(mixed)] == [PutRecord, TrajectoryPayload]
    assert _rt([]) == [] and unwrap([a]) == [a]
    scalar = [TrajectoryPayload(i, {"x": np.float32(i) * np.ones(())}) for i in range(2)]  # 0-d: kept as is
    assert [float(p.tensors["x"]) for p in _rt(scalar)] == [0.0, 1.0]
    keys = [TrajectoryPayload(0, {"x": np.zeros(2)}), TrajectoryPayload(1, {"y": np.ones(3)})]  # other keys
    assert [sorted(p.tensors) for p in _rt(keys)] == [["x"], ["y"]]
    odd = PutRecord(0, "u0", (FieldMeta("x", 1, 1), "not a field meta"), 1)  # a tuple mixing kinds
    assert to_wire([odd])[0] is None and _rt([odd]) == [odd]


def _loaded():
    batch = make_text_batch(TextDataConfig(num_prompts=8, group_size=4, response_len_median=32,
                                           max_response_len=128, prompt_len_mean=16, seed=0))
    dp = build_inprocess(TEXT_SCHEMA, {"u0": "n0"}, ("n0",))
    dp.client("u0").put([t.payload() for t in batch.trajectories])
    return dp, batch.minibatches(4)


@pytest.mark.parametrize("direct", [True, False])
def test_concurrent_prefetch_hands_out_in_admission_order_and_never_claims_past_its_bound(direct):
    """Direct reads (a resolve and a few copies: CPU work) take one worker; reads through the units (round trips)
    take ``depth`` workers, so one share's reads overlap another's. Either way at most ``depth`` prepared + one in
    flight, handed out in admission order."""
    dp, mbs = _loaded()
    dp.prepare = PrepareConfig(direct_reads=direct)
    client = dp.client()
    active, most, started = [0], [0], [0]
    lock = threading.Lock()
    real = client.fetch_next

    def slow_fetch(seq, *a, **k):  # later seqs finish first: order must come from the prefetcher
        share = real(seq, *a, **k)
        with lock:
            started[0] += 1
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.05 * (4 - seq))
        with lock:
            active[0] -= 1
        return share

    client.fetch_next = slow_fetch
    for mb in mbs:
        dp.controller.admit(mb)
    pf = Prefetcher(client, 0, config=PrefetchConfig(depth=2), count=4).start()
    time.sleep(0.5)  # the trainer has not asked yet: depth 2 waiting + one in flight = 3 fetched, no more
    assert started[0] == 3
    keys = [s.key for s in pf]
    assert keys == [MiniBatchKey(0, i) for i in range(4)]
    assert most[0] == (1 if direct else 2)  # one worker, or depth workers at once; never more
    assert [e.seq for e in pf.events] == [0, 1, 2, 3]
    pf.close()


def test_a_share_the_trainer_waits_for_is_handed_over_before_the_worker_fetches_the_next():
    """The worker's next pack holds the GIL for its whole copy: a trainer blocked on the share just posted must
    have taken it before the worker goes on (otherwise it waits out a switch interval, 5 ms, for the GIL)."""
    dp, mbs = _loaded()
    client = dp.client()
    order: list[str] = []
    real = client.fetch_next

    def fetch(seq, *a, **k):
        order.append(f"fetch {seq}")
        if seq == 0:
            time.sleep(0.2)  # the trainer is blocked on share 0 by the time it is posted
        return real(seq, *a, **k)

    client.fetch_next = fetch
    for mb in mbs:
        dp.controller.admit(mb)
    pf = Prefetcher(client, 0, config=PrefetchConfig(depth=2), count=2).start()
    share = pf.next(timeout=10)
    order.append(f"got {share.seq}")
    assert pf.next(timeout=10).seq == 1
    assert order == ["fetch 0", "got 0", "fetch 1"]
    pf.close()


def test_reads_held_back_by_a_read_limit_start_when_allowed_and_claim_nothing_before():
    dp, mbs = _loaded()
    client = dp.client()
    for mb in mbs:
        dp.controller.admit(mb)
    pf = Prefetcher(client, 0, config=PrefetchConfig(depth=2), read_limit=1).start()
    assert pf.next(timeout=10).seq == 0
    time.sleep(0.3)
    assert dp.controller.stats().claims == 1  # admitted, but past the limit: neither claimed nor read
    pf.allow_reads(pf.next_seq + 3)
    assert [pf.next(timeout=10).seq for _ in range(3)] == [1, 2, 3]
    pf.close()


def test_a_failed_fetch_in_the_middle_ends_the_stream_after_the_shares_before_it():
    dp, mbs = _loaded()
    client = dp.client()
    real = client.fetch_next

    def fail_third(seq, *a, **k):
        if seq == 2:
            raise RuntimeError("unit exploded")
        return real(seq, *a, **k)

    client.fetch_next = fail_third
    for mb in mbs:
        dp.controller.admit(mb)
    pf = Prefetcher(client, 0, config=PrefetchConfig(depth=3), count=4).start()
    got = [pf.next(timeout=10).key for _ in range(2)]
    assert got == [MiniBatchKey(0, 0), MiniBatchKey(0, 1)]
    with pytest.raises(RuntimeError, match="unit exploded"):
        pf.next(timeout=10)
    with pytest.raises(StopIteration):
        pf.next(timeout=10)
    pf.close()
    assert not any(t.is_alive() for t in pf._threads)


def test_the_file_journal_queues_under_the_lock_flushes_in_order_and_a_restart_replays_it(tmp_path, monkeypatch):
    from knittrans.dataplane import journal_file
    from knittrans.dataplane.journal_file import FileJournal

    path = str(tmp_path / "plane.journal")
    j = FileJournal(path)
    assert j.attach() is None  # the plane's first controller
    base = os.path.getsize(path)
    j.count("a", 1)
    j.count("b", 2)
    j.seal()
    assert os.path.getsize(path) == base  # queued, nothing written inside the controller's lock
    j.flush()
    grown = os.path.getsize(path)
    assert grown > base
    j.flush()
    assert os.path.getsize(path) == grown  # nothing queued: no write

    def writer(i):
        for k in range(20):
            j.count(f"w{i}", k)
            j.flush()

    ths = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    # a restarted controller process replays the file: every write once, in the order the controller made them
    state = FileJournal(path).attach()
    assert state.sealed and state.restarts == 1
    assert all(state.counters[f"w{i}"] == 19 for i in range(4))
    assert state.counters["a"] == 1 and state.counters["b"] == 2
    assert FileJournal(path).attach().restarts == 2  # the restart itself is journaled
    # a frame cut short by a kill mid-append is ignored
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00partial")
    assert FileJournal(path).attach().restarts == 3
    # a snapshot bounds the file: with the threshold at one byte, every flush starts it anew
    monkeypatch.setattr(journal_file, "SNAPSHOT_BYTES", 1)
    j2 = FileJournal(path)
    j2.attach()
    for k in range(50):
        j2.count("many", k)
        j2.flush()
    frame = len(pickle.dumps(("writes", [("count", ("many", 49))]), protocol=pickle.HIGHEST_PROTOCOL)) + 8
    assert os.path.getsize(path) == j2.size()["file_bytes"] < 50 * frame  # one snapshot, not 50 appended frames
    assert FileJournal(path).attach().counters["many"] == 49
    j2.close()
    assert not os.path.exists(path)

    from knittrans.dataplane.recovery import ControllerJournal

    cj = ControllerJournal()
    cj.write([("count", ("x", 3)), ("seal", ())])
    with pytest.raises(ValueError, match="not a journal write"):
        cj.write([("attach", ())])


def test_the_multimodal_unit_actor_returns_packed_fields_not_one_array_per_row():
    pytest.importorskip("ray")
    import torch

    from knittrans.mmdedup.plane import MM_SCHEMA, MMPayload
    from knittrans.mmdedup.plane_ray import MMUnitHost
    from knittrans.mmdedup.keys import encoding_hash_fn

    host = MMUnitHost("u0", "n0", MM_SCHEMA, encoding_hash_fn)
    img = torch.rand(4, 8)
    pays = [MMPayload(t, {"input_ids": np.arange(5 + t, dtype=np.int64),
                          "old_logprobs": np.zeros(5 + t, np.float32), "advantages": np.ones(5 + t, np.float32),
                          "loss_mask": np.ones(5 + t, bool)}, group=0, encodings=(img,), grids=((1, 2, 2),))
            for t in range(6)]
    host.put(WireList(pays))
    ch = host.get(tuple(range(6)), MM_SCHEMA.names)
    assert all(isinstance(v, np.ndarray) for v in ch.values)  # rows would be tuples of 6 arrays
    ids = ch.values[MM_SCHEMA.names.index("input_ids")]
    assert ids.shape == (sum(5 + t for t in range(6)),) and len(ch.pixels) == 1


def test_split_and_join_arrays_round_trip_and_name_where_each_row_lies():
    from knittrans.dataplane.wire import array_layout, from_wire, join_arrays, split_arrays

    payloads = [TrajectoryPayload(t, {"input_ids": np.arange(t + 1, dtype=np.int64),
                                      "loss_mask": np.ones(t + 2, dtype=bool)}) for t in range(4)]
    rest, arrays = split_arrays(to_wire(payloads))
    assert [a.shape[0] for a in arrays] == [1 + 2 + 3 + 4, 2 + 3 + 4 + 5]
    back = from_wire(join_arrays(pickle.loads(pickle.dumps(rest)), arrays))
    keys, first, offsets = array_layout(rest, "tensors")
    for i, (p, q) in enumerate(zip(payloads, back)):
        assert q.traj_id == p.traj_id
        for j, k in enumerate(keys):
            assert np.array_equal(q.tensors[k], p.tensors[k])
            assert np.array_equal(arrays[first + j][offsets[j][i]:offsets[j][i + 1]], p.tensors[k])
    with pytest.raises(ValueError):
        join_arrays(rest, arrays + arrays[:1])
    mixed = [TrajectoryPayload(0, {"input_ids": np.arange(3)}), TrajectoryPayload(1, {"loss_mask": np.ones(2, bool)})]
    rest, arrays = split_arrays(to_wire(mixed))
    assert arrays == () and array_layout(rest, "tensors") is None  # no array column: the put travels as it is


def test_a_unit_keeps_its_object_until_its_last_stored_row_is_dropped():
    """A Ray unit's object (one per large put) stays referenced by the unit while any of its rows is stored, and is
    let go with the last one (the controller and readers hold their own references)."""
    from knittrans.dataplane.ray_transport import StoredObjects

    objs = StoredObjects()
    ref = object()  # stands in for the ObjectRef
    objs.add(ref, [(7, "input_ids"), (8, "input_ids"), (8, "loss_mask")])
    objs.drop([7], None)
    assert objs.num_objects == 1
    objs.drop([8], ["input_ids"])
    assert objs.num_objects == 1  # 8's loss_mask still lies in it
    objs.drop([8], None)
    assert objs.num_objects == 0


def test_a_closed_file_journal_takes_no_more_writes_and_leaves_no_file(tmp_path):
    from knittrans.dataplane.journal_file import FileJournal

    path = str(tmp_path / "p.journal")
    j = FileJournal(path)
    j.attach()
    j.seal()
    j.close()
    j.count("late", 1)
    j.flush()  # a reply after close (the controller's wrapper flushes every call): nothing to write, no error
    assert not os.path.exists(path)
