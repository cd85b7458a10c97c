"""The Ray transport end to end: 2 storage-unit actors, 2 producer tasks, 2 consumer (trainer-rank) actors."""

from __future__ import annotations

import hashlib
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from knittrans.dataplane import (AlreadyConsumedError, FieldNotProducedError, MiniBatchKey,  # noqa: E402
                                 PrefetchConfig, Prefetcher, SchemaMismatchError, TrajectoryPayload,
                                 UnknownMiniBatchError)
from knittrans.dataplane.ray_transport import RayDataPlane, build_ray  # noqa: E402
from knittrans.types import MiniBatch  # noqa: E402
from workloads.text_data import TEXT_SCHEMA, TextDataConfig, make_text_batch  # noqa: E402

pytestmark = pytest.mark.ray

# Actors defined in this test module must travel by value (the module is not importable in Ray workers).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

UNITS = {"u0": "n0", "u1": "n1"}
RANKS = ("n0", "n1")
FIELDS = TEXT_SCHEMA.names


@pytest.fixture(scope="module")
def dp(ray_local):
    """One data plane for the module (actor start-up dominates these tests); tests use disjoint batch ids."""
    plane = build_ray(TEXT_SCHEMA, UNITS, RANKS)
    yield plane
    plane.close()


def _digest(arrays) -> str:
    h = hashlib.sha1()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@ray.remote(num_cpus=0)
def produce(dp: RayDataPlane, unit: str, payloads: list[TrajectoryPayload]) -> int:
    dp.client(unit).put(payloads)
    return len(payloads)


@ray.remote(num_cpus=0)
class Consumer:
    """A trainer rank: prefetches its shares of ``count`` admitted mini-batches; reports ids, bytes, digests."""

    def __init__(self, dp: RayDataPlane, rank: int) -> None:
        self.client = dp.client()
        self.rank = rank

    def consume(self, start_seq: int, count: int) -> list[tuple[MiniBatchKey, tuple[int, ...], int, str]]:
        pf = Prefetcher(self.client, self.rank, FIELDS, PrefetchConfig(depth=1, admit_timeout_s=60),
                        start_seq=start_seq, count=count)
        out = []
        for share in pf:
            f = share.fields["input_ids"]
            cu = f.cu_seqlens.tolist()
            out.append((share.key, share.traj_ids, share.nbytes,
                        _digest(f.values[cu[i]:cu[i + 1]].numpy() for i in range(len(cu) - 1))))
        return out


def test_ray_units_and_consumers_deliver_each_rank_exactly_its_share(dp):
    batch = make_text_batch(TextDataConfig(num_prompts=8, group_size=4, response_len_median=64,
                                           max_response_len=512, prompt_len_mean=32, seed=1))
    by_id = {t.traj_id: t for t in batch.trajectories}
    consumers = [Consumer.remote(dp, r) for r in range(len(RANKS))]
    mbs = batch.minibatches(2)
    start = dp.controller_stats().admitted
    runs = [c.consume.remote(start, len(mbs)) for c in consumers]  # waiting on admission before any data exists
    ray.get([produce.remote(dp, u, [t.payload() for t in batch.trajectories if t.traj_id % 2 == i])
             for i, u in enumerate(UNITS)])
    driver = dp.client()
    admitted = [driver.admit(mb) for mb in mbs]
    results = ray.get(runs, timeout=120)
    for rank, got in enumerate(results):
        assert [k for k, *_ in got] == [a.key for a in admitted]
        for (key, ids, nbytes, digest), adm in zip(got, admitted):
            assert ids == adm.shares[rank]
            assert nbytes == sum(by_id[t].nbytes for t in ids)
            assert digest == _digest(by_id[t].input_ids for t in ids)
    delivered = [t for got in results for _, ids, _, _ in got for t in ids]
    assert sorted(delivered) == sorted(by_id)  # every trajectory once, none twice
    assert dp.controller_stats().released_minibatches == len(mbs)


