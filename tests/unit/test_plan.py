"""The planner (``knittrans.plan``): its numbers are the simulator's, its advice meets its target, its registry
finds the policies, and the command runs as the README shows."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from baselines.admission import make_policy
from knittrans.constraints import BatchConstraints
from knittrans.plan import PlanConfig, Target, TargetKind, frontier, plan
from knittrans.plan.config import DEFAULT_POLICIES
from knittrans.plan.policies import registered
from knittrans.sim.config import BudgetRelease, EngineConfig, FlowConfig, FlowKind, SimConfig, SyncConfig, TrainerConfig
from knittrans.sim.lengths import LengthDist
from knittrans.sim.simulator import simulate
from knittrans.staleness import OperatingPoint, pareto_front, run_metrics
from knittrans.types import ExecutionMode, InflightPolicy, SyncPolicy, WorkloadBatch
from workloads.text import TextWorkloadConfig, generate_batches

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = {k: (lambda c, k=k: make_policy(k, c)) for k in ("knittrans", "train_batch", "greedy", "bounded_async")}
# A small cluster where rollout and trainer are within 2x of each other (so budgets matter): 16 prompts x 4, M=4.
SMALL = dict(dist="lognormal:median=300,sigma=0.9", max_response_len=2048, prompts_per_batch=16, group_size=4,
             num_minibatches=4, engines=1, slots=32, decode_tok_s=40.0, train_tok_s=20000.0, train_overhead_s=5.0,
             sync_cost_s=1.0, num_batches=8, warmup_batches=2, workers=1)


@pytest.fixture(scope="module")
def small_plan():
    return plan(PlanConfig(**SMALL), FACTORIES, progress=False)


def _direct(setting_policy: str, value: float, batches: list[WorkloadBatch]):
    """The simulator run by hand on SMALL's inputs, built without the planner's code."""
    c = BatchConstraints(batch_size=64, num_minibatches=4, max_response_len=2048, group_size=4)
    engine = EngineConfig(num_engines=1, slots=32, tpot=1 / 40.0)
    trainer = TrainerConfig(step_overhead=5.0, per_token=1 / 20000.0)
    sync = SyncConfig(policy=SyncPolicy.EVERY_STEP, k=4, cost=1.0, inflight=InflightPolicy.CONTINUE)
    if setting_policy == "colocated":
        cfg = SimConfig(mode=ExecutionMode.COLOCATED, engine=engine, trainer=trainer,
                        sync=SyncConfig(policy=SyncPolicy.EVERY_BATCH, k=4, cost=1.0),
                        flow=FlowConfig(kind=FlowKind.GROUPS, budget_groups=16), colocated_switch_cost=1.0)
        kind = "train_batch"
    elif setting_policy == "bounded_async":
        cfg = SimConfig(engine=engine, trainer=trainer, sync=sync, flow=FlowConfig(kind=FlowKind.AREAL, eta=int(value)))
        kind = setting_policy
    else:
        cfg = SimConfig(engine=engine, trainer=trainer, sync=sync,
                        flow=FlowConfig(kind=FlowKind.GROUPS, budget_groups=round(value * 16),
                                        release=BudgetRelease.STEP_END))
        kind = setting_policy
    res = simulate(cfg, make_policy(kind, c), batches)
    return run_metrics(res, warmup_batches=2, engine_slots=32)


def test_the_planners_frontier_equals_the_simulator_run_directly_on_the_same_inputs(small_plan):
    # the same lengths as workloads.text draws them for the same seed (prompt length aside, which no time uses)
    wl = TextWorkloadConfig(prompts_per_batch=16, group_size=4, num_minibatches=4, prompt_len=0,
                            lengths=LengthDist(median=300.0, sigma=0.9, max_len=2048))
    batches = generate_batches(wl, 8, seed=0)
    assert [b.lengths[g].tolist() for b in batches for g in b.lengths] == \
        [b.lengths[g].tolist() for b in small_plan.scenario.batches for g in b.lengths]
    for policy, front in small_plan.frontiers.items():
        direct = {p.setting.value: _direct(policy, p.setting.value, batches) for p in small_plan.of(policy)}
        ops = [OperatingPoint(m.steps_per_s, m.staleness.mean, budget=v) for v, m in direct.items()]
        want = [(op.budget, op.throughput, op.arch_staleness) for op in pareto_front(ops)]
        got = [(p.setting.value, p.metrics.steps_per_s, p.metrics.staleness_mean) for p in front]
        assert got == want, policy
        for p in small_plan.of(policy):  # every point, not only the front, is the simulator's
            m = direct[p.setting.value]
            assert (p.metrics.staleness_p99, p.metrics.trainer_idle, p.metrics.rollout_idle) == \
                (m.staleness.p99, m.trainer_idle_frac, m.rollout_idle_frac)
    ref = _direct("colocated", 1.0, batches)
    assert small_plan.of("colocated")[0].metrics.staleness_mean == ref.staleness.mean == 1.5


def test_a_parallel_sweep_predicts_what_a_serial_one_does(small_plan):
    par = plan(PlanConfig(**{**SMALL, "workers": 2, "policies": ("knittrans", "train_batch")}), FACTORIES,
               progress=False)
    for p in par.points:
        serial = next(q for q in small_plan.points if q.setting == p.setting)
        assert p.metrics == serial.metrics


@pytest.mark.parametrize("target", ["max-throughput", "staleness<=2", "p99<=6", "steps/s>=0.05"])
def test_the_recommended_setting_meets_its_target_in_the_simulator(small_plan, target):
    p = plan(PlanConfig(**{**SMALL, "target": target}), FACTORIES, progress=False)
    rec = p.recommendation
    assert rec is not None and rec.valid
    m = _direct(rec.setting.policy, rec.setting.value, list(p.scenario.batches))  # re-simulated by hand
    t = Target.parse(target)
    valid = [q for q in p.points if q.valid and q.setting.policy != "colocated"]
    if t.kind is TargetKind.MAX_THROUGHPUT:
        assert m.steps_per_s >= 0.99 * max(q.metrics.steps_per_s for q in valid)
    elif t.kind is TargetKind.MEAN_STALENESS:
        assert m.staleness.mean <= t.value
        assert all(m.steps_per_s >= 0.99 * q.metrics.steps_per_s for q in valid if t.meets(q))
    elif t.kind is TargetKind.P99_STALENESS:
        assert m.staleness.p99 <= t.value
    else:
        assert m.steps_per_s >= t.value
        assert all(m.staleness.mean <= q.metrics.staleness_mean for q in valid if t.meets(q))


def test_knittrans_reaches_train_batchs_throughput_at_lower_staleness(small_plan):
    """The question the planner answers, on a workload where it should: at train-batch's fastest point,
    KnitTrans's frontier is at least as fast with less staleness."""
    tb = max(small_plan.frontiers["train_batch"], key=lambda p: p.metrics.steps_per_s).metrics
    kt = [p.metrics for p in small_plan.frontiers["knittrans"] if p.metrics.steps_per_s >= 0.99 * tb.steps_per_s]
    assert kt and min(m.staleness_mean for m in kt) < tb.staleness_mean


