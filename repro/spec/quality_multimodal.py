"""The multimodal quality run (``python -m repro.quality workload=multimodal``, table ``quality-multimodal``): the tiny
Qwen2-VL on the counting task, GRPO through the same orchestrator and handoff (encoder once per distinct image),
arms ``colocated``, ``train_batch`` (budget P) and ``knittrans`` (a fixed budget from the config, not
throughput-matched). One ``MMQualityRun`` per (seed, arm). Its claims are all measurements (no verdict): a
~170K-parameter VLM learns little in the few dozen GRPO steps that fit a CPU run (docs/mmdedup.md: held-out greedy
accuracy can even fall while the sampled reward rises), so an AUC difference there is context, not evidence for
or against the paper's claim. Besides greedy accuracy the rows carry the held-out *sampled* reward (one sample per
prompt at T = 1, GRPO's objective) and the encoder patches of every step (dedup: each share's distinct images).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from repro.spec.core import Claim, ClaimKind, Measured, Trial, median_range, paired_mean_ci, trial
from repro.spec.quality import ArmRun, _by_seed, _paired, _per_arm, arch_reduction, throughput_ratio

MM_TABLE = "quality-multimodal"
MM_ARMS = ("colocated", "train_batch", "knittrans")


@trial(MM_TABLE)
@dataclass(frozen=True)
class MMQualityRun(ArmRun):
    """One GRPO run of one arm on the tiny VLM (counting task) from one seed's warm start."""

    sampled_auc: float
    """Mean held-out sampled reward (one sample per prompt, T = 1) over the evaluation points, in [0, 1]."""
    sampled_final: float
    mean_reward: float
    """Mean on-policy reward of the trajectories trained on."""
    staleness_mean: float
    staleness_max: float
    staleness_bound: int
    clip_frac: float
    wall_s: float
    """Run wall-clock (rollout + training through the handoff; evaluation excluded)."""
    steps_per_s: float
    encoder_patches: int
    """Patches the learner's vision encoder ran over, summed over steps (each share's distinct images)."""
    occurrence_patches: int
    """Patches of every sample's images, summed over steps (what an encoder without dedup runs over)."""
    warm_steps: int
    """Supervised warm-start steps this seed's start took (shared by its arms)."""
    warm_acc: float
    """The warm start's own evaluation accuracy when it stopped."""


def _mm_budget_note(rows: Sequence[Trial]) -> str:
    b = {a: sorted({r.budget_groups for r in _by_seed(rows, a).values()}) for a in ("train_batch", "knittrans")}
    return f"budgets (groups): train-batch {b['train_batch']}, KnitTrans {b['knittrans']} (not throughput-matched)"


def _dedup_factor(rows: Sequence[Trial]) -> Measured:
    return median_range([r.occurrence_patches / r.encoder_patches for r in rows
                         if isinstance(r, MMQualityRun) and r.encoder_patches > 0],
                        note="per run: occurrence patches / patches the learner's encoder ran over")


_MM_INFO = ("informational: no verdict (a tiny VLM learns little in a CPU-sized GRPO run; see the module doc)")
_CMP_MM = ("same seeds, warm start, prompt stream, batch shape and step count; KnitTrans at its configured budget, "
           "train-batch at P (budgets differ: this compares the systems as configured, not at matched throughput)")

CLAIMS = (
    Claim("mmquality_gap", MM_TABLE, ClaimKind.MEASUREMENT, paper="(the gap, tiny VLM)", unit="AUC",
          definition="per-seed paired AUC(colocated) - AUC(train-batch), AUC = mean held-out greedy accuracy over "
                     f"the evaluation points; mean with 95% t-interval, range [-1, 1]; {_MM_INFO}",
          measure=lambda rows: paired_mean_ci(_paired(rows, "colocated", "train_batch", "auc")),
          comparison="same seeds, warm start, prompts and step count; colocated vs train-batch"),
    Claim("mmquality_knittrans_vs_train_batch", MM_TABLE, ClaimKind.MEASUREMENT, paper="(narrower gap, tiny VLM)",
          unit="AUC",
          definition="per-seed paired AUC(KnitTrans) - AUC(train-batch), greedy held-out accuracy; mean with 95% "
                     f"t-interval, range [-1, 1]; {_MM_INFO}",
          measure=lambda rows: paired_mean_ci(_paired(rows, "knittrans", "train_batch", "auc"),
                                              note=_mm_budget_note(rows)), comparison=_CMP_MM),
    Claim("mmquality_sampled_knittrans_vs_train_batch", MM_TABLE, ClaimKind.MEASUREMENT, paper="(GRPO objective)",
          unit="reward",
          definition="per-seed paired sampled AUC(KnitTrans) - sampled AUC(train-batch), sampled AUC = mean held-out "
                     "reward of one T = 1 sample per prompt over the evaluation points; mean with 95% t-interval, "
                     f"range [-1, 1]; {_MM_INFO}",
          measure=lambda rows: paired_mean_ci(_paired(rows, "knittrans", "train_batch", "sampled_auc"),
                                              note=_mm_budget_note(rows)), comparison=_CMP_MM),
    Claim("mmquality_throughput_ratio", MM_TABLE, ClaimKind.MEASUREMENT, paper="(context)", unit="x",
          definition="raw steps/s of KnitTrans over train-batch's, per seed within one pass; median [min, max]",
          measure=lambda rows: throughput_ratio(rows, "knittrans")),
    Claim("mmquality_arch_staleness_reduction", MM_TABLE, ClaimKind.MEASUREMENT, paper="0.93 (staleness table)",
          unit="fraction",
          definition="per seed 1 - A_kt / A_tb, A = mean measured staleness - colocated's; range (-inf, 1]; "
                     "median [min, max] over seeds", measure=lambda rows: arch_reduction(rows, "knittrans"),
          comparison=_CMP_MM),
    Claim("mmquality_encoder_dedup_factor", MM_TABLE, ClaimKind.MEASUREMENT, paper="(n: encoder once per image)",
          unit="x",
          definition="per run, image patches of every trained sample over the patches the learner's vision encoder "
                     "ran over (each share's distinct images); equals the group size n unless two prompts of a "
                     "mini-batch show the same image; median [min, max] over runs", measure=_dedup_factor),
    *(Claim(f"mmquality_staleness_{arm}", MM_TABLE, ClaimKind.MEASUREMENT, paper="(measured)", unit="steps",
            definition=f"mean v_train - v_gen over every trajectory of a {arm} run, from the handoff's records; "
                       f"median [min, max] over seeds", measure=_per_arm(arm, "staleness_mean")) for arm in MM_ARMS),
    *(Claim(f"mmquality_auc_{arm}", MM_TABLE, ClaimKind.MEASUREMENT, paper="(measured)", unit="accuracy",
            definition=f"AUC (mean held-out greedy accuracy over the evaluation points) of a {arm} run; median "
                       f"[min, max] over seeds", measure=_per_arm(arm, "auc")) for arm in MM_ARMS),
    *(Claim(f"mmquality_wallclock_{arm}", MM_TABLE, ClaimKind.MEASUREMENT, paper="(measured)", unit="s",
            definition=f"wall-clock of a {arm} run (rollout + training through the handoff, evaluation excluded); "
                       f"median [min, max] over seeds", measure=_per_arm(arm, "wall_s")) for arm in MM_ARMS),
)
