"""The regression gates pass on main and fail, naming the claim and the measured value, on injected regressions."""

import pytest

from repro.gate import Injection, main, run_gates


def test_gates_pass_on_main():
    # deterministic gates only: the timing-ratio gates run in `make gate`, outside the busy test session
    results = run_gates(Injection.NONE, timing=False)
    assert results and all(r.passed for r in results), [r.message for r in results if not r.passed]


@pytest.mark.parametrize("inject, claim", [
    (Injection.KNITTRANS_WAITS_WHOLE_BATCH, "arch_staleness_reduction"),
    (Injection.NO_FEASIBILITY_CHECK, "knittrans_constraint_violations"),
    (Injection.DISABLE_DEDUP, "mm_encoder_patch_ratio"),
])
def test_an_injected_regression_fails_the_gate_that_guards_it(inject, claim):
    table = "speedup" if inject is Injection.DISABLE_DEDUP else "staleness"
    results = {r.gate.name: r for r in run_gates(inject, only=table)}
    assert not results[claim].passed
    assert claim in results[claim].message and "measured" in results[claim].message


def test_gate_cli_exit_code_and_message(capsys):
    assert main(["--only", "staleness", "--inject", "knittrans_waits_whole_batch"]) == 1
    out = capsys.readouterr().out
    assert "FAIL staleness/arch_staleness_reduction: measured 0" in out
