"""Faults on the Ray transport: corrupted messages across actors, a lost unit, a crashed rank, a dead unit actor,
and a small concurrent load (producer and consumer actors). Semantics: docs/reliability.md."""

from __future__ import annotations

import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from knittrans.dataplane import AlreadyConsumedError, MiniBatchKey, TrajectoryPayload  # noqa: E402
from knittrans.dataplane.faults import (CorruptGet, CorruptPut, FaultPlan, ProducerBuffer,  # noqa: E402
                                        UnitLoss)
from knittrans.dataplane.ray_transport import build_ray  # noqa: E402
from knittrans.dataplane.types import CorruptPayloadError, DataLostError, UnitLostError  # noqa: E402
from knittrans.types import MiniBatch  # noqa: E402
from workloads.reliability_faults import units_empty  # noqa: E402
from workloads.reliability_load import LoadConfig, load_ray  # noqa: E402
from workloads.text_data import TEXT_SCHEMA, TextDataConfig, make_text_batch  # noqa: E402

pytestmark = pytest.mark.ray

UNITS = {"u0": "n0", "u1": "n1"}
RANKS = ("n0", "n1")


def _batch(seed=0):
    return make_text_batch(TextDataConfig(num_prompts=4, group_size=4, response_len_median=16, max_response_len=64,
                                          prompt_len_mean=8, seed=seed))


def _rows(share, name):
    f = share.fields[name]
    cu = f.cu_seqlens.tolist()
    return {t: f.values[cu[i]:cu[i + 1]].numpy() for i, t in enumerate(share.traj_ids)}


def test_corrupted_messages_across_actors_are_named_and_change_nothing(ray_local):
    batch = _batch()
    by_id = {t.traj_id: t for t in batch.trajectories}
    dp = build_ray(TEXT_SCHEMA, UNITS, RANKS, checksums=True,
                   faults=FaultPlan((CorruptPut("u0", 2, "loss_mask"), CorruptGet("u0", 1, "input_ids"))))
    try:
        c = dp.client("u0")
        c.put([t.payload() for t in batch.trajectories[:8]])
        with pytest.raises(CorruptPayloadError, match=r"trajectory 8: field 'loss_mask' is corrupt on put"):
            c.put([t.payload() for t in batch.trajectories[8:]])
        assert [s.num_trajectories for s in dp.unit_stats()] == [8, 0]
        c.put([t.payload() for t in batch.trajectories[8:]])
        mb = batch.minibatches(1)[0]
        c.admit(mb)
        rank = 0  # every trajectory is on u0: the first read of any rank is the corrupted one
        with pytest.raises(CorruptPayloadError, match=r"trajectory \d+: field 'input_ids' is corrupt on fetch from "
                                                     r"unit u0"):
            c.fetch(mb, rank, ("input_ids", "old_logprobs"))
        share = c.fetch(mb, rank, ("input_ids", "old_logprobs"))  # the claim was undone; the retry is intact
        for name in share.fields:
            for t, arr in _rows(share, name).items():
                np.testing.assert_array_equal(arr, getattr(by_id[t], name))
        with pytest.raises(AlreadyConsumedError):
            c.fetch(mb, rank, ("input_ids",))
    finally:
        dp.close()


def test_lost_unit_on_ray_is_reput_and_never_yields_a_partial_share(ray_local):
    batch = _batch(seed=1)
    by_id = {t.traj_id: t for t in batch.trajectories}
    dp = build_ray(TEXT_SCHEMA, UNITS, RANKS, faults=FaultPlan((UnitLoss("u1", on_put=2),)))
    try:
        prod = {u: ProducerBuffer(dp.client(u), [v for v in UNITS if v != u]) for u in UNITS}
        ts = batch.trajectories
        prod["u1"].put([t.payload() for t in ts[:8]])
        with pytest.raises(UnitLostError, match="storage unit u1 is lost"):
            dp.client("u1").put([t.payload() for t in ts[8:]])
        prod["u0"].put([t.payload() for t in ts[8:]])
        mb = batch.minibatches(1)[0]
        c = dp.client()
        c.admit(mb)
        assert set(dp.client().controller.missing()) == {t.traj_id for t in ts[:8]}
        with pytest.raises(DataLostError):
            for r in (0, 1):
                c.fetch(mb, r)
        assert set(prod["u1"].reput_missing()) == {t.traj_id for t in ts[:8]}
        got = []
        for r in (0, 1):
            try:
                share = c.fetch(mb, r)
            except AlreadyConsumedError:  # the rank whose share was whole fetched it above
                continue
            got += share.traj_ids
            for t, arr in _rows(share, "input_ids").items():
                np.testing.assert_array_equal(arr, by_id[t].input_ids)
        assert units_empty(dp)
        assert dp.controller_stats().released_minibatches == 1
    finally:
        dp.close()


