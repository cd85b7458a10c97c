"""The spec: every claim of every table, as pure functions of logged trial rows (see ``repro.spec.core``).

One module per table (``repro/spec/<table>.py``) holds that table's trial-row dataclass and its ``CLAIMS``; this
package collects them. ``report``, ``gate`` and the README's results table read verdicts only through
``evaluate``/``evaluate_dir``.

    >>> from repro.spec import claims
    >>> all(c.table and c.definition for c in claims())
    True
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Sequence

from repro.spec.core import (PAPER_CLAIMS, Bound, Claim, ClaimKind, Evidence, Measured, Status, Trial, Verdict,
                             median_range, not_measured, paired_mean_ci, trial)

_TABLE_MODULES = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "core")


def claims(table: str | None = None) -> list[Claim]:
    """Every claim in the spec (of ``table`` only, if given), in each table module's order."""
    out: list[Claim] = []
    for name in _TABLE_MODULES:
        mod = importlib.import_module(f"repro.spec.{name}")
        out += [c for c in getattr(mod, "CLAIMS", ()) if table is None or c.table == table]
    names = [c.name for c in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"claim names must be unique across the spec: {dup}")
    if table is None:
        decided = [c.paper_claim for c in out if c.paper_claim is not None]
        if sorted(decided) != sorted(PAPER_CLAIMS):
            raise ValueError(f"each paper claim {sorted(PAPER_CLAIMS)} needs exactly one deciding target; got "
                             f"{sorted(decided)}")
    return out


def gate_modules() -> dict[str, str]:
    """Spec table -> the repro module whose ``gate_trials()`` runs it at CI size (each table module's ``GATES``)."""
    out: dict[str, str] = {}
    for name in _TABLE_MODULES:
        out.update(getattr(importlib.import_module(f"repro.spec.{name}"), "GATES", {}))
    return out


def tables() -> list[str]:
    return list(dict.fromkeys(c.table for c in claims()))


def evaluate(table: str, rows: Sequence[Trial]) -> list[Verdict]:
    """Every claim of ``table`` over ``rows``."""
    return [c.evaluate(rows) for c in claims(table)]


def evaluate_dir(results_dir: str | Path) -> dict[str, list[Verdict]]:
    """Verdicts of every table in the spec from ``<results_dir>/<table>/trials.jsonl``; a table without a log
    gets NOT_MEASURED verdicts (listed, never dropped)."""
    from repro.trials import read_all

    logs = read_all(results_dir)
    return {t: evaluate(t, logs[t].rows if t in logs else []) for t in tables()}


__all__ = ["PAPER_CLAIMS", "Bound", "Claim", "ClaimKind", "Evidence", "Measured", "Status", "Trial", "Verdict",
           "claims", "evaluate", "evaluate_dir", "gate_modules", "median_range", "not_measured", "paired_mean_ci",
           "tables", "trial"]
