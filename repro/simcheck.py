"""Simulator against reality, held out: calibrate the simulator on some real runs, predict the others.

    python -m repro.simcheck                       # real runs (tiny policy, CPU) + calibrated simulator replays
    python -m repro.simcheck seeds=[0,1] logger=none
    PYTHONPATH=. $(scripts/vllm_env.sh) -m repro.simcheck engine=vllm logger=none out_dir=results/sim-vs-real-vllm

Every setting (admission policy x in-flight budget x weight-sync policy x wave size) runs for real
(``knittrans.runtime``: HF engine in one thread, GRPO trainer in another, every trajectory through the handoff)
for every seed. The runs of ``calibrate_seeds`` at ``calibrate_budgets`` calibrate the simulator
(``knittrans.sim.calibrate.fit_time_model``, one fit over all of them: decode step time and its growth per
sequence in a wave, trainer step time per token, interference, sync cost); every other run is predicted from that
model and a calibration run's response lengths. Little's law predicts each run from its budget alone. Claims (``repro/spec/simcheck.py``):
the held-out error of both, per setting, with settings that flow control alone decides flagged and kept out of
the verdict. Writes ``results/sim-vs-real/``.

``engine=vllm`` runs every real run with vLLM as the rollout engine (one in-process engine for all runs; run it
with the vLLM environment's python, PYTHONPATH=. from the checkout, docs/runtime.md). The default size fits 2 cores
as is: 48 runs of 48 steps of the 130K-parameter policy took 4.8 min with vLLM (2.6-4.3 min with HF).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from tqdm import tqdm

from baselines.admission import make_policy
from repro.spec.simcheck import FLOW_DETERMINED_SPREAD, SimCheckRun, rel_error, setting_errors


@dataclass
class SimCheckConf:
    out_dir: str = "results/sim-vs-real"
    logger: str = "wandb"
    """wandb (offline unless WANDB_MODE=online) or none."""
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    """Policy seeds (each needs a supervised warm start)."""
    calibrate_seeds: list[int] = field(default_factory=lambda: [0])
    """Seeds whose runs at ``calibrate_budgets`` calibrate the time model; every other run is held out."""
    calibrate_budgets: list[int] = field(default_factory=lambda: [16, 64])
    """Budgets (groups) of the calibration runs (every mode, sync and wave size at these budgets)."""
    prompts_per_batch: int = 32
    group_size: int = 8
    num_minibatches: int = 8
    num_batches: int = 4
    warm_steps: int = 100
    """Supervised warm-start steps per seed (the policy's responses, hence the lengths, depend on it)."""
    wave_groups: list[int] = field(default_factory=lambda: [1, 4])
    """Groups per generation call of the real engine: 1 makes rollout slower than training (timing decides the
    staleness), 4 lets it keep the budget full (flow control decides)."""
    modes: list[str] = field(default_factory=lambda: ["train_batch", "knittrans"])
    budgets: list[int] = field(default_factory=lambda: [8, 16, 32, 64])
    """In-flight budgets in groups; settings that would deadlock a mode (train-batch below P) are skipped."""
    syncs: list[str] = field(default_factory=lambda: ["every_step", "every_batch"])
    threads: int = 1
    """torch intra-op threads per side."""
    engine: str = "hf"
    """Rollout engine of the real runs: hf (in the project's .venv) or vllm (in the vLLM environment)."""


ConfigStore.instance().store(name="simcheck_schema", node=SimCheckConf)


def settings(cfg: SimCheckConf) -> list[tuple[str, int, str, int]]:
    return [(m, b, s, w) for m in cfg.modes for b in cfg.budgets for s in cfg.syncs for w in cfg.wave_groups
            if not (m == "train_batch" and b < cfg.prompts_per_batch)]


def real_runs(cfg: SimCheckConf, engines=None) -> list[tuple[str, object]]:  # noqa: ANN001 - RolloutEngines
    """Every (setting, seed) run for real, settings alternating within each seed: (role, RunResult)."""
    from knittrans.runtime import RuntimeConfig
    from workloads.arith_session import RolloutEngines, arith_setup, run_mode
    from workloads.tiny_models import WarmStartConfig

    engines = engines or RolloutEngines(cfg.engine)
    out = []
    todo = settings(cfg)
    with tqdm(total=len(todo) * len(cfg.seeds), desc="sim-vs-real real runs", unit="run") as bar:
        for seed in cfg.seeds:
            setup = arith_setup(seed=seed, warm=WarmStartConfig(steps=cfg.warm_steps))
            for mode, budget, sync, waves in todo:
                rc = RuntimeConfig.for_system(mode, num_batches=cfg.num_batches,
                                              prompts_per_batch=cfg.prompts_per_batch, group_size=cfg.group_size,
                                              num_minibatches=cfg.num_minibatches, inflight_groups=budget,
                                              wave_groups=waves, sync=sync, seed=seed)
                role = "calibration" if seed in cfg.calibrate_seeds and budget in cfg.calibrate_budgets else "heldout"
                out.append((role, run_mode(rc, setup, engine=engines(setup), make_policy=make_policy)))
                bar.update(1)
    return out


def predict_all(runs: list[tuple[str, object]]):  # noqa: ANN201 - (rows, the fitted TimeModel)
    """Fit one time model to every calibration run jointly; predict every run with it (and Little's law)."""
    from knittrans.sim.calibrate import fit_time_model, littles_law, predict, timing_spread, workload_of

    cal_runs = [run for role, run in runs if role == "calibration"]
    if not cal_runs:
        raise ValueError("simcheck: no calibration run (calibrate_seeds x calibrate_budgets matched no setting)")
    model, _, _ = fit_time_model(cal_runs)
    by_seed = {run.config.seed: workload_of(run) for run in reversed(cal_runs)}  # each seed's first calibration run
    first = workload_of(cal_runs[0])
    rows = []
    for role, run in tqdm(runs, desc="simulator replays", unit="run"):
        c = run.config
        # a calibration run's lengths: this seed's if one calibrated (same prompt stream), else the first's
        batches = by_seed.get(c.seed, first)
        sim = predict(c, model, batches, make_policy).records.staleness
        meas = run.staleness()
        rows.append(SimCheckRun(
            seed=c.seed, mode=c.system, budget=c.budget, sync=c.sync.value, wave_groups=c.wave_groups, role=role,
            measured_mean=float(meas.mean()), measured_p99=float(run.staleness_stats.p99),
            sim_mean=float(sim.mean()), sim_p99=float(np.percentile(sim, 99)),
            little_mean=littles_law(c), sim_spread=timing_spread(c, model, batches, make_policy),
            wall_s=run.wall_s, steps_per_s=run.throughput_steps_per_s()))
    return rows, model


GATE_CONF = SimCheckConf(logger="none", seeds=[0, 1], calibrate_seeds=[0], calibrate_budgets=[16, 64],
                         budgets=[16, 32, 64], syncs=["every_step"], num_batches=4)
"""The gate's slice of the table: both modes, budgets 16-64, both wave sizes, every-step sync, two seeds (seed 0 at
budgets 16 and 64 calibrates; 14 of the 20 runs are held out)."""
GATE_TRACES = Path(__file__).parent / "fixtures" / "sim-vs-real-gate.jsonl.gz"
"""Real runs of ``GATE_CONF`` recorded by ``record_gate_traces()`` (the committed fixture the gate replays)."""


def record_gate_traces(path: str | Path = GATE_TRACES) -> Path:
    """Run ``GATE_CONF`` for real (HF engine, this process) and save the runs' traces: re-record after a change to
    the runtime that moves real staleness (the gate then checks the simulator against the new behaviour)."""
    import torch

    from knittrans.sim.trace import RunTrace, save_traces

    torch.set_num_threads(GATE_CONF.threads)
    return save_traces(path, [RunTrace.of(run, role) for role, run in real_runs(GATE_CONF)])


def gate_trials(path: str | Path = GATE_TRACES) -> list[SimCheckRun]:
    """The CI-size rows: the recorded real runs of ``GATE_CONF`` (``path``) calibrate the simulator and are
    predicted by it, in this process (a test's monkeypatch of the simulator or its calibration reaches it). The real
    runs are recorded, not re-run: on a shared CI machine a one-minute live version swings with the load (measured:
    the same six runs gave held-out errors 0.002-0.25), while the simulator's code, which this gate guards, is
    deterministic over a fixed trace."""
    from knittrans.sim.trace import load_traces, roles

    return predict_all(roles(load_traces(path)))[0]


def plot(rows: list[SimCheckRun], res) -> None:  # noqa: ANN001 - a repro.results.Results
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 5), sharey=True)
    for ax, which in zip(axes, ("sim", "little")):
        for sens, marker in ((True, "o"), (False, "x")):
            pts = [r for r in rows if r.role == "heldout" and (r.sim_spread >= FLOW_DETERMINED_SPREAD) == sens]
            ax.scatter([r.measured_mean for r in pts], [getattr(r, f"{which}_mean") for r in pts], marker=marker,
                       label="timing-sensitive" if sens else "flow-determined (excluded)")
        hi = max(max(r.measured_mean, r.sim_mean, r.little_mean) for r in rows) * 1.1 + 0.1
        ax.plot([0, hi], [0, hi], "k--", lw=0.8)
        ax.fill_between([0, hi], [0, hi * 0.8], [0, hi * 1.2], color="grey", alpha=0.15, label="+-20%")
        ax.set(xlabel="measured mean staleness (steps)", title={"sim": "calibrated simulator (held out)",
                                                                "little": "Little's law (no timing)"}[which])
        ax.legend(fontsize=8)
    axes[0].set_ylabel("predicted mean staleness (steps)")
    fig.tight_layout()
    fig.savefig(res.plot_path("sim_vs_real.png"), dpi=110)
    plt.close(fig)


