"""The replay table (``python -m repro.quality_replay``, table ``quality-replay``): SIMULATED schedules of the product
admission policies, each replayed by the learner of ``knittrans.sim.replay`` (every trajectory generated with the
weights of its ``v_gen``). The arms, the AUC and the measures are the real quality table's (``repro/spec/quality.py``);
the module docstring there says what the replay shows and what it does not.

Every claim here is a SIMULATED measurement: no verdict, and never the paper's claim 2, which is decided on the real
runtime (``quality-long``). The replay's learner is a linear-softmax bandit whose only channel of difference between
arms is staleness, so any arm with lower mean staleness wins at every learning rate tried: it shows the direction of
the effect, not its size for an LLM. ``replay_gap_narrowed`` keeps a CI gate, as a regression guard on the product
admission policies (KnitTrans degenerating into train-batch admission fails it), not as a verdict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from repro.spec.core import Bound, Claim, ClaimKind, Evidence, Measured, Trial, trial
from repro.spec.quality import (_NARROWED, _PAPER_NARROWED, ARMS, ArmRun, _context_claims, _gap, _per_arm,
                                gap_closed, gap_narrowed)


REPLAY_TABLE = "quality-replay"


@trial(REPLAY_TABLE)
@dataclass(frozen=True)
class ReplayRun(ArmRun):
    """One arm's simulated schedule replayed by the learner (``knittrans.sim.replay``) from one seed. ``auc``,
    ``final_acc`` and ``init_acc`` are held-out *expected* reward (exact, no evaluation noise)."""

    staleness_mean: float
    staleness_max: float
    clip_frac: float
    """Of the samples with a non-zero advantage, the fraction whose ratio was outside the clip range."""
    mean_reward: float
    steps_per_s: float
    """Simulated steady-state optimizer steps per simulated second (the staleness table's time model)."""
    lr: float
    """The learner's step size (its sensitivity to staleness), stated with every row."""


@trial(REPLAY_TABLE)
@dataclass(frozen=True)
class ReplayProbe(Trial):
    """One simulated run of the budget match (no learning): an arm at a budget, from one seed's workload."""

    arm: str
    budget_groups: int
    steps_per_s: float
    staleness_mean: float
    stalled: bool
    """The simulated run deadlocked at this budget (a whole-batch policy below one batch in flight)."""


_CMP_REPLAY = ("same seeds, workload, prompts, per-trajectory random draws, learner and step count; every schedule "
               "simulated with the staleness table's time model (budget release at step end); KnitTrans at the "
               "smallest budget whose simulated steps/s reaches train-batch's (the match is in the note and in "
               "replay_throughput_match)")
_REPLAY_WHAT = "expected reward (exact; the replay learner of knittrans.sim.replay)"


def _lr_note(rows: Sequence[Trial]) -> str:
    lrs = sorted({r.lr for r in rows if isinstance(r, ReplayRun)})
    return f"learner lr {lrs} (its sensitivity to staleness)"


def _replay_narrowed(rows: Sequence[Trial]) -> Measured:
    m = gap_narrowed(rows)
    return dataclasses.replace(m, note=f"{m.note}; {_lr_note(rows)}")


_CLAIMS: tuple[Claim, ...] = (
    Claim("replay_gap_narrowed", REPLAY_TABLE, ClaimKind.MEASUREMENT, paper=_PAPER_NARROWED, unit="AUC",
          definition=_NARROWED.format(what=_REPLAY_WHAT, verdict="") + ". SIMULATED: a measurement without a "
          "verdict (paper claim 2 is decided on the real runtime: quality-long's quality_gap_narrowed). Gate > 0 at "
          "CI size: a regression guard on the admission policies",
          measure=_replay_narrowed, gate=Bound(">", 0.0), comparison=_CMP_REPLAY),
    Claim("replay_gap", REPLAY_TABLE, ClaimKind.MEASUREMENT, paper="(the gap to narrow)", unit="AUC",
          definition="per-seed paired AUC(colocated) - AUC(train-batch) of the replayed schedules, mean with 95% "
                     "t-interval; range [-1, 1]", measure=_gap, comparison=_CMP_REPLAY),
    Claim("replay_gap_closed", REPLAY_TABLE, ClaimKind.MEASUREMENT, paper="(fraction of the gap)", unit="fraction",
          definition="(mean AUC_kt - mean AUC_tb) / (mean AUC_colocated - mean AUC_tb) over paired seeds, KnitTrans "
                     "at its matched budget; 1 = as good as colocated, > 1 = better (fresher than colocated's "
                     "(M-1)/2); not measured unless the gap's interval lies above 0",
          measure=gap_closed, comparison=_CMP_REPLAY),
    *_context_claims(REPLAY_TABLE, "replay", "simulated steady-state steps/s", _CMP_REPLAY,
                     "same seeds, workload, learner, step count and in-flight budget (P groups)",
                     rate_note="ratio of simulated steady-state steps/s per seed"),
    *(Claim(f"replay_{key}_{arm}", REPLAY_TABLE, ClaimKind.MEASUREMENT, paper="(measured)", unit=unit,
            definition=f"{what} of a {arm} replay; median [min, max] over seeds", measure=_per_arm(arm, key))
      for arm in ARMS for key, unit, what in (
          ("staleness_mean", "steps", "mean v_train - v_gen over every trajectory"),
          ("auc", "reward", "AUC (mean held-out expected reward over the steps, 0 included)"),
          ("clip_frac", "fraction", "fraction of the samples with a non-zero advantage whose ratio left the clip "
                                    "range"))),
)
CLAIMS = tuple(dataclasses.replace(c, evidence=Evidence.SIMULATED) for c in _CLAIMS)

GATES = {REPLAY_TABLE: "repro.quality_replay"}
