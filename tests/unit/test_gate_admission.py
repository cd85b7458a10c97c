"""The admission gate fails when product code regresses to per-decision rebuilds, and holds on main."""

from __future__ import annotations

import pytest

from repro.gates import evaluate_gate, run_gate
from repro.spec.admission import AdmissionTrial
from repro.spec.core import Status


def _statuses(out) -> dict[str, Status]:
    return {v.claim.name: v.status for v in out.verdicts}


def test_admission_gate_holds_on_main():
    assert set(_statuses(run_gate("admission")).values()) == {Status.HOLDS}


def test_admission_gate_fails_when_every_decision_rebuilds_the_batch(monkeypatch):
    """The regression issue 15 found: token sums rebuilt over every group on every decision, and a decision on
    every arrival -- quadratic in the batch."""
    from knittrans.admission import minibatch

    compose = minibatch.KnitTransAdmission._compose

    def rebuilding(self, b):
        self._rebuilt = sum(sum(t.num_tokens for t in g.arrived) for g in b.groups.values())
        return compose(self, b)

    monkeypatch.setattr(minibatch.KnitTransAdmission, "_compose", rebuilding)
    monkeypatch.setattr(minibatch.KnitTransAdmission, "on_complete",
                        lambda self, t: (self._record(t), setattr(self, "_dirty", True)))
    assert _statuses(run_gate("admission"))["admission_us_per_traj"] is Status.FAILS


@pytest.mark.parametrize("us,finished,status", [(10.0, True, Status.HOLDS), (60.0, True, Status.FAILS),
                                                (1.0, False, Status.FAILS)])
def test_admission_verdict_follows_the_rows(us, finished, status):
    rows = [AdmissionTrial(0, "a", 8192, 16, "whole", 2.0, 0, 0, True, 0),
            AdmissionTrial(0, "b", 8192, 16, "whole", us, 0, 0, finished, 0),
            AdmissionTrial(0, "b", 8192, 16, "per_arrival", 0, 0.1, 1.0, True, 0)]
    assert {v.claim.name: v.status for v in evaluate_gate("admission", rows)}["admission_us_per_traj"] is status
