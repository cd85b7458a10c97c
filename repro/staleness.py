"""The staleness table: architectural staleness of each admission policy on the staleness-throughput frontier.

    python -m repro.staleness                                  # headline + outer sweep + variable groups, 5 seeds
    python -m repro.staleness sweep.enabled=false seeds=[0] dapo.budgets=[0.5,1.0,2.0]
    python -m repro.staleness sweep.num_minibatches=[8,16] sweep.group_sizes=[16] sweep.tails=[heavy] parallel=none

Each point simulates one admission policy at one in-flight budget (groups dispatched and not yet consumed, in
batches of groups), sync policy and budget-release convention (``knittrans.sim.BudgetRelease``) on a time model
scaled from the DAPO-scale reference (``knittrans.sim.sweep.SystemModel``: every point keeps the reference's
rollout/trainer throughput ratio). Rows go to ``results/staleness/trials.jsonl``; every claim is computed from
them by ``repro.spec.staleness`` (matched operating points, the reduction at train-batch's trainer-bound point,
seeds). ``gate_trials()`` is the CI-size slice that ``python -m repro.gates --only staleness`` checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from baselines.admission import make_policy
from knittrans.constraints import BatchConstraints
from knittrans.sim import BudgetRelease, SimDeadlock, SyncPolicy
from knittrans.sim.sweep import COLOCATED, PointOutcome, PointSpec, SystemModel, Timeline, measure
from knittrans.sim.theory import TheoryCheck, budget_check, group_queue_check
from knittrans.types import AdmissionKind, InflightPolicy
from repro.spec.staleness import LittleLawTrial, StalenessTrial
from workloads.text import TAILS, LengthDist, TextWorkloadConfig, generate_batches

# -- configuration ---------------------------------------------------------------------------------------------

END, START = BudgetRelease.STEP_END, BudgetRelease.STEP_START
KT, TB, BA, GREEDY = (AdmissionKind.KNITTRANS, AdmissionKind.TRAIN_BATCH, AdmissionKind.BOUNDED_ASYNC,
                      AdmissionKind.GREEDY)
DENSE = [0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.25, 1.5, 2.0, 3.0]


@dataclass
class DapoConf:
    """The headline shape (DAPO: 512 prompts x 16 samples, 16 mini-batches; ``workloads.text``)."""

    enabled: bool = True
    prompts_per_batch: int = 512
    """Smaller values time-scale the reference system (``SystemModel.scaled``), as the gate does."""
    group_size: int = 16
    num_minibatches: int = 16
    tail: str = "light"
    """Length tail: light (log-normal sigma 0.9) or heavy (1.3)."""
    num_batches: int = 6
    warmup_batches: int = 2
    """Batches excluded from the metrics (pipeline fill)."""
    budgets: list[float] = field(default_factory=lambda: list(DENSE))
    """In-flight budgets in batches of groups; whole-batch policies run only from 1 batch up."""
    policies: list[AdmissionKind] = field(default_factory=lambda: [KT, TB])
    """With sync every_step: run at every seed and release convention (the headline)."""
    syncs: list[SyncPolicy] = field(default_factory=lambda: [SyncPolicy.EVERY_STEP, SyncPolicy.EVERY_BATCH])
    """Weight-sync policies (every_k pushes every ``system.sync_k`` steps). every_step is the headline's; the
    others run at the first seed and release only (context for the plots and rows)."""
    context_policies: list[AdmissionKind] = field(default_factory=lambda: [BA])
    """Run at the first seed and release only, for every sync policy (context)."""
    cdf_budget: float | None = None
    """The CDF plot compares policies at the throughput train-batch reaches with this budget; None: its fastest
    budget (its trainer-bound point, where the headline is decided; 1.0 until session 26)."""
    abort: bool = True
    """Also run the headline frontier (every seed, both release conventions, sync every step) with in-flight
    requests aborted at each sync (``system.inflight`` = abort): the ``arch_staleness_reduction_abort`` measurement.
    Skipped when ``system.inflight`` is abort already."""


@dataclass
class SweepConf:
    """The outer sweep at 64 prompts per batch, time-scaled (every config keeps the reference's throughput ratio)."""

    enabled: bool = True
    prompts_per_batch: int = 64
    num_minibatches: list[int] = field(default_factory=lambda: [1, 4, 16])
    group_sizes: list[int] = field(default_factory=lambda: [4, 16])
    tails: list[str] = field(default_factory=lambda: ["light", "heavy"])
    num_batches: int = 5
    warmup_batches: int = 2
    budgets: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0, 1.5, 2.0])
    policies: list[AdmissionKind] = field(default_factory=lambda: [KT, TB])
    num_seeds: int = 1
    """Run at the first this many of ``seeds``: 684 points per seed, the bulk of the table's time (per-config
    values moved by < 0.1 between seeds in development runs; the sweep is a measurement, not the headline). 2 until
    session 21; 1 so that ``make repro`` fits 30 minutes on 2 cores."""


