"""The cluster table (issue 14): the model checked against a RECORDED multi-raylet trace (tests/fixtures/
cluster_trace.jsonl, written by ``python -m repro.cluster``), the spec's verdicts flipping with the rows, the gate
failing when a regression is injected into the model, and the multi-raylet run itself (slow)."""

from __future__ import annotations

import dataclasses

import pytest

from knittrans.sim import cluster_model
from knittrans.sim.cluster_trace import fit_errors, read_trace, validate
from repro.cluster import FIXTURE, gate_trials
from repro.gates import evaluate_gate
from repro.spec import evaluate
from repro.spec.cluster import FIT_BOUND, REGISTERED, TABLE, ClusterPassTrial, ClusterProjectionTrial
from repro.spec.core import Status


def verdicts(rows) -> dict:  # noqa: ANN001
    return {v.claim.name: v for v in evaluate(TABLE, rows)}


@pytest.fixture(scope="module")
def rows():
    return gate_trials()


def test_the_recorded_trace_is_a_multi_raylet_run_of_both_systems():
    t = read_trace(FIXTURE)
    nodes = t.meta["nodes"]
    assert len({nodes["driver"], *nodes["units"], *nodes["ranks"]}) == 1 + len(nodes["units"]) + len(nodes["ranks"])
    assert {p.system for p in t.passes} == {"centralized", "knittrans-ray"} and len(t.calibration) >= 2
    for p in t.passes:  # every traced flow crosses a node boundary, from where the bytes sat to who reads them
        flows = [e for e in p.events if isinstance(e, cluster_model.FlowEvent)]
        assert flows and all(f.src != f.dst for f in flows)
        srcs, dsts = {f.src for f in flows}, {f.dst for f in flows}
        if p.system == "centralized":  # gathered from rollout nodes to the driver, scattered to the ranks
            assert srcs == {*nodes["units"], nodes["driver"]} and dsts == {nodes["driver"], *nodes["ranks"]}
        else:  # every rank reads straight from the units: the driver's node is on no flow
            assert srcs == set(nodes["units"]) and dsts == set(nodes["ranks"])


def test_model_predicts_the_recorded_multi_raylet_trace_within_20_percent():
    checks = validate(read_trace(FIXTURE))
    errs = fit_errors(checks, "centralized", "knittrans-ray")
    assert max(abs(errs[k]) for k in ("centralized", "knittrans-ray", "ratio")) <= FIT_BOUND, errs
    for c in checks:  # the link is fitted on calibration pulls only, and it explains them
        assert c.fit.link.bandwidth_Bps > 1e7 and c.fit.single_rel_err < 0.5


def test_fit_claim_holds_on_the_recorded_trace_and_fails_when_predictions_drift(rows):
    assert verdicts(rows)["cluster_model_fit_error"].status is Status.HOLDS
    drift = [dataclasses.replace(r, predicted_s=1.5 * r.predicted_s)
             if isinstance(r, ClusterPassTrial) and r.system == "knittrans-ray" else r for r in rows]
    v = verdicts(drift)
    assert v["cluster_model_fit_error"].status is Status.FAILS
    # an unvalidated model decides nothing: the projected claims are not measured
    assert v["cluster_projected_transfer_ratio"].status is Status.NOT_MEASURED
    assert v["cluster_projected_speedup"].status is Status.NOT_MEASURED
    assert "not validated" in v["cluster_projected_speedup"].measured.note


def test_projected_claims_get_a_verdict_from_the_registered_point_only_when_the_fit_holds(rows):
    v = verdicts(rows)
    assert v["cluster_projected_transfer_ratio"].status in (Status.HOLDS, Status.FAILS)
    assert "MODELLED" in v["cluster_projected_transfer_ratio"].measured.note
    at = next(r for r in rows if isinstance(r, ClusterProjectionTrial) and r.point == REGISTERED)
    better = dataclasses.replace(at, knittrans_raw_s=at.central_raw_s / 120, knittrans_exposed_s=0.0,
                                 knittrans_train_s=at.central_train_s / 10)
    flipped = verdicts([better if r is at else r for r in rows])
    assert flipped["cluster_projected_transfer_ratio"].status is Status.HOLDS
    assert flipped["cluster_projected_speedup"].status is Status.HOLDS
    assert flipped["cluster_projected_transfer_ratio"].measured.value == pytest.approx(120)
    no_multi = [r for r in rows if not (isinstance(r, ClusterPassTrial) and r.setting == "multi-raylet")]
    assert verdicts(no_multi)["cluster_projected_transfer_ratio"].status is Status.NOT_MEASURED


def test_projection_grows_with_n_for_the_baseline_and_not_for_knittrans(rows):
    proj = {r.point: r for r in rows if isinstance(r, ClusterProjectionTrial)}
    b, rk, _ = REGISTERED
    assert proj[(b, rk, 16)].central_raw_s > 1.8 * proj[(b, rk, 8)].central_raw_s
    assert proj[(b, rk, 16)].knittrans_raw_s == pytest.approx(proj[(b, rk, 8)].knittrans_raw_s, rel=0.05)
    assert proj[(3.0, rk, 8)].central_raw_s > proj[(25.0, rk, 8)].central_raw_s  # a slower NIC, a slower driver


def test_gate_holds_on_the_recorded_trace(rows):
    v = {x.claim.name: x for x in evaluate_gate(TABLE, rows)}
    assert v and all(x.status is Status.HOLDS for x in v.values()), {k: x.measured for k, x in v.items()}


