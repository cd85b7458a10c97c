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
    error: str = ""
    """What ended the run early (a Handoff run counts it as every kind not survived instead of raising)."""


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


# -- through the Handoff (issue 29): what a user of ``knittrans.Handoff`` meets, on both transports ----------------

HANDOFF_KINDS = ("rejected_put_reput", "bad_metadata_refused", "lost_claim_reply_same_incarnation",
                 "unit_lost_under_consumer", "fetch_timeout_under_stall", "put_after_close")
CLASSES.update({"rejected_put_reput": "lost_data", "bad_metadata_refused": "corruption",
                "lost_claim_reply_same_incarnation": "retries", "unit_lost_under_consumer": "lost_data",
                "fetch_timeout_under_stall": "hang", "put_after_close": "lost_data"})


@dataclass
class HandoffChaosConfig:
    batches: int = 20
    prompts: int = 8
    group_size: int = 4
    num_minibatches: int = 2
    fault_rate: float = 0.3
    """Per put call: probability of a rejected put (re-put at once) and of a rollout with wrong metadata."""
    seed: int = 0
    timeout_s: float = 60.0
    stall_s: float = 20.0
    """How long the stalled unit read of ``fetch_timeout_under_stall`` hangs (the call must end after 1 s)."""


def handoff_rollout(t: int, g: int, b: int, num_tokens: int | None = None):  # noqa: ANN201 - a Rollout
    """Trajectory ``t`` (group ``g``, batch ``b``) with ``expected(t)``'s tensors; ``num_tokens`` overrides the
    metadata's response length (a producer that miscounts)."""
    from knittrans.handoff import Rollout
    from knittrans.types import Trajectory

    arrs = expected(t)
    n = arrs["old_logprobs"].shape[0]
    return Rollout(Trajectory(t, g, b, n if num_tokens is None else num_tokens, v_gen=0), arrs)


