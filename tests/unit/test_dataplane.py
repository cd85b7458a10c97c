"""In-process data plane: shares, exactly-once delivery, prefetch gating, and bad input leaving state intact."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import torch

from knittrans.dataplane import (AlreadyConsumedError, DuplicatePutError, FieldNotProducedError, MiniBatchKey,
                                 PrefetchConfig, Prefetcher, PrepareConfig, SchemaMismatchError, TrajectoryPayload,
                                 UnknownMiniBatchError, build_inprocess)
from workloads.text_data import TEXT_SCHEMA, TextDataConfig, make_text_batch

FIELDS = TEXT_SCHEMA.names
UNITS = {"u0": "n0", "u1": "n1"}
RANKS = ("n0", "n1")


def _batch(prompts=8, n=4, seed=0):
    return make_text_batch(TextDataConfig(num_prompts=prompts, group_size=n, response_len_median=64,
                                          max_response_len=512, prompt_len_mean=32, seed=seed))


def _unit_of(traj_id: int) -> str:
    return "u0" if traj_id % 2 == 0 else "u1"


def _loaded(batch, **kw):
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS, **kw)
    for u in UNITS:
        dp.client(u).put([t.payload() for t in batch.trajectories if _unit_of(t.traj_id) == u])
    return dp


def _unpack(share, name):
    f = share.fields[name]
    cu = f.cu_seqlens.tolist()
    return [f.values[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]


def test_each_rank_receives_exactly_its_share_ids_and_bytes():
    batch = _batch()
    dp = _loaded(batch)
    by_id = {t.traj_id: t for t in batch.trajectories}
    c = dp.client()
    for mb in batch.minibatches(2):
        adm = c.admit(mb)
        got: list[int] = []
        for rank in range(len(RANKS)):
            share = c.fetch(mb, rank, FIELDS)
            assert share.traj_ids == adm.shares[rank]
            assert share.nbytes == sum(by_id[t].nbytes for t in share.traj_ids)
            assert share.num_tokens == sum(by_id[t].input_ids.shape[0] for t in share.traj_ids)
            for name in FIELDS:
                for t, arr in zip(share.traj_ids, _unpack(share, name)):
                    np.testing.assert_array_equal(arr.numpy(), getattr(by_id[t], name))
            got += share.traj_ids
        assert sorted(got) == sorted(mb.traj_ids)
        assert abs(len(adm.shares[0]) - len(adm.shares[1])) <= 1
    # every mini-batch fully consumed: the units dropped everything
    assert all(u.stats().nbytes == 0 for u in dp.units.values())
    assert dp.controller.stats().released_minibatches == 2


def test_shares_prefer_the_local_unit_when_tokens_allow():
    batch = _batch(prompts=16, n=4)
    dp = _loaded(batch, balance_slack=0.5)
    adm = dp.controller.admit(batch.minibatches(1)[0])
    assert adm.local_fraction >= 0.75
    lo, hi = min(adm.share_tokens), max(adm.share_tokens)
    assert hi <= 1.5 * (lo + hi) / 2 + max(t.input_ids.shape[0] for t in batch.trajectories)


def test_exactly_once_with_concurrent_producers_and_consumers():
    batch = _batch(prompts=16, n=4)
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS)
    mbs = batch.minibatches(4)
    put_done: set[int] = set()
    cv = threading.Condition()

    def producer(pid: int) -> None:  # 4 producers, 2 per unit, each putting every 4th trajectory
        client = dp.client(_unit_of(pid))
        for t in batch.trajectories[pid::4]:
            client.put([t.payload()])
            with cv:
                put_done.add(t.traj_id)
                cv.notify_all()

    def admitter() -> None:
        for mb in mbs:
            with cv:
                cv.wait_for(lambda: set(mb.traj_ids) <= put_done, timeout=30)
            dp.controller.admit(mb)

    delivered: list[tuple[int, str, bytes]] = []
    lock = threading.Lock()

    def consumer(rank: int) -> None:
        pf = Prefetcher(dp.client(), rank, FIELDS, PrefetchConfig(depth=2, admit_timeout_s=30), count=len(mbs))
        for share in pf:
            with lock:
                for name in FIELDS:
                    delivered.extend((t, name, a.numpy().tobytes())
                                     for t, a in zip(share.traj_ids, _unpack(share, name)))

    errors: list[BaseException] = []

    def guarded(fn, *args):
        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the test thread below
                errors.append(e)
        return threading.Thread(target=run)

    threads = [guarded(producer, i) for i in range(4)] + [guarded(admitter)] + [guarded(consumer, r) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    if errors:
        raise errors[0]
    keys = [(t, name) for t, name, _ in delivered]
    assert len(keys) == len(set(keys)) == len(batch.trajectories) * len(FIELDS)
    by_id = {t.traj_id: t for t in batch.trajectories}
    for t, name, raw in delivered:
        assert raw == getattr(by_id[t], name).tobytes()
    assert all(u.stats().num_trajectories == 0 for u in dp.units.values())


def test_prefetch_never_hands_out_a_minibatch_before_it_is_admitted():
    batch = _batch()
    dp = _loaded(batch)
    mbs = batch.minibatches(2)
    pf = Prefetcher(dp.client(), 0, FIELDS, count=2).start()
    with pytest.raises(queue.Empty):
        pf.next(timeout=0.3)  # everything is stored, nothing admitted: nothing may come out
    dp.controller.admit(mbs[0])
    first = pf.next(timeout=10)
    assert first.key == MiniBatchKey(0, 0)
    with pytest.raises(queue.Empty):
        pf.next(timeout=0.3)
    dp.controller.admit(mbs[1])
    assert pf.next(timeout=10).key == MiniBatchKey(0, 1)
    with pytest.raises(StopIteration):
        pf.next(timeout=10)
    assert [e.seq for e in pf.events] == [0, 1]


def test_prefetch_closes_cleanly_while_waiting():
    dp = _loaded(_batch())
    pf = Prefetcher(dp.client(), 0, FIELDS).start()
    dp.close()
    with pytest.raises(StopIteration):
        pf.next(timeout=10)
    pf.close()


def test_prepare_casts_fields():
    batch = _batch()
    dp = _loaded(batch, prepare=PrepareConfig(casts=(("advantages", "bfloat16"),)))
    mb = batch.minibatches(1)[0]
    dp.controller.admit(mb)
    share = dp.client().fetch(mb, 0, ("input_ids", "advantages"))
    assert share["advantages"].dtype == torch.bfloat16 and share["input_ids"].dtype == torch.int64


# -- bad input: clear errors, nothing corrupted or lost ---------------------------------------------------------


def test_fetch_of_an_unknown_minibatch_is_rejected():
    batch = _batch()
    dp = _loaded(batch)
    c = dp.client()
    with pytest.raises(UnknownMiniBatchError, match="never admitted"):
        c.fetch(MiniBatchKey(0, 7), 0, FIELDS)
    mb = batch.minibatches(1)[0]
    c.admit(mb)
    assert len(c.fetch(mb, 0, FIELDS).traj_ids) == len(mb.traj_ids) // 2  # nothing was consumed by the error


def test_fetch_of_a_field_never_produced_is_rejected_and_consumes_nothing():
    batch = _batch()
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS)
    c = dp.client("u0")
    c.put([TrajectoryPayload(t.traj_id, {"input_ids": t.input_ids, "loss_mask": t.loss_mask})
           for t in batch.trajectories])
    mb = batch.minibatches(1)[0]
    c.admit(mb)
    with pytest.raises(FieldNotProducedError, match="'advantages' of trajectory"):
        c.fetch(mb, 0, ("input_ids", "advantages"))
    with pytest.raises(FieldNotProducedError, match="not in the schema"):
        c.fetch(mb, 0, ("rewards",))
    share = c.fetch(mb, 0, ("input_ids",))  # the failed fetches claimed nothing
    assert share.traj_ids
    # the field can still be produced later and then fetched
    c.put([TrajectoryPayload(t.traj_id, {"advantages": t.advantages}) for t in batch.trajectories])
    assert c.fetch(mb, 0, ("advantages",)).traj_ids == share.traj_ids


def test_second_fetch_of_a_consumed_share_is_rejected():
    batch = _batch()
    dp = _loaded(batch)
    c = dp.client()
    mb = batch.minibatches(1)[0]
    c.admit(mb)
    first = c.fetch(mb, 1, ("input_ids",))
    before = first["input_ids"].clone()
    with pytest.raises(AlreadyConsumedError, match="exactly-once"):
        c.fetch(mb, 1, ("input_ids", "loss_mask"))
    assert torch.equal(first["input_ids"], before)
    assert c.fetch(mb, 1, ("loss_mask",)).traj_ids == first.traj_ids  # the rejected call claimed nothing


@pytest.mark.parametrize("bad", ["dtype", "ndim", "unknown_field", "not_array", "empty"])
def test_put_with_mismatched_schema_is_rejected_atomically(bad):
    batch = _batch()
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS)
    good = batch.trajectories[0]
    t = batch.trajectories[1]
    tensors = dict(t.payload().tensors)
    if bad == "dtype":
        tensors["old_logprobs"] = tensors["old_logprobs"].astype(np.float64)
    elif bad == "ndim":
        tensors["input_ids"] = tensors["input_ids"].reshape(1, -1)
    elif bad == "unknown_field":
        tensors["rewards"] = np.zeros(3, np.float32)
    elif bad == "not_array":
        tensors["loss_mask"] = [True, False]
    else:
        tensors = {}
    with pytest.raises(SchemaMismatchError):
        dp.client("u0").put([good.payload(), TrajectoryPayload(t.traj_id, tensors)])
    assert dp.units["u0"].stats().num_trajectories == 0 and dp.controller.stats().trajectories == 0
    dp.client("u0").put([good.payload()])  # the good one can still go in


def test_duplicate_put_is_rejected_and_the_original_survives():
    batch = _batch()
    dp = _loaded(batch)
    t = batch.trajectories[0]
    fake = TrajectoryPayload(t.traj_id, {"input_ids": np.zeros(5, np.int64)})
    with pytest.raises(DuplicatePutError):
        dp.client(_unit_of(t.traj_id)).put([fake])
    other = "u1" if _unit_of(t.traj_id) == "u0" else "u0"
    before = dp.units[other].stats()
    with pytest.raises(DuplicatePutError, match="split it across units"):
        dp.client(other).put([fake])
    assert dp.units[other].stats() == before  # the other unit's write was rolled back
    mb = batch.minibatches(1)[0]
    dp.controller.admit(mb)
    for rank in (0, 1):
        share = dp.client().fetch(mb, rank, ("input_ids",))
        if t.traj_id in share.traj_ids:
            i = share.traj_ids.index(t.traj_id)
            np.testing.assert_array_equal(_unpack(share, "input_ids")[i].numpy(), t.input_ids)


def test_unit_stats_bytes_track_every_put_drop_retry_and_clear():
    """``StorageUnit.stats`` keeps a running byte count: after any mix of puts (identical retries included),
    partial and whole drops, unknown ids and a clear, it equals the bytes actually held."""
    from knittrans.dataplane import StorageUnit

    rng = np.random.default_rng(5)
    unit = StorageUnit("u0", "n0", TEXT_SCHEMA)
    payloads = [t.payload() for t in _batch(prompts=6, seed=1).trajectories]

    def held() -> int:
        return sum(int(a.nbytes) for d in unit._data.values() for a in d.values())

    for step in range(60):
        op = rng.integers(0, 4)
        p = payloads[int(rng.integers(0, len(payloads)))]
        if op == 0:
            unit.put([p])
        elif op == 1:
            unit.put([p])
            unit.put([p])  # an identical retry stores nothing new
        elif op == 2:
            unit.drop([p.traj_id, 10**9], [str(rng.choice(TEXT_SCHEMA.names))])
        else:
            unit.drop([p.traj_id])
        assert unit.stats().nbytes == held(), step
    unit.clear()
    assert unit.stats().nbytes == 0 == held()
