"""Simulator vs reality (``python -m repro.simcheck``): does the simulator, calibrated on some real runs, predict
the mean staleness of real runs it never saw?

Rows: one ``SimCheckRun`` per real run (a setting -- admission policy x in-flight budget x weight-sync policy x
wave size -- and a seed), every trajectory through the handoff. ``role`` says whether the run calibrated the
simulator's time model (``calibration``) or is predicted by it (``heldout``): the model is the median over the
calibration runs of each run's fitted parameters, and a held-out prediction uses that model with a calibration
run's response lengths -- nothing from the run it predicts but its settings.

Beside it, Little's law (``knittrans.staleness.littles_law_staleness``): a timing-free prediction from the budget
and sync policy alone. Where flow control alone sets the staleness (rollout keeps the budget full whatever the
timing), both predictors are trivially right; such settings are detected before comparing with the measurement
(``sim_spread``: how far the simulator's own prediction moves when rollout runs 2x faster or 2x slower, about the
spread of step times on a shared machine), flagged, and kept out of the verdict.

Error of a prediction: ``|predicted - measured| / max(measured, 1)`` (mean staleness in steps; a floor of one step
so that near-zero staleness does not blow the ratio up), range [0, inf).

Gate (``make gate``, ``repro.simcheck.gate_trials``): the simulator calibrated on, and predicting, a RECORDED set
of real runs (``repro/fixtures/sim-vs-real-gate.jsonl.gz``: 20 runs of both modes, budgets 16-64, both wave sizes,
two seeds; seed 0 at budgets 16 and 64 calibrates, 14 runs are held out; re-record with
``repro.simcheck.record_gate_traces()`` after a runtime change that moves real staleness). The gate guards the
simulator and its calibration, which are deterministic over a fixed trace; live real runs at CI size swing with
the machine's load (the same six runs gave held-out errors 0.002-0.25 on the shared 2 cores). The current code's
held-out error on the trace is 0.05; the gate's bound, 0.10, fails a simulator that got twice as wrong: one that
stops enforcing the in-flight budget (0.15), a fit that drops rollout/trainer interference (0.13) or budget
released at step start (0.12) (tests/unit/test_gate_simcheck.py). tests/e2e/test_sim_calibration.py checks the
live calibration and held-out mechanics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from knittrans.sim.calibrate import FLOW_DETERMINED_SPREAD, heldout_error
from repro.spec.core import Bound, Claim, ClaimKind, Measured, Trial, median_range, not_measured, trial

TABLE = "sim-vs-real"


@trial(TABLE)
@dataclass(frozen=True)
class SimCheckRun(Trial):
    """One real run, its measured staleness and both predictions of it."""

    mode: str
    budget: int
    sync: str
    wave_groups: int
    role: str
    """``calibration`` (fitted the time model; its prediction is in-sample) or ``heldout`` (predicted)."""
    measured_mean: float
    measured_p99: float
    sim_mean: float
    """The calibrated simulator's mean staleness (pooled time model, a calibration run's lengths)."""
    sim_p99: float
    little_mean: float
    """Little's law: mean staleness from the budget and sync policy alone."""
    sim_spread: float
    """Max - min of the simulator's prediction with rollout 2x faster, as fitted, and 2x slower."""
    wall_s: float
    steps_per_s: float

    @property
    def setting(self) -> tuple[str, int, str, int]:
        return self.mode, self.budget, self.sync, self.wave_groups


rel_error = heldout_error
"""The error of a prediction (``knittrans.sim.calibrate.heldout_error``, which the planner reports too)."""


def setting_errors(rows: Sequence[Trial], which: str, role: str = "heldout",
                   timing_sensitive: bool | None = True) -> dict[tuple, float]:
    """Per setting, the median over its ``role`` runs of the ``which`` (``sim`` or ``little``) prediction's error;
    ``timing_sensitive``: only settings whose runs all moved with timing (True), only flow-determined ones
    (False), or all (None)."""
    by: dict[tuple, list[SimCheckRun]] = {}
    for r in rows:
        if isinstance(r, SimCheckRun) and r.role == role:
            by.setdefault(r.setting, []).append(r)
    out = {}
    for s, rs in sorted(by.items()):
        sensitive = all(r.sim_spread >= FLOW_DETERMINED_SPREAD for r in rs)
        if timing_sensitive is None or sensitive == timing_sensitive:
            out[s] = float(np.median([rel_error(getattr(r, f"{which}_mean"), r.measured_mean) for r in rs]))
    return out