def run_handoff_chaos(transport: str, cfg: HandoffChaosConfig) -> ChaosResult:
    """A GRPO run through ``knittrans.Handoff`` (2 units, 2 rank threads iterating their consumers, checksums on,
    KnitTrans admission) with the faults a Handoff user meets, counted from what fired:

    - ``rejected_put_reput``: a put call the controller refuses (one rollout of an unannounced group) is rolled back
      and its good rollouts re-put at once (issue 29: on Ray some ended registered but gone);
    - ``bad_metadata_refused``: a rollout whose ``num_tokens`` disagrees with its tensors is refused by name, and the
      corrected one put;
    - ``lost_claim_reply_same_incarnation``: a rank's claim whose reply was lost; the same incarnation's consumer
      then gets that very share (idempotent claim), never ``AlreadyConsumedError``;
    - ``unit_lost_under_consumer``: unit u1 dies while the consumers run; the producer re-puts what
      ``Handoff.missing`` names to u0, and the consumers go on without being rebuilt;
    - ``fetch_timeout_under_stall`` (a second, small handoff): a unit stalls in a read; ``fetch_next(timeout=1)``
      ends within a fraction of the stall with ``ReadTimeoutError``, the claim undone, and the retry gets the share;
    - ``put_after_close``: a put after ``close`` raises ``DataPlaneClosedError``.

    Survived only if every trajectory was trained exactly once with its exact bytes and the units ended empty."""
    import threading

    from knittrans.dataplane.faults import FaultPlan, UnitLoss
    from knittrans.dataplane.types import (AdmissionStateError, DataPlaneClosedError, SchemaMismatchError,
                                           UnitLostError)
    from knittrans.handoff import Handoff, HandoffConfig, Transport
    from knittrans.types import BatchPlan, GroupSpec

    rng = np.random.default_rng(cfg.seed)
    P, N, M = cfg.prompts, cfg.group_size, cfg.num_minibatches
    n = cfg.batches * P * N
    res = ChaosResult(f"{transport}/handoff", n, 0, 0, 0, 0, 0)
    inj, ok = res.injected, res.survived
    units = (("u0", "n0"), ("u1", "n1"))
    plan = FaultPlan((UnitLoss("u0", on_put=10**9), UnitLoss("u1", on_put=10**9)))  # wrappers; losses by hand
    h = Handoff(HandoffConfig.grpo(P, N, M, 8, transport=Transport(transport), units=units, rank_nodes=("n0", "n1"),
                                   checksums=True, faults=plan, admit_timeout_s=cfg.timeout_s))
    counts = np.zeros(n, np.int64)
    corrupted: set[int] = set()
    errors: list[BaseException] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def train(r: int) -> None:
        try:
            consumer = h.consumer(r, count=cfg.batches * M)
            for share in consumer:
                for name, f in share.fields.items():
                    cu = f.cu_seqlens.tolist()
                    for i, t in enumerate(share.traj_ids):
                        if not np.array_equal(f.values[cu[i]:cu[i + 1]].numpy(), expected(t)[name]):
                            corrupted.add(t)
                with lock:
                    counts[list(share.traj_ids)] += 1
                consumer.ack(share)
            consumer.close()
        except BaseException as e:  # noqa: BLE001 - re-raised by the driver
            errors.append(e)

    def lose_u1() -> None:
        if transport == "inprocess":
            h.plane.units["u1"].lose()
        else:
            import ray

            ray.get(h.plane.unit_actors["u1"].lose.remote(), timeout=30)

    live = {"u0", "u1"}

    def put(unit: str, rollouts: list) -> None:
        """Put to ``unit`` (u0 once u1 is lost), re-putting what the controller lists as missing after a loss."""
        for _ in range(3):
            u = unit if unit in live else "u0"
            try:
                h.producer(u).put(rollouts)
                return
            except UnitLostError:
                live.discard(u)
        raise RuntimeError(f"put to {unit} kept failing")

    def reput_missing() -> None:
        missing = h.missing()
        if missing:
            put("u0", [handoff_rollout(t, t // N, t // (P * N)) for t in missing])

    ranks, first = None, None
    try:
        lost_at = int(rng.integers(2, max(3, cfg.batches - 2)))
        for b in range(cfg.batches):
            h.add_batch(BatchPlan(b, tuple(GroupSpec(g, b, N) for g in range(b * P, (b + 1) * P))))
            if b == lost_at:  # the unit dies under running consumers; the producer re-puts, no consumer is rebuilt
                lose_u1()
                live.discard("u1")
                inj["unit_lost_under_consumer"] += 1
            for i, unit in enumerate(("u0", "u1")):
                groups = [g for g in range(b * P, (b + 1) * P) if g % 2 == i]
                for j in range(0, len(groups), 2):
                    good = [handoff_rollout(g * N + k, g, b) for g in groups[j:j + 2] for k in range(N)]
                    if rng.random() < cfg.fault_rate:  # one rollout of a group never announced: refused whole
                        inj["rejected_put_reput"] += 1
                        stray = handoff_rollout(n + b, 10**6 + b, b)
                        try:
                            put(unit, good + [stray])
                        except AdmissionStateError:
                            ok["rejected_put_reput"] += 1
                    if rng.random() < cfg.fault_rate:  # a producer that miscounts the response
                        inj["bad_metadata_refused"] += 1
                        t = good[0].traj.traj_id
                        try:
                            put(unit, [handoff_rollout(t, good[0].traj.group_id, b, num_tokens=1 + len(
                                expected(t)["old_logprobs"]))])
                        except SchemaMismatchError as e:
                            ok["bad_metadata_refused"] += int(f"trajectory {t}" in str(e))
                    put(unit, good)
            if b == lost_at:
                reput_missing()  # what a read or a put reported lost meanwhile
            if b == 0:  # the reply of rank 0's first claim is lost; its consumer (same incarnation) claims again
                inj["lost_claim_reply_same_incarnation"] += 1
                ctrl = h.plane.controller
                first = ctrl.claim_next(0, 0, h.plane.schema.names, cfg.timeout_s, ctrl.rank_epoch(0))
                ranks = [threading.Thread(target=train, args=(r,), daemon=True) for r in range(2)]
                for th in ranks:
                    th.start()
            if errors:
                raise errors[0]
        deadline = time.perf_counter() + cfg.timeout_s * 4
        while h.version < cfg.batches * M and time.perf_counter() < deadline and not errors:
            reput_missing()  # a loss a read reported after the last put
            try:
                h.wait_version(cfg.batches * M, timeout=1.0)
            except TimeoutError:
                continue
        for th in ranks or ():
            th.join(timeout=cfg.timeout_s)
        if errors:
            raise errors[0]
        if first is not None:
            trained_first = {t for t in first.traj_ids if counts[t] == 1}
            ok["lost_claim_reply_same_incarnation"] += int(trained_first == set(first.traj_ids))
        ok["unit_lost_under_consumer"] += inj["unit_lost_under_consumer"]  # zeroed below unless exact
        h.wait_drained(timeout=cfg.timeout_s)
        from workloads.reliability_faults import units_empty

        res.final_unit_bytes = 0 if units_empty(h.plane, timeout=0.0 if transport == "inprocess" else 10.0) else -1
        res.released_minibatches = h.version
    except Exception as e:  # noqa: BLE001 - a fault not survived: counted (every kind zeroed below), not raised
        res.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        h.close()
        res.wall_s = time.perf_counter() - t0
    inj["put_after_close"] += 1
    try:
        h.producer("u0").put([handoff_rollout(0, 0, 0)])
    except DataPlaneClosedError:
        ok["put_after_close"] += 1
    _stalled_fetch(transport, cfg, inj, ok)
    res.trained = int((counts > 0).sum())
    res.lost = int((counts == 0).sum())
    res.duplicated = int(np.clip(counts - 1, 0, None).sum())
    res.corrupted = len(corrupted)
    if res.error or res.lost or res.duplicated or res.corrupted or res.final_unit_bytes or \
            res.released_minibatches != cfg.batches * M:
        for kind in list(ok):
            ok[kind] = 0
    return res


def _stalled_fetch(transport: str, cfg: HandoffChaosConfig, inj: Counter, ok: Counter) -> None:
    """``fetch_timeout_under_stall``: unit u0's first read hangs ``stall_s``; ``fetch_next(timeout=1.0)`` must end well
    before (``ReadTimeoutError``, the claim undone) and a retry must get the whole share."""
    from knittrans.dataplane.faults import FaultPlan, SlowGet
    from knittrans.dataplane.types import ReadTimeoutError
    from knittrans.handoff import Handoff, HandoffConfig, Transport
    from knittrans.types import BatchPlan, GroupSpec

    h = Handoff(HandoffConfig.grpo(2, 2, 1, 8, transport=Transport(transport),
                                   faults=FaultPlan((SlowGet("u0", on_get=1, seconds=cfg.stall_s),))))
    try:
        h.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2), GroupSpec(1, 0, 2))))
        h.producer().put([handoff_rollout(t, t // 2, 0) for t in range(4)])
        client = h.plane.client()
        inj["fetch_timeout_under_stall"] += 1
        t0 = time.perf_counter()
        try:
            client.fetch_next(0, 0, timeout=1.0)
        except ReadTimeoutError:
            bounded = time.perf_counter() - t0 < cfg.stall_s / 2  # against the injected stall, not a speed
            share = client.fetch_next(0, 0, timeout=cfg.timeout_s)  # the claim was undone: the retry gets it all
            ok["fetch_timeout_under_stall"] += int(bounded and share.traj_ids == (0, 1, 2, 3))
    finally:
        h.close()
