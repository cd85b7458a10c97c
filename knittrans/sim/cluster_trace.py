"""A recorded multi-node run as one JSONL file, and the cluster model's check against it.

Format (one JSON object per line): a ``meta`` line (the layout: driver, unit and rank node ids; the workload;
this machine's memcpy rate), then per pass a ``calibration`` line (that pass's calibration pulls, ``FlowEvent``s)
and one ``pass`` line per system (its raw pass: t0, the measured raw time, bytes, which task graph replays it,
and its events). ``validate`` fits the link on each pass's calibration and replays each system's pass with it
(``knittrans.sim.cluster_model``): the model's prediction of a pass it never saw the flows of.

    >>> import tempfile, os
    >>> from knittrans.dataplane.trace import FlowEvent
    >>> t = ClusterTrace({"driver": "d"}, {0: [FlowEvent("calibration", "a", "b", 8, 0.0, 1.0, "single/0")]}, [])
    >>> p = os.path.join(tempfile.mkdtemp(), "trace.jsonl")
    >>> read_trace(write_trace(p, t)) == t
    True
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from knittrans.dataplane.trace import CpuEvent, FlowEvent, TraceEvent
from knittrans.sim.cluster_model import LinkFit, Prediction, fit_link_repeats, predict_pass


@dataclass(frozen=True)
class RecordedPass:
    """One system's raw pass: t0 -> every rank holds every share, measured, with its trace."""

    pass_index: int
    system: str
    graph: str
    """Which task graph replays it: "central" or "knittrans" (``cluster_model.GRAPHS``)."""
    t0: float
    raw_s: float
    bytes_moved: int
    events: tuple[TraceEvent, ...]
    pixel_bytes: int = 0


@dataclass(frozen=True)
class ClusterTrace:
    meta: dict[str, Any]
    calibration: dict[int, list[FlowEvent]]
    """Pass index -> that pass's calibration pulls."""
    passes: list[RecordedPass]


def _event_json(e: TraceEvent) -> dict[str, Any]:
    return {"type": "flow" if isinstance(e, FlowEvent) else "cpu", **dataclasses.asdict(e)}


def _event(d: dict[str, Any]) -> TraceEvent:
    d = dict(d)
    kind = d.pop("type")
    if kind == "flow":
        return FlowEvent(**d)
    if kind == "cpu":
        return CpuEvent(**d)
    raise ValueError(f"unknown trace event type {kind!r}")


def write_trace(path: str | Path, trace: ClusterTrace) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "meta", **trace.meta}) + "\n")
        for p, evs in sorted(trace.calibration.items()):
            f.write(json.dumps({"kind": "calibration", "pass": p, "events": [_event_json(e) for e in evs]}) + "\n")
        for r in trace.passes:
            row = {k: v for k, v in dataclasses.asdict(r).items() if k != "events"}
            f.write(json.dumps({"kind": "pass", **row, "events": [_event_json(e) for e in r.events]}) + "\n")
    return path


def read_trace(path: str | Path) -> ClusterTrace:
    """Parse a trace file; ``ValueError`` naming the file and line on anything malformed."""
    meta: dict[str, Any] | None = None
    cal: dict[int, list[FlowEvent]] = {}
    passes: list[RecordedPass] = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            kind = obj.pop("kind")
            if kind == "meta":
                meta = obj
            elif kind == "calibration":
                cal[int(obj["pass"])] = [e for e in map(_event, obj["events"]) if isinstance(e, FlowEvent)]
            elif kind == "pass":
                passes.append(RecordedPass(**{**obj, "events": tuple(map(_event, obj["events"]))}))
            else:
                raise ValueError(f"unknown line kind {kind!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: {e}") from e
    if meta is None:
        raise ValueError(f"{path}: no meta line")
    return ClusterTrace(meta, cal, passes)


@dataclass(frozen=True)
class PassCheck:
    """One recorded pass against the model fitted on the same pass's calibration."""

    prediction: Prediction
    fit: LinkFit
    pass_index: int


def validate(trace: ClusterTrace, host_cap: bool = True) -> list[PassCheck]:
    """Per pass: fit the link on that pass's calibration (the median repeat's, ``fit_link_repeats``), replay each
    system's pass."""
    out = []
    fits = {p: fit_link_repeats(evs, host_cap) for p, evs in trace.calibration.items()}
    for r in trace.passes:
        if r.pass_index not in fits:
            raise ValueError(f"pass {r.pass_index} has no calibration in the trace")
        fit = fits[r.pass_index]
        out.append(PassCheck(predict_pass(r.graph, r.events, r.t0, r.raw_s, fit.link, r.system), fit, r.pass_index))
    return out


def fit_errors(checks: Sequence[PassCheck], num: str, den: str) -> dict[str, float]:
    """Relative errors of the model's medians over passes: each system's raw time, and their ratio
    (``num`` / ``den``). Medians of measured and of predicted are compared (the model predicts what a table
    reports), with the per-pass errors' worst for context."""
    def med(system: str, attr: str) -> float:
        return float(np.median([getattr(c.prediction, attr) for c in checks if c.prediction.system == system]))

    out = {}
    for s in (num, den):
        out[s] = med(s, "predicted_s") / med(s, "measured_s") - 1.0
    ratio_meas = med(num, "measured_s") / med(den, "measured_s")
    ratio_pred = med(num, "predicted_s") / med(den, "predicted_s")
    out["ratio"] = ratio_pred / ratio_meas - 1.0
    out["worst_pass"] = max(abs(c.prediction.rel_err) for c in checks)
    return out
