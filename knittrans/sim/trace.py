"""A real run's trace on disk: what the simulator's calibration and its checks read from a run, and nothing else.

``RunTrace.of(run)`` keeps, of a ``knittrans.runtime.RunResult``, the run's config, every trajectory's dispatch,
completion, versions and length, every optimizer step's interval and tokens, the mean weight-sync cost and the
wall-clock. It offers the same attributes ``knittrans.sim.calibrate`` reads from a live run (``config``,
``trajectories``, ``steps``, ``timings()``, ``staleness()``, ``staleness_stats``, ``wall_s``,
``throughput_steps_per_s()``), so a time model can be fitted -- and a held-out prediction checked -- from traces
recorded on another machine or day (``save_traces`` / ``load_traces``: gzip'd JSON, one object per run, columnar).

Used by the sim-vs-real gate (``repro.simcheck.gate_trials``), which replays the calibrated simulator over a
recorded set of real runs so that its verdict depends on the simulator and calibration code only, not on how busy
the CI machine happens to be.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from knittrans.runtime.config import RuntimeConfig
from knittrans.runtime.records import StepRecord, TrajRecord
from knittrans.staleness import StalenessStats

FORMAT = 1
_TRAJ = ("traj_id", "group_id", "batch_id", "num_tokens", "v_gen", "v_train", "t_dispatch", "t_complete")
_STEP = ("step", "version", "batch_id", "minibatch_index", "t_start", "t_end", "step_s", "tokens")


class TraceFormatError(ValueError):
    """A trace file that is not a run trace of this format (the message names the file and what is wrong)."""


@dataclass(frozen=True)
class _Timings:
    sync_s_mean: float


@dataclass(frozen=True)
class RunTrace:
    """One real run, as far as the simulator's calibration sees it. ``role`` is free for the caller (e.g.
    ``calibration`` / ``heldout``)."""

    config: RuntimeConfig
    trajectories: tuple[TrajRecord, ...]
    steps: tuple[StepRecord, ...]
    sync_s_mean: float
    wall_s: float
    role: str = ""

    @classmethod
    def of(cls, run: Any, role: str = "") -> "RunTrace":  # a knittrans.runtime.RunResult
        sync = run.timings().sync_s_mean
        return cls(run.config, tuple(run.trajectories), tuple(run.steps),
                   float(sync) if np.isfinite(sync) else 0.0, float(run.wall_s), role)

    def timings(self) -> _Timings:
        return _Timings(self.sync_s_mean)

    def staleness(self) -> np.ndarray:
        return np.array([t.staleness for t in self.trajectories], dtype=float)

    @property
    def staleness_stats(self) -> StalenessStats:
        return StalenessStats.of(self.staleness())

    def throughput_steps_per_s(self) -> float:
        return len(self.steps) / self.wall_s if self.wall_s > 0 else float("nan")

    # -- on disk ---------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        cfg = {f.name: _plain(getattr(self.config, f.name)) for f in dataclasses.fields(self.config)}
        return {"format": FORMAT, "role": self.role, "config": cfg, "wall_s": self.wall_s,
                "sync_s_mean": self.sync_s_mean,
                "trajectories": {k: [getattr(t, k) for t in self.trajectories] for k in _TRAJ},
                "steps": {k: [getattr(s, k) for s in self.steps] for k in _STEP}}

    @classmethod
    def from_dict(cls, d: dict, where: str = "trace") -> "RunTrace":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise TraceFormatError(f"{where}: not a run trace of format {FORMAT} (got "
                                   f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r})")
        try:
            config = RuntimeConfig(**d["config"])
            tr, st = d["trajectories"], d["steps"]
            trajs = tuple(TrajRecord(traj_id=int(a), group_id=int(g), batch_id=int(b), num_tokens=int(n),
                                     reward=float("nan"), v_gen=int(vg), t_dispatch=float(td), t_complete=float(tc),
                                     v_train=int(vt))
                          for a, g, b, n, vg, vt, td, tc in zip(*(tr[k] for k in _TRAJ), strict=True))
            steps = tuple(StepRecord(step=int(s), version=int(v), batch_id=int(b), minibatch_index=int(m),
                                     t_start=float(a), t_end=float(e), step_s=float(ss), tokens=int(tk),
                                     mean_reward=float("nan"), mean_staleness=float("nan"), clip_frac=float("nan"),
                                     loss=float("nan"), kl=float("nan"))
                          for s, v, b, m, a, e, ss, tk in zip(*(st[k] for k in _STEP), strict=True))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceFormatError(f"{where}: malformed run trace ({type(e).__name__}: {e})") from None
        return cls(config, trajs, steps, float(d["sync_s_mean"]), float(d["wall_s"]), str(d.get("role", "")))


def _plain(v: Any) -> Any:
    return v.value if isinstance(v, Enum) else v


def save_traces(path: str | Path, traces: Iterable[RunTrace]) -> Path:
    """Write ``traces`` to ``path`` (gzip'd JSON lines, one run per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for t in traces:
            f.write(json.dumps(t.to_dict(), separators=(",", ":")) + "\n")
    return path


def load_traces(path: str | Path) -> list[RunTrace]:
    """The traces ``save_traces`` wrote, in order."""
    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.strip()]
    except (OSError, EOFError) as e:
        raise TraceFormatError(f"{path}: not a gzip'd run-trace file ({e})") from None
    out = []
    for i, ln in enumerate(lines):
        try:
            d = json.loads(ln)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{path}:{i + 1}: not JSON ({e})") from None
        out.append(RunTrace.from_dict(d, f"{path}:{i + 1}"))
    return out


def roles(traces: Sequence[RunTrace]) -> list[tuple[str, RunTrace]]:
    """``(role, trace)`` pairs, the shape ``repro.simcheck.predict_all`` takes."""
    return [(t.role, t) for t in traces]