def test_a_dead_unit_actor_reads_as_a_lost_unit(ray_local):
    dp = build_ray(TEXT_SCHEMA, UNITS, RANKS)
    try:
        c = dp.client("u1")
        c.put([TrajectoryPayload(t, {"input_ids": np.arange(t + 1)}) for t in range(4)])
        c.admit(MiniBatch(0, 0, (0, 1, 2, 3), (0,), 0))
        key = MiniBatchKey(0, 0)
        ref = dp.controller.claim(key, 0, ("input_ids",)).runs.sources[0]  # the unit's object (its owner)
        dp.controller.unclaim(key, 0, ("input_ids",))
        ray.kill(dp.unit_actors["u1"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # ray.kill returns before the actor is gone, and its objects after it
            try:
                ray.get(ref, timeout=5)
            except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError):
                break
            time.sleep(0.05)
        del ref  # (until its objects are gone a rank still reads the unit's intact bytes: nothing is lost then)
        with pytest.raises(UnitLostError, match="storage unit u1 is lost"):
            c.fetch(MiniBatch(0, 0, (0, 1, 2, 3), (0,), 0), 0, ("input_ids",))
        assert dp.client().controller.missing() == (0, 1, 2, 3)  # reported by the reader that saw it die
        dp.client("u0").put([TrajectoryPayload(t, {"input_ids": np.arange(t + 1)}) for t in range(4)])
        assert dp.client().controller.missing() == ()
        assert len(c.fetch(MiniBatch(0, 0, (0, 1, 2, 3), (0,), 0), 0, ("input_ids",)).traj_ids) == 2
    finally:
        dp.controller_actor.close.remote()
        ray.kill(dp.controller_actor)
        ray.kill(dp.unit_actors["u0"])


def test_small_concurrent_load_on_ray_is_exact_and_frees_storage(ray_local):
    res = load_ray(LoadConfig(load_trajectories=3000, load_minibatch=250, window=2))
    assert res.lost == 0 and res.duplicated == 0 and res.delivered == 3000
    assert res.final_unit_bytes == 0 and res.peak_unit_trajectories <= res.bound_trajectories


def test_chaos_on_ray_trains_every_trajectory_exactly_once_with_its_bytes(ray_local):
    """The chaos driver on actors (short): random faults from every class, exact accounting, every byte checked."""
    from workloads.chaos import CLASSES, ChaosConfig, run_chaos

    units = {"u0": "n0", "u1": "n1", "u2": "n2"}
    r = run_chaos("ray", lambda plan: build_ray(TEXT_SCHEMA, units, RANKS, checksums=True, faults=plan),
                  lambda dp, u: ray.get(dp.unit_actors[u].restart.remote(), timeout=30),
                  ChaosConfig(trajectories=300, minibatch=30, seed=1, fault_rate=0.3, timeout_s=30),
                  restart_controller=lambda dp: dp.restart_controller(timeout=30))
    assert (r.trained, r.lost, r.duplicated, r.corrupted) == (300, 0, 0, 0)
    assert dict(r.survived) == dict(r.injected)
    assert r.injected["controller_restart"] >= 1 and r.released_minibatches == 10  # killed mid-run, all released
    assert {CLASSES[k] for k in r.injected} == {"lost_data", "retries", "corruption", "hang"}


def test_a_unit_hung_in_get_ends_the_read_at_its_deadline_and_undoes_the_claim(ray_local):
    """A read has a deadline on Ray: a unit that never answers raises ReadTimeoutError (the claim is undone, so a
    retry after the unit recovers gets the share) instead of blocking the rank for ever."""
    import dataclasses
    import time

    from knittrans.dataplane.types import ReadTimeoutError

    from knittrans.dataplane.faults import SlowGet

    dp = dataclasses.replace(build_ray(TEXT_SCHEMA, {"u0": "n0"}, ("n0",), faults=FaultPlan((SlowGet("u0", 1, 4.0),))),
                             read_timeout_s=1.0)
    try:
        c = dp.client("u0")
        batch = _batch(seed=2)
        c.put([t.payload() for t in batch.trajectories[:4]])
        mb = MiniBatch(0, 0, tuple(t.traj_id for t in batch.trajectories[:4]), (0,), 0)
        c.admit(mb)
        t0 = time.perf_counter()
        with pytest.raises(ReadTimeoutError, match="did not answer a read within"):
            c.fetch(mb, 0)
        assert time.perf_counter() - t0 < 3.5  # ended at its deadline, not when the unit woke up
        time.sleep(3.0)  # the unit wakes up; its late answer is discarded
        assert c.fetch(mb, 0).traj_ids == mb.traj_ids  # the claim was undone: the retry gets the whole share
    finally:
        dp.close()


def test_a_dead_controller_actor_is_a_typed_error_not_a_raw_actor_error(ray_local):
    from knittrans.dataplane.types import ControllerLostError

    dp = build_ray(TEXT_SCHEMA, {"u0": "n0"}, ("n0",))
    try:
        ray.kill(dp.controller_actor)
        with pytest.raises(ControllerLostError, match="controller actor died"):
            dp.client("u0").put([TrajectoryPayload(0, {"input_ids": np.arange(3)})])
    finally:
        for a in dp.unit_actors.values():
            ray.kill(a)
