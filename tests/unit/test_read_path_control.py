"""The read path's control (issue 25, session 35): a rank's incarnation comes with its first long poll, polls say
which sources retired, a remote reader keeps what it mapped until then (``SourceCache``), and delayed acks go in
one call unless a flush asks for them at once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from knittrans.dataplane import TrajectoryPayload, build_inprocess
from knittrans.dataplane.client import SourceCache
from knittrans.dataplane.feed import AckSender
from knittrans.dataplane.sources import SourceTable
from knittrans.dataplane.types import FencedError, MiniBatchKey, Retired, ShareRuns
from workloads.text_data import TEXT_SCHEMA, TextDataConfig, make_text_batch

UNITS = {"u0": "n0", "u1": "n1"}
RANKS = ("n0", "n1")


class Ref:
    """An object-store handle as the controller and readers see one (``binary``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def binary(self) -> bytes:
        return self.name.encode()


def _admitted(seed: int = 0):
    batch = make_text_batch(TextDataConfig(num_prompts=8, group_size=4, response_len_median=64, max_response_len=512,
                                           prompt_len_mean=32, seed=seed))
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS)
    for i, u in enumerate(UNITS):
        dp.client(u).put([t.payload() for t in batch.trajectories if t.group_id % 2 == i])
    for mb in batch.minibatches(4):
        dp.client().admit(mb)
    return dp


def test_a_poll_answers_with_the_incarnation_it_was_fenced_by_and_times_out_empty():
    dp = _admitted()
    ctrl = dp.controller
    epoch, locs, _ = ctrl.poll(0, 0, TEXT_SCHEMA.names, 2, timeout=1.0)
    assert epoch == 0 and [loc.seq for loc in locs] == [0, 1] and all(loc.epoch == 0 for loc in locs)
    assert ctrl.poll(9, 0, TEXT_SCHEMA.names, 1, timeout=0.05).locs == ()  # nothing admitted: empty, no error
    ctrl.recover_rank(0)
    with pytest.raises(FencedError):  # the old incarnation is fenced off as before
        ctrl.poll(2, 0, TEXT_SCHEMA.names, 1, timeout=1.0, epoch=0)
    assert ctrl.poll(0, 0, TEXT_SCHEMA.names, 1, timeout=1.0).epoch == 1  # a new consumer adopts the new one


def test_a_poll_waiting_across_a_recovery_is_fenced_by_the_incarnation_it_arrived_with():
    dp = _admitted()
    ctrl = dp.controller
    got: list = []

    def poll():
        try:
            got.append(ctrl.poll(4, 0, TEXT_SCHEMA.names, 1, timeout=5.0))
        except FencedError as e:
            got.append(e)

    th = threading.Thread(target=poll)
    th.start()
    time.sleep(0.2)  # the poll waits for mini-batch #4 with incarnation 0
    ctrl.recover_rank(0)
    extra = make_text_batch(TextDataConfig(num_prompts=2, group_size=4, response_len_median=64, max_response_len=512,
                                           prompt_len_mean=32, seed=9))
    from knittrans.types import MiniBatch

    payloads = [TrajectoryPayload(1000 + t.traj_id, t.payload().tensors) for t in extra.trajectories]
    dp.client("u0").put(payloads)
    ctrl.admit(MiniBatch(batch_id=1, index=0, traj_ids=tuple(p.traj_id for p in payloads), group_ids=(0,),
                         num_tokens=sum(int(p.tensors["input_ids"].shape[0]) for p in payloads)))
    th.join(10)
    assert isinstance(got[0], FencedError)  # a zombie consumer never adopts the recovered rank's incarnation