def test_frontier_keeps_only_valid_undominated_points(small_plan):
    pts = small_plan.of("knittrans")
    front = frontier(pts)
    for p in pts:
        if p not in front:
            assert any(q.metrics.steps_per_s >= p.metrics.steps_per_s and
                       q.metrics.staleness_mean <= p.metrics.staleness_mean for q in front)
    run = pts[-1].run
    broken = dataclasses.replace(pts[-1], run=dataclasses.replace(run, metrics=dataclasses.replace(run.metrics,
                                                                                                  dead_ends=1)))
    assert broken not in frontier([*pts[:-1], broken])


def test_the_entry_points_register_every_policy_the_planner_sweeps():
    reg = registered()
    assert set(DEFAULT_POLICIES) <= set(reg)
    c = BatchConstraints(batch_size=8, num_minibatches=2, max_response_len=16, group_size=4)
    for name in DEFAULT_POLICIES:
        assert reg[name](c).name == name


def _cli(args: list[str], tmp_path: Path, module: bool = False) -> subprocess.CompletedProcess:
    exe = [sys.executable, "-m", "knittrans.plan"] if module else [str(Path(sys.executable).parent / "knittrans-plan")]
    return subprocess.run([*exe, *args, "--out-dir", str(tmp_path), "--no-progress"], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_the_command_prints_every_input_and_ends_with_one_json_document(tmp_path):
    r = _cli(["--dist", "lognormal:median=300,sigma=0.9", "--max-response-len", "2048", "--prompts-per-batch",
              "16", "--group-size", "4", "--num-minibatches", "4", "--engines", "1", "--slots", "32",
              "--num-batches", "6", "--policies", "knittrans,train_batch", "--workers", "1"], tmp_path, module=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    names = {i["name"]: i for i in doc["inputs"]}
    assert names["decode_tok_s"]["source"] == "default" and names["decode_tok_s"]["value"] == "40"
    assert names["engines"]["source"] == "given"
    assert {p["policy"] for p in doc["points"]} == {"colocated", "knittrans", "train_batch"}
    assert doc["recommendation"]["meets_target"] and doc["validation"]["littles_law_error"] is not None
    assert all((tmp_path / f).is_file() for f in ("plan.md", "frontier.png", "plan.json"))
    assert json.loads((tmp_path / "plan.json").read_text()) == doc
    assert "| knittrans | budget 0.5 batch (8 groups) |" in r.stdout


def test_the_readme_planner_commands_run_as_written(tmp_path):
    """Both commands of README's "Will it help my run?" section through the console script the set-up installs:
    the lengths-file one as written, the DAPO-size one over 4 batches instead of 20 (its full size is the
    benchmark's, tests/bench/test_bench_plan.py, ~40 CPU-seconds)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Will it help my run?"):]
    section = section[:section.index("\n## ", 4)]
    cmds = [ln.split("#")[0].strip() for ln in section.replace("\\\n", " ").splitlines()
            if ln.strip().startswith("knittrans-plan ")]
    assert len(cmds) == 2
    for cmd in cmds:
        short = ["--num-batches", "4", "--warmup-batches", "1"] if "--prompts-per-batch 512" in cmd else []
        r = _cli(shlex.split(cmd)[1:] + short, tmp_path)
        assert r.returncode == 0, (cmd, r.stderr[-2000:])
        assert json.loads(r.stdout.strip().splitlines()[-1])["recommendation"] is not None


def test_an_exact_tie_goes_to_the_smaller_budget_then_away_from_greedy(small_plan):
    from knittrans.plan import recommend
    from knittrans.plan.sweep import PlanPoint, Setting

    m = small_plan.of("knittrans")[-1].run
    pts = [PlanPoint(Setting("greedy", 1.0), m), PlanPoint(Setting("knittrans", 2.0), m),
           PlanPoint(Setting("knittrans", 1.0), m)]
    assert recommend(pts, Target.parse("max-throughput")).setting == Setting("knittrans", 1.0)
    assert recommend(pts[:2], Target.parse("max-throughput")).setting == Setting("greedy", 1.0)  # smaller budget
