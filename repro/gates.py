"""Regression gates from the spec: each table runs at CI size, logs its trial rows, and the spec's ``gate`` bounds
decide.

    python -m repro.gates                      # every table's gate; exit 1 if any claim fails or is skipped
    python -m repro.gates --only staleness     # one table
    python -m repro.gates --allow-skip kernels-gpu   # a table that may skip (e.g. needs a GPU), said explicitly

A table takes part by exposing ``gate_trials() -> list[Trial]`` in its repro module, named in its spec module's
``GATES`` (spec table -> module); a module that gates several tables takes the table's name (``gate_trials(table)``)
and runs only that table's rows. The gate has no switches of its own: a regression is injected by changing product
code (tests monkeypatch it), and the same claims, measured by the same spec functions as the full tables, must then
fail. A table whose gate cannot run (an optional dependency absent, no GPU) reports "skipped", which fails the
run unless ``--allow-skip`` names it. Timing claims gate on ratios measured within one run (medians of repeated,
interleaved passes, with the margin stated in the bound); everything else on deterministic quantities.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import time
from dataclasses import dataclass
from typing import Sequence

from repro.spec import claims, gate_modules
from repro.spec.core import Status, Trial, Verdict


class GateSkipped(Exception):
    """Raised by a ``gate_trials`` that cannot run here; the message says why."""


@dataclass(frozen=True)
class GateOutcome:
    table: str
    verdicts: tuple[Verdict, ...]
    seconds: float
    skipped: str = ""  # why the table's gate did not run ("" if it ran)
    skipped_claims: tuple[tuple[str, str], ...] = ()  # (claim, why) whose gate does not apply on this hardware

    def failed(self, allow_skip: Sequence[str] = ()) -> bool:
        """``allow_skip``: the names (``table`` or ``table/claim``) whose gate may skip here."""
        allowed = set(allow_skip)
        if self.skipped:
            return self.table not in allowed
        if any(self.table not in allowed and f"{self.table}/{c}" not in allowed for c, _ in self.skipped_claims):
            return True
        return any(v.status is not Status.HOLDS for v in self.verdicts)

    def lines(self) -> list[str]:
        if self.skipped:
            return [f"SKIP {self.table}: {self.skipped}"]
        out = [f"SKIP {self.table}/{c}: {why}" for c, why in self.skipped_claims]
        for v in self.verdicts:
            d = v.as_dict()
            mark = {Status.HOLDS: "ok  ", Status.FAILS: "FAIL", Status.NOT_MEASURED: "MISS"}[v.status]
            out.append(f"{mark} {self.table}/{d['name']}: measured {d['measured']}, required "
                       f"{v.claim.gate} ({d['note'] or v.claim.definition})")
        return out


def gated_claims(table: str) -> list:
    return [c for c in claims(table) if c.gate is not None]


def gate_exemptions(table: str) -> dict[str, str]:
    """Gated claims whose gate does not apply on this machine, with why (``Claim.gate_needs``)."""
    why = {c.name: c.gate_needs() for c in gated_claims(table) if c.gate_needs is not None}
    return {k: v for k, v in why.items() if v}


def evaluate_gate(table: str, rows: Sequence[Trial]) -> tuple[Verdict, ...]:
    """The table's gated claims over CI-size ``rows``, each against its ``gate`` bound (except those that do not
    apply on this machine: ``gate_exemptions``)."""
    skip = gate_exemptions(table)
    return tuple(c.evaluate(rows, gate=True) for c in gated_claims(table) if c.name not in skip)


def run_gate(table: str) -> GateOutcome:
    t0 = time.perf_counter()
    mod = importlib.import_module(gate_modules()[table])
    try:
        takes_table = "table" in inspect.signature(mod.gate_trials).parameters
        rows = mod.gate_trials(table) if takes_table else mod.gate_trials()
    except GateSkipped as e:
        return GateOutcome(table, (), time.perf_counter() - t0, skipped=str(e) or "skipped")
    return GateOutcome(table, evaluate_gate(table, rows), time.perf_counter() - t0,
                       skipped_claims=tuple(gate_exemptions(table).items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], help="run only these tables (repeatable)")
    ap.add_argument("--allow-skip", action="append", default=[],
                    help="a table (or table/claim) whose gate may skip here, e.g. for want of a GPU (repeatable)")
    args = ap.parse_args(argv)
    gated = gate_modules()
    unknown = set(args.only) - set(gated)
    if unknown:
        ap.error(f"unknown tables {sorted(unknown)}; gated tables: {sorted(gated)}")
    failed = 0
    for table in args.only or list(gated):
        out = run_gate(table)
        for line in out.lines():
            print(line, flush=True)
        print(f"     ({table}: {out.seconds:.1f} s)", flush=True)
        failed += out.failed(args.allow_skip)
    print(f"{'FAILED' if failed else 'passed'}: {failed} of {len(args.only or gated)} table gates failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
