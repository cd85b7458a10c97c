"""The staleness table: architectural staleness of each admission policy on the staleness-throughput frontier.

    python -m repro.staleness                      # DAPO-like config + the outer sweep (embedded defaults)
    python -m repro.staleness sweep.enabled=false dapo.policies=[knittrans,train_batch] dapo.budgets=[1.0,2.0]
    python -m repro.staleness sweep.M=[8,16] sweep.n=[16] sweep.tails=[heavy] logger=none parallel=none

For each workload config the in-flight budget (groups dispatched and not yet consumed, as a fraction of the
prompts per batch) and the weight-sync policy are swept for every admission policy; policies are compared at
matched operating points (DESIGN.md: comparisons live on the staleness-throughput frontier): for every
train-batch point on its own Pareto front, the best KnitTrans point with equal or higher throughput. Writes
``results/staleness/`` per the results contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from baselines.admission import make_policy
from knittrans.constraints import BatchConstraints
from knittrans.sim import (EngineConfig, FlowConfig, FlowKind, InflightPolicy, ExecutionMode, SimConfig, SimDeadlock, SyncConfig,
                           SyncPolicy, TrainerConfig, simulate)
from knittrans.staleness import run_metrics
from workloads.text import TAILS, LengthDist, TextWorkloadConfig, generate_batches

DAPO_PROMPTS = 512


# -- configuration ---------------------------------------------------------------------------------------------


@dataclass
class SystemConf:
    """Time model at DAPO scale (512 prompts per batch). Our assumptions, not published figures: 8 vLLM
    engines of 256 sequences at 25 ms per decode step, a trainer at 80k response tokens/s (fwd+bwd+recompute)
    plus 2 s per step, a 5 s weight broadcast. Rollout and trainer throughputs are then within a factor of 2 of
    each other, the regime where the handoff matters."""

    num_engines: int = 8
    """Rollout engines at DAPO scale (scaled with prompts per batch in the reduced sweep)."""
    slots: int = 256
    """Concurrent sequences per engine."""
    tpot: float = 0.025
    """Seconds per decode step."""
    load_alpha: float = 0.0
    """Decode step time grows by this fraction at full load."""
    step_overhead: float = 2.0
    """Trainer seconds per step independent of tokens (scaled with prompts per batch in the reduced sweep)."""
    per_token: float = 12.5e-6
    """Trainer seconds per response token."""
    sync_cost: float = 5.0
    """Seconds per weight sync (both sides pause; scaled with prompts per batch in the reduced sweep)."""
    inflight: str = "continue"
    """In-flight requests at a sync: continue (keep oldest version) or abort (regenerate)."""
    sync_k: int = 4
    """With sync policy every_k: push weights every this many optimizer steps."""


@dataclass
class DapoConf:
    enabled: bool = True
    prompts_per_batch: int = 512
    """P (DAPO: 512). Smaller values time-scale the system like the sweep does (for tests)."""
    n: int = 16
    """Samples per prompt (DAPO: 16)."""
    M: int = 16
    """Mini-batches per batch (DAPO: 512 / 32 = 16)."""
    tail: str = "light"
    """Length tail: light (log-normal sigma 0.9) or heavy (1.3)."""
    num_batches: int = 6
    warmup_batches: int = 2
    """Batches excluded from the metrics (pipeline fill)."""
    budgets: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0])
    """In-flight budgets, in batches of groups (x 512 groups)."""
    syncs: list[str] = field(default_factory=lambda: ["every_step", "every_batch"])
    """Weight-sync policies: every_step, every_k (system.sync_k), every_batch."""
    policies: list[str] = field(default_factory=lambda: ["knittrans", "clairvoyant", "train_batch",
                                                         "bounded_async", "greedy"])
    cdf_budget: float = 1.0
    """The CDF plot compares policies at the throughput train-batch reaches with this budget."""


@dataclass
class SweepConf:
    enabled: bool = True
    M: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    n: list[int] = field(default_factory=lambda: [4, 8, 16])
    tails: list[str] = field(default_factory=lambda: ["light", "heavy"])
    prompts_per_batch: int = 64
    """Reduced scale: capacity, per-step overhead and sync cost are scaled by prompts_per_batch / 512 so the
    ratio of rollout to trainer throughput matches the DAPO-scale time model."""
    num_batches: int = 5
    warmup_batches: int = 2
    budgets: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 1.5, 2.0])
    syncs: list[str] = field(default_factory=lambda: ["every_step"])
    policies: list[str] = field(default_factory=lambda: ["knittrans", "train_batch", "bounded_async"])


@dataclass
class VariableGroupsConf:
    """Variable group sizes (filtered groups, agentic rollouts) with whole-group mini-batches of exactly B/M
    trajectories: composing a mini-batch is a subset-sum problem and a careless choice leaves a remainder that no
    split can fix. Greedy streaming (no feasibility check) dead-ends here; KnitTrans must not."""

    enabled: bool = True
    prompts_per_batch: int = 32
    n: int = 8
    """Largest group; sizes are drawn from n/2..n and nudged so each batch holds exactly batch_total."""
    M: int = 4
    batch_total: int = 192
    num_batches: int = 6
    warmup_batches: int = 2
    budgets: list[float] = field(default_factory=lambda: [0.5, 1.0, 1.5, 2.0])
    policies: list[str] = field(default_factory=lambda: ["knittrans", "train_batch", "greedy"])


@dataclass
class StalenessConf:
    out_dir: str = "results/staleness"
    logger: str = "wandb"
    """wandb (offline unless WANDB_MODE=online) or none."""
    seed: int = 0
    parallel: str = "ray"
    """ray (local cluster) or none (serial, in this process)."""
    workers: int = 0
    """Ray CPUs; 0 = all cores."""
    system: SystemConf = field(default_factory=SystemConf)
    dapo: DapoConf = field(default_factory=DapoConf)
    sweep: SweepConf = field(default_factory=SweepConf)
    variable_groups: VariableGroupsConf = field(default_factory=VariableGroupsConf)


# -- one simulation point --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    scenario: str
    policy: str
    P: int
    n: int
    M: int
    tail: str
    budget: float  # in batches of groups
    sync: str
    num_batches: int
    warmup_batches: int
    seed: int
    system: SystemConf
    batch_total: int | None = None  # variable group sizes when set
    keep_hist: bool = False
    timeline: bool = False

    @property
    def config_key(self) -> tuple:
        return (self.scenario, self.M, self.n, self.tail, self.sync)


@dataclass
class PointResult:
    point: Point
    ok: bool
    note: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    hist: list[int] | None = None
    timeline: dict[str, Any] | None = None


def _workload(p: Point) -> TextWorkloadConfig:
    L = LengthDist(sigma=TAILS[p.tail])
    return TextWorkloadConfig(name=p.scenario, prompts_per_batch=p.P, group_size=p.n, num_minibatches=p.M,
                              lengths=L, variable_groups=p.batch_total is not None, batch_total=p.batch_total)


def _sim_config(p: Point) -> SimConfig:
    s = p.system
    scale = p.P / DAPO_PROMPTS
    mode = ExecutionMode.COLOCATED if p.policy == "colocated" else ExecutionMode.DISAGGREGATED
    if p.policy == "bounded_async":
        flow = FlowConfig(kind=FlowKind.AREAL, eta=max(0, int(round(p.budget)) - 1))
    else:
        flow = FlowConfig(kind=FlowKind.GROUPS, budget_groups=max(1, int(round(p.budget * p.P))))
    return SimConfig(
        mode=mode,
        engine=EngineConfig(num_engines=max(1, round(s.num_engines * scale)), slots=s.slots, tpot=s.tpot,
                            load_alpha=s.load_alpha),
        trainer=TrainerConfig(step_overhead=s.step_overhead * scale, per_token=s.per_token),
        sync=SyncConfig(policy=SyncPolicy(p.sync), k=s.sync_k, cost=s.sync_cost * scale,
                        inflight=InflightPolicy(s.inflight)),
        flow=flow, colocated_switch_cost=s.sync_cost * scale, record_timeline=p.timeline)


def run_point(p: Point) -> PointResult:
    """Simulate one (policy, config, budget, sync) point and return its steady-state metrics."""
    wl = _workload(p)
    batches = generate_batches(wl, p.num_batches, seed=p.seed)
    c = BatchConstraints(batch_size=wl.batch_size, num_minibatches=p.M,
                         group_size=None if p.batch_total is not None else p.n, max_response_len=wl.lengths.max_len)
    kwargs = {}
    if p.policy == "clairvoyant":
        truth = {g.group_id: wb.group_tokens(g.group_id) for wb in batches for g in wb.plan.groups}
        kwargs["oracle_tokens"] = truth.__getitem__
    try:
        policy = make_policy("train_batch" if p.policy == "colocated" else p.policy, c, **kwargs)
    except ValueError as e:
        return PointResult(p, False, f"not applicable: {e}")
    cfg = _sim_config(p)
    if cfg.flow.kind is FlowKind.GROUPS and cfg.flow.budget_groups * p.n < c.min_minibatch_size:
        return PointResult(p, False, "budget below one mini-batch")
    try:
        res = simulate(cfg, policy, batches)
    except SimDeadlock:
        return PointResult(p, False, "deadlock: budget below what the policy needs to finish a batch")
    m = run_metrics(res, warmup_batches=p.warmup_batches, engine_slots=cfg.engine.slots)
    metrics = {
        "staleness_mean": m.staleness.mean, "staleness_p50": m.staleness.p50, "staleness_p99": m.staleness.p99,
        "staleness_max": m.staleness.max, "arch_staleness": m.arch_staleness,
        "throughput_traj_s": m.throughput_traj_s, "throughput_tok_s": m.throughput_tok_s,
        "admission_delay_s": m.admission_delay_mean, "admission_delay_p99_s": m.admission_delay_p99,
        "trainer_idle": m.trainer_idle_frac, "rollout_idle": m.rollout_idle_frac,
        "dead_ends": m.dead_ends, "violations": m.violations, "wasted_tokens": m.wasted_tokens,
        "unknown_checks": res.policy_stats.unknown,
    }
    hist = None
    if p.keep_hist:
        from knittrans.staleness import window

        mask, *_ = window(res, p.warmup_batches)
        hist = np.bincount(res.records.staleness[mask].astype(np.int64)).tolist()
    timeline = None
    if p.timeline:
        timeline = _timeline_of(res, batch=p.warmup_batches + 1)
    return PointResult(p, True, "", metrics, hist, timeline)


def _timeline_of(res, batch: int) -> dict[str, Any]:
    """Rollout active slots (all engines) and trainer steps around one batch."""
    steps = [s for s in res.steps]
    r = res.records
    in_batch = r.batch == batch
    t0 = float(np.nanmin(r.t_start[in_batch])) if in_batch.any() else 0.0
    own = [s for s in steps if s.batch_id == batch]
    t1 = max(s.end for s in own) if own else res.total_time
    active: dict[int, int] = {}
    ts, tot = [], []
    for t, e, a in res.timeline:
        active[e] = a
        if t0 - 0.1 * (t1 - t0) <= t <= t1:
            ts.append(t)
            tot.append(sum(active.values()))
    return {"t": ts, "active": tot, "t0": t0, "t1": t1,
            "steps": [(s.start, s.end, s.batch_id, s.index) for s in steps if s.end >= t0 and s.start <= t1],
            "syncs": [(a, b) for a, b in res.syncs if b >= t0 and a <= t1]}


# -- frontier analysis -----------------------------------------------------------------------------------------


def pareto(points: list[PointResult]) -> list[PointResult]:
    """Points not dominated in (higher throughput, lower architectural staleness)."""
    ok = [p for p in points if p.ok]
    front = []
    for p in ok:
        thr, a = p.metrics["throughput_traj_s"], p.metrics["arch_staleness"]
        dominated = any(q.metrics["throughput_traj_s"] >= thr and q.metrics["arch_staleness"] <= a
                        and (q.metrics["throughput_traj_s"] > thr or q.metrics["arch_staleness"] < a)
                        for q in ok)
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: p.metrics["throughput_traj_s"])


@dataclass
class Matched:
    reduction: float
    tb: PointResult
    kt: PointResult


def matched_reduction(kt: list[PointResult], tb: list[PointResult]) -> Matched | None:
    """The largest 1 - A(KnitTrans)/A(train-batch) over train-batch's Pareto points (A > 0), each against the best
    KnitTrans point with equal or higher throughput."""
    best = None
    for q in pareto(tb):
        a_q = q.metrics["arch_staleness"]
        if a_q <= 0:
            continue
        cands = [p for p in kt if p.ok and p.metrics["throughput_traj_s"] >= q.metrics["throughput_traj_s"]]
        if not cands:
            continue
        k = min(cands, key=lambda p: p.metrics["arch_staleness"])
        r = 1.0 - k.metrics["arch_staleness"] / a_q
        if best is None or r > best.reduction:
            best = Matched(r, q, k)
    return best


# -- the table -------------------------------------------------------------------------------------------------


def build_points(cfg: StalenessConf) -> list[Point]:
    pts: list[Point] = []
    sysc = cfg.system
    if cfg.dapo.enabled:
        d = cfg.dapo
        for sync in d.syncs:
            for pol in d.policies:
                budgets = [b for b in d.budgets if pol != "bounded_async" or (b >= 1 and float(b).is_integer())]
                for b in budgets:
                    pts.append(Point("dapo", pol, d.prompts_per_batch, d.n, d.M, d.tail, b, sync, d.num_batches,
                                     d.warmup_batches, cfg.seed, sysc, keep_hist=(sync == "every_step")))
        pts.append(Point("dapo", "colocated", d.prompts_per_batch, d.n, d.M, d.tail, 1.0, "every_batch",
                         d.num_batches, d.warmup_batches, cfg.seed, sysc, keep_hist=True))
    if cfg.sweep.enabled:
        s = cfg.sweep
        for M in s.M:
            for n in s.n:
                for tail in s.tails:
                    if (s.prompts_per_batch * n) % M:
                        continue
                    for sync in s.syncs:
                        for pol in s.policies:
                            for b in s.budgets:
                                if pol == "bounded_async" and not (b >= 1 and float(b).is_integer()):
                                    continue
                                pts.append(Point("sweep", pol, s.prompts_per_batch, n, M, tail, b, sync,
                                                 s.num_batches, s.warmup_batches, cfg.seed, sysc))
                    pts.append(Point("sweep", "colocated", s.prompts_per_batch, n, M, tail, 1.0, "every_batch",
                                     s.num_batches, s.warmup_batches, cfg.seed, sysc))
    if cfg.variable_groups.enabled:
        v = cfg.variable_groups
        for pol in v.policies:
            for b in v.budgets:
                pts.append(Point("variable_groups", pol, v.prompts_per_batch, v.n, v.M, "light", b, "every_step",
                                 v.num_batches, v.warmup_batches, cfg.seed, sysc, batch_total=v.batch_total))
        pts.append(Point("variable_groups", "colocated", v.prompts_per_batch, v.n, v.M, "light", 1.0,
                         "every_batch", v.num_batches, v.warmup_batches, cfg.seed, sysc, batch_total=v.batch_total))
    return pts


def _row(r: PointResult) -> dict[str, Any]:
    p = r.point
    row: dict[str, Any] = {"scenario": p.scenario, "M": p.M, "n": p.n, "tail": p.tail, "sync": p.sync,
                           "policy": p.policy, "budget": p.budget, "ok": r.ok, "note": r.note}
    for k in ("staleness_mean", "staleness_p99", "arch_staleness", "throughput_traj_s", "admission_delay_s",
              "trainer_idle", "rollout_idle", "dead_ends", "violations"):
        row[k] = r.metrics.get(k, float("nan"))
    return row


def analyze(results: list[PointResult]) -> tuple[list[dict], dict[tuple, Matched | None]]:
    by_cfg: dict[tuple, list[PointResult]] = {}
    for r in results:
        if r.point.policy != "colocated":
            by_cfg.setdefault(r.point.config_key, []).append(r)
    matched = {}
    for key, rs in by_cfg.items():
        kt = [r for r in rs if r.point.policy == "knittrans"]
        tb = [r for r in rs if r.point.policy == "train_batch"]
        matched[key] = matched_reduction(kt, tb) if kt and tb else None
    return [_row(r) for r in results], matched


def _describe(key: tuple, m: Matched) -> str:
    scen, M, n, tail, sync = key
    return (f"{scen} M={M} n={n} tail={tail} sync={sync}: train-batch budget {m.tb.point.budget} "
            f"(A={m.tb.metrics['arch_staleness']:.2f}, {m.tb.metrics['throughput_traj_s']:.3g} traj/s) vs KnitTrans "
            f"budget {m.kt.point.budget} (A={m.kt.metrics['arch_staleness']:.2f}, "
            f"{m.kt.metrics['throughput_traj_s']:.3g} traj/s)")


def claims_from(results: list[PointResult], matched: dict[tuple, Matched | None]):
    from repro.results import Claim

    claims = []
    valid = {k: m for k, m in matched.items() if m is not None}
    if valid:
        key, m = max(valid.items(), key=lambda kv: kv[1].reduction)
        claims.append(Claim("arch_staleness_reduction", paper=0.93, measured=m.reduction, unit="fraction",
                            holds=m.reduction >= 0.90,
                            note=f"target >= 0.90; largest over {len(valid)} configs at matched throughput: "
                                 + _describe(key, m)
                                 + ("; > 1 means KnitTrans is below the colocated reference's staleness"
                                    if m.reduction > 1 else "")))
    dapo = {k: m for k, m in valid.items() if k[0] == "dapo"}
    if dapo:
        key, m = max(dapo.items(), key=lambda kv: kv[1].reduction)
        claims.append(Claim("arch_staleness_reduction_dapo", paper=0.93, measured=m.reduction, unit="fraction",
                            holds=m.reduction >= 0.90, note="target >= 0.90; " + _describe(key, m)))
    ratios = {}
    for r in results:
        p = r.point
        if p.scenario == "dapo" and p.sync == "every_step" and r.ok and p.policy in ("knittrans", "train_batch"):
            ratios.setdefault(p.budget, {})[p.policy] = r.metrics["throughput_traj_s"]
    pairs = {b: v["knittrans"] / v["train_batch"] for b, v in sorted(ratios.items()) if len(v) == 2}
    if pairs:
        worst = min(pairs.values())
        claims.append(Claim("throughput_ratio", paper=">= 1", measured=worst, unit="x",
                            holds=worst >= 1.0 - 1e-9,  # equal throughput (both rollout-bound) holds
                            note="target >= 1.0; KnitTrans / train-batch throughput at the same in-flight budget, "
                                 "DAPO-like config, sync every step; the minimum over budgets where train-batch "
                                 "runs: " + ", ".join(f"budget {b}: {x:.3f}" for b, x in pairs.items())))
    greedy = [r for r in results if r.point.policy == "greedy" and r.ok]
    kt_bad = [r for r in results if r.point.policy == "knittrans" and r.ok and r.metrics["violations"] > 0]
    if greedy:
        dead = sum(int(r.metrics["dead_ends"]) for r in greedy)
        claims.append(Claim("greedy_dead_ends", paper="n/a (ours)", measured=float(dead), unit="batches",
                            holds=dead > 0 and not kt_bad,
                            note=f"dead-ended batches of greedy streaming without a feasibility check over "
                                 f"{len(greedy)} runs; KnitTrans constraint violations: "
                                 f"{sum(int(r.metrics['violations']) for r in kt_bad)}"))
    return claims


# -- plots -----------------------------------------------------------------------------------------------------

COLORS = {"knittrans": "C0", "train_batch": "C1", "bounded_async": "C2", "greedy": "C3", "clairvoyant": "C4",
          "colocated": "k"}
# policies that often coincide (clairvoyant and greedy equal KnitTrans without token budgets / variable groups)
# get distinct line styles so an overlap stays visible
STYLES = {"knittrans": dict(ls="-", lw=2.5, marker="o"), "clairvoyant": dict(ls="--", lw=1.2, marker="x"),
          "greedy": dict(ls=":", lw=1.2, marker="+"), "train_batch": dict(ls="-", lw=1, marker="o"),
          "bounded_async": dict(ls="-", lw=1, marker="s"), "colocated": dict(ls="", marker="*", ms=9)}


def plot_frontiers(results: list[PointResult], scenario: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({r.point.config_key for r in results if r.point.scenario == scenario and r.point.policy !=
                   "colocated"}, key=str)
    if not keys:
        return
    cols = min(6, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for pol in COLORS:
            pts = [r for r in results if r.ok and r.point.policy == pol and r.point.scenario == scenario and (
                r.point.config_key == key or (pol == "colocated" and r.point.config_key[1:4] == key[1:4]))]
            if not pts:
                continue
            pts.sort(key=lambda r: r.point.budget)
            style = {"ms": 4, **STYLES[pol]}
            ax.plot([r.metrics["throughput_traj_s"] for r in pts], [r.metrics["arch_staleness"] for r in pts],
                    color=COLORS[pol], label=pol, **style)
        ax.set_title(f"M={key[1]} n={key[2]} {key[3]} {key[4]}", fontsize=8)
        ax.axhline(0, color="grey", lw=0.5)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=6)
    fig.supxlabel("throughput (trajectories/s)")
    fig.supylabel("architectural staleness (steps)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdf(results: list[PointResult], path: Path, cdf_budget: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in results if r.ok and r.point.scenario == "dapo" and r.hist is not None]
    ref = [r for r in pts if r.point.policy == "train_batch" and r.point.budget == cdf_budget]
    if not ref:
        return "no train-batch point at the CDF budget"
    target = ref[0].metrics["throughput_traj_s"]
    fig, ax = plt.subplots(figsize=(6, 4))
    chosen = []
    for pol in COLORS:
        cands = [r for r in pts if r.point.policy == pol and (pol == "colocated" or
                                                               r.metrics["throughput_traj_s"] >= target)]
        if not cands:
            continue
        r = min(cands, key=lambda r: r.metrics["staleness_mean"])
        h = np.asarray(r.hist, dtype=float)
        ax.step(np.arange(len(h)), np.cumsum(h) / h.sum(), where="post", color=COLORS[pol],
                ls=STYLES[pol].get("ls") or "-", lw=STYLES[pol].get("lw", 1.2),
                label=f"{pol} (budget {r.point.budget}, {r.metrics['throughput_traj_s']:.3g}/s)")
        chosen.append(f"{pol}: budget {r.point.budget}")
    ax.set_xlabel("staleness (optimizer steps)")
    ax.set_ylabel("CDF of trajectories")
    ax.set_title(f"DAPO-like, throughput >= train-batch at budget {cdf_budget} ({target:.3g} traj/s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "; ".join(chosen)


def plot_timelines(results: list[PointResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tls = [r for r in results if r.timeline is not None]
    if not tls:
        return
    fig, axes = plt.subplots(len(tls), 1, figsize=(10, 1.9 * len(tls)), squeeze=False)
    for ax, r in zip(axes[:, 0], tls):
        tl = r.timeline
        ax.step(tl["t"], tl["active"], where="post", color="C0", lw=0.8, label="rollout: active sequences")
        ax.set_ylim(bottom=0)
        ax2 = ax.twinx()
        for (a, b, bid, idx) in tl["steps"]:
            ax2.barh(0.5, b - a, left=a, height=0.8, color=f"C{bid % 10}", alpha=0.6, edgecolor="k", lw=0.3)
        for (a, b) in tl["syncs"]:
            ax2.barh(0.5, b - a, left=a, height=0.8, color="grey", alpha=0.9)
        ax2.set_ylim(0, 4)
        ax2.set_yticks([])
        ax.axvspan(tl["t0"], tl["t1"], color="yellow", alpha=0.08)
        ax.set_title(f"{r.point.policy} (budget {r.point.budget}): trainer steps (bars, colour = batch), "
                     f"syncs (grey)", fontsize=8)
        ax.set_ylabel("active", fontsize=7)
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- entry point -----------------------------------------------------------------------------------------------


def timeline_points(cfg: StalenessConf) -> list[Point]:
    d = cfg.dapo
    return [Point("dapo-timeline", pol, d.prompts_per_batch, d.n, d.M, d.tail, 1.0,
                  "every_step" if pol != "colocated" else "every_batch", min(d.num_batches, d.warmup_batches + 3),
                  d.warmup_batches, cfg.seed, cfg.system, timeline=True)
            for pol in ("colocated", "train_batch", "knittrans", "bounded_async")]


def run(cfg: StalenessConf) -> dict:
    from repro.logger import publish
    from repro.results import Results
    from repro.sweep import run_points

    out = Path(cfg.out_dir)
    res = Results(table="staleness", out_dir=out)
    points = build_points(cfg)
    if cfg.dapo.enabled:
        points += timeline_points(cfg)
    results = run_points(run_point, points, parallel=cfg.parallel, workers=cfg.workers, desc="staleness")
    main = [r for r in results if r.point.scenario != "dapo-timeline"]
    rows, matched = analyze(main)
    res.rows = rows
    res.claims = claims_from(main, matched)
    res.extra["matched"] = [
        {"scenario": k[0], "M": k[1], "n": k[2], "tail": k[3], "sync": k[4], "reduction": m.reduction,
         "train_batch_budget": m.tb.point.budget, "knittrans_budget": m.kt.point.budget,
         "A_train_batch": m.tb.metrics["arch_staleness"], "A_knittrans": m.kt.metrics["arch_staleness"]}
        for k, m in matched.items() if m is not None]
    if cfg.dapo.enabled:
        d = cfg.dapo
        plot_frontiers(main, "dapo", res.plot_path("frontier_dapo.png"),
                       f"DAPO-like ({d.prompts_per_batch}x{d.n}, M={d.M})")
        chosen = plot_cdf(main, res.plot_path("staleness_cdf_dapo.png"), cfg.dapo.cdf_budget)
        plot_timelines([r for r in results if r.point.scenario == "dapo-timeline"],
                       res.plot_path("timeline_dapo.png"))
        res.text += f"Staleness CDF points: {chosen}.\n"
    if cfg.sweep.enabled:
        plot_frontiers(main, "sweep", res.plot_path("frontier_sweep.png"),
                       f"outer sweep ({cfg.sweep.prompts_per_batch} prompts per batch, time-scaled)")
    if cfg.variable_groups.enabled:
        plot_frontiers(main, "variable_groups", res.plot_path("frontier_variable_groups.png"),
                       "variable group sizes, exact mini-batch sizes")
    res.text += _notes(cfg, matched)
    return publish(res, cfg.logger, "staleness", config=cfg, seed=cfg.seed)


def _notes(cfg: StalenessConf, matched: dict[tuple, Matched | None]) -> str:
    lines = [
        "Architectural staleness A = mean staleness - (M-1)/2 (the colocated reference). Reductions compare each "
        "train-batch point on its Pareto front with the best KnitTrans point of equal or higher throughput.",
        "Budgets are in batches of groups (groups dispatched and not yet consumed / prompts per batch); "
        "bounded_async uses AReaL's capacity rule with eta = budget - 1.",
        "Without a token budget, clairvoyant = KnitTrans (feasibility never needs lengths: KnitTrans admits as soon "
        "as any safe mini-batch has completed, which is what an admission knowing every completion time would do), "
        "and greedy = KnitTrans on uniform whole groups (they never dead-end); greedy differs in the "
        "variable-group scenario, where it dead-ends.",
        "A per-mini-batch token budget is supported (tests cover it) but not swept: a constraint set is accepted "
        "only if it is satisfiable when every response runs to max_response_len, which forces token_budget >= "
        "(B/M) * max_response_len, where it seldom binds.",
        "",
        "| config | reduction | train-batch budget | KnitTrans budget | A train-batch | A KnitTrans |",
        "|---|---|---|---|---|---|",
    ]
    for k, m in sorted(((k, m) for k, m in matched.items() if m is not None), key=lambda kv: str(kv[0])):
        lines.append(f"| {k[0]} M={k[1]} n={k[2]} {k[3]} {k[4]} | {m.reduction:.3f} | {m.tb.point.budget} | "
                     f"{m.kt.point.budget} | {m.tb.metrics['arch_staleness']:.2f} | "
                     f"{m.kt.metrics['arch_staleness']:.2f} |")
    return "\n".join(lines) + "\n"


ConfigStore.instance().store(name="staleness_schema", node=StalenessConf)


@hydra.main(config_path="conf", config_name="staleness", version_base=None)
def main(dcfg) -> None:
    cfg: StalenessConf = OmegaConf.to_object(dcfg)
    run(cfg)


if __name__ == "__main__":
    main()