def test_ray_bad_input_raises_the_data_plane_error_across_actors(dp):
    ids = (1000, 1001, 1002, 1003)  # disjoint from the other test's trajectories (batch 7, not 0)
    c = dp.client("u0")
    with pytest.raises(SchemaMismatchError):
        c.put([TrajectoryPayload(ids[0], {"input_ids": np.zeros(3, np.int32)})])
    c.put([TrajectoryPayload(t, {"input_ids": np.arange(t - 990, dtype=np.int64)}) for t in ids])
    with pytest.raises(UnknownMiniBatchError):
        c.fetch(MiniBatchKey(7, 0), 0, ("input_ids",))
    mb = MiniBatch(batch_id=7, index=0, traj_ids=ids, group_ids=(0,), num_tokens=0)
    c.admit(mb)
    with pytest.raises(FieldNotProducedError):
        c.fetch(mb, 0, ("input_ids", "advantages"))
    first = c.fetch(mb, 0, ("input_ids",))
    with pytest.raises(AlreadyConsumedError):
        c.fetch(mb, 0, ("input_ids",))
    assert len(first.traj_ids) == 2 and first.nbytes == 8 * sum(t - 990 for t in first.traj_ids)


def test_transferqueue_adapter_returns_the_same_share_bytes(ray_local):
    """TransferQueue (optional extra) on the same trajectories gives the same packed bytes as KnitTrans."""
    pytest.importorskip("transfer_queue")
    from baselines import transferqueue_adapter as tqa

    batch = make_text_batch(TextDataConfig(num_prompts=2, group_size=4, response_len_median=32,
                                           max_response_len=128, prompt_len_mean=16, seed=3))
    tqa.start(tqa.TQConfig(num_storage_units=2))
    try:
        tqa.put([t.payload() for t in batch.trajectories], TEXT_SCHEMA, "test")
        ids = (5, 0, 3)
        share = tqa.get(ids, FIELDS, TEXT_SCHEMA, "test")
        by_id = {t.traj_id: t for t in batch.trajectories}
        for name in FIELDS:
            np.testing.assert_array_equal(share.values[name], np.concatenate([getattr(by_id[t], name) for t in ids]))
        assert share.nbytes == sum(by_id[t].nbytes for t in ids)
        tqa.clear([t.traj_id for t in batch.trajectories], "test")
    finally:
        tqa.close()


def test_transferqueue_multimodal_get_returns_each_samples_own_images(ray_local):
    """The multimodal TransferQueue baseline: a get returns the share's token fields and every sample's own copy of
    its images (pixel_values back to back in share order), as a TransferQueue user would store them."""
    pytest.importorskip("transfer_queue")
    from baselines import transferqueue_adapter as tqa
    from baselines.transferqueue_system import PIXELS, mm_schema, tq_payloads
    from workloads.multimodal_data import MMTransferWorkload
    from workloads.transfer_data import MMPasses

    d = MMPasses(MMTransferWorkload(prompts_per_batch=2, group_size=2, images_per_prompt=1, image_side=56),
                 num_minibatches=2, num_producers=2).make(0)
    schema = mm_schema(TEXT_SCHEMA, d)
    tqa.start(tqa.TQConfig(num_storage_units=2))
    try:
        tqa.put(tq_payloads(d, multimodal=True), schema, "mm")
        by_id = {r.traj.traj_id: r for r in d.rollouts}
        ids = (3, 0)
        share = tqa.get(ids, schema.names, schema, "mm")
        want = np.concatenate([np.asarray(im) for t in ids for im in by_id[t].images])
        np.testing.assert_array_equal(share.values[PIXELS], want)
        tqa.clear(list(by_id), "mm")
    finally:
        tqa.close()


