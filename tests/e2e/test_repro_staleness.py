"""The staleness table end to end at a tiny scale: the results contract, trial rows, claims from the spec, plots."""

import json

from repro.spec import evaluate
from knittrans.sim import BudgetRelease
from repro.staleness import (DapoConf, LittleConf, StalenessConf, SweepConf, VariableGroupsConf, build_jobs,
                             little_rows, run)
from repro.trials import read_trials


def _tiny(tmp_path) -> StalenessConf:
    return StalenessConf(
        out_dir=str(tmp_path / "staleness"), logger="none", parallel="none", seeds=[0, 1],
        dapo=DapoConf(prompts_per_batch=16, group_size=4, num_minibatches=4, num_batches=5,
                      budgets=[0.5, 0.75, 1.0, 2.0]),
        sweep=SweepConf(num_minibatches=[2], group_sizes=[4], tails=["light"], prompts_per_batch=16,
                        budgets=[0.5, 1.0, 2.0], num_seeds=1),
        variable_groups=VariableGroupsConf(prompts_per_batch=16, group_size=8, num_minibatches=2, batch_total=96,
                                           num_batches=4, budgets=[1.0, 2.0]),
        little=LittleConf(rhos=[2.0], budget_groups=[8]))


def test_staleness_table_writes_the_results_contract(tmp_path, capsys):
    cfg = _tiny(tmp_path)
    summary = run(cfg)
    out = tmp_path / "staleness"
    for f in ("summary.json", "table.md", "config.yaml", "meta.json", "trials.jsonl", "frontier_dapo.png",
              "staleness_cdf_dapo.png", "timeline_dapo.png", "frontier_sweep.png", "frontier_variable_groups.png"):
        assert (out / f).exists(), f
    on_disk = json.loads((out / "summary.json").read_text())
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line) == on_disk == json.loads(json.dumps(summary))
    claims = {c["name"]: c for c in on_disk["claims"]}
    assert {"arch_staleness_reduction", "arch_staleness_reduction_release_end",
            "arch_staleness_reduction_release_start", "mean_staleness_knittrans", "mean_staleness_train_batch",
            "arch_staleness_reduction_sweep", "throughput_ratio", "greedy_dead_ends", "knittrans_violations",
            "littles_law_error"} <= set(claims)
    assert claims["greedy_dead_ends"]["measured"] > 0  # the variable-group scenario dead-ends greedy streaming
    assert claims["knittrans_violations"]["measured"] == 0
    assert all(c["holds"] is None for c in claims.values() if c["kind"] == "measurement")
    r = claims["arch_staleness_reduction"]
    assert r["measured"] is None and ">= 5 seeds" in r["note"]  # the headline needs 5 seeds; this run has 2
    r = claims["arch_staleness_reduction_release_end"]  # the same definition per convention: measured, uncapped
    assert r["measured"] is not None and r["low"] <= r["measured"] <= r["high"] and r["n"] == 2

    # the log alone reproduces the verdicts, and it holds every point that was run
    log = read_trials(out / "trials.jsonl")
    assert [v.as_dict() for v in evaluate("staleness", log.rows)] == on_disk["claims"]
    sim_rows = [x for x in log.rows if type(x).__name__ == "StalenessTrial"]
    assert len(sim_rows) == len(build_jobs(cfg))
    # the Little's-law checks, one pool task per seed, log exactly what one serial pass over the seeds gives
    little = [x for x in log.rows if type(x).__name__ == "LittleLawTrial"]
    assert little and little == little_rows(cfg.little, cfg.seeds, [BudgetRelease(r) for r in cfg.releases])
    assert {x.release for x in sim_rows if x.scenario == "dapo"} == {"step_end", "step_start"}
    coloc = [x for x in sim_rows if x.policy == "colocated"]
    assert coloc and all(abs(x.arch_staleness) < 1e-9 for x in coloc)
    assert "every matched train-batch Pareto point" in (out / "table.md").read_text()
