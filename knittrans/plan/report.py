"""What a plan prints and writes: a readable summary, ``plan.md`` (the tables), ``frontier.png`` (each policy's
frontier on the staleness-throughput plane) and ``plan.json`` (the same document the command prints as its last
stdout line)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from knittrans.plan.planner import Plan
from knittrans.plan.policies import COLOCATED
from knittrans.plan.recommend import same_prediction
from knittrans.plan.sweep import PlanPoint

METRICS = ("staleness_mean", "staleness_p50", "staleness_p99", "staleness_max", "arch_staleness", "steps_per_s",
           "throughput_traj_s", "trainer_idle", "rollout_idle", "admission_delay_s", "violations", "dead_ends",
           "wasted_tokens", "rollout_trainer_ratio")


def _num(v: float | int) -> float | int | None:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def point_doc(plan: Plan, p: PlanPoint) -> dict:
    s = p.setting
    doc = {"policy": s.policy, "knob": s.knob.value if s.policy != COLOCATED else None, "value": s.value,
           "setting": s.label(plan.scenario.prompts_per_batch), "ok": p.ok, "valid": p.valid, "note": p.note,
           "on_frontier": any(p is q for q in plan.frontiers.get(s.policy, ())),
           "meets_target": p.valid and plan.target.meets(p)}
    if p.metrics is not None:
        doc.update({k: _num(getattr(p.metrics, k)) for k in METRICS})
    return doc


def document(plan: Plan, files: dict[str, str]) -> dict:
    v = plan.validation
    held = {str(k): (None if (s := v.heldout_summary(k)) is None else asdict(s)) for k in (None, True)}
    return {
        "tool": "knittrans-plan", "target": str(plan.target),
        "inputs": [{**asdict(i), "source": i.source.value} for i in plan.scenario.inputs],
        "points": [point_doc(plan, p) for p in plan.points],
        "frontiers": {k: [p.setting.short for p in front] for k, front in plan.frontiers.items()},
        "best": {k: (None if p is None else point_doc(plan, p)) for k, p in plan.best.items()},
        "recommendation": None if plan.recommendation is None else point_doc(plan, plan.recommendation),
        "unmet": None if plan.unmet is None else {"binding": plan.unmet.binding.value, "message": str(plan.unmet)},
        "validation": {"littles_law_error": _num(v.littles_law_error) if v.littles_law_error is not None else None,
                       "littles_law_note": v.littles_law_note, "heldout_method": v.heldout_method,
                       "heldout_all": held["None"], "heldout_timing_sensitive": held["True"],
                       "heldout": [{**asdict(h), "error": h.error, "steps_error": h.steps_error,
                                    "timing_sensitive": h.timing_sensitive} for h in v.heldout]},
        "files": files,
    }


def _row(plan: Plan, p: PlanPoint) -> str:
    s = p.setting
    head = f"| {s.policy} | {s.label(plan.scenario.prompts_per_batch)} |"
    if p.metrics is None:
        return head + " | | | | | | | | " + p.note + " |"
    m = p.metrics
    front = "yes" if any(p is q for q in plan.frontiers.get(s.policy, ())) else ""
    meets = ("yes" if plan.target.meets(p) else "no") if p.valid else "invalid"
    note = p.note or (f"{m.dead_ends} dead ends, {m.violations} broken constraints" if not p.valid else "")
    return (head + f" {m.steps_per_s:.4g} | {m.staleness_mean:.2f} | {m.staleness_p99:.1f} | {m.arch_staleness:.2f} |"
            f" {m.trainer_idle:.1%} | {m.rollout_idle:.1%} | {front} | {meets} | {note} |")


def _point_line(plan: Plan, p: PlanPoint) -> str:
    m = p.metrics
    return (f"{p.setting.policy} at {p.setting.label(plan.scenario.prompts_per_batch)}: mean staleness "
            f"{m.staleness_mean:.2f} steps (p99 {m.staleness_p99:.1f}), {m.steps_per_s:.4g} steps/s, trainer idle "
            f"{m.trainer_idle:.1%}, rollout idle {m.rollout_idle:.1%}")


def validation_lines(plan: Plan) -> list[str]:
    v = plan.validation
    out = [f"- Little's law on this batch shape: "
           + (f"error {v.littles_law_error:.1%} ({v.littles_law_note})" if v.littles_law_error is not None
              else v.littles_law_note)]
    s, t = v.heldout_summary(), v.heldout_summary(True)
    if s is None:
        out.append(f"- held-out error against real runs: {v.heldout_method}")
        return out
    out.append(f"- held-out error of mean staleness against real runs ({v.heldout_method}), "
               f"|predicted - measured| / max(measured, 1): median {s.median:.3f} over {s.settings} settings "
               f"({s.runs} runs; worst setting {s.worst_setting} {s.worst:.3f}, worst single run {s.worst_run:.3f})")
    out.append("  - timing-sensitive settings only (the sim-vs-real claim's statistic): " +
               (f"median {t.median:.3f} over {t.settings} settings, worst {t.worst_setting} {t.worst:.3f}" if t
                else "none: flow control alone sets every held-out run's staleness, so timing is not validated"))
    out.append(f"  - steps/s (context, not validated by the sim-vs-real table): error median {s.steps_median:.2f}, "
               f"worst {s.steps_worst:.2f}")
    for h in v.heldout:
        out.append(f"  - {h.setting} seed {h.seed}: mean staleness measured {h.measured_mean:.3f}, predicted "
                   f"{h.predicted_mean:.3f} (error {h.error:.3f}{'' if h.timing_sensitive else ', flow-determined'});"
                   f" steps/s measured {h.measured_steps_per_s:.3g}, predicted {h.predicted_steps_per_s:.3g}")
    return out


def markdown(plan: Plan) -> str:
    lines = ["# knittrans-plan", "", "## Inputs", "", "| input | value | source | note |", "|---|---|---|---|"]
    lines += [f"| {i.name} | {i.value} | {i.source.value} | {i.note} |" for i in plan.scenario.inputs]
    lines += ["", f"## Settings (target: {plan.target})", "",
              "| policy | setting | steps/s | mean s | p99 s | arch s | trainer idle | rollout idle | frontier | "
              "meets target | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(plan, p) for p in plan.points]
    lines += ["", "## Recommendation", ""]
    rec = plan.recommendation
    lines.append(f"**{_point_line(plan, rec)}**" if rec is not None else f"**{plan.unmet}**")
    if rec is not None:
        same = [p for p in plan.points if p is not rec and p.valid and p.setting.policy != COLOCATED
                and same_prediction(p, rec)]
        if same:
            lines.append("(the same prediction: " + ", ".join(
                f"{p.setting.policy} at {p.setting.label(plan.scenario.prompts_per_batch)}" for p in same) + ")")
    lines += [""] + [f"- best {k}: " + (_point_line(plan, p) if p else "cannot meet the target")
                     for k, p in plan.best.items()]
    lines += ["", "## Validation", ""] + validation_lines(plan)
    return "\n".join(lines) + "\n"


def plot(plan: Plan, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for policy in plan.frontiers:
        pts = [p for p in plan.of(policy) if p.valid]
        line = ax.plot([p.metrics.steps_per_s for p in plan.frontiers[policy]],
                       [p.metrics.staleness_mean for p in plan.frontiers[policy]], "-o", label=policy)[0]
        ax.scatter([p.metrics.steps_per_s for p in pts], [p.metrics.staleness_mean for p in pts], s=14,
                   color=line.get_color(), alpha=0.4)
    ref = [p for p in plan.of(COLOCATED) if p.metrics is not None]
    if ref:
        ax.scatter([ref[0].metrics.steps_per_s], [ref[0].metrics.staleness_mean], marker="*", s=140, color="k",
                   label="colocated (synchronous)", zorder=3)
    if plan.recommendation is not None:
        r = plan.recommendation.metrics
        ax.scatter([r.steps_per_s], [r.staleness_mean], s=260, facecolors="none", edgecolors="red", linewidths=2,
                   label="recommended", zorder=4)
    if plan.target.kind.value in ("staleness", "p99"):
        ax.axhline(plan.target.value, color="grey", ls="--", lw=0.8, label=f"target {plan.target}")
    elif plan.target.kind.value == "steps/s":
        ax.axvline(plan.target.value, color="grey", ls="--", lw=0.8, label=f"target {plan.target}")
    ax.set(xlabel="optimizer steps per second (steady state)", ylabel="mean staleness (steps)",
           title="staleness-throughput frontier per admission policy (simulated)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(plan: Plan, out_dir: str | Path) -> dict:
    """Write plan.md, frontier.png and plan.json under ``out_dir``; return the JSON document."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"markdown": str(out / "plan.md"), "plot": str(out / "frontier.png"), "json": str(out / "plan.json")}
    (out / "plan.md").write_text(markdown(plan))
    plot(plan, out / "frontier.png")
    doc = document(plan, files)
    (out / "plan.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc
