"""The contract's vocabulary: trial rows, claims, bounds, measurements, verdicts.

Every table writes typed **trial rows** (one frozen dataclass per table, registered with ``@trial``) to
``results/<table>/trials.jsonl`` (``repro.trials``). Every claim is a **pure function of trial rows** with its
metric's definition and, for a target claim, a **pre-registered bound**, written here before any run. Verdicts are
computed from logged rows by ``evaluate`` and nothing else: a table script never decides whether a claim holds,
and ``report``, ``gate`` and the README's results table read verdicts only from here.

Two kinds of claim:

- ``TARGET``: the paper's number (or our pre-registered target); carries a verdict and is counted in the report.
- ``MEASUREMENT``: reported for context (a bytes ratio, an in-process variant); never a verdict, never counted.

Two labels say what a claim's number is evidence of. ``paper_claim`` (1-4) marks the one target that decides each
of the paper's four headline claims (DESIGN.md; ``PAPER_CLAIMS``): exactly one per claim, so one paper claim never
gets two verdicts. ``evidence`` says where the number comes from: ``MEASURED`` on this machine (the staleness table's
schedules are the product admission policies run on the simulator's calibrated time model, checked against the
real runtime by sim-vs-real), ``MODELLED`` (a model's projection to hardware we do not have) or ``SIMULATED`` (a
simulated stand-in for the thing the claim is about, e.g. a bandit learner for an LLM's learning). A MODELLED or
SIMULATED claim never decides a paper claim (``paper_claim`` needs ``MEASURED``); the report lists them apart.

**Stability.** A target whose value is a median over repeated passes, seeds or runs (``Measured.repeats``) and whose
[min, max] over them straddles its bound (the bound holds at one end and not at the other) is ``UNSTABLE``, never
``HOLDS`` or ``FAILS``: its verdict would flip with the run. ``==`` bounds (deterministic counts) and claims decided
on an interval's end or a worst case are not judged this way. Gates (``repro.gates``) decide on the value alone:
their bounds carry stated margins.

Example::

    >>> @trial("demo")
    ... @dataclass(frozen=True)
    ... class DemoTrial(Trial):
    ...     ratio: float
    >>> c = Claim("demo_ratio", "demo", ClaimKind.TARGET, paper=">= 2", unit="x", definition="a ratio",
    ...           measure=lambda rows: median_range([r.ratio for r in rows]), bound=Bound(">=", 2.0))
    >>> v = c.evaluate([DemoTrial(seed=0, ratio=2.1), DemoTrial(seed=1, ratio=2.5), DemoTrial(seed=2, ratio=3.0)])
    >>> v.status.value, v.measured.value, (v.measured.low, v.measured.high)
    ('holds', 2.5, (2.1, 3.0))
    >>> c.evaluate([DemoTrial(seed=0, ratio=1.5), DemoTrial(seed=1, ratio=2.5)]).status.value  # seeds disagree
    'unstable'
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, ClassVar, Sequence

import numpy as np


@dataclass(frozen=True)
class Trial:
    """Base of every trial row: one measured unit of a table (a seed, a pass, a sweep point). Subclasses add the
    table's fields; ``TABLE`` is set by ``@trial``."""

    TABLE: ClassVar[str] = ""
    seed: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TRIAL_TYPES: dict[str, type[Trial]] = {}


def trial(table: str) -> Callable[[type[Trial]], type[Trial]]:
    """Register a trial-row class for ``table`` (one per table; the name is how trials.jsonl stores it)."""

    def register(cls: type[Trial]) -> type[Trial]:
        if not (dataclasses.is_dataclass(cls) and issubclass(cls, Trial)):
            raise TypeError(f"@trial({table!r}) needs a dataclass subclass of Trial, got {cls!r}")
        if cls.__name__ in TRIAL_TYPES and TRIAL_TYPES[cls.__name__] is not cls:
            raise TypeError(f"two trial-row classes are named {cls.__name__}")
        cls.TABLE = table
        TRIAL_TYPES[cls.__name__] = cls
        return cls

    return register


def row_from_dict(type_name: str, data: dict[str, Any]) -> Trial:
    """Rebuild a logged row. Unknown fields are an error (a log from another version of the spec)."""
    cls = TRIAL_TYPES.get(type_name)
    if cls is None:  # the table modules register their row types when imported: load the whole spec once
        import repro.spec

        repro.spec.claims()
        cls = TRIAL_TYPES.get(type_name)
    if cls is None:
        raise ValueError(f"unknown trial-row type {type_name!r} (known: {sorted(TRIAL_TYPES)})")
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(data) - names
    if extra:
        raise ValueError(f"{type_name}: logged fields {sorted(extra)} are not in the spec's row type")
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            v = data[f.name]
            kw[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kw)


class ClaimKind(str, Enum):
    TARGET = "target"
    MEASUREMENT = "measurement"


class Evidence(str, Enum):
    """Where a claim's number comes from (module docstring)."""

    MEASURED = "measured"
    MODELLED = "modelled"
    SIMULATED = "simulated"


PAPER_CLAIMS = {
    1: "up to 93% lower architectural staleness than train-batch admission",
    2: "a narrower learning-quality gap between disaggregated and colocated runs",
    3: "multimodal transfer latency cut by two orders of magnitude",
    4: "up to 5.8x speedup in multimodal transfer plus training",
}
"""The paper's four headline claims (DESIGN.md), by the number a claim's ``paper_claim`` names."""


_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}


@dataclass(frozen=True)
class Bound:
    """A pre-registered threshold: the claim holds iff ``measured <op> value``."""

    op: str
    value: float

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"Bound.op must be one of {sorted(_OPS)}, got {self.op!r}")

    def holds(self, x: float) -> bool:
        return bool(_OPS[self.op](x, self.value))

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


@dataclass(frozen=True)
class Measured:
    """A claim's value over its rows: ``value`` decides; ``[low, high]`` is its spread (``spread`` says which:
    min-max over passes or seeds, or a confidence interval); ``n`` how many trials it summarizes. ``value`` None:
    not measured (the rows it needs are absent), with the reason in ``note``."""

    value: float | None
    low: float | None = None
    high: float | None = None
    n: int = 0
    spread: str = ""
    note: str = ""
    repeats: bool = False
    """[low, high] spans repeated passes, seeds or runs of one configuration around a median ``value`` (what the
    stability rule reads); False for intervals, worst cases and spreads over different settings."""

    @property
    def measured(self) -> bool:
        """A number was measured (+inf counts: e.g. a run that never finished is infinitely slow; NaN does not)."""
        return self.value is not None and not math.isnan(self.value)


def not_measured(why: str) -> Measured:
    return Measured(None, note=why)


class Status(str, Enum):
    HOLDS = "holds"
    FAILS = "fails"
    UNSTABLE = "unstable"  # the repeats straddle the bound: neither holds nor fails (module docstring)
    NOT_MEASURED = "not measured"
    INFO = "info"  # a measurement claim: no verdict


def straddles(m: Measured, bound: Bound) -> bool:
    """The repeats behind ``m`` fall on both sides of ``bound`` (the stability rule; module docstring).

    >>> straddles(Measured(0.19, 0.07, 0.23, 6, repeats=True), Bound("<=", 0.2))
    True
    >>> straddles(Measured(0.19, 0.07, 0.23, 6), Bound("<=", 0.2))  # an interval or a worst case: not judged so
    False
    """
    if not m.repeats or bound.op == "==" or m.low is None or m.high is None:
        return False
    return bound.holds(m.low) != bound.holds(m.high)


@dataclass(frozen=True)
class Claim:
    """One claim: what is measured (``definition``, with the metric's range), how (``measure``: a pure function of
    the table's trial rows), and, for a target, the bound that decides it (fixed before the run)."""

    name: str
    table: str
    kind: ClaimKind
    paper: str
    """The paper's statement of the number (or "(ours)" for a target of our own)."""
    unit: str
    definition: str
    measure: Callable[[Sequence[Trial]], Measured]
    bound: Bound | None = None
    gate: Bound | None = None
    """The CI gate's bound on the same measure over gate-size rows (looser where the CI size is noisier); None:
    the claim has no gate."""
    comparison: str = ""
    """What the compared arms share (budget, throughput match, data): the one thing that changes, stated."""
    gate_needs: Callable[[], str] | None = None
    """For a gate that only means something on some hardware: returns "" where it applies, else why not (the gate
    then skips this claim, which fails ``python -m repro.gates`` unless ``--allow-skip table/claim`` says so)."""
    gate_measure: Callable[[Sequence[Trial]], Measured] | None = None
    """The gate's measure where the CI slice cannot meet the full table's (fewer seeds); None: ``measure``."""
    paper_claim: int | None = None
    """1-4: this target decides that paper claim (``PAPER_CLAIMS``); None: a goal of our own, or context."""
    evidence: Evidence = Evidence.MEASURED

    def __post_init__(self) -> None:
        if self.kind is ClaimKind.TARGET and self.bound is None:
            raise ValueError(f"target claim {self.name} needs a pre-registered bound")
        if self.kind is ClaimKind.MEASUREMENT and self.bound is not None:
            raise ValueError(f"measurement {self.name} carries no verdict: drop its bound")
        if self.paper_claim is not None:
            if self.paper_claim not in PAPER_CLAIMS:
                raise ValueError(f"{self.name}: paper_claim must be one of {sorted(PAPER_CLAIMS)}")
            if self.kind is not ClaimKind.TARGET or self.evidence is not Evidence.MEASURED:
                raise ValueError(f"{self.name}: a paper claim is decided by a MEASURED target only "
                                 f"(got {self.kind.value}, {self.evidence.value})")

    def evaluate(self, rows: Sequence[Trial], bound: Bound | None = None, gate: bool = False) -> "Verdict":
        """The verdict over ``rows`` (this table's rows only), against ``bound`` (default: the claim's own).
        ``gate``: the CI gate's evaluation (``gate_measure``; a measurement's gate bound gets a verdict; no
        stability rule: gate bounds carry their own margins)."""
        mine = [r for r in rows if r.TABLE == self.table]
        measure = (self.gate_measure or self.measure) if gate else self.measure
        m = measure(mine) if mine else not_measured(f"no {self.table} trials logged")
        bound = bound or (self.gate if gate else self.bound)
        if self.kind is ClaimKind.MEASUREMENT and not gate:
            return Verdict(self, m, Status.INFO)
        if not m.measured:
            return Verdict(self, m, Status.NOT_MEASURED)
        assert bound is not None
        if not gate and straddles(m, bound):
            return Verdict(self, m, Status.UNSTABLE)
        return Verdict(self, m, Status.HOLDS if bound.holds(float(m.value)) else Status.FAILS)


@dataclass(frozen=True)
class Verdict:
    claim: Claim
    measured: Measured
    status: Status

    def as_dict(self) -> dict[str, Any]:
        c, m = self.claim, self.measured
        return {"name": c.name, "table": c.table, "kind": c.kind.value, "paper": c.paper, "unit": c.unit,
                "bound": str(c.bound) if c.bound else None, "measured": _num(m.value), "low": _num(m.low),
                "high": _num(m.high), "n": m.n, "spread": m.spread, "status": self.status.value,
                "holds": {Status.HOLDS: True, Status.FAILS: False}.get(self.status), "note": m.note,
                "definition": c.definition, "comparison": c.comparison, "paper_claim": c.paper_claim,
                "evidence": c.evidence.value, "repeats": m.repeats, "infinite": _infinite(m)}


def _num(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _infinite(m: Measured) -> str | None:
    """``value [low, high]`` as text where an end is infinite (JSON holds them as null), e.g. "-inf [-inf, 0.04]"
    for a reduction whose KnitTrans never reached the throughput; None where every end is finite or absent."""
    ends = (m.value, m.low, m.high)
    if not any(x is not None and math.isinf(x) for x in ends):
        return None
    v, lo, hi = (format(x, ".3g") if x is not None else "n/a" for x in ends)
    return v if m.low is None or m.high is None else f"{v} [{lo}, {hi}]"


# -- statistics shared by claims ---------------------------------------------------------------------------------


def median_range(values: Sequence[float], note: str = "", repeats: bool = True) -> Measured:
    """Median with [min, max] (timings: decide on the median of repeated, interleaved passes, never the best).
    ``repeats``: the values are repeats of one configuration (passes, seeds, rounds), so the stability rule reads
    their spread; False for values over different settings."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return not_measured(note or "no finite values")
    return Measured(float(np.median(xs)), min(xs), max(xs), len(xs), "min-max", note, repeats)


def paired_mean_ci(diffs: Sequence[float], note: str = "", level: float = 0.95) -> Measured:
    """Mean of paired differences (one per seed) with a Student-t interval (``ddof=1``); with fewer than two
    pairs there is no interval."""
    d = np.asarray([float(x) for x in diffs], dtype=float)
    if d.size == 0:
        return not_measured(note or "no pairs")
    if d.size == 1:
        return Measured(float(d[0]), None, None, 1, "", note)
    from scipy import stats

    half = float(stats.t.ppf(0.5 + level / 2, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size))
    mean = float(d.mean())
    return Measured(mean, mean - half, mean + half, int(d.size), f"{level:.0%} t-interval", note)


def naming_verl(measure: Callable[[Sequence[Trial]], Measured]) -> Callable[[Sequence[Trial]], Measured]:
    """``measure`` with the verl version that ran (its rows' ``verl_version``) at the head of the note."""

    def named(rows: Sequence[Trial]) -> Measured:
        m = measure(rows)
        versions = sorted({v for r in rows if (v := getattr(r, "verl_version", None))})
        if not versions:
            return m
        head = f"verl {', '.join(versions)}"
        return dataclasses.replace(m, note=f"{head}; {m.note}" if m.note else head)
    return named
