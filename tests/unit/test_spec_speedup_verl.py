"""The speedup against verl (``mm_transfer_train_speedup_verl``): its step is the baseline's, and rows without
verl's transfer time are not measured."""

from __future__ import annotations


def test_the_verl_speedup_uses_the_baselines_step_and_is_not_measured_without_verl_rows():
    from repro.spec.speedup import CLAIMS, SpeedupTrial

    base = dict(seed=0, group_size=8, images_per_prompt=1, pass_index=0, num_minibatches=2, baseline_transfer_s=0.5,
                knittrans_transfer_s=0.1, baseline_step_s=1.0, knittrans_step_s=0.5, baseline_patches=8,
                knittrans_patches=1, baseline_bytes=8, knittrans_bytes=1)
    claim = next(c for c in CLAIMS if c.name == "mm_transfer_train_speedup_verl")
    with_verl = SpeedupTrial(**base, verl_transfer_s=1.9)
    assert with_verl.speedup_verl == (1.9 + 2 * 1.0) / (0.1 + 2 * 0.5)
    assert claim.measure([with_verl]).value == with_verl.speedup_verl
    assert claim.measure([SpeedupTrial(**base)]).value is None  # verl not run: not measured, never a verdict