def run(cfg: SimCheckConf, engines=None) -> dict:  # noqa: ANN001 - a workloads.arith_session.RolloutEngines
    """The table; ``engines`` (default: ``RolloutEngines(cfg.engine)``) lets a caller share one vLLM engine."""
    import torch

    from repro.logger import publish
    from repro.results import Results
    from workloads.arith_session import RolloutEngines

    engines = engines or RolloutEngines(cfg.engine)
    if engines.kind != cfg.engine:
        raise ValueError(f"simcheck: engine={cfg.engine!r} but the engines passed are {engines.kind!r}")
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    res = Results(table="sim-vs-real", out_dir=cfg.out_dir)
    rows, model = predict_all(real_runs(cfg, engines))
    res.extra["rollout_engine"] = engines.describe()
    res.set_trials(rows)
    res.rows = [{**r.as_dict(), "sim_error": rel_error(r.sim_mean, r.measured_mean),
                 "little_error": rel_error(r.little_mean, r.measured_mean),
                 "flow_determined": r.sim_spread < FLOW_DETERMINED_SPREAD} for r in rows]
    sim_err, lit_err = setting_errors(rows, "sim", timing_sensitive=None), setting_errors(rows, "little",
                                                                                       timing_sensitive=None)
    res.extra["per_setting_heldout"] = [{"setting": "/".join(map(str, s)), "sim_error": e,
                                         "little_error": lit_err[s]} for s, e in sim_err.items()]
    res.extra["total_s"] = time.perf_counter() - t0
    plot(rows, res)
    res.extra["time_model"] = dataclasses.asdict(model)
    res.text = (f"Rollout engine: {cfg.engine}. Held-out check: the simulator's time model (static waves like the real HF engine, decode step "
                "time and its growth per sequence, trainer step time per token, rollout/trainer interference, sync "
                f"cost) is fitted jointly to the calibration runs (seeds {cfg.calibrate_seeds}, budgets "
                f"{cfg.calibrate_budgets}); "
                "every other run is predicted with it and a calibration run's response lengths. Little's law "
                "predicts from the budget and sync policy alone. A setting is flow-determined (excluded from the "
                f"verdict) when the simulator's prediction moves less than {FLOW_DETERMINED_SPREAD} steps with "
                "rollout 2x faster or slower: there flow control alone sets the staleness.\n")
    return publish(res, cfg.logger, "sim-vs-real", config=cfg)


@hydra.main(config_path="conf", config_name="simcheck", version_base=None)
def main(dcfg) -> None:  # noqa: ANN001
    run(OmegaConf.to_object(dcfg))


if __name__ == "__main__":
    main()
