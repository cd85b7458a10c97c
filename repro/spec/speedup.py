"""Spec of the speedup table: transfer plus training time per batch, verl-style baseline vs KnitTrans, one row per
(sweep point, pass).

Per batch: baseline = exposed transfer (centralized, build-ahead) + M x one training step that encodes every image
occurrence; KnitTrans = exposed transfer (``knittrans.Handoff`` on Ray, prefetch) + M x one step that encodes each
distinct image once (the share the multimodal handoff delivered). The paper says "up to 5.8x"; the claim is
pre-registered at one sweep point -- the most image occurrences per prompt (largest n x images per prompt), where
the paper's largest gain comes from -- instead of the best of the sweep, which would select on noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from repro.spec.core import (Bound, Claim, ClaimKind, Measured, Trial, median_range, naming_verl, not_measured,
                             trial)

GATES = {"speedup": "repro.speedup"}


@trial("speedup")
@dataclass(frozen=True)
class SpeedupTrial(Trial):
    group_size: int
    """n: samples per prompt."""
    images_per_prompt: int
    pass_index: int
    num_minibatches: int
    """M: optimizer steps per batch."""
    baseline_transfer_s: float | None
    """Exposed transfer latency per batch, centralized (build-ahead), steady state."""
    knittrans_transfer_s: float | None
    """Exposed transfer latency per batch, knittrans-ray (prefetch), steady state."""
    baseline_step_s: float
    """One forward + backward of rank 0's mini-batch share, every image occurrence encoded (median of repeats)."""
    knittrans_step_s: float
    """The same share as the handoff delivered it, each distinct image encoded once."""
    baseline_patches: int
    """Patches the vision tower encoded in the baseline step (counted by a hook on the tower)."""
    knittrans_patches: int
    baseline_bytes: int
    """Bytes per batch the baseline moved (gather + scatter)."""
    knittrans_bytes: int
    verl_transfer_s: float | None = None
    """Exposed transfer latency per batch, verl (verl's own code, ``baselines.verl_system``: per-sample
    multi_modal_inputs in a DataProto, three dispatches per step through its single controller; build-ahead), steady
    state; None where it was not run (rows before session 28: the re-implementation verl-mm). Its training step is
    the baseline's (every occurrence encoded)."""
    verl_version: str | None = None
    """The verl that ran (None where it did not)."""
    image_side: int | None = None
    """Nominal image side in pixels (the paper's images are 448 x 448); None for rows written before this column."""
    prompts_per_batch: int | None = None
    """P: prompts per batch."""

    @property
    def speedup(self) -> float | None:
        if self.baseline_transfer_s is None or self.knittrans_transfer_s is None:
            return None
        m = self.num_minibatches
        return ((self.baseline_transfer_s + m * self.baseline_step_s)
                / (self.knittrans_transfer_s + m * self.knittrans_step_s))

    @property
    def speedup_verl(self) -> float | None:
        """``speedup`` with verl's transfer as the baseline's."""
        if self.verl_transfer_s is None or self.knittrans_transfer_s is None:
            return None
        m = self.num_minibatches
        return ((self.verl_transfer_s + m * self.baseline_step_s)
                / (self.knittrans_transfer_s + m * self.knittrans_step_s))


def _point(r: SpeedupTrial) -> tuple[int, int]:
    return r.group_size, r.images_per_prompt


def registered_point(rows: Sequence[SpeedupTrial]) -> tuple[int, int] | None:
    """The pre-registered sweep point: the most image occurrences per prompt (n x k), then the larger n."""
    points = {_point(r) for r in rows}
    return max(points, key=lambda p: (p[0] * p[1], p[0])) if points else None


def at_point(field: str) -> Callable[[Sequence[Trial]], Measured]:
    def measure(rows: Sequence[Trial]) -> Measured:
        mine = [r for r in rows if isinstance(r, SpeedupTrial)]
        p = registered_point(mine)
        if p is None:
            return not_measured("no speedup trials")
        vals = [v for v in (getattr(r, field) for r in mine if _point(r) == p) if v is not None]
        if not vals:
            return not_measured(f"no {field} at n={p[0]}, {p[1]} image(s) per prompt (its system was not run)")
        return median_range(vals, f"n={p[0]}, {p[1]} image(s) per prompt{_size(mine)}")
    return measure


def _size(rows: Sequence[SpeedupTrial]) -> str:
    """The image size and batch the rows ran at, against the paper's 448 px."""
    sides = sorted({r.image_side for r in rows if r.image_side is not None})
    prompts = sorted({r.prompts_per_batch for r in rows if r.prompts_per_batch is not None})
    if not sides:
        return "; image size not logged (rows older than the image_side column)"
    return (f", {'/'.join(map(str, sides))} px images (the paper's: 448 px), P={'/'.join(map(str, prompts))} "
            f"prompts per batch")


def step_ratio(rows: Sequence[Trial]) -> Measured:
    mine = [r for r in rows if isinstance(r, SpeedupTrial)]
    p = registered_point(mine)
    if p is None:
        return not_measured("no speedup trials")
    return median_range([r.baseline_step_s / r.knittrans_step_s for r in mine if _point(r) == p],
                        f"n={p[0]}, {p[1]} image(s) per prompt")


