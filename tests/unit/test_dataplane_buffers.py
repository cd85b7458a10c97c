"""Pack buffers (``knittrans.dataplane.buffers``): a share still referenced is never overwritten, a released one's
buffer is reused, and the pooled pack is byte-identical to its plain twin (fresh allocations) on awkward shapes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans.dataplane import (FieldSpec, MiniBatchKey, PrepareConfig, ShareLocation, TrajectoryPayload,
                                 TrajectorySchema, UnitChunk, build_inprocess, pack_share)
from knittrans.dataplane.types import ReadTimeoutError
from knittrans.dataplane.buffers import BufferPool
from knittrans.dataplane.storage import StorageUnit, packed_chunk
from workloads.text_data import TEXT_SCHEMA, TextDataConfig, make_text_batch

UNITS = {"u0": "n0", "u1": "n1"}
RANKS = ("n0", "n1")


def _loaded(prepare: PrepareConfig, prompts: int = 8, n: int = 4):
    batch = make_text_batch(TextDataConfig(num_prompts=prompts, group_size=n, response_len_median=64,
                                           max_response_len=512, prompt_len_mean=32, seed=0))
    dp = build_inprocess(TEXT_SCHEMA, UNITS, RANKS, prepare=prepare)
    for i, u in enumerate(UNITS):
        dp.client(u).put([t.payload() for t in batch.trajectories if t.traj_id % 2 == i])
    return dp, batch


def _bytes(share) -> dict:  # noqa: ANN001
    return {k: (f.values.numpy().copy(), None if f.cu_seqlens is None else f.cu_seqlens.numpy().copy())
            for k, f in share.fields.items()}


def test_a_share_still_referenced_is_never_overwritten_by_a_later_pack():
    dp, batch = _loaded(PrepareConfig())
    c = dp.client()
    mbs = batch.minibatches(4)
    for mb in mbs:
        c.admit(mb)
    kept = c.fetch(mbs[0], 0)
    view = kept["input_ids"][1:]  # a view of the packed tensor keeps the buffer alive too
    before = _bytes(kept)
    later = [c.fetch(mb, r) for mb in mbs for r in range(len(RANKS)) if (mb, r) != (mbs[0], 0)]
    for s in later:
        for f in s.fields.values():
            assert not np.shares_memory(f.values.numpy(), kept["input_ids"].numpy())
            f.values.fill_(0)  # trainers edit their batch in place
    assert all(np.array_equal(before[k][0], kept.fields[k].values.numpy()) for k in before)
    assert torch.equal(view, torch.from_numpy(before["input_ids"][0][1:]))


def test_a_released_share_buffer_is_reused_without_allocating():
    dp, batch = _loaded(PrepareConfig())
    c = dp.client()
    mbs = batch.minibatches(4)
    for mb in mbs:
        c.admit(mb)
    assert c.pack_pool() is not None  # the process's pool by default; this test watches a pool of its own
    c.pool = pool = BufferPool(4)
    first = c.fetch(mbs[0], 0)
    ptr = first["input_ids"].data_ptr()
    del first  # the trainer is done with it: nothing references its buffer any more
    allocated = pool.allocations
    again = c.fetch(mbs[1], 0)  # no larger than the pool's buffers (1/8 headroom, 2 MiB grain)
    assert pool.allocations == allocated
    assert again["input_ids"].data_ptr() == ptr


@pytest.mark.parametrize("reuse", [True, False])
def test_pooled_and_plain_packs_are_byte_identical(reuse):
    """Units answering in rows form and in packed form, out of share order, with a fixed-shape field, an empty
    ragged row and odd sizes: the pack is the same bytes either way (and equal to the plain twin's)."""
    schema = TrajectorySchema((FieldSpec("ids", "int64"), FieldSpec("x", "float32", ragged=False, tail=(3,)),
                               FieldSpec("m", "bool")), token_field="ids")
    rng = np.random.default_rng(1)
    data = {t: {"ids": rng.integers(0, 99, size=1 + t * 7 % 13), "x": rng.random(3, dtype=np.float32),
                "m": rng.random(t % 3) > 0.5} for t in range(11)}
    u0, u1 = StorageUnit("u0", "n0", schema), StorageUnit("u1", "n1", schema)
    u0.put([TrajectoryPayload(t, data[t]) for t in range(0, 11, 2)])
    u1.put([TrajectoryPayload(t, data[t]) for t in range(1, 11, 2)])
    names = ("ids", "x", "m")
    order = (5, 0, 3, 10, 1, 8, 7, 2, 9, 4, 6)
    loc = ShareLocation(MiniBatchKey(0, 0), 0, order, tuple(f"u{t % 2}" for t in order), names, nbytes=0)
    chunks = [u0.get(tuple(range(0, 11, 2)), names), packed_chunk(u1.get(tuple(range(1, 11, 2)), names))]
    pool = BufferPool(4) if reuse else None
    got = pack_share(loc, chunks, schema, PrepareConfig(), pool)
    plain = pack_share(loc, chunks, schema, PrepareConfig(), None)
    for name in names:
        want = [data[t][name] for t in order]
        f = got.fields[name]
        if name == "x":
            np.testing.assert_array_equal(f.values.numpy(), np.stack(want))
            assert f.cu_seqlens is None
        else:
            np.testing.assert_array_equal(f.values.numpy(), np.concatenate(want))
            np.testing.assert_array_equal(f.cu_seqlens.numpy(), np.cumsum([0, *(len(w) for w in want)]))
        assert torch.equal(f.values, plain.fields[name].values)
        assert f.values.numpy().flags.writeable  # the consumer's own bytes (never a view of a unit's copy)
    assert got.num_tokens == sum(len(data[t]["ids"]) for t in order)


def test_packed_chunk_keeps_every_row_and_frees_its_buffer_for_the_next_get():
    u = StorageUnit("u0", "n0", TEXT_SCHEMA)
    batch = make_text_batch(TextDataConfig(num_prompts=2, group_size=3, response_len_median=16, max_response_len=64,
                                           prompt_len_mean=8, seed=2))
    u.put([t.payload() for t in batch.trajectories])
    ids = tuple(t.traj_id for t in batch.trajectories)
    rows = u.get(ids, TEXT_SCHEMA.names)
    pool = BufferPool(2)
    packed = packed_chunk(rows, pool)
    assert all(isinstance(v, np.ndarray) for v in packed.values)
    for f in range(len(rows.fields)):
        assert all(np.array_equal(a, b) for a, b in zip(rows.rows(f), packed.rows(f)))
    ptr = packed.values[0].ctypes.data
    del packed  # Ray has serialized the reply: the buffer is free again
    assert packed_chunk(rows, pool).values[0].ctypes.data == ptr and pool.allocations == 1


def test_buffer_pool_bad_input_and_pickling():
    with pytest.raises(ValueError, match="max_buffers"):
        BufferPool(-1)
    pool = BufferPool(0)
    with pytest.raises(ValueError, match="nbytes"):
        pool.take(-1)
    a, b = pool.take(16), pool.take(16)  # a pool of 0 buffers hands out plain allocations, never shared
    assert not np.shares_memory(a, b) and pool.num_buffers == 0
    assert pool.take(0).nbytes == 0
    full = BufferPool(2)
    keep = full.take(1 << 10)
    clone = pickle.loads(pickle.dumps(full))  # buffers never travel with a client
    assert clone.num_buffers == 0 and clone.max_buffers == 2 and full.num_buffers == 1
    del keep


def test_unit_chunk_rows_reads_both_forms_alike():
    vals = np.arange(6)
    packed = UnitChunk("u", (1, 2, 3), ("a",), (vals,), (np.array([1, 0, 5]),))
    rows = UnitChunk("u", (1, 2, 3), ("a",), ((vals[:1], vals[1:1], vals[1:]),), (np.array([1, 0, 5]),))
    assert [r.tolist() for r in packed.rows(0)] == [r.tolist() for r in rows.rows(0)] == [[0], [], [1, 2, 3, 4, 5]]
    fixed = UnitChunk("u", (1, 2), ("b",), (np.arange(6).reshape(2, 3),), (None,))
    assert [r.tolist() for r in fixed.rows(0)] == [[0, 1, 2], [3, 4, 5]]


def test_a_direct_read_never_waits_on_a_unit():
    """A share whose rows lie in their units' sources is read from the sources, not through the units: a unit
    whose lock never frees does not hold up the read (the bytes are the put's)."""
    dp, batch = _loaded(PrepareConfig())
    dp.read_timeout_s = 0.2
    c = dp.client()
    mb = batch.minibatches(2)[0]
    c.admit(mb)
    locks = [u._lock for u in dp.units.values()]  # noqa: SLF001 - a unit stuck holding its lock
    for lock in locks:
        lock.acquire()
    try:
        share = c.fetch(mb, 0)
    finally:
        for lock in locks:
            lock.release()
    assert share.traj_ids and share.nbytes > 0


def test_a_plain_unit_read_on_the_rank_thread_still_has_its_deadline():
    """Plain units are read inline (no reader thread) when a share goes through its units: a unit whose lock
    never frees still raises ``ReadTimeoutError`` at the deadline, the claim undone, and the retry gets the
    share."""
    dp, batch = _loaded(PrepareConfig(direct_reads=False))
    dp.read_timeout_s = 0.2
    c = dp.client()
    mb = batch.minibatches(2)[0]
    c.admit(mb)
    locks = [u._lock for u in dp.units.values()]  # noqa: SLF001 - a unit stuck holding its lock
    for lock in locks:
        lock.acquire()
    try:
        with pytest.raises(ReadTimeoutError, match="did not answer a read within 0.2"):
            c.fetch(mb, 0)
    finally:
        for lock in locks:
            lock.release()
    assert c.fetch(mb, 0).traj_ids


def test_a_share_for_the_gpu_is_packed_into_one_pinned_block_as_torch_views(monkeypatch):
    """With CUDA, the share goes into one block from torch's caching host allocator, each field a torch view of it
    (so the allocator tracks async copies reading it), with the same bytes as the pageable pack. No GPU here: the
    pinned allocation is stood in for, the layout and the views are what is checked."""
    u = StorageUnit("u0", "n0", TEXT_SCHEMA)
    batch = make_text_batch(TextDataConfig(num_prompts=2, group_size=3, response_len_median=16, max_response_len=64,
                                           prompt_len_mean=8, seed=4))
    u.put([t.payload() for t in batch.trajectories])
    ids = tuple(t.traj_id for t in batch.trajectories)
    loc = ShareLocation(MiniBatchKey(0, 0), 0, ids, ("u0",) * len(ids), TEXT_SCHEMA.names, nbytes=0)
    chunks = [u.get(ids, TEXT_SCHEMA.names)]
    pageable = pack_share(loc, chunks, TEXT_SCHEMA, PrepareConfig(pin_memory=False), BufferPool(2))
    real_empty, pinned_calls = torch.empty, []

    def empty(*args, pin_memory=False, **kw):  # noqa: ANN001, ANN202
        pinned_calls.append(pin_memory)
        return real_empty(*args, **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", empty)
    pinned = pack_share(loc, chunks, TEXT_SCHEMA, PrepareConfig(), BufferPool(2))
    assert pinned_calls == [True]
    storages = {f.values.untyped_storage().data_ptr() for f in pinned.fields.values()}
    assert len(storages) == 1  # one block, every field a torch view of it
    for name in TEXT_SCHEMA.names:
        assert torch.equal(pinned[name], pageable[name]) and pinned[name].dtype == pageable[name].dtype


def test_copy_rows_writes_what_numpy_would_and_never_past_its_output():
    from knittrans.dataplane.buffers import copy_rows

    rng = np.random.default_rng(3)
    rows = [rng.random((n, 3)).astype(np.float32) for n in (4, 0, 7, 1)]
    out = np.empty((12, 3), np.float32)
    copy_rows(rows, out, ragged=True)
    np.testing.assert_array_equal(out, np.concatenate(rows))
    fixed = [rng.integers(0, 9, 5) for _ in range(3)]
    out2 = np.empty((3, 5), np.int64)
    copy_rows(fixed, out2, ragged=False)
    np.testing.assert_array_equal(out2, np.stack(fixed))
    odd = [rows[0][::2], rows[2].astype(np.float64)]  # not contiguous; another dtype: numpy's path, same result
    out3 = np.empty((9, 3), np.float32)
    copy_rows(odd, out3, ragged=True)
    np.testing.assert_array_equal(out3, np.concatenate(odd).astype(np.float32))
    with pytest.raises(ValueError):  # one row too many: numpy's shape error, never a write past the buffer
        copy_rows(rows, np.empty((11, 3), np.float32), ragged=True)


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(["int64", "int32", "float32", "float16", "bool", "uint8", ">i4"]),
       tail=st.sampled_from([(), (3,), (2, 2)]), lengths=st.lists(st.integers(0, 9), min_size=0, max_size=8),
       ragged=st.booleans(), strided=st.booleans(), other_dtype=st.booleans())
def test_copy_rows_matches_numpy_on_any_rows(dtype, tail, lengths, ragged, strided, other_dtype):
    """The fast path (memoryview slices) and numpy's agree for every dtype, shape and layout, and a row of another
    dtype is converted as numpy would, never copied as raw bytes."""
    from knittrans.dataplane.buffers import copy_rows

    rng = np.random.default_rng(len(lengths))
    if not ragged:
        lengths = [3] * len(lengths)
    rows = []
    for i, n in enumerate(lengths):
        base = (rng.random((2 * n, *tail)) * 100).astype(dtype)
        r = base[::2] if strided else base[:n]
        if other_dtype and i == 0:
            r = r.astype("float64")
        rows.append(r)
    if not rows:
        return
    shape = (sum(len(r) for r in rows), *tail) if ragged else (len(rows), *rows[0].shape)
    want, out = np.zeros(shape, dtype), np.ones(shape, dtype)
    try:
        (np.concatenate if ragged else np.stack)(rows, out=want)
    except (TypeError, ValueError) as e:  # e.g. an unsafe cast: copy_rows refuses it the same way
        with pytest.raises(type(e)):
            copy_rows(rows, out, ragged)
        return
    copy_rows(rows, out, ragged)
    np.testing.assert_array_equal(out, want)


def _no_gil_drops(monkeypatch) -> list:  # noqa: ANN001
    """Make every call that drops the GIL in a pack raise (torch tensor methods, ``np.copyto``); returns what was
    called."""
    called: list = []

    def refuse(name):  # noqa: ANN001, ANN202
        def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
            called.append(name)
            raise AssertionError(f"the pack called {name}, which drops the GIL")
        return call

    for name in ("view", "reshape", "to", "contiguous"):
        monkeypatch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
    monkeypatch.setattr(np, "copyto", refuse("np.copyto"))
    return called


def test_a_share_packed_for_the_cpu_calls_nothing_that_drops_the_gil(monkeypatch):
    """A pack holds the GIL from its first copy to its last view: every torch tensor method (``view``, ``reshape``,
    ...) and ``np.copyto`` drop it, and beside a thread running Python each re-acquisition waits out the switch
    interval (``Tensor.reshape`` ~4 ms, ``Tensor.view`` ~1 ms per call here). The direct pack made its views with
    them (8 per text share): two rank threads packing in one process then waited on each other at every view
    (``scripts/inproc_ceiling.py`` both ranks at once 0.31-0.38 of memcpy; numpy views wrapped by
    ``torch.from_numpy``: 0.59-0.61, docs/experiments.md session 44). Text shares and multimodal ones (fields and
    each distinct image), read from their sources, with the bytes a plain unit read gives."""
    from knittrans.dataplane.types import MiniBatchKey
    from knittrans.mmdedup.plane import build_mm_inprocess
    from test_mmdedup_plane import _groups, _minibatches, _put_all

    dp, batch = _loaded(PrepareConfig())
    plain, _ = _loaded(PrepareConfig(direct_reads=False))
    mb = batch.minibatches(2)[0]
    for p in (dp, plain):
        p.client().admit(mb)
    want = _bytes(plain.client().fetch(mb, 0))
    assert dp.controller.claim(MiniBatchKey(mb.batch_id, mb.index), 1, TEXT_SCHEMA.names).runs is not None
    groups = _groups(seed=3)
    mm = build_mm_inprocess({"u0": "n0", "u1": "n1"}, ("n0", "n1"))
    _put_all(mm, groups)
    mmb = _minibatches(groups, 2)[0]
    mm.controller.admit(mmb)
    called = _no_gil_drops(monkeypatch)
    got = _bytes(dp.client().fetch(mb, 0))
    share = mm.client().fetch(mmb, 0)
    monkeypatch.undo()
    assert called == []
    assert got.keys() == want.keys()
    for k in want:
        assert np.array_equal(got[k][0], want[k][0]) and np.array_equal(got[k][1], want[k][1]), k
    assert share.images.pixels and share.pixel_nbytes > 0
