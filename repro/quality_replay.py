"""Learning quality, replayed: colocated vs train-batch vs KnitTrans admission on simulated schedules, each replayed
by a small GRPO learner that generates every trajectory with the weights of its ``v_gen`` (table ``quality-replay``).

    python -m repro.quality_replay                       # 10 seeds, P=128 x n=8, M=16, 10 batches (about a minute)
    python -m repro.quality_replay seeds=[0,1] logger=none learner.lr=0.05

Per seed: the staleness table's time model (``knittrans.sim.sweep.SystemModel``, scaled to the batch) simulates
train-batch at budget P, KnitTrans at every candidate budget (a mini-batch's worth of groups up to P) and colocated
execution, with the product admission policies (``baselines.admission.make_policy``). KnitTrans's matched budget is
the smallest whose simulated steady-state steps/s, over train-batch's from the same seed, has a median >= 1 over
seeds. Then four schedules per seed (colocated, train-batch at P, KnitTrans at P, KnitTrans at the matched budget)
are replayed by ``knittrans.sim.replay`` with the seed's task and random draws: a paired comparison that changes
only the schedule. Rows and claims: ``repro/spec/quality_replay.py``: every claim a SIMULATED measurement (paper
claim 2 is decided on the real runtime, ``python -m repro.quality_long``); ``replay_gap_narrowed`` is gated in CI as
a regression guard on the admission policies.

Deterministic: the same config gives the same rows on any machine. Writes ``results/quality-replay/``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from knittrans.sim import BudgetRelease, SimDeadlock, SyncPolicy
from knittrans.sim.replay import BanditTask, ReplayConfig, ReplayCurve, replay
from knittrans.sim.sweep import COLOCATED, PointSpec, SystemModel
from repro.spec.quality import ARMS, matched_budget
from repro.spec.quality_replay import ReplayProbe, ReplayRun
from workloads.text import TAILS, LengthDist, TextWorkloadConfig, generate_batches


@dataclass
class ReplayQualityConf:
    out_dir: str = "results/quality-replay"
    logger: str = "wandb"
    """wandb (offline unless WANDB_MODE=online) or none."""
    seeds: list[int] = field(default_factory=lambda: list(range(10)))
    """One paired comparison per seed: the workload's lengths, the task, and every trajectory's random draw."""
    prompts_per_batch: int = 128
    """P (the real quality table's shape)."""
    group_size: int = 8
    num_minibatches: int = 16
    """M: colocated's mean staleness is (M - 1) / 2 = 7.5 steps."""
    num_batches: int = 10
    """Batches per run: M * num_batches optimizer steps."""
    warmup_batches: int = 1
    """Batches left out of the steady-state throughput (the pipeline fill); learning counts every step."""
    tail: str = "light"
    """Response-length tail (``workloads.text.TAILS``)."""
    release: BudgetRelease = BudgetRelease.STEP_END
    """When a consumed group frees its budget place (the real runtime's convention: step end)."""
    budgets: list[int] = field(default_factory=list)
    """KnitTrans's candidate budgets in groups; [] = every mini-batch's worth (P / M groups) up to P."""
    match_target: float = 1.0
    """The matched budget's median steps/s ratio to train-batch's must reach this."""
    system: SystemModel = field(default_factory=SystemModel)
    task: BanditTask = field(default_factory=BanditTask)
    learner: ReplayConfig = field(default_factory=ReplayConfig)
    parallel: str = "ray"
    """ray (local cluster) or none (serial, in this process)."""
    workers: int = 0
    """Ray CPUs; 0 = all cores."""


ConfigStore.instance().store(name="quality_replay_schema", node=ReplayQualityConf)


@dataclass(frozen=True)
class Job:
    """One simulated run (and, if ``learn``, its replay): a Ray task's argument."""

    cfg: ReplayQualityConf
    seed: int
    arm: str
    """An ARMS name, or "knittrans" for a probe of the budget match."""
    budget: int
    """In-flight budget in groups (colocated: P, unused)."""
    learn: bool


def candidates(cfg: ReplayQualityConf) -> list[int]:
    if cfg.budgets:
        return sorted(set(cfg.budgets))
    per_mb = max(1, cfg.prompts_per_batch // cfg.num_minibatches)
    return list(range(per_mb, cfg.prompts_per_batch + 1, per_mb))


def _policy_of(arm: str) -> str:
    return {"colocated": COLOCATED, "train_batch": "train_batch"}.get(arm, "knittrans")


def run_job(job: Job) -> "ReplayProbe | tuple[ReplayRun, ReplayCurve]":
    """Simulate one schedule with the product admission policy: a probe row, or (if ``job.learn``) the replayed
    run's row and curve."""
    from baselines.admission import make_policy
    from knittrans.sim.simulator import simulate
    from knittrans.staleness import run_metrics
    from knittrans.types import AdmissionKind

    c, pol = job.cfg, _policy_of(job.arm)
    spec = PointSpec(policy=pol, prompts_per_batch=c.prompts_per_batch, group_size=c.group_size,
                     num_minibatches=c.num_minibatches, batch_size=c.prompts_per_batch * c.group_size,
                     budget=job.budget / c.prompts_per_batch,
                     sync=SyncPolicy.EVERY_BATCH if pol == COLOCATED else SyncPolicy.EVERY_STEP,
                     release=BudgetRelease(c.release), system=c.system, warmup_batches=c.warmup_batches)
    wl = TextWorkloadConfig(name="quality-replay", prompts_per_batch=c.prompts_per_batch, group_size=c.group_size,
                            num_minibatches=c.num_minibatches, lengths=LengthDist(sigma=TAILS[c.tail]))
    batches = generate_batches(wl, c.num_batches, seed=job.seed)
    kind = AdmissionKind.TRAIN_BATCH if pol == COLOCATED else AdmissionKind(pol)
    try:
        res = simulate(spec.sim_config(), make_policy(kind, spec.constraints(wl.lengths.max_len)), batches)
    except SimDeadlock:
        if job.learn:
            raise
        return ReplayProbe(seed=job.seed, arm=job.arm, budget_groups=job.budget, steps_per_s=0.0,
                           staleness_mean=float("nan"), stalled=True)
    m = run_metrics(res, warmup_batches=c.warmup_batches)
    steps_per_s = m.throughput_traj_s * c.num_minibatches / spec.batch_size
    if not job.learn:
        return ReplayProbe(seed=job.seed, arm=job.arm, budget_groups=job.budget, steps_per_s=steps_per_s,
                           staleness_mean=float(res.records.staleness.mean()), stalled=False)
    curve = replay(res.records, c.task, c.learner, seed=job.seed)
    return ReplayRun(seed=job.seed, arm=job.arm, budget_groups=0 if pol == COLOCATED else job.budget, order=0,
                     steps=len(curve.expected_reward) - 1, auc=curve.auc, final_acc=curve.final,
                     init_acc=curve.expected_reward[0], staleness_mean=curve.staleness_mean,
                     staleness_max=float(res.records.staleness.max()), clip_frac=curve.clip_frac,
                     mean_reward=curve.mean_reward, steps_per_s=steps_per_s, lr=c.learner.lr), curve


def _run(jobs: Sequence[Job], cfg: ReplayQualityConf, desc: str) -> list:
    from repro.sweep import run_points
    return run_points(run_job, list(jobs), parallel=cfg.parallel, workers=cfg.workers, desc=desc)


def trials(cfg: ReplayQualityConf) -> tuple[list, dict]:
    """Every row of the table (probes first), and each replayed run's curve by (seed, arm)."""
    P = cfg.prompts_per_batch
    probe_jobs = [Job(cfg, s, "train_batch", P, False) for s in cfg.seeds]
    probe_jobs += [Job(cfg, s, "knittrans", b, False) for s in cfg.seeds for b in candidates(cfg)]
    probes = _run(probe_jobs, cfg, "quality-replay: budget match")
    matched, _ = matched_budget(probes, cfg.match_target)
    budget = {"colocated": P, "train_batch": P, "knittrans_same_budget": P, "knittrans_matched": matched}
    out = _run([Job(cfg, s, arm, budget[arm], True) for s in cfg.seeds for arm in ARMS], cfg,
               "quality-replay: replays")
    curves = {(r.seed, r.arm): c for r, c in out}
    return probes + [r for r, _ in out], curves


GATE_CONF = ReplayQualityConf(logger="none", seeds=list(range(8)), prompts_per_batch=64, num_batches=6,
                              parallel="none")
"""The CI-size table: 8 seeds of P=64 x n=8, M=16, 6 batches (96 steps), serial in this process (so a test's
monkeypatch of the admission policies or the simulator reaches it)."""


def gate_trials() -> list:
    return trials(GATE_CONF)[0]


def plot(curves: dict, rows: list, res) -> None:  # noqa: ANN001 - a repro.results.Results
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5))
    for arm in ARMS:
        ys = np.array([c.expected_reward for (s, a), c in sorted(curves.items()) if a == arm])
        if len(ys):
            med = np.median(ys, axis=0)
            ax.plot(med, label=arm)
            ax.fill_between(range(ys.shape[1]), ys.min(axis=0), ys.max(axis=0), alpha=0.12)
    ax.set(xlabel="optimizer step", ylabel="held-out expected reward", title="replayed learning (median, range)")
    ax.legend(fontsize=8)
    runs = [r for r in rows if isinstance(r, ReplayRun)]
    for arm in ARMS:
        pts = [r for r in runs if r.arm == arm]
        bx.scatter([r.staleness_mean for r in pts], [r.auc for r in pts], label=arm, s=18)
    bx.set(xlabel="mean staleness (steps)", ylabel="AUC", title="AUC vs staleness (one point per seed)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(res.plot_path("replay_learning.png"), dpi=110)
    plt.close(fig)


def run(cfg: ReplayQualityConf) -> dict:
    from repro.logger import publish
    from repro.results import Results

    t0 = time.perf_counter()
    res = Results(table="quality-replay", out_dir=cfg.out_dir)
    rows, curves = trials(cfg)
    res.set_trials(rows)
    runs = [r for r in rows if isinstance(r, ReplayRun)]
    res.rows = [{"arm": arm, "budget_groups": sorted({r.budget_groups for r in runs if r.arm == arm}),
                 **{k: float(np.median([getattr(r, k) for r in runs if r.arm == arm]))
                    for k in ("staleness_mean", "auc", "final_acc", "clip_frac", "steps_per_s")}}
                for arm in ARMS]
    plot(curves, rows, res)
    res.extra["total_s"] = time.perf_counter() - t0
    res.text = (f"Schedules from the simulator (time model: the staleness table's SystemModel scaled to P="
                f"{cfg.prompts_per_batch} x n={cfg.group_size}, M={cfg.num_minibatches}; budget release "
                f"{BudgetRelease(cfg.release).value}), replayed by a GRPO learner on a {cfg.task.actions}-action "
                f"contextual bandit (lr {cfg.learner.lr}, clip {cfg.learner.clip_eps}), every trajectory generated "
                f"with the weights of its v_gen. {len(cfg.seeds)} seeds; per seed the four arms share the task, "
                "prompts and per-trajectory random draws. The learner's sensitivity to staleness is a choice "
                "(its learning rate), not a measurement of a real model: the table isolates the schedule's part.\n")
    return publish(res, cfg.logger, "quality-replay", config=cfg)


@hydra.main(config_path="conf", config_name="quality_replay", version_base=None)
def main(dcfg) -> None:  # noqa: ANN001
    run(OmegaConf.to_object(dcfg))


if __name__ == "__main__":
    main()