def transfer_ratio(rows: Sequence[Trial]) -> Measured:
    mine = [r for r in rows if isinstance(r, SpeedupTrial) and r.knittrans_transfer_s is not None
            and r.baseline_transfer_s is not None]
    p = registered_point(mine)
    if p is None:
        return not_measured("no transfer measured")
    at = [r for r in mine if _point(r) == p]
    d = float(np.median([r.knittrans_transfer_s for r in at]))
    return median_range([r.baseline_transfer_s / max(r.knittrans_transfer_s, 1e-4) for r in at],
                        f"n={p[0]}, {p[1]} image(s); knittrans-ray median {d * 1e3:.3g} ms per batch"
                        + (" (tiny denominator)" if d < 0.02 else ""))


def best_point(rows: Sequence[Trial]) -> Measured:
    mine = [r for r in rows if isinstance(r, SpeedupTrial) and r.speedup is not None]
    if not mine:
        return not_measured("no speedup trials")
    med = {p: float(np.median([r.speedup for r in mine if _point(r) == p])) for p in {_point(r) for r in mine}}
    best = max(med, key=med.get)
    return Measured(med[best], min(med.values()), max(med.values()), len(med), "min-max over sweep points",
                    f"best point n={best[0]}, {best[1]} image(s) per prompt (a selection over the sweep)")


def patch_ratio_over_n(rows: Sequence[Trial]) -> Measured:
    mine = [r for r in rows if isinstance(r, SpeedupTrial)]
    vals = [r.baseline_patches / r.knittrans_patches / r.group_size for r in mine if r.knittrans_patches > 0]
    if not vals:
        return not_measured("no patches counted")
    worst = max(vals, key=lambda v: abs(v - 1.0))
    return Measured(worst, min(vals), max(vals), len(vals), "min-max over (point, pass)",
                    f"points (n, k): {sorted({_point(r) for r in mine})}")


S = "speedup"
SAME = ("same batches (rank 0's share of mini-batch 0 for training; the whole batch for transfer), same model and "
        "weights, same trainer-rank actors and rollout clock; each system's emulated compute in the transfer pass is "
        "calibrated to its own measured step (the window its overlap has); what changes is the system: verl's path "
        "(every occurrence moved and encoded) vs knittrans.Handoff with the dedup trainer path")

CLAIMS: tuple[Claim, ...] = (
    Claim("mm_transfer_train_speedup", S, ClaimKind.TARGET, "up to 5.8x", "x",
          "(baseline exposed transfer + M baseline steps) / (KnitTrans exposed transfer + M dedup steps) per batch, "
          "per pass, at the pre-registered point (largest n x images per prompt); median over K passes, [min, max]; "
          "range (0, inf). Decided at the table's image size (the largest that fits a make repro on 2 CPU cores; "
          "stated in the note with the paper's 448 px: a larger image raises the vision tower's share of a step "
          "and so what dedup saves). Bound 4.6 = 0.8 x 5.8, fixed before the run. Gate bound 1.5 at CI size (n=8, "
          "336px, "
          "the tiny model, whose vision tower is then most of a step, 5 passes): medians 2.9-3.3 on an idle 2-core "
          "machine, and 1.24-1.27 with the plane's dedup off (at 168px, the gate's size until session 21, 2.1-2.3 "
          "and 1.30-1.44: too close to the bound for the regression test to run in CI)",
          at_point("speedup"), bound=Bound(">=", 4.6), gate=Bound(">=", 1.5), comparison=SAME, paper_claim=4),
    Claim("mm_encoder_patch_ratio", S, ClaimKind.TARGET, "n (each distinct image encoded once)", "x n",
          "vision-tower patches encoded per step, baseline / KnitTrans, divided by n, counted by a hook on the tower "
          "while training on the share the handoff delivered; exactly 1 at every (point, pass) (the row farthest "
          "from 1 decides; deterministic)", patch_ratio_over_n, bound=Bound("==", 1.0), gate=Bound("==", 1.0),
          comparison=SAME),
    Claim("mm_transfer_train_speedup_best", S, ClaimKind.MEASUREMENT, "up to 5.8x", "x",
          "the speedup's median at the best sweep point (a selection over the sweep: context, not a verdict)",
          best_point, comparison=SAME),
    Claim("mm_transfer_train_speedup_verl", S, ClaimKind.MEASUREMENT, "up to 5.8x", "x",
          "the same speedup with verl (verl's own code, the version named in the note: per-sample multi_modal_inputs "
          "dicts of tensors in a DataProto, gathered to the driver and moved through verl's single controller for "
          "each of old log-prob, reference and update) as the baseline's transfer, at the pre-registered point; not "
          "measured when verl was not run", naming_verl(at_point("speedup_verl")), comparison=SAME),
    Claim("mm_train_speedup", S, ClaimKind.MEASUREMENT, "(context)", "x",
          "baseline step / dedup step at the pre-registered point (what dedup saves in training alone)", step_ratio),
    Claim("mm_transfer_speedup", S, ClaimKind.MEASUREMENT, "(context)", "x",
          "baseline / KnitTrans exposed transfer per batch at the pre-registered point", transfer_ratio,
          comparison=SAME),
)
