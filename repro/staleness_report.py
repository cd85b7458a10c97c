"""The staleness table's notes and plots, drawn from its trial rows alone (``repro.staleness`` runs the points).

- ``describe``: the matched operating points behind the headline (every train-batch Pareto point, per seed and
  release convention) and the outer sweep's per-config reductions, as markdown;
- ``plot_all``: frontiers (headline, sweep, variable groups), the staleness CDF at a matched throughput, and a
  timeline of rollout activity and trainer steps around one batch.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from knittrans.staleness import trainer_bound
from repro.spec.staleness import (HEADLINE_SCENARIO, HEADLINE_SYNC, RELEASES, StalenessTrial, config_key,
                                  matched_by_config)

COLORS = {"knittrans": "C0", "train_batch": "C1", "bounded_async": "C2", "greedy": "C3", "clairvoyant": "C4",
          "colocated": "k"}
# policies that can coincide get distinct line styles so an overlap stays visible
STYLES = {"knittrans": dict(lw=2.5, marker="o"), "clairvoyant": dict(lw=1.2, marker="x"),
          "greedy": dict(lw=1.2, marker="+"), "train_batch": dict(lw=1, marker="o"),
          "bounded_async": dict(lw=1, marker="s"), "colocated": dict(ls="", marker="*", ms=9)}
RELEASE_LS = {"step_end": "-", "step_start": "--"}


def describe(rows: Sequence[Any], cfg: Any) -> str:
    """Markdown: how to read the table, then every matched point of the headline and the sweep's configs."""
    lines = [
        "Architectural staleness A = mean staleness - (M-1)/2 (the colocated reference). Each train-batch Pareto "
        "point is matched with KnitTrans's Pareto front at equal or higher throughput, interpolated between "
        "neighbouring budgets; the reduction is 1 - A_kt/A_tb, uncapped, only where A_tb >= 1 step. The headline is "
        "decided at train-batch's trainer-bound (fastest) Pareto point; the other points are context.",
        "Budgets are in batches of groups (groups dispatched and not yet consumed / prompts per batch); "
        "bounded_async uses AReaL's capacity rule with eta = budget - 1. A consumed group frees its budget place "
        "when its step ends (step_end, the real runtime's convention) or starts (step_start).",
        f"Time model: {cfg.system}; every point keeps the reference's rollout/trainer throughput ratio "
        "(knittrans.sim.sweep.SystemModel.scaled).",
        "", "### Headline: every matched train-batch Pareto point", "",
        "| in-flight | release | seed | train-batch budget | A train-batch | thr train-batch | A KnitTrans (interp.) "
        "| reduction |",
        "|---|---|---|---|---|---|---|---|"]
    for key, ms in sorted(matched_by_config(rows, HEADLINE_SCENARIO).items(), key=lambda kv: str(kv[0])):
        if key[5] != HEADLINE_SYNC:
            continue
        for m in ms:
            a = "n/a" if m.arch_knittrans is None else f"{m.arch_knittrans:.2f}"
            r = "no match" if m.reduction is None else f"{m.reduction:.3f}"
            mark = " (trainer-bound)" if m is trainer_bound(ms) else ""
            lines.append(f"| {key[6]} | {key[7]} | {key[8]} | {m.train_batch.budget:g}{mark} | "
                         f"{m.train_batch.arch_staleness:.2f} | {m.train_batch.throughput:.3g} | {a} | {r} |")
    sweep: dict[tuple, list[float]] = defaultdict(list)
    for key, ms in matched_by_config(rows, "sweep").items():
        if (b := trainer_bound(ms)) is not None and b.reduction is not None:
            sweep[(key[3], key[2], key[4], key[7])].append(b.reduction)
    if sweep:
        idle: dict[tuple, list[float]] = defaultdict(list)
        for r in rows:
            if isinstance(r, StalenessTrial) and r.scenario == "sweep" and r.ok and r.policy == "knittrans":
                idle[(r.num_minibatches, r.group_size, r.tail, r.release)].append(r.trainer_idle)
        lines += ["", "### Outer sweep: reduction at the trainer-bound point per config (median [min, max] over "
                  "seeds)", "",
                  "| M | n | tail | release | reduction | KnitTrans trainer idle (median) |",
                  "|---|---|---|---|---|---|"]
        for k, v in sorted(sweep.items()):
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {statistics.median(v):.3f} [{min(v):.3f}, "
                         f"{max(v):.3f}] | {statistics.median(idle[k]):.2f} |")
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontiers(rows: Sequence[StalenessTrial], scenario: str, path, title: str) -> None:
    """One panel per config (first seed): A against throughput, one line per policy and release convention."""
    first = min((r.seed for r in rows), default=0)
    rs = [r for r in rows if r.scenario == scenario and r.ok and r.seed == first]
    keys = sorted({config_key(r)[:5] for r in rs}, key=str)
    if not keys:
        return
    plt = _plt()
    cols = min(6, len(keys))
    nrows = math.ceil(len(keys) / cols)
    size = (6.5, 4.5) if len(keys) == 1 else (3.2 * cols, 2.6 * nrows)
    fig, axes = plt.subplots(nrows, cols, figsize=size, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        lines = defaultdict(list)
        for r in rs:
            if config_key(r)[:5] == key and (r.sync == HEADLINE_SYNC or r.policy == "colocated"):
                lines[(r.policy, r.release)].append(r)
        for (pol, rel), pts in sorted(lines.items()):
            pts.sort(key=lambda r: r.budget)
            style = {"ms": 4, "ls": RELEASE_LS.get(rel, "-"), **STYLES.get(pol, {})}
            ax.plot([r.throughput_traj_s for r in pts], [r.arch_staleness for r in pts], color=COLORS.get(pol, "C5"),
                    label=pol if pol == "colocated" else f"{pol} ({rel})", **style)
        ax.set_title(f"M={key[3]} n={key[2]} {key[4]}", fontsize=8)
        ax.axhline(0, color="grey", lw=0.5)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=6 if len(keys) > 1 else 8)
    fig.supxlabel("throughput (trajectories/s)")
    fig.supylabel("architectural staleness (steps)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdf(rows: Sequence[StalenessTrial], path, cdf_budget: float | None) -> str:
    """Staleness CDFs at the throughput train-batch reaches with ``cdf_budget`` (None: at its fastest budget, the
    trainer-bound point), first release convention."""
    pts = [r for r in rows if r.scenario == HEADLINE_SCENARIO and r.ok and r.hist and r.release == RELEASES[0]]
    tb = [r for r in pts if r.policy == "train_batch"]
    ref = tb if cdf_budget is None else [r for r in tb if r.budget == cdf_budget]
    if not ref:
        return "no train-batch point at the CDF budget"
    fastest = max(ref, key=lambda r: r.throughput_traj_s)
    target, cdf_budget = fastest.throughput_traj_s, fastest.budget
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    chosen = []
    for pol in COLORS:
        cands = [r for r in pts if r.policy == pol and (pol == "colocated" or r.throughput_traj_s >= target)]
        if cands:
            r = min(cands, key=lambda r: r.staleness_mean)
            h = np.asarray(r.hist, dtype=float)
            ax.step(np.arange(len(h)), np.cumsum(h) / h.sum(), where="post", color=COLORS[pol],
                    lw=STYLES[pol].get("lw", 1.2), label=f"{pol} (budget {r.budget:g}, {r.throughput_traj_s:.3g}/s)")
            chosen.append(f"{pol}: budget {r.budget:g}")
    ax.set_xlabel("staleness (optimizer steps)")
    ax.set_ylabel("CDF of trajectories")
    ax.set_title(f"headline shape, throughput >= train-batch at budget {cdf_budget:g} ({target:.3g} traj/s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "; ".join(chosen)


def plot_timelines(timelines: Sequence[tuple[Any, Any]], path) -> None:
    """Rollout active sequences, trainer steps (colour = batch) and syncs (grey) around one batch per policy."""
    tls = [(s, tl) for s, tl in timelines if tl is not None]
    if not tls:
        return
    plt = _plt()
    fig, axes = plt.subplots(len(tls), 1, figsize=(10, 1.9 * len(tls)), squeeze=False)
    for ax, (spec, tl) in zip(axes[:, 0], tls):
        ax.step(tl.t, tl.active, where="post", color="C0", lw=0.8)
        ax.set_ylim(bottom=0)
        ax2 = ax.twinx()
        for (a, b, bid, _) in tl.steps:
            ax2.barh(0.5, b - a, left=a, height=0.8, color=f"C{bid % 10}", alpha=0.6, edgecolor="k", lw=0.3)
        for (a, b) in tl.syncs:
            ax2.barh(0.5, b - a, left=a, height=0.8, color="grey", alpha=0.9)
        ax2.set_ylim(0, 4)
        ax2.set_yticks([])
        ax.axvspan(tl.t0, tl.t1, color="yellow", alpha=0.08)
        ax.set_title(f"{spec.policy} (budget {spec.budget:g}): rollout active sequences, trainer steps, syncs",
                     fontsize=8)
        ax.set_ylabel("active", fontsize=7)
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(res: Any, rows: Sequence[Any], timelines: Sequence[tuple[Any, Any]], cfg: Any) -> None:
    # the configured in-flight convention only: the headline's abort rows (dapo.abort) are a measurement beside it
    st = [r for r in rows if isinstance(r, StalenessTrial) and r.inflight == cfg.system.inflight.value]
    if cfg.dapo.enabled:
        d = cfg.dapo
        plot_frontiers(st, "dapo", res.plot_path("frontier_dapo.png"),
                       f"headline ({d.prompts_per_batch}x{d.group_size}, M={d.num_minibatches}), first seed; "
                       "dashed: budget released at step start")
        res.text += f"\nStaleness CDF points: {plot_cdf(st, res.plot_path('staleness_cdf_dapo.png'), d.cdf_budget)}.\n"
        plot_timelines(timelines, res.plot_path("timeline_dapo.png"))
    if cfg.sweep.enabled:
        plot_frontiers(st, "sweep", res.plot_path("frontier_sweep.png"),
                       f"outer sweep ({cfg.sweep.prompts_per_batch} prompts per batch, time-scaled)")
    if cfg.variable_groups.enabled:
        plot_frontiers(st, "variable_groups", res.plot_path("frontier_variable_groups.png"),
                       "variable group sizes, exact mini-batch sizes")