@dataclass
class VariableGroupsConf:
    """Variable group sizes with whole-group mini-batches of exactly B/M: composing a mini-batch is subset sum and
    a careless choice leaves a remainder no split can fix. Greedy streaming dead-ends here; KnitTrans must not."""

    enabled: bool = True
    prompts_per_batch: int = 32
    group_size: int = 8
    """Largest group; sizes are drawn from n/2..n and nudged so each batch holds exactly batch_total."""
    num_minibatches: int = 4
    batch_total: int = 192
    num_batches: int = 6
    warmup_batches: int = 2
    budgets: list[float] = field(default_factory=lambda: [0.5, 1.0, 1.5, 2.0])
    policies: list[AdmissionKind] = field(default_factory=lambda: [KT, TB, GREEDY])


@dataclass
class LittleConf:
    """The simulator against its closed forms (``knittrans.sim.theory``)."""

    enabled: bool = True
    rhos: list[float] = field(default_factory=lambda: [0.3, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0])
    budget_groups: list[int] = field(default_factory=lambda: [4, 8, 16, 24])


@dataclass
class StalenessConf:
    out_dir: str = "results/staleness"
    logger: str = "wandb"
    """wandb (offline unless WANDB_MODE=online) or none."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    releases: list[BudgetRelease] = field(default_factory=lambda: [END, START])
    parallel: str = "ray"
    """ray (local cluster) or none (serial, in this process)."""
    workers: int = 0
    """Ray CPUs; 0 = all cores."""
    system: SystemModel = field(default_factory=SystemModel)
    dapo: DapoConf = field(default_factory=DapoConf)
    sweep: SweepConf = field(default_factory=SweepConf)
    variable_groups: VariableGroupsConf = field(default_factory=VariableGroupsConf)
    little: LittleConf = field(default_factory=LittleConf)


# -- one point -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """A point plus what the workload and the report need (a Ray task's argument)."""

    spec: PointSpec
    scenario: str
    tail: str
    seed: int
    num_batches: int
    keep_hist: bool = False
    timeline: bool = False


def workload(job: Job) -> TextWorkloadConfig:
    s = job.spec
    return TextWorkloadConfig(name=job.scenario, prompts_per_batch=s.prompts_per_batch, group_size=s.group_size,
                              num_minibatches=s.num_minibatches, lengths=LengthDist(sigma=TAILS[job.tail]),
                              variable_groups=s.variable_groups,
                              batch_total=s.batch_size if s.variable_groups else None)


def run_job(job: Job) -> tuple[StalenessTrial, Timeline | None]:
    """Simulate one point; the policy is built here (``make_policy``) and passed into the simulator."""
    wl = workload(job)
    batches = generate_batches(wl, job.num_batches, seed=job.seed)
    s = job.spec
    c = s.constraints(wl.lengths.max_len)
    kind = TB if s.policy == COLOCATED else AdmissionKind(s.policy)
    kw = {}
    if kind is AdmissionKind.CLAIRVOYANT:
        truth = {g.group_id: wb.group_tokens(g.group_id) for wb in batches for g in wb.plan.groups}
        kw["oracle_tokens"] = truth.__getitem__
    out = measure(s, make_policy(kind, c, **kw), batches, keep_hist=job.keep_hist,
                  timeline_batch=s.warmup_batches + 1 if job.timeline else None)
    return to_row(job, out), out.timeline


def to_row(job: Job, out: PointOutcome) -> StalenessTrial:
    s, m = job.spec, out.metrics
    metrics = {} if m is None else {k: getattr(m, k) for k in StalenessTrial.__dataclass_fields__ if hasattr(m, k)}
    return StalenessTrial(seed=job.seed, scenario=job.scenario, policy=s.policy,
                          prompts_per_batch=s.prompts_per_batch, group_size=s.group_size,
                          num_minibatches=s.num_minibatches, batch_size=s.batch_size, tail=job.tail, budget=s.budget,
                          sync=s.sync.value, inflight=s.system.inflight.value, release=s.release.value, ok=out.ok,
                          note=out.note, stalled=out.stalled, **metrics)


def budgets_for(policy: str, budgets: list[float]) -> list[float]:
    """Whole-batch policies deadlock below one batch in flight; bounded_async's eta is a whole number of batches."""
    k = AdmissionKind(policy)
    if k is BA:
        return [b for b in budgets if b >= 1 and float(b).is_integer()]
    return [b for b in budgets if b >= 1] if k.whole_batch else list(budgets)


def frontier_jobs(scenario: str, shape: dict, tail: str, seed: int, num_batches: int, warmup: int,
                  policies: list, budgets: list[float], syncs: list[SyncPolicy], releases: list[BudgetRelease],
                  system: SystemModel, keep_hist: bool = False) -> list[Job]:
    """Every (policy, budget, sync, release) of one frontier, plus the colocated reference."""
    base = PointSpec(policy=COLOCATED, budget=1.0, sync=SyncPolicy.EVERY_BATCH, release=END, system=system,
                     warmup_batches=warmup, **shape)
    jobs = [Job(base, scenario, tail, seed, num_batches, keep_hist)]
    for sync in syncs:
        for rel in releases:
            for pol in policies:
                pol = AdmissionKind(pol).value
                jobs += [Job(replace(base, policy=pol, budget=b, sync=sync, release=rel), scenario, tail, seed,
                             num_batches, keep_hist and sync is SyncPolicy.EVERY_STEP)
                         for b in budgets_for(pol, budgets)]
    return jobs


def _shape(prompts: int, n: int, M: int, total: int | None = None) -> dict:
    return dict(prompts_per_batch=prompts, group_size=n, num_minibatches=M, batch_size=total or prompts * n,
                variable_groups=total is not None)


def build_jobs(cfg: StalenessConf) -> list[Job]:
    jobs: list[Job] = []
    rels, ES = [BudgetRelease(r) for r in cfg.releases], SyncPolicy.EVERY_STEP
    d, s, v = cfg.dapo, cfg.sweep, cfg.variable_groups
    for i, seed in enumerate(cfg.seeds):
        if d.enabled:
            shape = _shape(d.prompts_per_batch, d.group_size, d.num_minibatches)
            syncs = [SyncPolicy(x) for x in d.syncs]
            head = frontier_jobs("dapo", shape, d.tail, seed, d.num_batches, d.warmup_batches, d.policies,
                                 d.budgets, [x for x in syncs if x is ES], rels, cfg.system, keep_hist=i == 0)
            if d.abort and cfg.system.inflight is not InflightPolicy.ABORT:
                head += frontier_jobs("dapo", shape, d.tail, seed, d.num_batches, d.warmup_batches, d.policies,
                                      d.budgets, [ES], rels, replace(cfg.system, inflight=InflightPolicy.ABORT))[1:]
            if i == 0:
                head += frontier_jobs("dapo", shape, d.tail, seed, d.num_batches, d.warmup_batches,
                                      d.context_policies, d.budgets, syncs, rels[:1], cfg.system)[1:]
                head += frontier_jobs("dapo", shape, d.tail, seed, d.num_batches, d.warmup_batches, d.policies,
                                      d.budgets, [x for x in syncs if x is not ES], rels[:1], cfg.system)[1:]
            jobs += head
        if s.enabled and i < s.num_seeds:
            for M in s.num_minibatches:
                for n in s.group_sizes:
                    for tail in s.tails:
                        if (s.prompts_per_batch * n) % M == 0:
                            jobs += frontier_jobs("sweep", _shape(s.prompts_per_batch, n, M), tail, seed,
                                                  s.num_batches, s.warmup_batches, s.policies, s.budgets, [ES],
                                                  rels, cfg.system)
        if v.enabled:
            jobs += frontier_jobs("variable_groups", _shape(v.prompts_per_batch, v.group_size, v.num_minibatches,
                                                            v.batch_total), "light", seed, v.num_batches,
                                  v.warmup_batches, v.policies, v.budgets, [ES], rels[:1], cfg.system)
    return jobs


def little_rows(cfg: LittleConf, seeds: list[int], releases: list[BudgetRelease]) -> list[LittleLawTrial]:
    """The simulator against Little's law: the group queue over rho (bounded-async admission, one step per
    batch) and a binding in-flight budget under each release convention (KnitTrans admission)."""
    rows = []
    gq = TextWorkloadConfig(name="theory", prompts_per_batch=16, group_size=8, num_minibatches=1, prompt_len=0,
                            lengths=LengthDist(median=400, sigma=0.8, max_len=4000, min_len=8))
    bw = TextWorkloadConfig(name="budget", prompts_per_batch=16, group_size=4, num_minibatches=4, prompt_len=0,
                            lengths=LengthDist(median=300, sigma=0.9, max_len=2048, min_len=8))
    for seed in seeds:
        batches = generate_batches(gq, 60, seed=seed)
        for rho in cfg.rhos:
            c = BatchConstraints(gq.batch_size, 1, 4000, group_size=gq.group_size)
            chk = group_queue_check(make_policy(BA, c), batches, rho)
            rows.append(LittleLawTrial(seed, "group_queue", "n/a", rho, chk.measured, chk.predicted))
        batches = generate_batches(bw, 12, seed=seed)
        for rel in releases:
            for g in cfg.budget_groups:
                c = BatchConstraints(bw.batch_size, bw.num_minibatches, 2048, group_size=bw.group_size)
                try:
                    chk = budget_check(make_policy(KT, c), batches, g, BudgetRelease(rel), warmup_batches=3)
                except SimDeadlock:  # a stall is a failed check (logged as no measurement), not a crash
                    chk = TheoryCheck(math.nan, math.nan)
                rows.append(LittleLawTrial(seed, "budget", BudgetRelease(rel).value, g, chk.measured, chk.predicted))
    return rows


@dataclass(frozen=True)
class LittleJob:
    """The Little's-law checks of one seed (a pool task beside the sweep's points)."""

    conf: LittleConf
    seed: int
    releases: tuple[BudgetRelease, ...]


def run_point(job: Job | LittleJob):  # noqa: ANN201 - run_job's pair, or a LittleJob's rows
    """One pool task of the table: a sweep point (``run_job``) or one seed's Little's-law checks."""
    if isinstance(job, LittleJob):
        return little_rows(job.conf, [job.seed], list(job.releases))
    return run_job(job)


# -- gate --------------------------------------------------------------------------------------------------------


def gate_trials() -> list[StalenessTrial | LittleLawTrial]:
    """The CI-size slice, serial and in this process (so a test's monkeypatch reaches it), deterministic: the
    headline shape time-scaled to 64 prompts (seed 0, both release conventions), the variable-group scenario, and
    the Little's-law checks at two rhos and two budgets."""
    sysm, ES = SystemModel(), SyncPolicy.EVERY_STEP
    jobs = frontier_jobs("dapo", _shape(64, 16, 16), "light", 0, 5, 2, [KT, TB], DENSE, [ES], [END, START], sysm)
    jobs += frontier_jobs("variable_groups", _shape(32, 8, 4, 192), "light", 0, 5, 2, [KT, GREEDY], [1.0, 2.0],
                          [ES], [END], sysm)
    rows: list = [run_job(j)[0] for j in jobs]
    return rows + little_rows(LittleConf(rhos=[0.5, 2.0], budget_groups=[8, 16]), [0], [END, START])


# -- the table ---------------------------------------------------------------------------------------------------


def run(cfg: StalenessConf) -> dict:
    from repro.logger import publish
    from repro.results import Results
    from repro.staleness_report import describe, plot_all
    from repro.sweep import run_points

    res = Results(table="staleness", out_dir=Path(cfg.out_dir))
    jobs = build_jobs(cfg)
    timelines = []
    if cfg.dapo.enabled:
        d = cfg.dapo
        shape = _shape(d.prompts_per_batch, d.group_size, d.num_minibatches)
        for pol in (COLOCATED, TB.value, KT.value, BA.value):
            spec = PointSpec(policy=pol, budget=1.0, release=BudgetRelease(cfg.releases[0]), system=cfg.system,
                             sync=SyncPolicy.EVERY_BATCH if pol == COLOCATED else SyncPolicy.EVERY_STEP,
                             warmup_batches=d.warmup_batches, **shape)
            timelines.append(Job(spec, "dapo-timeline", d.tail, cfg.seeds[0], d.warmup_batches + 3, timeline=True))
    # The Little's-law checks run in the same pool, one task per seed (serial after the sweep they held one core
    # for ~9 s while the other idled); concatenated in seed order they are little_rows over every seed.
    little = ([LittleJob(cfg.little, seed, tuple(BudgetRelease(r) for r in cfg.releases)) for seed in cfg.seeds]
              if cfg.little.enabled else [])
    out = run_points(run_point, [*jobs, *timelines, *little], parallel=cfg.parallel, workers=cfg.workers,
                     desc="staleness")
    rows: list = [r for r, _ in out[:len(jobs)]]
    for part in out[len(jobs) + len(timelines):]:
        rows += part
    res.set_trials(rows)
    res.rows = [{k: v for k, v in r.as_dict().items() if k != "hist"} for r in rows
                if isinstance(r, StalenessTrial) and r.seed == cfg.seeds[0] and r.scenario != "sweep"]
    res.text = describe(rows, cfg)
    plot_all(res, rows, [(j.spec, tl) for j, (_, tl) in zip(timelines, out[len(jobs):])], cfg)
    return publish(res, cfg.logger, "staleness", config=cfg, seed=cfg.seeds[0])


ConfigStore.instance().store(name="staleness_schema", node=StalenessConf)


@hydra.main(config_path="conf", config_name="staleness", version_base=None)
def main(dcfg) -> None:
    cfg: StalenessConf = OmegaConf.to_object(dcfg)
    run(cfg)


if __name__ == "__main__":
    main()