def test_multi_batch_passes_move_each_batch_once_on_every_system(ray_local):
    """The steady-state (multi-batch) pass over Ray: knittrans.Handoff delivers every batch exactly once (admitted
    by its controller as the producers' completing puts arrive, acked after each step, every drop confirmed); the
    centralized driver moves gather (ragged) + scatter (dense) bytes per batch, in both padding modes."""
    from baselines.centralized import CentralizedConfig, balance_plan, build_dense_batch
    from baselines.centralized_system import CentralizedSystem
    from knittrans.bench import BenchLayout, KnitTransSystem
    from knittrans.bench.ray_ranks import RaySession
    from knittrans.handoff import Transport
    from workloads.transfer_data import TextPasses

    layout = BenchLayout(num_ranks=2, num_units=2, lead_steps=1, warmup_batches=1)
    src = TextPasses(TextDataConfig(num_prompts=4, group_size=4, prompt_len_mean=16, response_len_median=32,
                                    max_response_len=128), num_minibatches=2, num_producers=2)
    with RaySession(layout.num_ranks) as session:
        datas = [src.make(500 + i) for i in range(3)]
        kt = KnitTransSystem("knittrans-ray", layout, Transport.RAY, session=session)
        try:
            res = kt.run_steady(datas, iters_per_token=0.0)
            stats, units = kt.handoff(datas[0]).stats()
            assert stats.released_minibatches == stats.admitted == 3 * 2
            assert stats.claims == 3 * 2 * layout.num_ranks and stats.completed == 3 * 16
            assert all(u.num_trajectories == 0 for u in units)  # wait_drained: every unit confirmed its drops
        finally:
            kt.close()
        assert len(res.exposed) == 2 and res.bytes_moved == datas[0].field_nbytes and res.live_bytes_after == 0
        for pad_to in ("longest", "max"):
            datas = [src.make(600 + 10 * (pad_to == "max") + i) for i in range(3)]
            conf = CentralizedConfig(pad_to=pad_to, max_prompt_len=64, max_response_len=128)
            res = CentralizedSystem(f"centralized-{pad_to}", layout, session, conf).run_steady(datas, 0.0)
            d = datas[-1]
            plan = balance_plan(d.minibatches, d.tokens, layout.num_ranks)
            dense = build_dense_batch([d.payloads()], d.prompts, d.prompt_of, d.group_size, plan, conf)
            assert res.bytes_moved == d.field_nbytes + dense.nbytes  # gather + scatter, the same for every batch
            assert len(res.exposed) == 2 and all(len(row) == 2 for row in res.exposed)


def test_a_ray_session_settles_every_rank_heap_and_hands_the_drivers_back_at_exit(ray_local):
    """``RaySession.settle`` (called by the tables before every timed pass): each rank actor collects and freezes
    what is alive, the driver too; the driver's frozen objects go back to the collector when the session ends."""
    import gc

    from knittrans.bench.ray_ranks import RaySession

    before = gc.get_freeze_count()
    with RaySession(2) as session:
        session.settle()
        assert gc.get_freeze_count() > before
        frozen = ray.get([r.settle.remote() for r in session.ranks])
        assert len(frozen) == 2 and min(frozen) > 10_000  # the rank's imports (numpy, torch, Ray) at least
    assert gc.get_freeze_count() == 0


@ray.remote(num_cpus=0)
def _map_object_store() -> int:
    from knittrans.bench.ray_ranks import map_object_store

    return map_object_store()


def test_map_object_store_maps_the_written_pages_and_allocates_no_others(ray_local):
    """``map_object_store`` (every rank actor, once the tables warmed the store): a reader's page faults paid before
    the passes -- every page an object was written to is mapped, pages nothing wrote are not (mapping them would
    allocate the whole store)."""
    import platform

    import numpy as np

    if platform.system() != "Linux" or tuple(int(v) for v in platform.release().split(".")[:2]) < (5, 14):
        pytest.skip("MADV_POPULATE_READ needs Linux >= 5.14 (elsewhere map_object_store maps nothing)")
    ref = ray.put(np.ones(64 << 20, dtype=np.uint8))
    mapped = ray.get(_map_object_store.remote())
    assert mapped >= 64 << 20
    assert mapped < ray.cluster_resources()["object_store_memory"]
    del ref


@ray.remote(num_cpus=0)
class Producer:
    """A rollout worker in its own process (killed by the test after its put)."""

    def put(self, dp: RayDataPlane, unit: str, payloads: list[TrajectoryPayload]) -> int:
        dp.client(unit).put(payloads)
        return len(payloads)