def test_gate_fails_when_the_model_stops_sharing_links(monkeypatch):
    """The injected regression: flows no longer share a NIC (each gets the whole link): the replay of the recorded
    centralized pass (two gathers into the driver, two scatters out of it) comes out too fast."""
    monkeypatch.setattr(cluster_model, "fair_rates", lambda flows, link: [link.bandwidth_Bps] * len(flows))
    v = {x.claim.name: x for x in evaluate_gate(TABLE, gate_trials())}
    assert v["cluster_model_fit_error"].status is Status.FAILS, v["cluster_model_fit_error"].measured


@pytest.mark.ray
@pytest.mark.slow
def test_multi_raylet_passes_record_cross_node_flows_for_both_systems(tmp_path):
    """The real thing, small: 5 raylets, one traced raw pass per system, the trace written and read back."""
    from knittrans.sim.cluster_trace import write_trace
    from repro.cluster import ClusterConfig, multi_raylet_trace, passes_of
    from workloads.multimodal_data import MMTransferWorkload

    cfg = ClusterConfig(multimodal=MMTransferWorkload(prompts_per_batch=4, group_size=4, image_side=112),
                        passes=1, calibration_kib=[64, 2048, 8192], logger="none")
    trace = multi_raylet_trace(cfg, passes_of(cfg), {"memcpy_gbps": 5.0})
    t = read_trace(write_trace(tmp_path / "trace.jsonl", trace))
    assert {p.system for p in t.passes} == {"centralized", "knittrans-ray", "verl"}
    verl = next(p for p in t.passes if p.system == "verl")  # three dispatches of every rank's chunk
    scat = [e for e in verl.events if isinstance(e, cluster_model.FlowEvent) and e.label == "scatter"]
    assert len(scat) == 3 * cfg.num_ranks and {e.key.split("/")[0] for e in scat} == {"d0", "d1", "d2"}
    for p in t.passes:
        flows = [e for e in p.events if isinstance(e, cluster_model.FlowEvent)]
        assert flows and all(f.src != f.dst and f.t_end >= f.t_start for f in flows)
        assert p.raw_s > 0 and sum(f.nbytes for f in flows) >= p.pixel_bytes
    assert all(c.prediction.predicted_s > 0 for c in validate(t))


@pytest.fixture(scope="module")
def verl_rows():
    from repro.cluster import FIXTURE_VERL, rows_from_trace

    return rows_from_trace(read_trace(FIXTURE_VERL))


@pytest.mark.parametrize("system,graph", [("verl", "verl_wg")])
def test_the_verl_trace_ships_every_ranks_chunk_three_times_from_the_driver(system, graph):
    from repro.cluster import FIXTURE_VERL

    t = read_trace(FIXTURE_VERL)
    nodes = t.meta["nodes"]
    verl = [p for p in t.passes if p.system == system]
    assert verl and {p.graph for p in verl} == {graph}
    for p in verl:
        flows = [e for e in p.events if isinstance(e, cluster_model.FlowEvent)]
        gather = [f for f in flows if f.label == "gather"]
        scatter = [f for f in flows if f.label == "scatter"]
        assert {f.src for f in gather} == set(nodes["units"]) and {f.dst for f in gather} == {nodes["driver"]}
        assert len(scatter) == 3 * len(nodes["ranks"]) and {f.src for f in scatter} == {nodes["driver"]}
        # every dispatch ships the rows' pixels again: at least 3x the gathered pixels leave the driver
        assert sum(f.nbytes for f in scatter) >= p.pixel_bytes


@pytest.mark.parametrize("system", ["verl"])
def test_model_predicts_the_recorded_verl_passes_within_20_percent(system):
    from repro.cluster import FIXTURE_VERL

    errs = fit_errors(validate(read_trace(FIXTURE_VERL)), system, "knittrans-ray")
    assert max(abs(errs[k]) for k in (system, "knittrans-ray", "ratio")) <= FIT_BOUND, errs


def test_verl_projection_is_decided_on_verl_fit_only_and_grows_with_n(verl_rows):
    v = verdicts(verl_rows)
    assert v["cluster_model_fit_error_verl"].status is Status.HOLDS
    assert v["cluster_projected_transfer_ratio_verl"].status in (Status.HOLDS, Status.FAILS)
    assert "MODELLED" in v["cluster_projected_transfer_ratio_verl"].measured.note
    proj = {r.point: r for r in verl_rows if isinstance(r, ClusterProjectionTrial)}
    b, rk, _ = REGISTERED
    assert proj[(b, rk, 16)].verl_raw_s > 1.5 * proj[(b, rk, 8)].verl_raw_s  # n copies of every image
    assert proj[(b, rk, 8)].verl_raw_s > proj[(b, rk, 8)].central_raw_s  # three dispatches, not one
    drift = [dataclasses.replace(r, predicted_s=1.5 * r.predicted_s)
             if isinstance(r, ClusterPassTrial) and r.system == "verl" else r for r in verl_rows]
    v = verdicts(drift)
    assert v["cluster_model_fit_error_verl"].status is Status.FAILS
    assert v["cluster_projected_transfer_ratio_verl"].status is Status.NOT_MEASURED
    assert v["cluster_projected_speedup_verl"].status is Status.NOT_MEASURED
