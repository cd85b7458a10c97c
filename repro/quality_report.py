"""The runtime quality tables' learning curves and their plot (``repro.quality`` runs the arms and writes the rows)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from repro.spec.quality import ARMS


@dataclass
class Curve:
    """One run's learning curve (for the plots)."""

    arm: str
    seed: int
    steps: list[int]
    acc: list[float]
    wall: list[float]
    reward: list[float]
    staleness: np.ndarray


def plot(curves: list[Curve], results, arms: tuple[str, ...] = ARMS) -> None:  # noqa: ANN001 - a Results
    """Accuracy against steps and wall-clock (mean over seeds), each arm's paired gain over train-batch at every
    evaluation point (mean, min-max band over seeds: the warm start moves every arm of a seed together), and the
    measured staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a_step, a_gain, a_wall, a_st) = plt.subplots(1, 4, figsize=(21, 4.5))
    tb = {c.seed: np.array(c.acc) for c in curves if c.arm == "train_batch"}
    for color, arm in enumerate(arms):
        cs = [c for c in curves if c.arm == arm]
        if not cs:
            continue
        kw = {"color": f"C{color}", "label": arm}
        acc = np.array([c.acc for c in cs])
        a_step.plot(cs[0].steps, acc.mean(0), **kw)
        gain = np.array([np.array(c.acc) - tb[c.seed] for c in cs if c.seed in tb])
        if arm != "train_batch" and len(gain):
            a_gain.plot(cs[0].steps, gain.mean(0), **kw)
            a_gain.fill_between(cs[0].steps, gain.min(0), gain.max(0), color=f"C{color}", alpha=0.15)
        a_wall.plot(np.array([c.wall for c in cs]).mean(0), acc.mean(0), **kw)
        st = np.concatenate([c.staleness for c in cs])
        a_st.hist(st, bins=np.arange(st.max() + 2) - 0.5, alpha=0.4, color=f"C{color}",
                  label=f"{arm} (mean {st.mean():.2f})")
    a_step.set(xlabel="optimizer step", ylabel="held-out greedy accuracy", title="accuracy vs steps (mean over seeds)")
    a_gain.axhline(0, color="k", lw=0.8)
    a_gain.set(xlabel="optimizer step", ylabel="accuracy - train-batch's (same seed)",
               title="paired gain over train-batch (min-max band)")
    a_wall.set(xlabel="wall-clock (s, mean over seeds)", ylabel="held-out greedy accuracy",
               title="accuracy vs wall-clock")
    a_st.set(xlabel="staleness v_train - v_gen (steps)", ylabel="trajectories", title="measured staleness")
    for a in (a_step, a_gain, a_wall, a_st):
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results.plot_path("quality_curves.png"), dpi=110)
    plt.close(fig)
