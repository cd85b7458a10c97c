"""Fault scenarios for the reliability table: typed faults (``knittrans.runtime.faults.RuntimeFaultPlan``,
``knittrans.dataplane.faults.FaultPlan`` / ``RankCrash``) injected into real runs and data planes, each checked
for exact accounting (every trajectory trained or delivered exactly once, storage freed)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class FaultOutcome:
    scenario: str
    transport: str
    injected: int
    survived: int
    trajectories: int
    lost: int
    duplicated: int
    note: str = ""


def count(delivered: list[int], expected: set[int]) -> tuple[int, int]:
    from collections import Counter

    c = Counter(delivered)
    return len(expected - set(c)), sum(v - 1 for v in c.values() if v > 1)


RUNTIME_KINDS = ("rollout_worker_dies_mid_group", "straggling_engine_timeout", "trainer_crash_before_update",
                 "trainer_crash_after_update")
"""The runtime scenarios' fault kinds, in the order ``runtime_fault_scenarios`` runs them."""


def runtime_fault_scenarios(seed: int) -> list[FaultOutcome]:
    """Real runs (tiny policy, CPU) with each runtime fault injected."""
    import torch

    from knittrans.runtime.config import RuntimeConfig
    from knittrans.runtime.faults import RuntimeFaultPlan
    from baselines.admission import make_policy
    from workloads.arith_session import arith_setup, run_mode
    from workloads.tiny_models import WarmStartConfig

    torch.set_num_threads(1)
    setup = arith_setup(seed=seed, warm=WarmStartConfig(steps=20))
    small = dict(num_batches=3, prompts_per_batch=8, group_size=2, num_minibatches=4, wave_groups=2, seed=seed)
    scenarios = [
        ("rollout_worker_dies_mid_group", RuntimeConfig.for_system("knittrans", inflight_groups=4, **small),
         RuntimeFaultPlan(kill_worker_groups=(3, 12))),
        ("straggling_engine_timeout", RuntimeConfig.for_system("knittrans", inflight_groups=4, generation_timeout_s=1.0,
                                                    **small), RuntimeFaultPlan(slow_groups=(5,), slow_s=120.0)),
        ("trainer_crash_before_update", RuntimeConfig.for_system("knittrans", inflight_groups=4, **small),
         RuntimeFaultPlan(crash_steps=(2, 7))),
        ("trainer_crash_after_update", RuntimeConfig.for_system("train_batch", inflight_groups=8, **small),
         RuntimeFaultPlan(crash_steps=(5,), crash_after_update=True)),
    ]
    assert tuple(name for name, _, _ in scenarios) == RUNTIME_KINDS
    out = []
    for name, cfg, plan in scenarios:
        # raises RunInvariantError if anything was lost or trained twice
        run = run_mode(cfg, setup, faults=plan, make_policy=make_policy)
        injected = sum(run.faults_injected.values())
        recovered = run.faults_recovered.get("regenerated_wave", 0) + run.faults_recovered.get("trainer_restart", 0)
        expected = set(range(cfg.num_batches * cfg.prompts_per_batch * cfg.group_size))
        lost, dup = count([t.traj_id for t in run.trajectories if t.step >= 0], expected)
        steps_once = [s.version for s in run.steps] == list(range(1, cfg.total_steps + 1))
        out.append(FaultOutcome(name, "runtime", injected, min(injected, recovered) if steps_once else 0,
                                len(expected), lost, dup, note=f"recovered {run.faults_recovered}; "
                                f"{len(run.steps)} steps, versions 1..{run.steps[-1].version}"))
    return out


