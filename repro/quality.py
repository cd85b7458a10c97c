"""Learning quality on the real system, every trajectory through the handoff: colocated vs disaggregated with
train-batch admission vs disaggregated with KnitTrans admission at train-batch's budget and a throughput-matched one.

A ~130K-parameter Llama-style policy learns "ab+c=" arithmetic with GRPO on CPU (HF engine in one thread, GRPO trainer
in another, ``knittrans.runtime``). Per seed, every arm starts from the same warm-started weights and prompt stream (a
paired comparison) and runs the same number of optimizer steps; the arms of a seed run back to back, the order
rotating with the seed. Claims, rows and their definitions: ``repro/spec/quality.py`` (multimodal:
``repro/spec/quality_multimodal.py``).

The throughput match comes first: short probe runs of train-batch (budget P) and of KnitTrans at each candidate budget
alternate within each of ``match_passes`` passes; KnitTrans's matched budget is the smallest whose median raw steps/s
ratio to train-batch's (same pass) is >= ``match_target``. The main runs then report the match they actually got
(``quality_throughput_match``) beside the claim.

Run: ``python -m repro.quality`` (defaults in repro/conf/quality.yaml; a smoke run: ``seeds=[0,1] num_batches=4
prompts_per_batch=8 num_minibatches=4 match_batches=2 match_passes=1 warm_steps=10 eval_every=4 heldout=32``).

``python -m repro.quality workload=multimodal`` (settings under ``mm.``, results in ``mm.out_dir``, table
``quality-multimodal``): the tiny Qwen2-VL on the counting task (``workloads.vlm_session``), GRPO through the same
orchestrator and multimodal handoff, arms colocated / train-batch / KnitTrans at a configured budget; every claim of
that table is a measurement (no verdict; ``repro/spec/quality_multimodal.py`` says why).
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

from baselines.admission import make_policy
from knittrans.runtime.config import RuntimeConfig, SyncPolicy
from knittrans.runtime.records import RunResult, write_trace
from knittrans.runtime.trainer import GRPOConfig
from repro.quality_report import Curve, plot
from repro.spec.quality import ARMS, ROW_TYPES, QualityRun, ThroughputProbe, matched_budget
from repro.spec.quality_multimodal import MM_ARMS, MMQualityRun
from workloads.arith import ArithTask
from workloads.arith_session import RolloutEngines, arith_setup, evaluate_snapshots, heldout_problems, run_mode
from workloads.tiny_models import TinyPolicyConfig, WarmStartConfig


@dataclass
class MMQuality:
    """The multimodal run's settings (``workload=multimodal``): the tiny VLM on the counting task, sized to finish
    in under ~10 minutes on 2 shared cores."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """One paired comparison per seed (each its own warm start)."""
    num_batches: int = 8
    """Training batches per run (steps = num_batches * num_minibatches; 20 until session 21: measurements only)."""
    prompts_per_batch: int = 16
    """P: prompts (images) per batch."""
    group_size: int = 8
    """n: samples per prompt (each image recurs n times in a batch)."""
    num_minibatches: int = 8
    """M: optimizer steps per batch (2 groups each: train-batch's staleness ~M, KnitTrans's ~1)."""
    lr: float = 1e-3
    """Adam learning rate (clip and KL: the table's ``clip_eps`` and ``kl_coef``)."""
    warm_max_steps: int = 150
    """Most supervised warm-start steps (``MMWarmStartConfig.max_steps``; 300 until session 22: it was half the time)."""
    warm_target: float = 0.5
    """The warm start stops at this evaluation accuracy (``MMWarmStartConfig.target_accuracy``)."""
    knittrans_budget: int = 0
    """KnitTrans's in-flight budget in groups; 0 = two mini-batches' worth (train-batch runs at P, its minimum)."""
    wave_groups: int = 2
    """Groups per generation call."""
    eval_every: int = 8
    """Held-out evaluation every this many steps (step 0 included)."""
    heldout: int = 96
    """Held-out prompts (``MMCountingTask.heldout``): greedy accuracy and one T = 1 sample each."""
    max_new_tokens: int = 3
    """Response cap (a count's digit + EOS fit in 2)."""
    out_dir: str = "results/quality-multimodal"
    """Where the multimodal run writes the results contract."""


@dataclass
class QualityConfig:
    """The quality table's run settings."""

    workload: str = "text"
    """``text`` (the arithmetic policy, the fields below) or ``multimodal`` (the tiny VLM, settings under ``mm``)."""
    table: str = "quality"
    """The text run's table: ``quality`` (make repro's size: measurements) or ``quality-long`` (the pre-registered
    long profile that decides paper claim 2: ``python -m repro.quality_long``, repro/conf/quality_long.yaml)."""
    mm: MMQuality = field(default_factory=MMQuality)
    """The multimodal run's settings."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    """One paired comparison (every arm from the same warm start) per seed; >= 2 for an interval."""
    num_batches: int = 6
    """Training batches per run; optimizer steps = num_batches * num_minibatches: 96 at the defaults (480, then
    256 until session 22; cut for ``make repro``'s time: measurements only, the target is decided on the replay)."""
    prompts_per_batch: int = 128
    """P: prompts per batch."""
    group_size: int = 8
    """n: samples per prompt."""
    num_minibatches: int = 16
    """M: optimizer steps per batch (colocated mean staleness (M - 1) / 2). M = 16 with P = 128 keeps a step at
    64 trajectories and makes the staleness that admission decides large enough to show in learning."""
    lr: float = 3e-4
    """Adam learning rate."""
    clip_eps: float = 0.2
    """PPO clip range."""
    kl_coef: float = 0.0
    """KL penalty to the warm-started policy."""
    warm_steps: int = 200
    """Supervised warm-start steps (to roughly 20% greedy accuracy)."""
    trainbatch_budget: int = 0
    """In-flight groups for train-batch admission (and KnitTrans's same-budget arm); 0 = P, its minimum."""
    knittrans_budget: int = 0
    """KnitTrans's matched budget in groups; 0 = found by the throughput probes below."""
    match_budgets: list[int] = field(default_factory=list)
    """Candidate KnitTrans budgets for the match; [] = 1, 2, 4 ... mini-batches' worth of groups, up to P."""
    match_batches: int = 2
    """Training batches per probe run."""
    match_passes: int = 2
    """Interleaved probe passes (train-batch and every candidate once per pass)."""
    match_target: float = 1.0
    """The matched budget's median raw steps/s ratio to train-batch's must reach this."""
    sync: str = "every_step"
    """Weight sync policy of the disaggregated modes: every_step, every_k, every_batch."""
    sync_every: int = 1
    """k for every_k."""
    wave_groups: int = 8
    """Groups per generation call (one mini-batch's worth at the defaults)."""
    eval_every: int = 24
    """Held-out evaluation every this many optimizer steps (step 0 included)."""
    heldout: int = 256
    """Held-out problems (fixed set, greedy decoding)."""
    threads: int = 1
    """torch intra-op threads per side (the disaggregated modes run two sides at once on 2 cores)."""
    engine: str = "hf"
    """Rollout engine: hf, or vllm in the vLLM environment (2-core size there and numbers: docs/runtime.md)."""
    logger: str = "none"
    """Experiment logger: wandb (offline unless WANDB_MODE=online) or none."""
    out_dir: str = "results/quality"
    """Where the results contract is written."""


ConfigStore.instance().store(name="quality_schema", node=QualityConfig)


def runtime_config(cfg: QualityConfig, system: str, budget: int, seed: int, num_batches: int | None = None,
                   eval_every: int = 0) -> RuntimeConfig:
    return RuntimeConfig.for_system(
        system, num_batches=num_batches or cfg.num_batches, prompts_per_batch=cfg.prompts_per_batch,
        group_size=cfg.group_size, num_minibatches=cfg.num_minibatches, max_new_tokens=ArithTask().max_answer_len + 2,
        sync=SyncPolicy(cfg.sync), sync_every=cfg.sync_every, inflight_groups=budget, wave_groups=cfg.wave_groups,
        eval_every=eval_every, seed=seed)


def candidates(cfg: QualityConfig) -> list[int]:
    if cfg.match_budgets:
        return sorted(cfg.match_budgets)
    g, P = cfg.prompts_per_batch // cfg.num_minibatches, cfg.prompts_per_batch
    if g < 1 or P % cfg.num_minibatches:  # g = 0 would double forever
        raise ValueError(f"prompts_per_batch={P} must be a positive multiple of num_minibatches={cfg.num_minibatches}")
    out, b = [], g
    while b < P:
        out.append(b)
        b *= 2
    return out + [P]


def rotate(xs: list, k: int) -> list:
    k %= max(1, len(xs))
    return xs[k:] + xs[:k]


def probe(cfg: QualityConfig, setup, engines: RolloutEngines) -> list[ThroughputProbe]:  # noqa: ANN001 - ArithSetup
    """Short runs of train-batch and of KnitTrans at each candidate budget, alternating within each pass."""
    P = cfg.trainbatch_budget or cfg.prompts_per_batch
    arms = [("train_batch", P)] + [("knittrans", b) for b in candidates(cfg)]
    rows = []
    for k in tqdm(range(cfg.match_passes), desc="throughput probes", unit="pass"):
        for arm, budget in rotate(arms, k):
            rc = runtime_config(cfg, arm, budget, setup.seed, num_batches=cfg.match_batches)
            run = run_mode(rc, setup, engine=engines(setup), make_policy=make_policy)
            rows.append(ROW_TYPES[cfg.table][1](seed=setup.seed, pass_index=k, arm=arm, budget_groups=budget,
                                                steps_per_s=run.throughput_steps_per_s(),
                                                staleness_mean=run.staleness_stats.mean))
    return rows


def run_seed(cfg: QualityConfig, setup, budgets: dict[str, int], problems, bar, engines: RolloutEngines) -> tuple[list[QualityRun], list[Curve]]:  # noqa: ANN001,E501
    """Every arm from this seed's warm start, back to back (the order rotates with the seed)."""
    rows, curves = [], []
    for order, arm in enumerate(rotate(list(ARMS), setup.seed)):
        system = "knittrans" if arm.startswith("knittrans") else arm
        rc = runtime_config(cfg, system, budgets[arm], setup.seed, eval_every=cfg.eval_every)
        run = run_mode(rc, setup, engine=engines(setup), make_policy=make_policy)
        steps, acc, wall = evaluate_snapshots(setup, run, problems, max_new_tokens=rc.max_new_tokens)
        write_trace(run, f"{cfg.out_dir}/traces/{arm}-seed{setup.seed}.csv.gz")
        rows.append(row(arm, order, rc, run, acc, ROW_TYPES[cfg.table][0]))
        curves.append(Curve(arm, setup.seed, steps, acc, wall, [s.mean_reward for s in run.steps], run.staleness()))
        bar.set_postfix(arm=arm, seed=setup.seed, auc=f"{rows[-1].auc:.3f}", stale=f"{rows[-1].staleness_mean:.2f}")
        bar.update()
    return rows, curves


def row(arm: str, order: int, rc: RuntimeConfig, run: RunResult, acc: list[float],
        cls: type[QualityRun] = QualityRun) -> QualityRun:
    st = run.staleness_stats
    return cls(
        seed=rc.seed, arm=arm, budget_groups=rc.budget if arm != "colocated" else 0, order=order,
        steps=len(run.steps), auc=float(np.mean(acc)), final_acc=acc[-1], init_acc=acc[0],
        mean_reward=float(np.mean([s.mean_reward for s in run.steps])), staleness_mean=st.mean,
        staleness_p99=st.p99, staleness_max=st.max, staleness_bound=rc.staleness_bound(),
        clip_frac=float(np.mean([s.clip_frac for s in run.steps])), wall_s=run.wall_s,
        steps_per_s=run.throughput_steps_per_s(), trainer_busy=run.trainer_busy_fraction())


def mm_seed(cfg: QualityConfig, setup, prompts, bar) -> tuple[list[MMQualityRun], list[Curve]]:  # noqa: ANN001
    """Every multimodal arm from this seed's warm start (a ``VLMSetup``), back to back, order rotating."""
    from workloads.vlm_session import evaluate_snapshots as mm_evaluate
    from workloads.vlm_session import run_mode as mm_run

    m, rows, curves = cfg.mm, [], []
    budgets = {"colocated": 0, "train_batch": m.prompts_per_batch,
               "knittrans": m.knittrans_budget or 2 * m.prompts_per_batch // m.num_minibatches}
    for order, arm in enumerate(rotate(list(MM_ARMS), setup.seed)):
        rc = RuntimeConfig.for_system(
            arm, num_batches=m.num_batches, prompts_per_batch=m.prompts_per_batch, group_size=m.group_size,
            num_minibatches=m.num_minibatches, max_new_tokens=m.max_new_tokens, sync=SyncPolicy(cfg.sync),
            sync_every=cfg.sync_every, inflight_groups=budgets[arm], wave_groups=m.wave_groups,
            eval_every=m.eval_every, seed=setup.seed, multimodal=True)
        run = mm_run(rc, setup, make_policy=make_policy)
        steps, acc, sampled = mm_evaluate(setup, run, prompts, m.max_new_tokens)
        write_trace(run, f"{m.out_dir}/traces/{arm}-seed{setup.seed}.csv.gz")
        st, end_of = run.staleness_stats, {s.version: s.t_end for s in run.steps}
        rows.append(MMQualityRun(
            seed=setup.seed, arm=arm, budget_groups=budgets[arm], order=order, steps=len(run.steps),
            auc=float(np.mean(acc)), final_acc=acc[-1], init_acc=acc[0], sampled_auc=float(np.mean(sampled)),
            sampled_final=sampled[-1], mean_reward=float(np.mean([t.reward for t in run.trajectories])),
            staleness_mean=st.mean, staleness_max=st.max, staleness_bound=rc.staleness_bound(),
            clip_frac=float(np.mean([s.clip_frac for s in run.steps])), wall_s=run.wall_s,
            steps_per_s=run.throughput_steps_per_s(), encoder_patches=sum(s.encoder_patches for s in run.steps),
            occurrence_patches=sum(s.occurrence_patches for s in run.steps), warm_steps=setup.warm.steps,
            warm_acc=setup.warm.accuracy))
        curves.append(Curve(arm, setup.seed, steps, acc, [end_of.get(v, 0.0) for v in steps],
                            [s.mean_reward for s in run.steps], run.staleness()))
        bar.set_postfix(arm=arm, seed=setup.seed, auc=f"{rows[-1].auc:.3f}", stale=f"{st.mean:.2f}")
        bar.update()
    return rows, curves


def run_mm_table(cfg: QualityConfig):  # noqa: ANN201 - a repro.results.Results
    """The multimodal run: every arm per seed on the tiny VLM, rows logged, no verdict (see the spec)."""
    from repro.results import Results
    from workloads.mm_task import MMWarmStartConfig
    from workloads.vlm_session import vlm_setup

    m, t_start = cfg.mm, time.perf_counter()
    results = Results(table="quality-multimodal", out_dir=m.out_dir)
    grpo = GRPOConfig(lr=m.lr, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef)
    rows, curves = [], []  # MMQualityRun, Curve
    with tqdm(total=len(m.seeds) * len(MM_ARMS), desc="multimodal quality runs", unit="run") as bar:
        for seed in m.seeds:
            setup = vlm_setup(seed, warm=MMWarmStartConfig(max_steps=m.warm_max_steps, target_accuracy=m.warm_target),
                              grpo=grpo)
            r, c = mm_seed(cfg, setup, setup.task.heldout(m.heldout), bar)
            rows, curves = rows + r, curves + c
    results.set_trials(rows)
    results.rows = [r.as_dict() for r in rows]
    plot(curves, results, MM_ARMS)
    results.extra["total_s"] = time.perf_counter() - t_start
    results.text = (
        f"Policy: tiny Qwen2-VL ({sum(p.numel() for p in setup.model.parameters())} parameters) on the counting task "
        f"(one 84x84 image, 1-6 shapes, exact reward), warm-started per seed until {m.warm_target} accuracy or "
        f"{m.warm_max_steps} steps (rows: warm_steps, warm_acc). GRPO: P={m.prompts_per_batch} x n={m.group_size}, "
        f"M={m.num_minibatches}, {m.num_batches * m.num_minibatches} steps per run, lr {m.lr}. Every trajectory "
        f"goes through the multimodal handoff (each distinct image stored once); the learner's encoder runs once per "
        f"distinct image of a share (rows: encoder_patches vs occurrence_patches).\n\nBudgets (groups in flight): "
        f"train-batch {m.prompts_per_batch}, KnitTrans {m.knittrans_budget or 2 * m.prompts_per_batch // m.num_minibatches}"
        f" (not throughput-matched). Weight sync {cfg.sync}. Informational: no claim of this table has a verdict.\n")
    return results


def run_table(cfg: QualityConfig, engines: RolloutEngines | None = None):  # noqa: ANN201 - a repro.results.Results
    from repro.results import Results

    engines = engines or RolloutEngines(cfg.engine)  # a caller (a test) may share one vLLM engine
    torch.set_num_threads(cfg.threads)
    if cfg.workload == "multimodal" and cfg.engine == "hf":
        return run_mm_table(cfg)
    if cfg.workload != "text":
        raise ValueError(f"QualityConfig: workload={cfg.workload!r} engine={cfg.engine!r}; text, or multimodal with hf")
    if cfg.table not in ROW_TYPES:
        raise ValueError(f"QualityConfig: table={cfg.table!r}; one of {sorted(ROW_TYPES)}")
    results, t_start = Results(table=cfg.table, out_dir=cfg.out_dir), time.perf_counter()
    problems = heldout_problems(task := ArithTask(), cfg.heldout)
    grpo = GRPOConfig(lr=cfg.lr, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef)

    def setup_of(seed: int):  # noqa: ANN202
        return arith_setup(seed, TinyPolicyConfig(), WarmStartConfig(steps=cfg.warm_steps), grpo, task)

    first = setup_of(cfg.seeds[0])
    probes: list[ThroughputProbe] = []
    P = cfg.trainbatch_budget or cfg.prompts_per_batch
    if cfg.knittrans_budget:
        matched, ratio = cfg.knittrans_budget, float("nan")
    else:
        probes = probe(cfg, first, engines)
        matched, ratio = matched_budget(probes, cfg.match_target)
    budgets = {"colocated": 0, "train_batch": P, "knittrans_same_budget": P, "knittrans_matched": matched}
    rows: list[QualityRun] = []
    curves: list[Curve] = []
    with tqdm(total=len(cfg.seeds) * len(ARMS), desc="quality runs", unit="run") as bar:
        for seed in cfg.seeds:
            r, c = run_seed(cfg, first if seed == cfg.seeds[0] else setup_of(seed), budgets, problems, bar, engines)
            rows += r
            curves += c
    results.set_trials([*probes, *rows])
    results.rows = [r.as_dict() for r in rows]
    plot(curves, results)
    results.extra["curves"] = [{"arm": c.arm, "seed": c.seed, "steps": c.steps, "acc": c.acc, "wall_s": c.wall}
                               for c in curves]
    results.extra.update(total_s=time.perf_counter() - t_start, rollout_engine=engines.describe())
    results.extra["matched_budget"] = {"budget_groups": matched, "probe_median_ratio": ratio,
                                       "probes": [p.as_dict() for p in probes]}
    results.extra["traces"] = "traces/<arm>-seed<seed>.csv.gz: per trajectory v_gen, v_train, step, timestamps"
    results.text = (
        f"Policy: Llama-style, {sum(p.numel() for p in first.model.parameters())} parameters, 15-token character "
        f"tokenizer; task ab+c= with exact-match reward; warm start {cfg.warm_steps} supervised steps. GRPO: "
        f"P={cfg.prompts_per_batch} prompts x n={cfg.group_size}, M={cfg.num_minibatches}, "
        f"{cfg.num_batches * cfg.num_minibatches} optimizer steps per run, Adam lr {cfg.lr}, clip {cfg.clip_eps}, "
        f"KL {cfg.kl_coef}. Every trajectory goes through the handoff (in-process transport): put by the rollout "
        f"thread, admitted in its controller, fetched packed and prefetched by the trainer, acked after the step.\n\n"
        f"Version semantics: disaggregated weight sync {cfg.sync} (k={cfg.sync_every}); the engine loads the newest "
        f"published weights between generation waves of {cfg.wave_groups} groups; in-flight waves finish with the "
        f"weights they started with (v_gen is exact). Colocated generates each batch with the newest weights.\n\n"
        f"Budgets (groups in flight): train-batch {P} (its minimum), KnitTrans {P} (same budget) and {matched} "
        f"(throughput-matched: median probe steps/s ratio {ratio:.2f} over {cfg.match_passes} interleaved passes of "
        f"{cfg.match_batches} batches; candidates {candidates(cfg)}). Raw steps/s on a shared 2-core machine is "
        f"noisy; the probes alternate the systems within each pass so they see the same load.\n")
    return results


def cli(cfg) -> None:  # noqa: ANN001 - a DictConfig of QualityConfig
    """Run the table ``cfg`` composes and publish it (``main`` here, ``repro.quality_long.main``)."""
    from repro.logger import publish

    qc = OmegaConf.to_object(cfg)
    name = qc.table if qc.workload == "text" else f"quality-{qc.workload}"
    publish(run_table(qc), qc.logger, name, config=cfg, seed=(qc.seeds if qc.workload == "text" else qc.mm.seeds)[0])


@hydra.main(config_path="conf", config_name="quality", version_base=None)
def main(cfg) -> None:  # noqa: ANN001
    cli(cfg)


if __name__ == "__main__":
    main()