def _field_digest(share, name: str) -> str:
    f = share.fields[name]
    cu = f.cu_seqlens.tolist()
    return _digest(f.values[cu[i]:cu[i + 1]].numpy() for i in range(len(cu) - 1))


@ray.remote(num_cpus=0)
def fetch_all_fields(dp: RayDataPlane, mb: MiniBatch, rank: int) -> tuple[tuple[int, ...], dict[str, str]]:
    share = dp.client().fetch(mb, rank)
    return share.traj_ids, {n: _field_digest(share, n) for n in FIELDS}


def test_large_puts_are_unit_objects_ranks_read_without_a_unit_call_that_outlive_their_producer(ray_local):
    """A put past ``STORE_MIN_BYTES`` becomes an object the unit owns and the controller learns where its rows lie:
    a claim hands the rank its share as runs of those objects (one object per unit's put, a few runs per field),
    the rank reads them with one ``ray.get`` and no unit answers a read, every field's bytes arrive intact after
    the producer's process is gone, and the objects are freed once consumed."""
    from knittrans.dataplane.ray_transport import STORE_MIN_BYTES

    dp = build_ray(TEXT_SCHEMA, UNITS, RANKS)  # its own plane: the module's reuses these trajectory ids
    try:
        batch = make_text_batch(TextDataConfig(num_prompts=4, group_size=4, response_len_median=2048,
                                               max_response_len=4096, prompt_len_mean=32, seed=5))
        by_id = {t.traj_id: t for t in batch.trajectories}
        per_unit = {u: [t for t in batch.trajectories if t.traj_id % 2 == i] for i, u in enumerate(UNITS)}
        assert all(sum(t.nbytes for t in ts) >= STORE_MIN_BYTES for ts in per_unit.values())
        actors = dp.unit_actors
        objects0 = {u: ray.get(a.num_objects.remote()) for u, a in actors.items()}
        producers = {u: Producer.remote() for u in UNITS}
        ray.get([producers[u].put.remote(dp, u, [t.payload() for t in ts]) for u, ts in per_unit.items()])
        for p in producers.values():  # the producers' processes end: what they put must stay readable
            ray.kill(p)
        assert all(ray.get(a.num_objects.remote()) == objects0[u] + 1 for u, a in actors.items())
        mb = batch.minibatches(1)[0]
        dp.client().admit(mb)
        got = ray.get([fetch_all_fields.remote(dp, mb, r) for r in range(len(RANKS))], timeout=120)
        for ids, digests in got:
            for name in FIELDS:
                assert digests[name] == _digest(by_id[t].payload().tensors[name] for t in ids), name
        assert sorted(t for ids, _ in got for t in ids) == sorted(by_id)
        assert [ray.get(a.get_count.remote()) for a in actors.values()] == [0, 0]  # no unit call on the read path
        dp.wait_drained(timeout=60)
        assert {u: ray.get(a.num_objects.remote()) for u, a in actors.items()} == objects0  # freed once consumed
    finally:
        dp.close()


def test_a_claim_names_each_unit_object_once_and_merges_back_to_back_rows_into_runs(ray_local):
    dp = build_ray(TEXT_SCHEMA, {"u0": "n0"}, ("n0",))
    try:
        batch = make_text_batch(TextDataConfig(num_prompts=4, group_size=4, response_len_median=2048,
                                               max_response_len=4096, prompt_len_mean=32, seed=7))
        dp.client("u0").put([t.payload() for t in batch.trajectories])
        mb = batch.minibatches(1)[0]
        dp.client().admit(mb)
        loc = dp.controller.claim(MiniBatchKey(mb.batch_id, mb.index), 0, FIELDS)
        assert loc.runs is not None and len(loc.runs.sources) == 1 and loc.runs.source_units == ("u0",)
        assert [len(r) for r in loc.runs.runs] == [1, 1, 1, 1]  # the whole share lies back to back in its put
        assert [int(r[:, 3].sum() - r[:, 2].sum()) for r in loc.runs.runs] == [int(n.sum()) for n in loc.runs.nbytes]
        dp.controller.unclaim(loc.key, 0, FIELDS)
    finally:
        dp.close()


