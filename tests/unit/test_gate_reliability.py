"""The reliability gate's claims can fail: an injected regression (no compaction of released mini-batches, the
controller as it was before issue 13) must flip the bounded-state claim, measured by the same spec function."""

from __future__ import annotations

from repro.reliability import ReliabilityConf, load_row
from repro.spec import evaluate
from repro.spec.core import Status
from workloads.reliability_load import LoadConfig, load_inprocess


def _held_verdict():
    ld = load_inprocess(LoadConfig(load_trajectories=6000, load_minibatch=300, window=2))
    v = {x.claim.name: x for x in evaluate("reliability", [load_row(ld, ReliabilityConf())])}
    return ld, v["reliability_controller_held_ratio"]


def test_bounded_controller_state_holds_and_a_controller_without_compaction_fails_it(monkeypatch):
    ld, v = _held_verdict()
    assert v.status is Status.HOLDS and ld.lost == 0 and ld.duplicated == 0

    from knittrans.dataplane.controller import Controller

    def keep_everything(self, st):  # noqa: ANN001, ANN202 - the pre-issue-13 controller: nothing forgotten
        return None

    monkeypatch.setattr(Controller, "_compact_locked", keep_everything)
    ld, v = _held_verdict()
    assert ld.lost == 0 and ld.duplicated == 0  # still correct, just unbounded
    assert v.status is Status.FAILS and v.measured.value > 1.0


def test_the_gate_fails_when_controller_restart_regresses(monkeypatch):
    """Injected regression in product code: the controller's journal forgets ranks' acks (only releases stay), so
    a restart between two ranks' acks leaves that mini-batch unreleased for ever. The gate's chaos run must then
    count the fault kind as not survived: the fault claims fail (measured by the same spec functions)."""
    from repro.gates import evaluate_gate
    from repro.reliability import chaos_on, chaos_rows
    from repro.spec.reliability import GATE_FAULT_KINDS
    from knittrans.dataplane.recovery import ControllerJournal

    real_ack = ControllerJournal.ack

    def forget_rank_acks(self, key, rank, fields, released=None):  # noqa: ANN001, ANN202
        return real_ack(self, key, rank, (), released)

    monkeypatch.setattr(ControllerJournal, "ack", forget_rank_acks)
    cfg = ReliabilityConf(logger="none", chaos_trajectories=1500, chaos_fault_rate=0.3)  # the gate's chaos run
    rows = chaos_rows(chaos_on("inprocess", cfg), cfg.seed)
    restarts = [r for r in rows if r.part == "fault" and r.scenario == "controller_restart"]
    assert restarts and restarts[0].injected > 0 and restarts[0].survived == 0
    v = {x.claim.name: x for x in evaluate_gate("reliability", rows)}
    assert v["reliability_faults_not_survived"].status is Status.FAILS
    assert "controller_restart/inprocess" in v["reliability_faults_not_survived"].measured.note
    assert v["reliability_fault_kinds_survived"].status is Status.FAILS
    assert v["reliability_fault_kinds_survived"].measured.value < GATE_FAULT_KINDS - 4  # chaos kinds not survived


def test_the_gate_counts_every_fault_kind_it_runs():
    from repro.spec.reliability import GATE_FAULT_KINDS
    from workloads.chaos import HANDOFF_KINDS, KINDS
    from workloads.reliability_faults import RUNTIME_KINDS

    assert GATE_FAULT_KINDS == len(set(KINDS) | set(HANDOFF_KINDS) | set(RUNTIME_KINDS)) == 27


def test_the_gate_fails_when_a_claim_retry_by_the_same_incarnation_is_refused_again(monkeypatch):
    """Injected regression in product code: the controller as it was before issue 29, refusing a fenced claim's retry
    with AlreadyConsumedError. The gate's Handoff chaos run must count it as not survived (measured by the spec)."""
    from repro.gates import evaluate_gate
    from repro.reliability import chaos_rows, handoff_chaos_on
    from knittrans.dataplane.controller import Controller

    monkeypatch.setattr(Controller, "_retried_claim", staticmethod(lambda *a: False))
    cfg = ReliabilityConf(logger="none", handoff_chaos_batches=6)
    rows = chaos_rows(handoff_chaos_on("inprocess", cfg), cfg.seed)
    kind = [r for r in rows if r.part == "fault" and r.scenario == "lost_claim_reply_same_incarnation"]
    assert kind and kind[0].injected == 1 and kind[0].survived == 0
    v = {x.claim.name: x for x in evaluate_gate("reliability", rows)}
    assert v["reliability_faults_not_survived"].status is Status.FAILS
