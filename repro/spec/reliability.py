"""Reliability table (issue 13): nothing lost, duplicated or corrupted under faults, bad input rejected by name,
bounded memory under load.

One row per measured unit:

- ``part="fault"``: one fault kind on one transport (a runtime scenario, a data-plane scenario, or a chaos kind);
  ``injected`` counts what fired (errors observed, actions taken), ``survived`` those after which every
  trajectory was still trained exactly once with its exact bytes;
- ``part="bad_input"``: one catalogue case (``workloads.reliability_catalogue``); ``rejected`` 1 iff it raised its
  typed error naming the problem and left what was stored intact;
- ``part="load"`` / ``"chaos"``: a whole run with its accounting (lost, duplicated, corrupted), controller state
  after warm-up and, in process, RSS growth.

Pre-registered bounds (issue 13's acceptance): 0 lost, 0 duplicated, 0 corrupted; >= 30 bad-input cases rejected
cleanly and none accepted; >= 20 fault kinds survived and no injected fault unsurvived; controller state bounded
by the producers' window after warm-up; RSS growth after warm-up <= 32 B per trajectory on a load of >= 1e6
trajectories (the state before compaction held ~520 B per trajectory for ever). The gate runs the same claims at
CI size, in process; the RSS claim has no gate (below ~1e6 trajectories allocator noise dominates a per-trajectory
figure). The fault-kind count gates at every kind the CI-size gate runs: ``GATE_FAULT_KINDS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from repro.spec.core import Bound, Claim, ClaimKind, Measured, Trial, not_measured, trial

RSS_MIN_TRAJECTORIES = 1_000_000
GATE_FAULT_KINDS = 27
"""Fault kinds the CI-size gate runs (in process): the 17 chaos kinds of ``workloads.chaos.KINDS`` (controller
restart included; the data-plane scenarios repeat five of them), the 6 Handoff chaos kinds of
``workloads.chaos.HANDOFF_KINDS`` (issue 29) and the 4 runtime scenarios. Each must fire and be survived; a kind that
regresses drops the count below this bound and fails the gate."""


@trial("reliability")
@dataclass(frozen=True)
class ReliabilityTrial(Trial):
    part: str  # fault | bad_input | load | chaos
    scenario: str  # the fault kind, the bad-input case, or the run's label
    transport: str  # inprocess | ray | runtime | (bad input: its category)
    fault_class: str = ""  # lost_data | retries | corruption | hang | input | load
    injected: int = 0
    survived: int = 0
    trajectories: int = 0
    lost: int = 0
    duplicated: int = 0
    corrupted: int = 0
    rejected: int = 0
    throughput: float = math.nan  # trajectories/s (load)
    held_ratio: float = math.nan  # controller-held trajectories after warm-up / (window + 2) mini-batches
    rss_growth_b_per_traj: float = math.nan
    peak_rss_growth_mb: float = math.nan
    wall_s: float = math.nan
    note: str = ""


def _sum(field: str, what: str):  # noqa: ANN202
    def measure(rows: Sequence[ReliabilityTrial]) -> Measured:
        runs = [r for r in rows if r.part in ("fault", "load", "chaos")]
        if not runs:
            return not_measured("no fault, load or chaos rows")
        v = sum(getattr(r, field) for r in runs)
        worst = sorted({f"{r.scenario}/{r.transport}" for r in runs if getattr(r, field)})
        return Measured(float(v), n=len(runs), note=f"{what} over {len(runs)} runs"
                        + (f"; in {worst[:6]}" if worst else ""))
    return measure


def bad_input_rejected(rows: Sequence[ReliabilityTrial]) -> Measured:
    bad = [r for r in rows if r.part == "bad_input"]
    if not bad:
        return not_measured("no bad-input rows")
    cats = sorted({r.transport for r in bad})
    return Measured(float(sum(r.rejected for r in bad)), n=len(bad),
                    note=f"{len(bad)} cases tried in categories {cats}")


def bad_input_accepted(rows: Sequence[ReliabilityTrial]) -> Measured:
    bad = [r for r in rows if r.part == "bad_input"]
    if not bad:
        return not_measured("no bad-input rows")
    miss = [r.scenario for r in bad if not r.rejected]
    return Measured(float(len(miss)), n=len(bad), note=f"accepted or misnamed: {miss}" if miss else "none")


def fault_kinds_survived(rows: Sequence[ReliabilityTrial]) -> Measured:
    faults = [r for r in rows if r.part == "fault"]
    if not faults:
        return not_measured("no fault rows")
    kinds: dict[str, list[ReliabilityTrial]] = {}
    for r in faults:
        kinds.setdefault(r.scenario, []).append(r)
    ok = sorted(k for k, rs in kinds.items() if sum(r.injected for r in rs) > 0
                and all(r.survived == r.injected for r in rs))
    never = sorted(k for k, rs in kinds.items() if sum(r.injected for r in rs) == 0)
    return Measured(float(len(ok)), n=len(faults), note=f"{len(kinds)} kinds tried"
                    + (f"; never fired: {never}" if never else ""))


def faults_not_survived(rows: Sequence[ReliabilityTrial]) -> Measured:
    faults = [r for r in rows if r.part == "fault"]
    if not faults:
        return not_measured("no fault rows")
    bad = [f"{r.scenario}/{r.transport}" for r in faults if r.survived != r.injected]
    return Measured(float(sum(r.injected - r.survived for r in faults)), n=len(faults),
                    note=f"{sum(r.injected for r in faults)} injected" + (f"; not survived: {bad}" if bad else ""))


def held_ratio(rows: Sequence[ReliabilityTrial]) -> Measured:
    xs = [r.held_ratio for r in rows if r.part == "load" and not math.isnan(r.held_ratio)]
    if not xs:
        return not_measured("no load rows with controller state")
    return Measured(max(xs), min(xs), max(xs), len(xs), "min-max over load runs",
                    "max trajectories with live controller metadata after warm-up / (window + 2) mini-batches")


def rss_growth(rows: Sequence[ReliabilityTrial]) -> Measured:
    big = [r for r in rows if r.part == "load" and r.trajectories >= RSS_MIN_TRAJECTORIES
           and not math.isnan(r.rss_growth_b_per_traj)]
    if not big:
        return not_measured(f"no in-process load of >= {RSS_MIN_TRAJECTORIES:,} trajectories")
    xs = [r.rss_growth_b_per_traj for r in big]
    return Measured(max(xs), min(xs), max(xs), len(xs), "min-max over load runs",
                    f"RSS growth after warm-up per trajectory, {big[0].trajectories:,} trajectories; peak RSS growth "
                    f"{max(r.peak_rss_growth_mb for r in big):.0f} MiB")


def throughput(transport: str):  # noqa: ANN202
    def measure(rows: Sequence[ReliabilityTrial]) -> Measured:
        xs = [r for r in rows if r.part == "load" and r.transport == transport]
        if not xs:
            return not_measured(f"no {transport} load")
        v = [r.throughput for r in xs]
        return Measured(max(v), min(v), max(v), len(v), "min-max over load runs",
                        f"{xs[0].trajectories:,} trajectories, {xs[0].wall_s:.1f} s; {xs[0].note}")
    return measure


def _target(name: str, paper: str, unit: str, definition: str, measure, bound: Bound,  # noqa: ANN001
            gate: Bound | None) -> Claim:
    return Claim(name, "reliability", ClaimKind.TARGET, paper, unit, definition, measure, bound=bound, gate=gate)


ZERO = Bound("<=", 0.0)
CLAIMS = (
    _target("reliability_lost", "(issue 13) 0", "trajectories", "trajectories never trained (nor explicitly "
            "discarded) over every fault, chaos and load run; [0, inf)", _sum("lost", "lost"), ZERO, ZERO),
    _target("reliability_duplicated", "(issue 13) 0", "trajectories", "extra trainings of a trajectory (a step "
            "replayed is not a second training: the StepLedger skips it); [0, inf)",
            _sum("duplicated", "trained twice"), ZERO, ZERO),
    _target("reliability_corrupted", "(issue 13) 0", "trajectories", "trajectories delivered with a byte that "
            "differs from what the producer put (every delivered byte checked in chaos runs); [0, inf)",
            _sum("corrupted", "corrupted"), ZERO, ZERO),
    _target("reliability_bad_input_rejected", "(issue 13) >= 30", "cases", "bad-input cases rejected with their "
            "typed error, a message naming the problem, and stored state intact", bad_input_rejected,
            Bound(">=", 30.0), Bound(">=", 30.0)),
    _target("reliability_bad_input_accepted", "(issue 13) 0", "cases", "bad-input cases accepted, misnamed or "
            "leaving state damaged", bad_input_accepted, ZERO, ZERO),
    _target("reliability_fault_kinds_survived", "(issue 13) >= 20", "kinds", "distinct fault kinds that fired at "
            "least once and were survived every time they fired (on every transport run)", fault_kinds_survived,
            Bound(">=", 20.0), Bound(">=", float(GATE_FAULT_KINDS))),
    _target("reliability_faults_not_survived", "(issue 13) 0", "faults", "injected faults (counted from what "
            "fired) after which some trajectory was lost, duplicated or corrupted, or a step ran twice",
            faults_not_survived, ZERO, ZERO),
    _target("reliability_controller_held_ratio", "(issue 13) <= 1", "x bound", "controller state after warm-up: "
            "most trajectories with live metadata / what the producers' window lets be in flight", held_ratio,
            Bound("<=", 1.0), Bound("<=", 1.0)),
    _target("reliability_rss_growth_per_traj", "(issue 13) flat", "B/trajectory", "process RSS growth from "
            "warm-up to the end of an in-process load of >= 1e6 trajectories, per trajectory after warm-up "
            "(before compaction: ~520 B of controller state per trajectory)", rss_growth, Bound("<=", 32.0), None),
    Claim("reliability_throughput_inprocess", "reliability", ClaimKind.MEASUREMENT, "(ours)", "trajectories/s",
          "load throughput in process (tiny payloads: per-trajectory overhead, not bandwidth)",
          throughput("inprocess")),
    Claim("reliability_throughput_ray", "reliability", ClaimKind.MEASUREMENT, "(ours)", "trajectories/s",
          "load throughput on Ray actors (tiny payloads)", throughput("ray")),
)
GATES = {"reliability": "repro.reliability"}
