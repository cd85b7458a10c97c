"""Admission table (issue 15): what one admission decision costs, per completed trajectory and per arrival.

One row per timed round: a case (a constraint set and group shape at B, M, max_response_len), timed either as a
whole (``us_per_traj``: every on_complete and trainer-ready call of the batch / B, in CPU time) or per arrival
(``p99_ms``, ``max_ms``: one arrival's on_complete plus its trainer-ready calls). A round that did not finish the
batch in exactly M mini-batches before its deadline counts as infinitely slow.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from repro.spec.core import Bound, Claim, ClaimKind, Measured, Trial, not_measured, trial


@trial("admission")
@dataclass(frozen=True)
class AdmissionTrial(Trial):
    case: str
    batch_size: int
    num_minibatches: int
    timing: str  # "whole" (us_per_traj) or "per_arrival" (p99_ms, max_ms)
    us_per_traj: float
    p99_ms: float
    max_ms: float
    finished: bool
    unknown: int  # decisions that waited on a search cut off by its budget (sound)
    reason: str = ""  # the profile's top functions when the case missed a goal


def _worst(rows: Sequence[AdmissionTrial], timing: str, field: str, what: str) -> Measured:
    """The slowest case's median over its rounds, with the spread of that case's rounds."""
    by_case: dict[str, list[float]] = {}
    for r in rows:
        if r.timing == timing:
            by_case.setdefault(r.case, []).append(getattr(r, field) if r.finished else math.inf)
    if not by_case:
        return not_measured(f"no {timing} rounds")
    med = {c: statistics.median(v) for c, v in by_case.items()}
    worst = max(med, key=med.get)
    xs = by_case[worst]
    reasons = sorted({r.reason for r in rows if r.case == worst and r.reason})
    note = (f"worst of {len(med)} cases: {worst} (B={rows[0].batch_size}, M={rows[0].num_minibatches}); "
            f"{what}" + (f"; {reasons[0]}" if reasons else ""))
    return Measured(med[worst], min(xs), max(xs), len(xs), "min-max over the worst case's rounds", note)


def us_per_traj(rows: Sequence[AdmissionTrial]) -> Measured:
    return _worst(rows, "whole", "us_per_traj", "CPU time per completed trajectory, median of rounds")


def p99_ms(rows: Sequence[AdmissionTrial]) -> Measured:
    return _worst(rows, "per_arrival", "p99_ms", "p99 of one arrival's decision time, median of rounds")


def unknown(rows: Sequence[AdmissionTrial]) -> Measured:
    v = max((r.unknown for r in rows), default=0)
    return Measured(float(v), n=len(rows), note="max over rounds of decisions that waited on a cut-off search")


CLAIMS = (
    Claim("admission_us_per_traj", "admission", ClaimKind.TARGET, "(issue 15) <= 50 us", "us",
          "admission CPU time per completed trajectory, the slowest constraint set's median over rounds; every "
          "case of the table (exact sizes, variable groups, slack, token budgets); range [0, inf)",
          us_per_traj, bound=Bound("<=", 50.0), gate=Bound("<=", 50.0)),
    Claim("admission_p99_ms", "admission", ClaimKind.TARGET, "(issue 15) <= 5 ms", "ms",
          "p99 over arrivals of one arrival's decision time, the slowest case's median over rounds; [0, inf)",
          p99_ms, bound=Bound("<=", 5.0), gate=Bound("<=", 5.0)),
    Claim("admission_unknown_waits", "admission", ClaimKind.MEASUREMENT, "(ours)", "decisions",
          "decisions that waited because a search was cut off (sound, but possibly a missed admission)", unknown),
)
GATES = {"admission": "repro.admission"}
