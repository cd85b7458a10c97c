"""The kernels gate: it holds on this code, each TARGET claim's gate fails when the product regresses the way the
claim guards against (injected by monkeypatching product code, never by a switch), the spec's verdicts flip with the
rows, and a gate that cannot run the Triton kernels is skipped, never passed."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from repro.gates import GateOutcome, GateSkipped, evaluate_gate, gate_exemptions, run_gate
from repro.kernels import GATE_CONFIG, check_rows, gate_trials, resolve_device, timing_rows
from repro.spec import claims
from repro.spec.core import Status
from repro.spec.kernels import Check, KernelCheckTrial, KernelOp, KernelTrial
from triton_kernels import backend
from triton_kernels.encoding_hash import reference as hash_ref

bp = importlib.import_module("triton_kernels.batched_pack")  # the package (triton_kernels.batched_pack is the function)
CLAIMS = {c.name: c for c in claims("kernels")}
DEVICE = resolve_device("auto")


def gate_verdict(name: str, rows) -> Status:
    c = CLAIMS[name]
    return c.evaluate(rows, gate=True).status


@pytest.fixture(scope="module")
def gate_rows():
    return gate_trials()


def test_every_target_claim_with_a_gate_holds_on_this_code(gate_rows):
    verdicts = evaluate_gate("kernels", gate_rows)
    gated = {c.name for c in CLAIMS.values() if c.gate is not None}
    assert {v.claim.name for v in verdicts} == gated - set(gate_exemptions("kernels"))
    assert all(v.status is Status.HOLDS for v in verdicts), [(v.claim.name, v.measured) for v in verdicts]


def test_every_cpu_target_claim_has_a_gate_and_the_gpu_ones_say_why_not():
    for c in CLAIMS.values():
        if c.kind.value == "target" and c.gate is None:
            assert "GPU" in c.definition, c.name  # GPU-only claims: no GPU in CI


# -- injected regressions: deterministic claims ------------------------------------------------------------------


def _no_reset(positions: torch.Tensor) -> torch.Tensor:
    """Positions that run on through a row instead of restarting at each sequence (pads keep counting too)."""
    return positions.copy_(torch.arange(positions.shape[1], device=positions.device).expand_as(positions))


def test_hash_length_mixing_dropped_fails_the_zero_pad_gate(monkeypatch):
    for name in ("finalize", "finalize_numpy"):  # the torch twin and the CPU path
        step4 = getattr(hash_ref, name)
        monkeypatch.setattr(hash_ref, name, lambda c, nbytes, step4=step4: step4(c, nbytes * 0))
    assert gate_verdict(Check.HASH_PAD.value, check_rows(DEVICE, 0)) is Status.FAILS


def test_a_kernel_constant_drifting_from_the_reference_fails_the_hash_kernel_gate(monkeypatch):
    from triton_kernels.encoding_hash import kernel

    monkeypatch.setattr(kernel, "LEN_SEED", kernel.LEN_SEED ^ 1)
    rows = check_rows(DEVICE, 0)
    assert gate_verdict(Check.HASH_KERNEL.value, rows) is Status.FAILS
    assert gate_verdict(Check.HASH_PAD.value, rows) is Status.HOLDS  # the reference itself is untouched


def test_kernel_positions_without_reset_fail_the_pack_kernel_gate(monkeypatch):
    from triton_kernels.batched_pack import kernel

    broken = kernel.position_ids_triton
    monkeypatch.setattr(kernel, "position_ids_triton", lambda *a, **k: _no_reset(broken(*a, **k)))
    rows = check_rows(DEVICE, 0)
    assert gate_verdict(Check.PACK_KERNEL.value, rows) is Status.FAILS
    assert gate_verdict(Check.PACK_PATH.value, rows) is Status.HOLDS


def test_torch_path_positions_without_reset_fail_the_pack_path_gate(monkeypatch):
    broken = bp.position_ids_slices
    monkeypatch.setattr(bp, "position_ids_slices", lambda *a, **k: _no_reset(broken(*a, **k)))
    rows = check_rows(DEVICE, 0)
    assert gate_verdict(Check.PACK_PATH.value, rows) is Status.FAILS
    assert gate_verdict(Check.PACK_KERNEL.value, rows) is Status.HOLDS


def test_a_torch_path_that_leaks_old_buffer_contents_into_pads_fails_the_pack_path_gate(monkeypatch):
    copy_field = bp.copy_field

    def pads_left_alone(values, copies, pad_value, out):  # writes the sequences, keeps whatever the pads held
        old = out.clone().view(-1)
        copy_field(values, copies, pad_value, out)
        sizes = [s.stop - s.start for s in copies.seq_slices] + [s.stop for s in copies.pad_slices]
        at = 0
        for i in copies.order:
            if i >= len(copies.seq_slices):
                out.view(-1)[at:at + sizes[i]] = old[at:at + sizes[i]]
            at += sizes[i]
        return out

    monkeypatch.setattr(bp, "copy_field", pads_left_alone)
    assert gate_verdict(Check.PACK_PATH.value, check_rows(DEVICE, 0)) is Status.FAILS


# -- injected regressions: timing claims (ratios within one run; gates with a 3-5x margin) ---------------------------


def test_a_hash_gate_that_does_not_apply_here_is_a_named_skip_that_fails_unless_allowed():
    out = GateOutcome("kernels", (), 1.0, skipped_claims=(("hash_reference_fraction_of_memcpy", "no VNNI"),))
    assert out.failed([]) and out.failed(["kernels/pack_fraction_of_memcpy"])
    assert not out.failed(["kernels/hash_reference_fraction_of_memcpy"]) and not out.failed(["kernels"])
    assert out.lines() == ["SKIP kernels/hash_reference_fraction_of_memcpy: no VNNI"]


@pytest.mark.skipif(bool(gate_exemptions("kernels")), reason="the hash gate does not apply on this CPU (no int8 dot)")
def test_a_hash_without_the_int8_gemm_fails_the_hash_timing_gate(monkeypatch):
    """The product's own fallback for a torch without ``_int_mm``: exact float64 matmul, 8 bytes per input byte."""
    monkeypatch.setattr(hash_ref, "_block_sums",
                        lambda rows, k: (rows.to(torch.float64) @ k.to(torch.float64)).to(torch.int32))
    hash_only = dataclasses.replace(GATE_CONFIG, pack_tokens=[])  # the gate's hash point, not its pack point
    rows = timing_rows(hash_only, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert gate_verdict("hash_reference_fraction_of_memcpy", rows) is Status.FAILS


def test_a_pack_by_per_token_scatter_fails_the_pack_timing_gate(monkeypatch):
    """The CPU pack regressing to the specification's method: an int64 index per token, scattered."""
    packed_by_slices = bp.batched_pack

    def scatter_pack(fields, seq_offsets, plan, pad_values=None, *, impl="auto", out=None):
        got = packed_by_slices(fields, seq_offsets, plan, pad_values, impl=impl, out=out)
        for name, v in fields.items():
            got.fields[name].copy_(bp.pack_field_reference(v, seq_offsets, plan))
        got.position_ids.copy_(bp.position_ids_reference(seq_offsets, plan))
        return got

    monkeypatch.setattr(bp, "batched_pack", scatter_pack)
    pack_only = dataclasses.replace(GATE_CONFIG, images=[])
    rows = timing_rows(pack_only, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert gate_verdict("pack_fraction_of_memcpy", rows) is Status.FAILS


# -- a gate that cannot run the kernels is skipped (and fails CI unless allowed), never passed ---------------------


def test_kernels_defined_compiled_on_a_cpu_machine_skip_the_gate(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU machine the kernels compile: nothing to skip")
    monkeypatch.setattr(backend, "_defined_interpreted", lambda: {"triton_kernels.encoding_hash.kernel": False})
    with pytest.raises(GateSkipped, match="already imported"):
        gate_trials()
    outcome = run_gate("kernels")
    assert outcome.skipped and outcome.failed(allow_skip=[]) and not outcome.failed(allow_skip=["kernels"])


def test_no_interpreter_on_a_cpu_machine_is_reported_not_passed(monkeypatch):
    monkeypatch.setattr(backend, "_defined_interpreted", lambda: {})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET" in backend.triton_unavailable("cpu")
    rows = check_rows(torch.device("cpu"), 0)
    kernel_checks = {r.check: r for r in rows if r.check in (Check.HASH_KERNEL.value, Check.PACK_KERNEL.value)}
    assert all(not r.ran for r in kernel_checks.values())
    for name in kernel_checks:
        assert gate_verdict(name, rows) is Status.NOT_MEASURED


# -- the spec's verdicts flip with fixture rows --------------------------------------------------------------------


def _timed(op: KernelOp, fractions, device="cpu", outputs="", nbytes=1000, spec=None, items=1, impl="reference"):
    return [KernelTrial(seed=0, pass_index=i, op=op.value, impl=impl, device=device, size="s", items=items,
                        bytes_read=nbytes // 2, bytes_written=nbytes - nbytes // 2, op_cpu_s=1.0, op_wall_s=1.0,
                        memcpy_cpu_s=f, memcpy_wall_s=f, outputs=outputs, spec_bandwidth=spec)
            for i, f in enumerate(fractions)]


def test_pack_claim_is_decided_on_the_median_pass_at_the_largest_size():
    c = CLAIMS["pack_fraction_of_memcpy"]
    assert c.evaluate(_timed(KernelOp.PACK, [0.52, 0.55, 0.6], outputs="reused")).status is Status.HOLDS
    assert c.evaluate(_timed(KernelOp.PACK, [0.3, 0.45, 0.48], outputs="reused")).status is Status.FAILS
    # the best pass never decides: passes on both sides of the bound are unstable, never "holds"
    assert c.evaluate(_timed(KernelOp.PACK, [0.3, 0.45, 0.9], outputs="reused")).status is Status.UNSTABLE
    small_fast = _timed(KernelOp.PACK, [0.9, 0.9, 0.9], outputs="reused", nbytes=10)
    assert c.evaluate(small_fast + _timed(KernelOp.PACK, [0.3, 0.3, 0.3], outputs="reused")).status is Status.FAILS
    assert c.evaluate(_timed(KernelOp.PACK, [0.9, 0.9, 0.9], outputs="fresh")).status is Status.NOT_MEASURED


def test_hash_claim_flips_and_its_note_gives_the_profile_reason_when_short():
    c = CLAIMS["hash_reference_fraction_of_memcpy"]
    assert c.evaluate(_timed(KernelOp.HASH, [0.3, 0.3, 0.3])).status is Status.HOLDS
    v = c.evaluate(_timed(KernelOp.HASH, [0.2, 0.2, 0.2]) + _timed(KernelOp.HASH_BLOCK_SUMS, [0.22, 0.22, 0.22]))
    assert v.status is Status.FAILS and "block-sum GEMM" in v.measured.note and "short of 0.25" in v.measured.note


def test_gpu_claims_are_not_measured_without_gpu_rows_and_decided_with_them():
    for name in ("hash_kernel_fraction_of_hbm", "pack_kernel_fraction_of_hbm", "hash_rate_vs_sglang"):
        assert CLAIMS[name].evaluate(_timed(KernelOp.HASH, [0.9])).status is Status.NOT_MEASURED
    hbm = CLAIMS["hash_kernel_fraction_of_hbm"]
    fast = _timed(KernelOp.HASH, [1.0] * 3, device="cuda", nbytes=4_000_000_000, spec=4.8e9, impl="triton")
    slow = _timed(KernelOp.HASH, [1.0] * 3, device="cuda", nbytes=2_000_000_000, spec=4.8e9, impl="triton")
    assert hbm.evaluate(fast).status is Status.HOLDS and hbm.evaluate(slow).status is Status.FAILS
    rate = CLAIMS["hash_rate_vs_sglang"]
    assert rate.evaluate(_timed(KernelOp.HASH_RATE, [1.0], device="cuda", items=100_000)).status is Status.HOLDS
    assert rate.evaluate(_timed(KernelOp.HASH_RATE, [1.0], device="cuda", items=1000)).status is Status.FAILS


@pytest.mark.parametrize("check", list(Check))
def test_check_claims_hold_at_zero_fail_at_one_and_are_not_measured_when_not_run(check):
    c = CLAIMS[check.value]

    def row(mismatches, ran=True):
        return [KernelCheckTrial(0, check.value, "cpu", ran, 5, mismatches, "" if ran else "no triton")]

    assert c.evaluate(row(0)).status is Status.HOLDS
    assert c.evaluate(row(1)).status is Status.FAILS
    assert c.evaluate(row(0, ran=False)).status is Status.NOT_MEASURED
