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
