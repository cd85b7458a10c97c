"""Chaos: the data plane under load with random faults from every class of issue 13, with exact accounting.

One driver for both transports (``build(plan)`` returns an in-process or a Ray data plane). Trajectory ids and
their bytes are a pure function of the id (``expected``), so every delivered byte is checked. Per mini-batch, a
seeded RNG picks which faults fire:

- lost data: a storage unit dies mid-put (``UnitLoss``; producers fall back and re-put from ``ProducerBuffer``,
  field by field), the unit restarts empty, a rank crashes before or after its step (``recover_rank``; the
  ``StepLedger`` skips a replayed step), a prefetching rank crashes with the default ``PrefetchConfig``, a
  producer dies mid-group (its orphans are discarded and regenerated under the same ids);
- lost replies and retries: a put's reply is lost and the put retried (idempotent), a register reply is lost (the
  unit holds fields the controller never saw; the retry registers them), a fetch reply is lost (the retry is
  refused as already consumed; the rank recovers), an ack is repeated, a late retry arrives after release;
- silent corruption: a message corrupted on put or on fetch (checksums), a producer that edits its buffer after
  put, a consumer that edits its share in place;
- hangs: a rank asks for a mini-batch before it is admitted (a deadline, never a hang);
- controller restart (``restart_controller``): the controller dies and is rebuilt from its journal and the units
  (on Ray: the actor is killed and Ray restarts it), before an admission or between a rank's step and its ack;
  counted when the rebuilt controller reports the restart, survived when the run still ends exact (every
  trajectory trained once with its bytes, every mini-batch released, storage freed).

Counted from what fired (errors observed at the client, actions taken), never from the plan. Every wait has a
timeout. ``python -m repro.reliability`` runs it on both transports; tests run it small.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

KINDS = ("storage_unit_lost", "unit_restarts_empty", "corrupted_put", "corrupted_fetch",
         "trainer_rank_crash_before_step", "trainer_rank_crash_after_step", "prefetching_rank_crash_default_config",
         "producer_death_mid_group", "lost_put_reply_retry", "lost_register_reply", "lost_fetch_reply",
         "repeated_ack", "late_retry_after_release", "producer_mutates_after_put", "consumer_edits_in_place",
         "read_before_admission_deadline", "controller_restart")
CLASSES = {"storage_unit_lost": "lost_data", "unit_restarts_empty": "lost_data",
           "trainer_rank_crash_before_step": "lost_data", "trainer_rank_crash_after_step": "lost_data",
           "prefetching_rank_crash_default_config": "lost_data", "producer_death_mid_group": "lost_data",
           "lost_put_reply_retry": "retries", "lost_register_reply": "retries", "lost_fetch_reply": "retries",
           "repeated_ack": "retries", "late_retry_after_release": "retries", "corrupted_put": "corruption",
           "corrupted_fetch": "corruption", "producer_mutates_after_put": "corruption",
           "consumer_edits_in_place": "corruption", "read_before_admission_deadline": "hang",
           "controller_restart": "lost_data"}


@dataclass
class ChaosConfig:
    trajectories: int = 3000
    minibatch: int = 60
    ranks: int = 2
    fault_rate: float = 0.2
    """Probability per mini-batch that each action-driven fault fires."""
    seed: int = 0
    timeout_s: float = 30.0
    """Deadline of every wait (a hang fails the run with TimeoutError instead of blocking it)."""
    max_controller_restarts: int = 4
    """Most controller restarts per run (on Ray each one starts a new actor process: seconds on a loaded machine)."""


@dataclass
class ChaosResult:
    transport: str
    trajectories: int
    trained: int
    lost: int
    duplicated: int
    corrupted: int
    regenerated: int
    injected: Counter = field(default_factory=Counter)
    survived: Counter = field(default_factory=Counter)
    held_max: int = 0
    """Most trajectories with live controller metadata at a mini-batch boundary (compaction bounds it)."""
    final_unit_bytes: int = -1
    released_minibatches: int = 0
    """Mini-batches released at the end (all of them when every rank's ack survived)."""
    wall_s: float = 0.0


def expected(t: int) -> dict[str, np.ndarray]:
    """Trajectory ``t``'s fields (a pure function of the id, so every delivered byte can be checked)."""
    n = 2 + t % 7
    mask = np.ones(n, bool)
    mask[0] = t % 2 == 0
    return {"input_ids": np.arange(n + 3, dtype=np.int64) + t,
            "old_logprobs": np.full(n, -(t % 13 + 1) / 10, np.float32),
            "advantages": np.full(n, (t % 5) - 2.0, np.float32), "loss_mask": mask}


def chaos_plan(cfg: ChaosConfig, rng: np.random.Generator):  # noqa: ANN201 - a FaultPlan
    """Unit u2 dies once, u0 corrupts some puts, u1 some replies (call numbers drawn from the seed)."""
    from knittrans.dataplane.faults import CorruptGet, CorruptPut, FaultPlan, UnitLoss

    mbs = -(-cfg.trajectories // cfg.minibatch)
    lo, hi = 2, max(3, mbs)
    faults = [UnitLoss("u2", on_put=int(rng.integers(lo, max(lo + 1, hi // 2))))]
    faults += [CorruptPut("u0", on_put=int(k), field="old_logprobs")
               for k in sorted(set(rng.integers(lo, hi, max(1, mbs // 10)).tolist()))]
    faults += [CorruptGet("u1", on_get=int(k), field="input_ids")
               for k in sorted(set(rng.integers(lo, hi, max(1, mbs // 10)).tolist()))]
    return FaultPlan(tuple(faults))


def run_chaos(transport: str, build: Callable, restart_unit: Callable, cfg: ChaosConfig,
              restart_controller: Callable | None = None) -> ChaosResult:
    """``build(plan)`` makes the data plane (3 units u0..u2 on nodes n0..n2, ``cfg.ranks`` ranks, checksums on);
    ``restart_unit(dp, unit)`` brings a lost unit back empty; ``restart_controller(dp)`` crashes the controller
    and returns once it runs again (None: that fault is not injected)."""
    from knittrans.dataplane import TrajectoryPayload
    from knittrans.dataplane.faults import ProducerBuffer, StepLedger, with_checksums
    from knittrans.dataplane.prefetch import PrefetchConfig, Prefetcher
    from knittrans.dataplane.types import (AlreadyConsumedError, CorruptPayloadError, DataLostError,
                                           DuplicatePutError, UnitLostError)
    from knittrans.types import MiniBatch

    rng = np.random.default_rng(cfg.seed)
    dp = build(chaos_plan(cfg, rng))
    res = ChaosResult(transport, cfg.trajectories, 0, 0, 0, 0, 0)
    inj, ok = res.injected, res.survived
    units = ("u0", "u1", "u2")
    prods = {u: ProducerBuffer(dp.client(u), [v for v in units if v != u]) for u in units}
    ledgers = [StepLedger() for _ in range(cfg.ranks)]
    fresh: list[int] = []
    corrupted: set[int] = set()
    lost_unit_seen = False
    t0 = time.perf_counter()

    def chance() -> bool:
        return bool(rng.random() < cfg.fault_rate)

    def controller_restart() -> None:
        """The controller dies and comes back; counted only when the rebuilt one reports the restart."""
        if inj["controller_restart"] >= cfg.max_controller_restarts:
            return
        before = dp.controller_stats().restarts
        restart_controller(dp)
        inj["controller_restart"] += int(dp.controller_stats().restarts > before)

    def payload(t: int, names: tuple[str, ...] | None = None) -> TrajectoryPayload:
        arrs = expected(t)
        return TrajectoryPayload(t, {k: v for k, v in arrs.items() if names is None or k in names})

    def put(u: str, payloads: list) -> None:
        nonlocal lost_unit_seen
        for _ in range(4):
            try:
                prods[u].put(payloads)
                return
            except CorruptPayloadError:  # corrupted on its way to the unit: refused whole, retried
                inj["corrupted_put"] += 1
                ok["corrupted_put"] += 1
            except UnitLostError:  # every unit lost at once: not in this plan
                raise
        raise RuntimeError(f"put to {u} kept failing")

    def verify(share) -> list[int]:  # noqa: ANN001
        for name in share.fields:
            f = share.fields[name]
            cu = f.cu_seqlens.tolist()
            for i, t in enumerate(share.traj_ids):
                if not np.array_equal(f.values[cu[i]:cu[i + 1]].numpy(), expected(t)[name]):
                    corrupted.add(t)
        return list(share.traj_ids)

    def stored(client, t: int) -> np.ndarray | None:  # noqa: ANN001
        """What a unit holds now for ``t``'s input_ids (before the ack lets it drop them). Read up to three times:
        a reply corrupted in transit (``CorruptGet``) differs once; an edited stored copy differs every time."""
        for u in units:
            for _ in range(3):
                try:
                    got = client.units[u].get((t,), ("input_ids",)).rows(0)[0]
                except Exception:  # noqa: BLE001 - not on this unit (or the unit is lost): try the next
                    break
                if np.array_equal(got, expected(t)["input_ids"]):
                    return got
        return None

    def deliver(client, r: int, k: int) -> None:  # noqa: ANN001
        fired: set[str] = set()  # each fault at most once per (rank, mini-batch): the retry must then succeed

        def once(kind: str) -> bool:
            if kind in fired or not chance():
                return False
            fired.add(kind)
            inj[kind] += 1
            return True

        for _ in range(10):
            try:
                share = client.fetch_next(k, r, timeout=cfg.timeout_s, ack=False)
            except CorruptPayloadError:
                inj["corrupted_fetch"] += 1  # the client undid the claim; the retry reads it again
                ok["corrupted_fetch"] += 1
                continue
            except (DataLostError, UnitLostError):
                for p in prods.values():
                    p.reput_missing()
                continue
            if once("lost_fetch_reply"):  # the reply is lost: the rank asks again, is refused, recovers its claim
                try:
                    client.fetch_next(k, r, timeout=cfg.timeout_s, ack=False)
                except AlreadyConsumedError:
                    if client.controller.recover_rank(r) == k:
                        ok["lost_fetch_reply"] += 1
                continue
            if once("trainer_rank_crash_before_step"):
                ok["trainer_rank_crash_before_step"] += int(client.controller.recover_rank(r) == k)
                continue
            ids, new = ledgers[r].apply(share.key, lambda: verify(share))
            if new:
                fresh.extend(ids)
            if restart_controller is not None and "restart" not in fired and chance():
                fired.add("restart")
                controller_restart()  # the rank stepped; its ack goes to the rebuilt controller
            if once("trainer_rank_crash_after_step"):
                ok["trainer_rank_crash_after_step"] += int(client.controller.recover_rank(r) == k)
                continue
            if once("consumer_edits_in_place"):  # a trainer edits its batch in place: stored bytes must not change
                for f in share.fields.values():
                    f.values.fill_(0)
                t = share.traj_ids[0]
                ok["consumer_edits_in_place"] += int(np.array_equal(stored(client, t), expected(t)["input_ids"]))
            client.ack(share)
            if once("repeated_ack"):
                client.ack(share)
                ok["repeated_ack"] += 1
            return
        raise RuntimeError(f"rank {r}: mini-batch #{k} not delivered in 10 attempts")

    try:
        client = dp.client()
        crashed_prefetch = False
        for k, lo in enumerate(range(0, cfg.trajectories, cfg.minibatch)):
            ids = list(range(lo, min(cfg.trajectories, lo + cfg.minibatch)))
            if chance() and len(ids) >= 2:  # a producer dies mid-group: two orphans, discarded, regenerated
                inj["producer_death_mid_group"] += 1
                orphans = ids[:2]
                dp.client("u1").put([payload(t, ("input_ids",)) for t in orphans])
                dp.client("u1").discard(orphans)
                res.regenerated += len(orphans)
                ok["producer_death_mid_group"] += int(client.controller.unreleased(orphans) == tuple(orphans))
            if chance():
                inj["read_before_admission_deadline"] += 1
                try:
                    client.fetch_next(k, 0, timeout=0.05, ack=False)
                except TimeoutError:
                    ok["read_before_admission_deadline"] += 1
            for i, u in enumerate(units):
                mine = [t for t in ids if t % 3 == i]
                if not mine:
                    continue
                if u == "u2":  # field by field: a loss must re-put every field, not the last put's
                    try:
                        put(u, [payload(t, ("input_ids",)) for t in mine])
                        put(u, [payload(t, ("old_logprobs", "advantages", "loss_mask")) for t in mine])
                    finally:
                        if not lost_unit_seen and prods[u].fallbacks:
                            lost_unit_seen = True
                            inj["storage_unit_lost"] += 1
                    continue
                batch = [payload(t) for t in mine]
                if chance():  # the reply of the unit's put is lost before register: the retry registers it
                    inj["lost_register_reply"] += 1
                    try:
                        dp.client(u).units[u].put(with_checksums(batch))
                    except CorruptPayloadError:
                        inj["corrupted_put"] += 1
                        ok["corrupted_put"] += 1
                put(u, batch)
                if chance():  # the reply of the whole put is lost: the producer retries it
                    inj["lost_put_reply_retry"] += 1
                    put(u, batch)
                    ok["lost_put_reply_retry"] += 1
                if chance():  # the producer reuses its buffers right after put
                    inj["producer_mutates_after_put"] += 1
                    for p in batch:
                        for a in p.tensors.values():
                            a[...] = 0
            for p in prods.values():
                p.reput_missing()
            if lost_unit_seen and "unit_restarts_empty" not in inj:
                inj["unit_restarts_empty"] += 1
                restart_unit(dp, "u2")
            if restart_controller is not None and chance():  # everything put, nothing admitted yet
                controller_restart()
            client.admit(MiniBatch(0, k, tuple(ids), (k,), 0))
            inj_register = inj["lost_register_reply"]
            if not crashed_prefetch and k >= 1 and chance():  # a rank crashes holding a default prefetch
                crashed_prefetch = True
                inj["prefetching_rank_crash_default_config"] += 1
                pf = Prefetcher(client, 0, None, PrefetchConfig(depth=2, admit_timeout_s=cfg.timeout_s), start_seq=k)
                pf.next(timeout=cfg.timeout_s)
                pf.close()
                ok["prefetching_rank_crash_default_config"] += int(client.controller.recover_rank(0) == k)
            for r in range(cfg.ranks):
                deliver(client, r, k)
            ok["lost_register_reply"] = inj_register  # every mini-batch was delivered whole, so each one held
            if k >= 1 and chance():  # a retry of an old put arrives after its mini-batch was trained
                inj["late_retry_after_release"] += 1
                t = lo - 1
                try:
                    prods[units[t % 3]].client.put([payload(t)])
                except (DuplicatePutError, UnitLostError, CorruptPayloadError):
                    pass  # refused by name; a re-put after a loss is dropped instead: either way never trained twice
                ok["late_retry_after_release"] += 1  # zeroed below if anything was trained twice
            for p in prods.values():
                p.prune()
            res.held_max = max(res.held_max, client.controller.stats().held)
        if lost_unit_seen:
            ok["storage_unit_lost"] += 1
            ok["unit_restarts_empty"] += 1
    finally:
        res.wall_s = time.perf_counter() - t0
    n_mbs = -(-cfg.trajectories // cfg.minibatch)
    res.released_minibatches = client.controller.stats().released_minibatches
    counts = Counter(fresh)
    res.trained = len(counts)
    res.lost = len(set(range(cfg.trajectories)) - set(counts))
    res.duplicated = sum(v - 1 for v in counts.values() if v > 1)
    res.corrupted = len(corrupted)
    if res.lost or res.duplicated or res.corrupted:  # a fault of this kind was not survived
        for kind in list(ok):
            ok[kind] = 0
    if res.corrupted:  # every delivered byte is checked: a mutation that reached storage shows here
        ok["producer_mutates_after_put"] = 0
    else:
        ok["producer_mutates_after_put"] = inj["producer_mutates_after_put"]
    if "controller_restart" in inj:  # survived iff the whole run ended exact (the zeroing above and below)
        ok["controller_restart"] = inj["controller_restart"]
    from workloads.reliability_faults import units_empty

    res.final_unit_bytes = 0 if units_empty(dp, timeout=0.0 if transport == "inprocess" else 10.0) else -1
    if res.final_unit_bytes or res.released_minibatches != n_mbs:  # a lost ack or release leaks state: not survived
        for kind in list(ok):
            ok[kind] = 0
    dp.close()
    return res