def _name(s: tuple) -> str:
    return f"{s[0]}/b{s[1]}/{s[2]}/w{s[3]}"


def _summary(errs: dict[tuple, float], what: str) -> Measured:
    if not errs:
        return not_measured(f"no {what} settings")
    worst = max(errs, key=errs.get)
    m = median_range(list(errs.values()))
    return Measured(m.value, m.low, m.high, m.n, "min-max over settings",
                    f"{len(errs)} {what} settings; worst {_name(worst)} {errs[worst]:.2f}")


def heldout(which: str, timing_sensitive: bool | None = True):  # noqa: ANN201 - a measure
    what = {True: "timing-sensitive held-out", False: "flow-determined held-out", None: "held-out"}[timing_sensitive]
    return lambda rows: _summary(setting_errors(rows, which, "heldout", timing_sensitive), what)


def flow_determined(rows: Sequence[Trial]) -> Measured:
    """How many held-out settings flow control alone decides (kept out of the verdict), with both errors."""
    fd = setting_errors(rows, "sim", timing_sensitive=False)
    alls = setting_errors(rows, "sim", timing_sensitive=None)
    if not alls:
        return not_measured("no held-out runs")
    lit = setting_errors(rows, "little", timing_sensitive=False)
    detail = "; ".join(f"{_name(s)} sim {fd[s]:.2f} little {lit[s]:.2f}" for s in fd)
    return Measured(float(len(fd)), n=len(alls), note=f"{len(fd)} of {len(alls)} held-out settings: {detail or '-'}")


_DEF = ("per timing-sensitive held-out setting, the median over its held-out runs of |predicted - measured| / "
        "max(measured, 1 step) of the mean staleness (range [0, inf)); ")
_CMP = ("the same real runs (settings x seeds, every trajectory through the handoff); the simulator's time model "
        "and response lengths come from the calibration runs only; Little's law uses no timing at all")

CLAIMS: tuple[Claim, ...] = (
    Claim("sim_heldout_staleness_error", TABLE, ClaimKind.TARGET, paper="(ours) <= 0.20", unit="relative",
          definition=_DEF + "value: the median over those settings, [min, max] over them; holds if <= 0.20. "
                     "Settings where flow control alone sets the staleness (the prediction moves < "
                     f"{FLOW_DETERMINED_SPREAD} steps with rollout 2x faster or slower) are excluded "
                     "(sim_flow_determined_settings)", measure=heldout("sim"), bound=Bound("<=", 0.20),
          gate=Bound("<=", 0.10), comparison=_CMP),
    Claim("littles_law_heldout_staleness_error", TABLE, ClaimKind.MEASUREMENT, paper="(timing-free baseline)",
          unit="relative", definition=_DEF + "for Little's law's prediction; median [min, max] over the settings",
          measure=heldout("little"), comparison=_CMP),
    Claim("sim_flow_determined_settings", TABLE, ClaimKind.MEASUREMENT, paper="(excluded from the verdict)",
          unit="settings", definition="held-out settings whose staleness flow control alone sets (see above), with "
                                      "each one's simulator and Little's-law errors", measure=flow_determined),
    Claim("sim_heldout_error_all_settings", TABLE, ClaimKind.MEASUREMENT, paper="(context)", unit="relative",
          definition="the simulator's held-out error over every setting, flow-determined ones included: what "
                     "counting them would report", measure=heldout("sim", None)),
    Claim("sim_in_sample_error", TABLE, ClaimKind.MEASUREMENT, paper="(context: the old check)", unit="relative",
          definition="the simulator's error on its own calibration runs (in-sample, timing-sensitive settings)",
          measure=lambda rows: _summary(setting_errors(rows, "sim", "calibration"), "timing-sensitive calibration")),
)

GATES = {TABLE: "repro.simcheck"}
