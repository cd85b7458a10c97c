"""The staleness gate (``repro.gates`` over ``repro.staleness.gate_trials``) holds on this code and fails, claim by
claim, when a regression is injected into product code (the admission policies, the simulator)."""

import types

import pytest

import baselines.admission
import knittrans.admission.minibatch as minibatch
from baselines.admission import TrainBatchAdmission
from knittrans.admission.feasibility import Solution, Verdict
from knittrans.admission.minibatch import KnitTransAdmission
from knittrans.sim.config import FlowKind
from knittrans.sim.simulator import Simulator
from repro.gates import evaluate_gate, run_gate
from repro.spec import evaluate
from repro.spec.core import Status
from repro.staleness import gate_trials


def _gate(monkeypatch=None) -> dict:
    return {v.claim.name: v for v in evaluate_gate("staleness", gate_trials())}


def test_the_staleness_gate_holds_without_injection():
    out = run_gate("staleness")
    assert not out.skipped
    names = {v.claim.name for v in out.verdicts}
    assert {"arch_staleness_reduction", "throughput_ratio", "greedy_dead_ends", "knittrans_violations",
            "littles_law_error"} <= names
    assert all(v.status is Status.HOLDS for v in out.verdicts), [line for line in out.lines() if "ok" not in line]


def test_knittrans_waiting_for_the_whole_batch_fails_the_reduction(monkeypatch):
    # the regression the headline guards: mini-batch admission degenerates into train-batch admission
    monkeypatch.setattr(KnitTransAdmission, "on_trainer_ready", TrainBatchAdmission.on_trainer_ready)
    v = _gate()["arch_staleness_reduction"]
    assert v.status is Status.FAILS and v.measured.value < 0.1


def test_whole_batch_admission_at_budgets_of_a_batch_or_more_fails_the_reduction(monkeypatch):
    """A regression that touches only the trainer-bound points: whenever the in-flight budget reaches one batch,
    KnitTrans admits whole batches (train-batch's behaviour); below one batch it stays mini-batch admission. The
    low-budget points, which the old best-of-points definition took (1.0 after its clamp), are untouched; the gate,
    decided at train-batch's trainer-bound point, must fail, and no other staleness gate notices."""
    original = Simulator.__init__

    def whole_batches_from_one_batch_up(self, cfg, policy, batches):
        original(self, cfg, policy, batches)
        if (isinstance(policy, KnitTransAdmission) and cfg.flow.kind is FlowKind.GROUPS
                and cfg.flow.budget_groups >= len(self.batches[0].plan.groups)):
            policy.on_trainer_ready = types.MethodType(TrainBatchAdmission.on_trainer_ready, policy)

    monkeypatch.setattr(Simulator, "__init__", whole_batches_from_one_batch_up)
    rows = gate_trials()
    gate = {v.claim.name: v for v in evaluate_gate("staleness", rows)}
    assert gate["arch_staleness_reduction"].status is Status.FAILS
    assert gate["arch_staleness_reduction"].measured.value < 0.1
    assert all(v.status is Status.HOLDS for name, v in gate.items() if name != "arch_staleness_reduction")
    every = {v.claim.name: v for v in evaluate("staleness", rows)}["arch_staleness_reduction_every_point"]
    assert every.measured.high > 1.0  # the best point still reads as if nothing had happened


def test_a_missed_wakeup_in_knittrans_fails_the_throughput_ratio(monkeypatch):
    # after committing a mini-batch the policy forgets that more may be ready, so it re-checks only when the next
    # trajectory completes: the trainer waits on rollout it does not need, and stalls once rollout is done
    original = KnitTransAdmission.on_trainer_ready

    def forgetful(self, now):
        out = original(self, now)
        self._dirty = False
        return out

    monkeypatch.setattr(KnitTransAdmission, "on_trainer_ready", forgetful)
    v = _gate()["throughput_ratio"]
    assert v.status is Status.FAILS and v.measured.value < 0.99


def test_admission_without_its_look_ahead_fails_no_dead_ends(monkeypatch):
    """KnitTrans fills each mini-batch first-fit from the ready groups without proving the rest splittable (its
    feasibility check removed): the variable-group scenario then walks into a batch it cannot finish."""

    def careless(self, b, search, r, u, k, rest):
        return minibatch._first_fit_to(list(b.ready_units.values()), self.constraints.minibatch_size,
                                       self.constraints)

    monkeypatch.setattr(minibatch.KnitTransAdmission, "_by_sizes", careless)
    monkeypatch.setattr(minibatch, "solve", lambda *a, **k: Solution(Verdict.FEASIBLE, exact=True))
    v = _gate()["knittrans_violations"]
    assert v.status is Status.FAILS and v.measured.value >= 1


def test_a_greedy_baseline_that_cannot_dead_end_fails_the_scenario_check(monkeypatch):
    # the variable-group scenario must keep exercising feasibility: if the baseline it is measured against
    # (greedy streaming, no look-ahead) stopped dead-ending there, knittrans_violations == 0 would prove nothing
    monkeypatch.setattr(baselines.admission, "GreedyStreamingAdmission", KnitTransAdmission)
    v = _gate()["greedy_dead_ends"]
    assert v.status is Status.FAILS and v.measured.value == 0


def test_releasing_the_budget_a_step_late_fails_littles_law(monkeypatch):
    # the simulator frees a consumed group's budget place one step after the convention says
    original = Simulator._release

    def late(self, mb):
        previous, self._late = getattr(self, "_late", None), mb
        if previous is not None:
            original(self, previous)

    monkeypatch.setattr(Simulator, "_release", late)
    v = _gate()["littles_law_error"]
    assert v.status is Status.FAILS and v.measured.value > 0.10


@pytest.mark.parametrize("table", ["staleness"])
def test_the_gate_module_is_registered_in_the_spec(table):
    from repro.spec import gate_modules

    assert gate_modules()[table] == "repro.staleness"
