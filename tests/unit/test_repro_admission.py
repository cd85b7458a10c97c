"""The admission table at a tiny scale: the results contract, claims held against the goals, the profile's reason
for a missed goal. Timing is measured, never asserted."""

import json

from repro.admission import AdmissionConf, default_cases, make_instance, run
from repro.logger import publish


def _tiny(tmp_path, **kw) -> AdmissionConf:
    cases = {c.name: c for c in default_cases()}
    return AdmissionConf(out_dir=str(tmp_path / "admission"), logger="none", batch_size=512, repeats=1,
                         deadline_s=60.0, cases=[cases["uniform_512x16"], cases["variable_1_31_slack64_budget"]],
                         **kw)


def test_admission_table_writes_the_results_contract(tmp_path, capsys):
    cfg = _tiny(tmp_path, profile_misses=False)
    summary = publish(run(cfg), cfg.logger, "admission", config=cfg, seed=cfg.seed)
    out = tmp_path / "admission"
    for f in ("summary.json", "table.md", "config.yaml", "meta.json"):
        assert (out / f).exists(), f
    on_disk = json.loads((out / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == on_disk == json.loads(json.dumps(summary))
    assert [r["case"] for r in on_disk["rows"]] == ["uniform_512x16", "variable_1_31_slack64_budget"]
    for r in on_disk["rows"]:
        assert r["finished"] and r["arrivals"] == 512
        assert r["us_per_traj_min"] <= r["us_per_traj"] <= r["us_per_traj_max"]
        assert r["us_goal_met"] == (r["us_per_traj"] <= cfg.goal_us_per_traj)
        assert r["p99_goal_met"] == (r["p99_ms"] <= cfg.goal_p99_ms)
    claims = {c["name"]: c for c in on_disk["claims"]}  # the spec's verdicts over the logged rounds
    assert set(claims) == {"admission_us_per_traj", "admission_p99_ms", "admission_unknown_waits"}
    assert claims["admission_us_per_traj"]["holds"] == all(r["us_goal_met"] for r in on_disk["rows"])
    assert claims["admission_p99_ms"]["holds"] == all(r["p99_goal_met"] for r in on_disk["rows"])
    assert (out / "trials.jsonl").exists()


def test_a_missed_goal_names_the_profiles_top_functions(tmp_path):
    cfg = _tiny(tmp_path, goal_us_per_traj=0.0, profile_misses=True)  # a goal no run can meet
    rows = run(cfg).rows
    assert all(not r["us_goal_met"] and r["reason"].startswith("profile: ") for r in rows)


def test_instances_hold_exactly_b_trajectories_in_a_plan_the_constraints_accept():
    for case in default_cases():
        c, plan, trajs = make_instance(case, 8192, 16, 20480, seed=0)
        assert plan.num_trajectories == len(trajs) == 8192
        assert {t.traj_id for t in trajs} == set(range(8192))
        assert all(1 <= t.num_tokens <= 20480 for t in trajs)
        if case.budget == "binds":
            assert c.max_minibatch_size * c.max_response_len > c.token_budget
        if case.budget == "never_binds":
            assert c.max_minibatch_size * c.max_response_len <= c.token_budget
