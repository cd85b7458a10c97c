"""The regression gates pass on main and fail, naming the claim and the measured value, on injected regressions.

(The staleness table's gates live in the spec now: tests/unit/test_gate_staleness.py.)"""

import pytest

from repro.gate import Injection, main, run_gates


def test_gates_pass_on_main():
    # deterministic gates only: the timing-ratio gates run in `make gate`, outside the busy test session
    results = run_gates(Injection.NONE, timing=False)
    assert results and all(r.passed for r in results), [r.message for r in results if not r.passed]


@pytest.mark.parametrize("inject, claim", [
    (Injection.DISABLE_DEDUP, "mm_encoder_patch_ratio"),
])
def test_an_injected_regression_fails_the_gate_that_guards_it(inject, claim):
    results = {r.gate.name: r for r in run_gates(inject, only="speedup")}
    assert not results[claim].passed
    assert claim in results[claim].message and "measured" in results[claim].message


def test_gate_cli_exit_code_and_message(capsys):
    assert main(["--only", "speedup", "--inject", "disable_dedup"]) == 1
    out = capsys.readouterr().out
    assert "FAIL speedup/mm_encoder_patch_ratio: measured" in out