def test_the_source_table_logs_retired_remote_sources_for_readers_to_page_through():
    t = SourceTable()
    a, b = Ref("a"), Ref("b")
    ra = t.add(a, "u0", [("ids", (0, 0, 8))])
    rb = [t.add(b, "u0", [("ids", (0, 0, 8))])]
    t.end_put()
    start = t.retired_since(None)
    assert start.ids == () and not start.reset
    t.release(ra)
    got = t.retired_since(start.cursor)
    assert got.ids == (b"a",) and not got.reset
    assert t.retired_since(got.cursor).ids == ()  # each retirement once per reader
    t.release(rb[0])
    assert t.retired_since(got.cursor).ids == (b"b",)
    assert SourceTable().retired_since(got.cursor).reset  # another table (a restarted controller): reset
    arrays = (np.arange(4),)  # in process a source is arrays: nobody maps it, nothing is logged
    t.release(t.add(arrays, "u0", [("ids", (0, 0, 8))]))
    assert t.retired_since(got.cursor).ids == (b"b",)


def _runs(*names: str) -> ShareRuns:
    return ShareRuns(tuple(Ref(n) for n in names), ("u0",) * len(names), (), ())


def test_a_reader_maps_each_source_once_and_keeps_it_until_it_retires():
    cache, calls = SourceCache(), []

    def resolve(runs):
        calls.append([h.name for h in runs.sources])
        return [(np.full(2, ord(h.name[0])),) for h in runs.sources]

    cache.retiring = True  # a feed's polls tell it what retires
    s1 = (MiniBatchKey(0, 0), 0)
    first = cache.objects(_runs("a", "b"), s1, resolve)
    assert [int(x[0][0]) for x in first] == [ord("a"), ord("b")] and calls == [["a", "b"]]
    cache.release(s1)  # acked: both stay mapped (a later claim names them again)
    cache.objects(_runs("b", "c"), (MiniBatchKey(0, 1), 0), resolve)
    assert calls[-1] == ["c"] and len(cache) == 3
    cache.retire(Retired((b"a",), ("log", 1), False))
    assert len(cache) == 2
    cache.retire(Retired((), ("log", 1), True))  # a reset lets go of what no unacked share reads
    assert len(cache) == 2  # b and c are read by the unacked share (0, 1)
    cache.release((MiniBatchKey(0, 1), 0))
    cache.retire(Retired((), ("log", 1), True))
    assert len(cache) == 0


def test_without_a_feed_a_reader_lets_go_once_no_unacked_share_reads_a_source_and_a_failed_map_leaves_nothing():
    cache = SourceCache()
    user = (MiniBatchKey(0, 0), 1)
    cache.objects(_runs("a"), user, lambda runs: [(np.zeros(1),) for _ in runs.sources])
    assert len(cache) == 1
    cache.release(user)
    assert len(cache) == 0

    def broken(runs):
        raise RuntimeError("lost")

    with pytest.raises(RuntimeError):
        cache.objects(_runs("x"), user, broken)
    assert len(cache) == 0


class RecordingController:
    def __init__(self) -> None:
        self.calls: list[list] = []

    def ack_many(self, batch) -> None:
        self.calls.append(list(batch))


def test_delayed_acks_go_in_one_call_and_a_flush_sends_at_once():
    ctrl = RecordingController()
    sender = AckSender(ctrl, delay_s=5.0)
    for k in range(3):
        sender.send(MiniBatchKey(0, k), 0, ("input_ids",), 0)
    time.sleep(0.1)
    assert ctrl.calls == []  # held for more
    t = time.perf_counter()
    sender.flush(timeout=2.0)
    assert time.perf_counter() - t < 2.0 and [len(c) for c in ctrl.calls] == [3]
    sender.close()
    prompt = RecordingController()
    at_once = AckSender(prompt)  # delay 0: a plain client's acks go at once
    at_once.send(MiniBatchKey(0, 0), 0, ("input_ids",), None)
    deadline = time.perf_counter() + 2.0
    while not prompt.calls and time.perf_counter() < deadline:
        time.sleep(0.005)
    assert [len(c) for c in prompt.calls] == [1]
    at_once.close()


