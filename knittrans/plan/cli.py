"""``knittrans-plan`` (also ``python -m knittrans.plan``): will mini-batch admission help my run?

    knittrans-plan --dist heavy --prompts-per-batch 512 --group-size 16 --num-minibatches 16
    knittrans-plan --lengths workloads/examples/lengths.csv --column num_tokens --group-column prompt_id \\
        --prompts-per-batch 64 --group-size 8 --num-minibatches 8 --max-response-len 8192 --target 'staleness<=2'
    knittrans-plan --calibrate trial.jsonl.gz       # a real trial's traces: fitted time model, held-out error

Every flag is a field of ``knittrans.plan.config.PlanConfig`` (its help text is the field's). Prints the inputs
with the value each took, one row per simulated setting, the recommendation and the validation errors, writes
plan.md, frontier.png and plan.json to --out-dir, and prints the JSON document as the last stdout line. Exit
status: 0; 1 when no setting meets --target (the frontier is still written); 2 on a bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from enum import Enum
from typing import Sequence

from knittrans.plan.config import PlanConfig, PlanError, flag
from knittrans.plan.planner import plan
from knittrans.plan.report import markdown, write
from knittrans.plan.scenario import DEFAULTS

_TYPES = {"int | None": int, "float | None": float, "str | None": str, "int": int, "str": str}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="knittrans-plan", description="Will mini-batch admission help my run? Each "
                                 "admission policy's staleness-throughput frontier on your workload, simulated, and "
                                 "the setting to run (docs/planner.md).")
    for f in dataclasses.fields(PlanConfig):
        help = f.metadata["help"]
        if f.name in DEFAULTS:  # the value an unset (None) input takes
            help += f" (default: {_shown(DEFAULTS[f.name])})"
        if f.name == "whole_groups":
            ap.add_argument("--no-whole-groups", dest="whole_groups", action="store_false", help=help)
        elif f.name in ("calibrate", "policies"):
            ap.add_argument(flag(f.name), nargs="+", default=list(f.default),
                            help=help + (f" (default: {' '.join(f.default)})" if f.default else ""))
        elif f.name == "grid":
            ap.add_argument(flag(f.name), action="append", default=[], metavar="POLICY=V1,V2", help=help)
        else:
            shown = f" (default: {f.default})" if f.default is not None and f.name not in DEFAULTS else ""
            ap.add_argument(flag(f.name), type=_TYPES[str(f.type)], default=f.default, help=help + shown)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _shown(v: object) -> str:
    return str(v.value) if isinstance(v, Enum) else f"{v:g}" if isinstance(v, float) else str(v)


def _policies(values: Sequence[str]) -> tuple[str, ...]:
    """``--policies a b`` and ``--policies a,b`` alike."""
    return tuple(p for v in values for p in v.split(",") if p)


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(parser().parse_args(argv))
    progress = not args.pop("no_progress")
    args["policies"] = _policies(args["policies"])
    try:
        cfg = PlanConfig(**args)
        result = plan(cfg, progress=progress)
    except PlanError as e:
        print(f"knittrans-plan: error: {e}", file=sys.stderr)
        return 2
    doc = write(result, cfg.out_dir)
    print(markdown(result))
    print(f"wrote {', '.join(doc['files'].values())}")
    print(json.dumps(doc, separators=(",", ":")))
    if result.unmet is not None:
        print(f"knittrans-plan: {result.unmet}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