def dataplane_fault_scenarios(transport: str, dp_factory) -> list[FaultOutcome]:  # noqa: ANN001
    """Unit loss, corrupted get and put, and a rank crash on one data plane built by ``dp_factory(faults)``."""
    from knittrans.dataplane.faults import (CorruptGet, CorruptPut, FaultPlan, InjectedCrash, ProducerBuffer,
                                            RankCrash, StepLedger, UnitLoss, run_rank)
    from knittrans.dataplane.types import CorruptPayloadError, DataLostError, UnitLostError
    from workloads.text_data import TextDataConfig, make_text_batch

    batch = make_text_batch(TextDataConfig(num_prompts=16, group_size=4, response_len_median=16,
                                           max_response_len=64, prompt_len_mean=8, seed=3))
    by_id = {t.traj_id: t for t in batch.trajectories}
    mbs = batch.minibatches(4)
    outcomes = []

    def consume_all(dp, crash=None, ledgers=None) -> tuple[list[int], int]:  # noqa: ANN001
        """Every rank steps every mini-batch (ack after step); returns delivered ids and crashes survived."""
        delivered: list[int] = []
        survived = 0

        def step(share):  # noqa: ANN001, ANN202
            f = share.fields["input_ids"]
            for i, t in enumerate(share.traj_ids):
                got = f.values[f.cu_seqlens[i]:f.cu_seqlens[i + 1]].numpy()
                if not np.array_equal(got, by_id[t].input_ids):
                    raise AssertionError(f"trajectory {t} delivered with wrong bytes")
            delivered.extend(share.traj_ids)
            return share.key

        for rank in range(2):
            led = ledgers[rank] if ledgers else StepLedger()
            start = 0
            while True:
                try:
                    run_rank(dp.client(), rank, led, start, len(mbs), step, crash=crash)
                    break
                except InjectedCrash:
                    crash = None  # one crash; the restarted rank resumes where the controller says
                    start = dp.client().controller.recover_rank(rank)
                    survived += 1
                except (CorruptPayloadError, DataLostError, UnitLostError):
                    start = dp.client().controller.recover_rank(rank)
        return delivered, survived

    def load(dp, producers):  # noqa: ANN001, ANN202
        for t in batch.trajectories:
            u = "u0" if t.traj_id % 2 == 0 else "u1"
            try:
                producers[u].put([t.payload()])
            except (UnitLostError, CorruptPayloadError):
                producers[u].put([t.payload()])  # a lost unit falls back; a corrupted put is retried
        for p in producers.values():
            p.reput_missing()
        for mb in mbs:
            dp.client().admit(mb)

    scenarios = [
        ("storage_unit_lost", FaultPlan((UnitLoss("u1", on_put=20),))),
        ("corrupted_fetch", FaultPlan((CorruptGet("u0", on_get=3, field="input_ids"),))),
        ("corrupted_put", FaultPlan((CorruptPut("u1", on_put=5, field="old_logprobs"),))),
        ("trainer_rank_crash_before_step", FaultPlan()),
        ("trainer_rank_crash_after_step", FaultPlan()),
    ]
    for name, plan in scenarios:
        dp = dp_factory(plan)
        try:
            producers = {u: ProducerBuffer(dp.client(u), [v for v in ("u0", "u1") if v != u]) for u in ("u0", "u1")}
            load(dp, producers)
            crash = None
            if name.startswith("trainer_rank_crash"):
                crash = RankCrash(rank=1, at_seq=2, after_step=name.endswith("after_step"))
            ledgers = [StepLedger(), StepLedger()]
            delivered, crashes = consume_all(dp, crash, ledgers)
            lost, dup = count(delivered, set(by_id))
            stats = dp.controller_stats() if hasattr(dp, "controller_stats") else dp.controller.stats()
            units_freed = units_empty(dp)
            steps_once = all(led.version == len(mbs) for led in ledgers)
            if crash is not None:
                injected, survived = 1, crashes if steps_once else 0
                note = f"replays skipped by the step ledger: {sum(led.replays for led in ledgers)}"
            else:
                injected = 1
                reput = sum(p.reputs for p in producers.values())
                survived = int(lost == 0 and dup == 0 and units_freed and stats.missing == 0)
                note = f"re-put {reput} lost trajectories; units lost {stats.units_lost}"
            survived = survived if (lost == 0 and dup == 0 and units_freed and steps_once) else 0
            outcomes.append(FaultOutcome(name, transport, injected, survived, len(by_id), lost, dup,
                                         note + f"; storage freed: {units_freed}"))
        finally:
            dp.close()
    return outcomes


def units_empty(dp, timeout: float = 10.0) -> bool:  # noqa: ANN001
    """Whether every unit is empty (on Ray drops are fire-and-forget: wait for them, briefly)."""
    deadline = time.perf_counter() + timeout
    while True:
        stats = dp.unit_stats() if hasattr(dp, "unit_stats") else [u.stats() for u in dp.units.values()]
        if all(s.nbytes == 0 for s in stats):
            return True
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.05)  # polling a remote actor's stats; the drops it waits for are fire-and-forget messages


