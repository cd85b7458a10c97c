"""Learning quality on a real system: colocated vs disaggregated with train-batch admission vs with KnitTrans.

Paper claim: KnitTrans narrows the learning-quality gap between disaggregated and colocated execution. Here a
~130K-parameter Llama-style policy learns "ab+c=" arithmetic with GRPO on CPU, for each seed from the same
warm-started weights in all three modes (a paired comparison), and we measure:

- held-out greedy accuracy and training reward against optimizer steps and wall-clock, per mode, mean and spread
  over seeds; the quality metric is the area under the held-out accuracy curve (the mean over evaluation points,
  step 0 included), which is less noisy than the final accuracy;
- ``quality_gap_closed = 1 - (R_coloc - R_knittrans) / (R_coloc - R_trainbatch)`` at the fixed step budget, with a
  bootstrap confidence interval over seeds;
- each mode's measured staleness (mean, p99), wall-clock and throughput; and each run's measured time model
  (decode time per token, trainer step time per token, sync cost) for calibrating the simulator.

Operating points (DESIGN.md, "Comparisons live on the staleness-throughput frontier"): each disaggregated mode runs
at the smallest in-flight budget that does not cost it throughput. Train-batch admission needs a whole batch in
flight (budget P; less deadlocks); KnitTrans admits a mini-batch at a time, so 2 mini-batches' worth of groups
(double buffering) keeps its trainer busy. The run checks that KnitTrans's throughput is at least train-batch's
(the ``throughput_matched`` claim, on the trainer's busy fraction, which the machine's load does not move the way
it moves raw steps/s); if it is not, the comparison is reported as unmatched.

Run: ``python -m repro.quality`` (defaults in repro/conf/quality.yaml; e.g. ``num_batches=20 seeds=[0]`` for a
smoke run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import hydra
import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from tqdm import tqdm

from knittrans.runtime.config import RuntimeConfig, SyncPolicy
from knittrans.runtime.records import RunResult, write_trace
from workloads.arith_session import arith_setup, greedy_accuracy, heldout_problems, run_mode
from knittrans.runtime.trainer import GRPOConfig
from workloads.arith import ArithTask
from workloads.tiny_models import TinyPolicyConfig, WarmStartConfig
from baselines.admission import make_policy

MODES = ("colocated", "train_batch", "knittrans")


@dataclass
class QualityConfig:
    """The quality table's run settings."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """One paired comparison (all three modes from the same warm start) per seed."""
    num_batches: int = 50
    """Training batches per run; optimizer steps = num_batches * num_minibatches (the fixed step budget)."""
    prompts_per_batch: int = 128
    """P: prompts per batch."""
    group_size: int = 8
    """n: samples per prompt."""
    num_minibatches: int = 16
    """M: optimizer steps per batch (colocated mean staleness (M - 1) / 2). M = 16 with P = 128 keeps a step at
    64 trajectories (the step cost of P = 64, M = 8) and doubles the staleness that admission decides."""
    lr: float = 3e-4
    """Adam learning rate."""
    clip_eps: float = 0.2
    """PPO clip range."""
    kl_coef: float = 0.0
    """KL penalty to the warm-started policy."""
    warm_steps: int = 200
    """Supervised warm-start steps (to roughly 20% greedy accuracy)."""
    trainbatch_budget: int = 0
    """In-flight groups for train-batch admission; 0 = P, its minimum (anything less deadlocks)."""
    knittrans_budget: int = 0
    """In-flight groups for KnitTrans; 0 = 2 mini-batches' worth (2 P / M)."""
    sync: str = "every_step"
    """Weight sync policy of the disaggregated modes: every_step, every_k, every_batch."""
    sync_every: int = 1
    """k for every_k."""
    wave_groups: int = 8
    """Groups per generation call (one mini-batch's worth at the defaults)."""
    eval_every: int = 50
    """Held-out evaluation every this many optimizer steps."""
    heldout: int = 256
    """Held-out problems (fixed set, greedy decoding)."""
    bootstrap: int = 2000
    """Bootstrap resamples (over seeds) for the confidence interval."""
    threads: int = 1
    """torch intra-op threads per side (the disaggregated modes run two sides at once on 2 cores)."""
    logger: str = "none"
    """Experiment logger: wandb (offline unless WANDB_MODE=online) or none."""
    out_dir: str = "results/quality"
    """Where the results contract is written."""


