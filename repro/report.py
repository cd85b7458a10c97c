"""The combined report: ``results/REPORT.md`` from the tables already written, without rerunning anything.

    python -m repro.report                     # reads results/*/summary.json, writes results/REPORT.md
    python -m repro.report --results some/dir  # another results folder

Every table's claims appear with the paper's number beside ours and a verdict; each table's plots are linked
(relative paths, so the report renders wherever the folder is copied). Tables are computed from the written
results alone (as AlgoPerf computes its tables from logs), so the report is reproducible from a results archive.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The paper's headline claims, in the order the paper makes them; tables not yet run are listed as missing.
EXPECTED = [
    ("staleness", "arch_staleness_reduction"),
    ("staleness", "throughput_ratio"),
    ("quality", "quality_gap_closed"),
    ("transfer-text", "exposed_latency_ratio"),
    ("transfer-multimodal", "mm_transfer_latency_ratio"),
    ("transfer-multimodal", "mm_exposed_latency_ratio"),
    ("speedup", "mm_transfer_train_speedup"),
]


@dataclass(frozen=True)
class TableResult:
    folder: str  # results/<folder>
    table: str
    claims: list[dict[str, Any]]
    plots: list[str]  # file names in the folder
    meta: dict[str, Any]


def load(results_dir: Path) -> list[TableResult]:
    """Every ``<results_dir>/<folder>/summary.json``, sorted by folder. Unreadable summaries raise with the path."""
    out = []
    for summary in sorted(results_dir.glob("*/summary.json")):
        try:
            data = json.loads(summary.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{summary}: not valid JSON ({e})") from e
        if not isinstance(data, dict) or "table" not in data or "claims" not in data:
            raise ValueError(f"{summary}: not a results summary (needs 'table' and 'claims')")
        meta_path = summary.parent / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        plots = sorted(p.name for p in summary.parent.glob("*.png"))
        out.append(TableResult(summary.parent.name, data["table"], list(data["claims"]), plots, meta))
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "not measured"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "n/a" if not math.isfinite(v) else f"{v:.3g}"
    return str(v)


def verdict(claim: dict[str, Any]) -> str:
    if claim.get("measured") is None:
        return "NOT MEASURED"
    return "HOLDS" if claim.get("holds") else "DOES NOT HOLD"


def render(tables: list[TableResult]) -> str:
    lines = ["# KnitTrans reproduction report", ""]
    present = {(t.folder, c.get("name")) for t in tables for c in t.claims}
    n_claims = sum(len(t.claims) for t in tables)
    n_hold = sum(1 for t in tables for c in t.claims if c.get("holds"))
    lines += [f"{len(tables)} tables, {n_claims} claims, {n_hold} hold. Each claim: the paper's number, ours, and "
              "the verdict; the note says where and how it was measured, and why when it does not hold.", ""]
    lines += ["## Headline claims", "", "| table | claim | paper | ours | verdict |", "|---|---|---|---|---|"]
    for folder, name in EXPECTED:
        match = [c for t in tables if t.folder == folder for c in t.claims if c.get("name") == name]
        if match:
            c = match[0]
            lines.append(f"| {folder} | `{name}` | {_fmt(c.get('paper'))} | {_fmt(c.get('measured'))} "
                         f"{c.get('unit', '')} | {verdict(c)} |")
        elif (folder, name) not in present:
            lines.append(f"| {folder} | `{name}` | | | MISSING (table not run) |")
    for t in tables:
        lines += ["", f"## {t.folder}", ""]
        sha = t.meta.get("git_sha")
        if sha:
            lines.append(f"git {sha[:10]}{' (dirty)' if t.meta.get('git_dirty') else ''}, "
                         f"{t.meta.get('cpu_count', '?')} CPUs, GPU: {t.meta.get('gpu') or 'none'}, "
                         f"seed {t.meta.get('seed')}")
            lines.append("")
        lines += ["| claim | paper | ours | unit | verdict | note |", "|---|---|---|---|---|---|"]
        for c in t.claims:
            note = str(c.get("note", "")).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{c.get('name')}` | {_fmt(c.get('paper'))} | {_fmt(c.get('measured'))} | "
                         f"{c.get('unit', '')} | {verdict(c)} | {note} |")
        if t.plots:
            lines.append("")
            lines += [f"![{t.folder}/{p}]({t.folder}/{p})" for p in t.plots]
        lines.append(f"\nFull table: [{t.folder}/table.md]({t.folder}/table.md)")
    return "\n".join(lines) + "\n"


def write_report(results_dir: str | Path = "results") -> Path:
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise FileNotFoundError(f"{results_dir} does not exist: run the repro tables first (make repro)")
    tables = load(results_dir)
    if not tables:
        raise FileNotFoundError(f"no */summary.json under {results_dir}: run the repro tables first (make repro)")
    path = results_dir / "REPORT.md"
    path.write_text(render(tables))
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results", help="results folder (default: results)")
    args = ap.parse_args(argv)
    path = write_report(args.results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