def test_an_admission_is_shown_to_the_polls_only_after_the_journal_flush_that_writes_it(tmp_path, monkeypatch):
    """A Ray controller answers a poll only after flushing its journal; a poll woken at the admission itself would wait
    for that flush (and for the GIL beside the admitting call) before it could answer. So an admission is shown to
    waiters once its host has written it: the host's flush runs with the admission still hidden, then shows it."""
    import tempfile
    import uuid

    from knittrans.dataplane import ray_transport
    from knittrans.dataplane.storage import StorageUnit

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the journal file (journal_path) under tmp_path
    batch = make_text_batch(TextDataConfig(num_prompts=4, group_size=2, response_len_median=16, max_response_len=64,
                                           prompt_len_mean=8, seed=0))
    host = ray_transport.ControllerHost(TEXT_SCHEMA, {"u0": "n0"}, ray_transport.ControllerConfig(("n0",)), {},
                                        plane=f"shown-{uuid.uuid4().hex[:8]}")
    host.register(StorageUnit("u0", "n0", TEXT_SCHEMA).put([t.payload() for t in batch.trajectories]))
    seen_at_flush: list[int] = []
    flush = host._journal.flush
    monkeypatch.setattr(host._journal, "flush", lambda: (seen_at_flush.append(host.ctrl._shown()), flush())[1])
    mb = batch.minibatches(2)[0]
    host.admit(mb)
    assert seen_at_flush == [0]  # the admitting call's flush ran with the admission hidden from the polls
    assert host.ctrl.next_admitted(0, timeout=1.0).traj_ids == tuple(mb.traj_ids)  # shown once written
    ctrl = host.ctrl
    ctrl.admit(batch.minibatches(2)[1])  # straight into the controller: admitted, never flushed by a host call
    assert ctrl.admitted_count() == 2 and ctrl.poll(1, 0, TEXT_SCHEMA.names, 1, timeout=0.05).locs == ()
    with pytest.raises(TimeoutError):
        ctrl.next_admitted(1, timeout=0.05)
    ctrl.show(ctrl.admitted_count())
    assert [loc.seq for loc in ctrl.poll(1, 0, TEXT_SCHEMA.names, 1, timeout=1.0).locs] == [1]
    host.close()