def test_a_rank_reading_objects_of_a_killed_unit_reports_it_lost_and_gives_the_share_back(ray_local):
    """The objects' owner is their unit: once it is gone, a rank's read of them raises ``UnitLostError`` naming it,
    the unit is reported lost (its trajectories become missing) and the claim is undone (never a partial share)."""
    from knittrans.dataplane.types import UnitLostError

    dp = build_ray(TEXT_SCHEMA, UNITS, RANKS, controller_restarts=0)
    try:
        batch = make_text_batch(TextDataConfig(num_prompts=4, group_size=4, response_len_median=2048,
                                               max_response_len=4096, prompt_len_mean=32, seed=8))
        for i, u in enumerate(UNITS):
            dp.client(u).put([t.payload() for t in batch.trajectories if t.traj_id % 2 == i])
        mb = batch.minibatches(1)[0]
        client = dp.client()
        client.admit(mb)
        key = MiniBatchKey(mb.batch_id, mb.index)
        runs = dp.controller.claim(key, 0, FIELDS).runs
        dp.controller.unclaim(key, 0, FIELDS)
        ref = runs.sources[runs.source_units.index("u1")]
        ray.kill(dp.unit_actors["u1"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # ray.kill returns before the actor is gone, and its objects after
            try:
                ray.get(ref, timeout=5)
            except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError):
                break
            time.sleep(0.05)
        del ref, runs
        with pytest.raises(UnitLostError, match="u1"):
            client.fetch(mb, 0)
        assert set(dp.controller.missing()) == {t.traj_id for t in batch.trajectories if t.traj_id % 2 == 1}
    finally:
        dp.close()


@ray.remote(num_cpus=0)
class Never:
    """Hands out a ref that never becomes ready (a task waiting on an event nobody sets)."""

    def __init__(self) -> None:
        import threading

        self.event = threading.Event()

    def wait(self) -> int:
        self.event.wait()
        return 0


def test_a_share_whose_sources_never_map_is_read_through_its_units_and_counted(ray_local, monkeypatch):
    """The safety net (``RESOLVE_TIMEOUT_S``): a ``ray.get`` of a live unit's objects that never returns costs the
    rank that bound, then the share is read through its units instead -- same bytes, counted and logged, the
    stalled ref let go of -- rather than a 300 s read timeout that ends the trainer's iteration."""
    import dataclasses

    from knittrans.dataplane import ray_transport

    monkeypatch.setattr(ray_transport, "RESOLVE_TIMEOUT_S", 1.0)
    dp = build_ray(TEXT_SCHEMA, UNITS, RANKS, controller_restarts=0)
    never = Never.options(max_concurrency=2).remote()
    try:
        batch = make_text_batch(TextDataConfig(num_prompts=4, group_size=4, response_len_median=2048,
                                               max_response_len=4096, prompt_len_mean=32, seed=9))
        by_id = {t.traj_id: t for t in batch.trajectories}
        for i, u in enumerate(UNITS):
            dp.client(u).put([t.payload() for t in batch.trajectories if t.traj_id % 2 == i])
        mb = batch.minibatches(1)[0]
        client = dp.client()
        client.admit(mb)
        loc = dp.controller.claim(MiniBatchKey(mb.batch_id, mb.index), 0, FIELDS)
        stuck = never.wait.remote()  # a ref of the same share that never maps: u0's first object stands in
        runs = dataclasses.replace(loc.runs, sources=(stuck, *loc.runs.sources[1:]))
        share = client.deliver(dataclasses.replace(loc, runs=runs), ack=False)
        assert client.resolve_fallbacks == 1 and len(client._sources) == 0  # noqa: SLF001 - nothing stalled kept
        for name in FIELDS:
            f = share.fields[name]
            cu = f.cu_seqlens.tolist()
            got = [f.values[cu[i]:cu[i + 1]].numpy() for i in range(len(cu) - 1)]
            assert _digest(got) == _digest(by_id[t].payload().tensors[name] for t in share.traj_ids), name
        client.ack(share)
        client.flush_acks()
    finally:
        ray.kill(never)
        dp.close()