ConfigStore.instance().store(name="quality_schema", node=QualityConfig)


def runtime_config(cfg: QualityConfig, mode: str, seed: int) -> RuntimeConfig:
    P, M = cfg.prompts_per_batch, cfg.num_minibatches
    budget = {"colocated": 0, "train_batch": cfg.trainbatch_budget or P,
              "knittrans": cfg.knittrans_budget or 2 * P // M}[mode]
    return RuntimeConfig.for_system(mode, num_batches=cfg.num_batches, prompts_per_batch=P, group_size=cfg.group_size,
                         num_minibatches=M, max_new_tokens=ArithTask().max_answer_len + 2,
                         sync=SyncPolicy(cfg.sync), sync_every=cfg.sync_every, inflight_groups=budget,
                         wave_groups=cfg.wave_groups, eval_every=cfg.eval_every, seed=seed)


@dataclass
class Curve:
    """One run's learning curves and summary numbers."""

    mode: str
    seed: int
    eval_steps: list[int]
    eval_acc: list[float]
    eval_wall: list[float]
    reward: list[float]
    """Mean training reward of each step's mini-batch."""
    run: RunResult

    @property
    def auc(self) -> float:
        return float(np.mean(self.eval_acc))


def evaluate(setup, run: RunResult, problems) -> tuple[list[int], list[float], list[float]]:
    """Held-out accuracy of every snapshot, and the wall-clock time (since run start) it was reached."""
    end_of = {s.version: s.t_end for s in run.steps}
    steps = sorted(run.snapshots)
    acc = [greedy_accuracy(setup, run.snapshots[k], problems) for k in steps]
    return steps, acc, [end_of.get(k, 0.0) for k in steps]


def gap_closed(rc: float, rt: float, rk: float) -> float:
    d = rc - rt
    return 1.0 - (rc - rk) / d if d != 0 else float("nan")


def bootstrap_ci(aucs: dict[str, np.ndarray], n: int, seed: int = 0) -> tuple[float, float]:
    """95% interval of quality_gap_closed, resampling seeds (paired: one index picks all three modes' runs)."""
    rng = np.random.default_rng(seed)
    k = len(aucs["colocated"])
    vals = []
    for _ in range(n):
        idx = rng.integers(0, k, size=k)
        g = gap_closed(*(float(aucs[m][idx].mean()) for m in ("colocated", "train_batch", "knittrans")))
        if np.isfinite(g):
            vals.append(g)
    if not vals:
        return float("nan"), float("nan")
    return float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))