def test_a_waiting_poll_is_answered_by_the_admitting_call_once_the_journal_file_holds_the_admission(
        tmp_path, monkeypatch):
    """A Ray controller writes an admission its policy made into the journal file inside the registration that made
    it, and answers the polls waiting for it there, under that call's lock: a rank's first share leaves with the
    admitting call instead of after it, its host's flush and whichever call takes the lock next (the other producer's
    registration, ~2-5 ms on a loaded machine). The answer is backed by the file: a controller restarted right after
    the call finds the admission. A poll itself writes nothing and answers without a flush."""
    import tempfile
    import uuid

    from knittrans.admission.minibatch import KnitTransAdmission
    from knittrans.constraints import BatchConstraints
    from knittrans.dataplane import ray_transport
    from knittrans.dataplane.journal_file import FileJournal, journal_path
    from knittrans.dataplane.storage import StorageUnit
    from knittrans.types import BatchPlan, GroupSpec, Trajectory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the journal file (journal_path) under tmp_path
    plane = f"served-{uuid.uuid4().hex[:8]}"
    c = BatchConstraints(batch_size=4, num_minibatches=1, max_response_len=8, group_size=2)
    host = ray_transport.ControllerHost(TEXT_SCHEMA, {"u0": "n0"}, ray_transport.ControllerConfig(("n0",)), {},
                                        policy=KnitTransAdmission(c), plane=plane)
    ctrl = host.ctrl
    host.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2), GroupSpec(1, 0, 2))))
    at_flush: list[tuple[int, int]] = []  # (admitted, claims) each time the in-call flush runs
    durable = ctrl._durable
    monkeypatch.setattr(ctrl, "_durable", lambda: (at_flush.append((ctrl.admitted_count(), ctrl.stats().claims)),
                                                   durable())[1])
    got: list = []
    poller = threading.Thread(target=lambda: got.append(ctrl.poll(0, 0, TEXT_SCHEMA.names, 1, timeout=10.0)))
    poller.start()
    deadline = time.monotonic() + 5.0
    while not ctrl._polls and time.monotonic() < deadline:  # the poll is waiting
        time.sleep(0.001)
    payloads = []
    for t in range(4):
        p = TrajectoryPayload(t, {"input_ids": np.arange(4, dtype=np.int64), "old_logprobs": np.zeros(2, np.float32),
                                  "advantages": np.ones(2, np.float32), "loss_mask": np.ones(2, bool)},
                              meta=Trajectory(traj_id=t, group_id=t // 2, batch_id=0, num_tokens=2, v_gen=0))
        payloads.append(p)
    host.register(StorageUnit("u0", "n0", TEXT_SCHEMA).put(payloads))
    assert at_flush == [(1, 0)]  # written inside the admitting call, before anything was handed out
    assert ctrl.stats().claims == 1  # and the waiting poll answered by that call, before it returned
    assert [k.batch_id for k in FileJournal(journal_path(plane)).attach().log] == [0]  # what a restart finds
    poller.join(timeout=10.0)
    assert [(loc.seq, sorted(loc.traj_ids)) for loc in got[0].locs] == [(0, [0, 1, 2, 3])]
    flushes: list[int] = []
    monkeypatch.setattr(host._journal, "flush", lambda: flushes.append(1))
    assert host.poll(1, 0, TEXT_SCHEMA.names, 1, timeout=0.01).locs == () and flushes == []  # no flush for a poll
    host.close()


def test_a_waiting_poll_is_woken_only_by_its_answer_and_leaves_while_the_admitting_call_still_holds_the_lock(
        tmp_path, monkeypatch):
    """The changes a registration makes before its admission is written (its completions, the admission itself) do
    not wake a waiting poll: woken to check again, it would queue for the controller's lock behind that call and
    the next one, and its answer, given in place meanwhile, would wait with it (~10 ms under the raw pass's load,
    perf sched trace in docs/experiments.md, session 43). It wakes with its answer and returns without the lock."""
    import tempfile
    import uuid

    from knittrans.admission.minibatch import KnitTransAdmission
    from knittrans.constraints import BatchConstraints
    from knittrans.dataplane import ray_transport
    from knittrans.dataplane.storage import StorageUnit
    from knittrans.types import BatchPlan, GroupSpec, Trajectory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    c = BatchConstraints(batch_size=4, num_minibatches=1, max_response_len=8, group_size=2)
    host = ray_transport.ControllerHost(TEXT_SCHEMA, {"u0": "n0"}, ray_transport.ControllerConfig(("n0",)), {},
                                        policy=KnitTransAdmission(c), plane=f"woken-{uuid.uuid4().hex[:8]}")
    ctrl = host.ctrl
    host.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2), GroupSpec(1, 0, 2))))
    durable = ctrl._durable
    monkeypatch.setattr(ctrl, "_durable", lambda: (time.sleep(0.2), durable())[1])  # a slow write: time to wake
    got: list = []
    poller = threading.Thread(target=lambda: got.append(ctrl.poll(0, 0, TEXT_SCHEMA.names, 1, timeout=10.0)))
    poller.start()
    deadline = time.monotonic() + 5.0
    while not ctrl._polls and time.monotonic() < deadline:
        time.sleep(0.001)
    payloads = [TrajectoryPayload(t, {"input_ids": np.arange(4, dtype=np.int64), "old_logprobs": np.zeros(2, np.float32),
                                      "advantages": np.ones(2, np.float32), "loss_mask": np.ones(2, bool)},
                                  meta=Trajectory(traj_id=t, group_id=t // 2, batch_id=0, num_tokens=2, v_gen=0))
                for t in range(4)]
    records = StorageUnit("u0", "n0", TEXT_SCHEMA).put(payloads)
    with ctrl._cv:  # the admitting call, and then whatever holds the lock after it
        host.register(records)
        poller.join(timeout=5.0)
        returned_under_lock = not poller.is_alive()
    poller.join(timeout=10.0)
    assert returned_under_lock
    assert [(loc.seq, sorted(loc.traj_ids)) for loc in got[0].locs] == [(0, [0, 1, 2, 3])]
    host.close()