def plot(curves: list[Curve], results) -> None:
    """Accuracy and reward against steps and wall-clock (mean over seeds, min-max band), and staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (a_step, a_wall), (r_step, r_wall) = axes
    for mode in MODES:
        cs = [c for c in curves if c.mode == mode]
        if not cs:
            continue
        steps = np.array(cs[0].eval_steps)
        acc = np.array([c.eval_acc for c in cs])
        a_step.plot(steps, acc.mean(0), label=mode)
        a_step.fill_between(steps, acc.min(0), acc.max(0), alpha=0.2)
        a_wall.plot(np.array([c.eval_wall for c in cs]).mean(0), acc.mean(0), label=mode)
        rew = np.array([c.reward for c in cs])
        w = max(1, rew.shape[1] // 40)
        smooth = np.array([np.convolve(r, np.ones(w) / w, mode="valid") for r in rew]).mean(0)
        r_step.plot(np.arange(len(smooth)) + w, smooth, label=mode)
        t_end = np.array([[s.t_end for s in c.run.steps] for c in cs]).mean(0)
        r_wall.plot(t_end[w - 1:], smooth, label=mode)
    a_step.set(xlabel="optimizer step", ylabel="held-out greedy accuracy", title="accuracy vs steps (min-max band)")
    a_wall.set(xlabel="wall-clock (s, mean over seeds)", ylabel="held-out greedy accuracy",
               title="accuracy vs wall-clock")
    r_step.set(xlabel="optimizer step", ylabel="training reward (moving mean)", title="reward vs steps")
    r_wall.set(xlabel="wall-clock (s, mean over seeds)", ylabel="training reward (moving mean)",
               title="reward vs wall-clock")
    for a in axes.flat:
        a.legend()
    fig.tight_layout()
    fig.savefig(results.plot_path("quality_curves.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        st = np.concatenate([c.run.staleness() for c in curves if c.mode == mode])
        ax.hist(st, bins=np.arange(st.max() + 2) - 0.5, alpha=0.5, label=f"{mode} (mean {st.mean():.2f})")
    ax.set(xlabel="staleness v_train - v_gen (steps)", ylabel="trajectories", title="measured staleness")
    ax.legend()
    fig.tight_layout()
    fig.savefig(results.plot_path("quality_staleness.png"), dpi=110)
    plt.close(fig)


def run_table(cfg: QualityConfig):
    from repro.results import Claim, Results

    torch.set_num_threads(cfg.threads)
    results = Results(table="quality", out_dir=cfg.out_dir)
    task = ArithTask()
    problems = heldout_problems(task, cfg.heldout)
    curves: list[Curve] = []
    t_start = time.perf_counter()
    bar = tqdm(total=len(cfg.seeds) * len(MODES), desc="quality runs")
    for seed in cfg.seeds:
        setup = arith_setup(seed, TinyPolicyConfig(), WarmStartConfig(steps=cfg.warm_steps),
                            GRPOConfig(lr=cfg.lr, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef), task)
        for mode in MODES:
            rc = runtime_config(cfg, mode, seed)
            run = run_mode(rc, setup, make_policy=make_policy)
            steps, acc, wall = evaluate(setup, run, problems)
            curves.append(Curve(mode, seed, steps, acc, wall, [s.mean_reward for s in run.steps], run))
            write_trace(run, f"{cfg.out_dir}/traces/{mode}-seed{seed}.csv.gz")
            st, tm = run.staleness_summary(), run.timings()
            results.rows.append({
                "mode": mode, "seed": seed, "budget_groups": rc.budget if mode != "colocated" else None,
                "steps": len(run.steps), "auc_acc": curves[-1].auc, "final_acc": acc[-1], "init_acc": acc[0],
                "mean_reward": float(np.mean(curves[-1].reward)), "staleness_mean": st["mean"],
                "staleness_p99": st["p99"], "staleness_max": st["max"], "staleness_bound": rc.staleness_bound(),
                "clip_frac": float(np.mean([s.clip_frac for s in run.steps])), "wall_s": run.wall_s,
                "steps_per_s": run.throughput_steps_per_s(), "trainer_busy": run.trainer_busy_fraction(),
                "trainer_wait_s": run.wall_s - sum(s.step_s for s in run.steps),
                "decode_s_per_token": tm.decode_s_per_token,
                "train_s_per_token": tm.train_s_per_token, "step_s_mean": tm.step_s_mean,
                "sync_s_mean": tm.sync_s_mean, "syncs": tm.syncs, "wave_s_mean": tm.wave_s_mean})
            bar.set_postfix(mode=mode, seed=seed, auc=f"{curves[-1].auc:.3f}", stale=f"{st['mean']:.2f}")
            bar.update()
    bar.close()

    def per_mode(key: str) -> dict[str, np.ndarray]:
        return {m: np.array([r[key] for r in results.rows if r["mode"] == m], dtype=float) for m in MODES}

    auc, stale, wall, thr = per_mode("auc_acc"), per_mode("staleness_mean"), per_mode("wall_s"), per_mode("steps_per_s")
    busy = per_mode("trainer_busy")
    for m in MODES:
        results.rows.append({"mode": m, "seed": "mean", "auc_acc": auc[m].mean(), "staleness_mean": stale[m].mean(),
                             "wall_s": wall[m].mean(), "steps_per_s": thr[m].mean(), "trainer_busy": busy[m].mean(),
                             "auc_spread": float(auc[m].max() - auc[m].min())})
    rc_, rt_, rk_ = (float(auc[m].mean()) for m in MODES)
    gap = gap_closed(rc_, rt_, rk_)
    lo, hi = bootstrap_ci(auc, cfg.bootstrap)
    gap_exists = rc_ - rt_ > float(np.std(auc["colocated"] - auc["train_batch"]) / max(1, len(cfg.seeds)) ** 0.5)
    results.claims.append(Claim(
        "quality_gap_closed", paper="narrows the gap (> 0)", measured=gap, unit="fraction",
        holds=bool(gap_exists and lo > 0),
        note=f"AUC of held-out accuracy over {len(curves[0].run.steps)} steps: colocated {rc_:.3f}, train-batch "
             f"{rt_:.3f}, KnitTrans {rk_:.3f}; 95% bootstrap CI over {len(cfg.seeds)} seeds [{lo:.2f}, {hi:.2f}]; "
             f"holds if the colocated/train-batch gap exceeds its standard error and the CI is above 0"
             + ("" if gap_exists else "; the gap does not show at this scale")))
    A_tb = stale["train_batch"].mean() - stale["colocated"].mean()
    A_kt = stale["knittrans"].mean() - stale["colocated"].mean()
    results.claims.append(Claim(
        "architectural_staleness_reduction", paper=0.93, measured=1 - A_kt / A_tb if A_tb else None, unit="fraction",
        holds=bool(A_tb > 0 and 1 - A_kt / A_tb > 0),
        note=f"measured A = mean staleness - colocated's ({stale['colocated'].mean():.2f}): train-batch {A_tb:.2f}, "
             f"KnitTrans {A_kt:.2f} (negative: fresher than colocated); each at its smallest budget that keeps "
             f"the trainer busy"))
    for m in MODES:
        results.claims.append(Claim(f"staleness_mean_{m}", paper=None, measured=float(stale[m].mean()), unit="steps",
                                    holds=True, note="measured v_train - v_gen over every trajectory, mean over seeds"))
        results.claims.append(Claim(f"wallclock_{m}", paper=None, measured=float(wall[m].mean()), unit="s",
                                    holds=True, note="run wall-clock (rollout + training, no evaluation), mean"))
    ratio = float(busy["knittrans"].mean() / busy["train_batch"].mean())
    raw = float(thr["knittrans"].mean() / thr["train_batch"].mean())
    results.claims.append(Claim(
        "throughput_matched", paper=">= 1", measured=ratio, unit="x", holds=ratio >= 0.98,
        note=f"KnitTrans trainer busy fraction over train-batch's at their budgets ({busy['knittrans'].mean():.3f} vs "
             f"{busy['train_batch'].mean():.3f}); matched operating point if >= 1 (0.98 allows for noise). Raw "
             f"steps/s ratio {raw:.2f}: on a shared 2-core machine the step time itself varies ~2x between runs, "
             f"so raw throughput compares machine load, the busy fraction compares the modes"))
    plot(curves, results)
    results.extra["calibration"] = [{k: r[k] for k in ("mode", "seed", "decode_s_per_token", "train_s_per_token",
                                                        "step_s_mean", "sync_s_mean", "syncs", "wave_s_mean")}
                                    for r in results.rows if r["seed"] != "mean"]
    results.extra["total_s"] = time.perf_counter() - t_start
    results.extra["traces"] = "traces/<mode>-seed<seed>.csv.gz: per trajectory v_gen, v_train, step, timestamps"
    results.text = (
        f"Policy: Llama-style, {sum(p.numel() for p in setup.model.parameters())} parameters, "
        f"15-token character tokenizer; task ab+c= with exact-match reward; warm start {cfg.warm_steps} supervised "
        f"steps. GRPO: P={cfg.prompts_per_batch} prompts x n={cfg.group_size}, M={cfg.num_minibatches}, Adam lr "
        f"{cfg.lr}, clip {cfg.clip_eps}, KL {cfg.kl_coef}.\n\n"
        f"Version semantics: disaggregated weight sync {cfg.sync} (k={cfg.sync_every}); the engine loads the newest "
        f"published weights between generation waves of {cfg.wave_groups} groups; in-flight waves finish with the "
        f"weights they started with (v_gen is exact). Colocated generates each batch with the newest weights.\n\n"
        f"Budgets (groups in flight): train-batch {cfg.trainbatch_budget or cfg.prompts_per_batch} (its minimum), "
        f"KnitTrans {cfg.knittrans_budget or 2 * cfg.prompts_per_batch // cfg.num_minibatches}. Wall-clock on a "
        f"shared 2-core machine is noisy; the per-run time model is in summary.json under `calibration`.\n")
    return results


@hydra.main(config_path="conf", config_name="quality", version_base=None)
def main(cfg) -> None:
    from repro.logger import publish

    qc = QualityConfig(**OmegaConf.to_container(cfg, resolve=True))
    publish(run_table(qc), qc.logger, "quality", config=cfg, seed=qc.seeds[0])


if __name__ == "__main__":
    main()
