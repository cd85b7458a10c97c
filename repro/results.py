"""The results contract shared by every repro script (see DESIGN.md, "Results contract").

Each table writes ``results/<table>/`` (or ``results/<table>-<workload>/``) holding ``summary.json``,
``table.md``, plots (PNG), ``config.yaml`` (the resolved config) and ``meta.json`` (git SHA, package versions,
CPU/GPU, seed), and prints the summary JSON as the last line of stdout so other programs can parse it.

Example::

    >>> from repro.results import Claim, Results
    >>> r = Results(table="demo", out_dir="/tmp/knittrans-demo")
    >>> r.claims.append(Claim("x_ratio", paper=2.0, measured=2.5, unit="x", holds=True, note="toy"))
    >>> r.rows.append({"policy": "knittrans", "x": 1.0})
    >>> r.claims[0].as_dict()["holds"]
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from repro.pagereport import MIN_FREE_MS


@dataclass
class Claim:
    """One paper claim as measured here.

    ``paper`` is the paper's number (or our target when the paper gives none); ``holds`` is decided by the
    caller against a target stated in ``note``; a claim that does not hold is still reported as measured."""

    name: str
    paper: float | str | None
    measured: float | None
    unit: str
    holds: bool
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: jsonable(v) for k, v in dataclasses.asdict(self).items()}


def jsonable(v: Any) -> Any:
    """Plain JSON types; NaN/inf become None (JSON has no NaN), numpy scalars become Python numbers."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if hasattr(v, "item") and callable(v.item) and getattr(v, "ndim", 0) == 0:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def run_metadata(seed: int | None = None) -> dict[str, Any]:
    """Git SHA, package versions, CPU/GPU and seed, written beside every result."""
    meta: dict[str, Any] = {"seed": seed, "python": sys.version.split()[0], "platform": platform.platform()}
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        meta["git_sha"] = sha.stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5, cwd=Path(__file__).resolve().parent)
        meta["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        meta["git_sha"] = None
    versions = {}
    for pkg in ("torch", "numpy", "triton", "transformers", "ray", "vllm", "hydra", "wandb"):
        mod = sys.modules.get(pkg)
        if mod is not None:
            versions[pkg] = getattr(mod, "__version__", "?")
    meta["packages"] = versions
    meta["cpu"] = platform.processor() or platform.machine()
    meta["cpu_count"] = os.cpu_count()
    try:  # a VM's free page reporting during the run (``repro.pagereport``)
        meta["page_reporting_min_free_ms"] = int(MIN_FREE_MS.read_text())
    except (OSError, ValueError):
        meta["page_reporting_min_free_ms"] = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
    else:
        meta["gpu"] = None
    return meta


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                   floatfmt: str = ".3g") -> str:
    """A GitHub-flavoured markdown table of ``rows`` (missing cells are blank)."""
    if not rows:
        return "_no rows_\n"
    cols = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, float):
            return format(v, floatfmt) if math.isfinite(v) else "n/a"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def claims_table(claims: Sequence[Claim]) -> str:
    rows = [{"claim": c.name, "paper": c.paper, "measured": c.measured, "unit": c.unit,
             "holds": c.holds, "note": c.note} for c in claims]
    return markdown_table(rows, ["claim", "paper", "measured", "unit", "holds", "note"])


def fmt_measured(d: dict[str, Any]) -> str:
    """``value [low, high]`` of a verdict dict, or "not measured"."""
    v = d.get("measured")
    if d.get("infinite"):
        return d["infinite"]
    if v is None:
        return "did not finish" if d.get("holds") is False else "not measured"
    out = format(v, ".3g")
    if d.get("low") is not None and d.get("high") is not None:
        out += f" [{d['low']:.3g}, {d['high']:.3g}]"
    return out


def verdicts_table(verdicts: Sequence[Any]) -> str:
    rows = []
    for v in verdicts:
        d = v.as_dict()
        rows.append({"claim": d["name"], "kind": d["kind"], "paper": d["paper"], "bound": d["bound"] or "",
                     "measured": fmt_measured(d), "unit": d["unit"], "n": d["n"], "verdict": d["status"],
                     "note": d["note"]})
    return markdown_table(rows, ["claim", "kind", "paper", "bound", "measured", "unit", "n", "verdict", "note"])


@dataclass
class Results:
    """Collects one table's claims, rows and plots, then writes them per the contract."""

    table: str
    out_dir: str | Path
    claims: list[Claim] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    text: str = ""  # free markdown appended to table.md (context, what did not reproduce and why)
    verdicts: list[Any] = field(default_factory=list)
    """``repro.spec`` verdicts over this table's logged trial rows (set by ``set_trials``); when present they are
    the table's claims (``claims`` is the legacy form of tables not yet on the spec)."""
    trials: list[Any] = field(default_factory=list)

    def set_trials(self, rows: Sequence[Any]) -> None:
        """This table's typed trial rows: the spec computes every claim from them (``repro.spec.evaluate``)."""
        from repro.spec import evaluate

        self.trials = list(rows)
        self.verdicts = evaluate(self.table, self.trials)

    def claim_dicts(self) -> list[dict[str, Any]]:
        if self.verdicts:
            return [v.as_dict() for v in self.verdicts]
        return [c.as_dict() for c in self.claims]

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def plot_path(self, name: str) -> Path:
        p = Path(self.out_dir) / name
        self.plots.append(p)
        return p

    def summary(self) -> dict[str, Any]:
        return {"table": self.table, "claims": self.claim_dicts(),
                "rows": jsonable(self.rows), **jsonable(self.extra)}

    def write(self, config: Any = None, seed: int | None = None, columns: Sequence[str] | None = None) -> dict:
        """Write summary.json, table.md, config.yaml, meta.json; print the summary as the last stdout line."""
        out = Path(self.out_dir)
        summary = self.summary()
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        md = [f"# {self.table}\n", "## Claims\n", claims_table(self.claims) if not self.verdicts
              else verdicts_table(self.verdicts), "\n## Rows\n",
              markdown_table(self.rows, columns)]
        if self.plots:
            md += ["\n## Plots\n"] + [f"![{p.stem}]({p.name})\n" for p in self.plots if p.exists()]
        if self.text:
            md += ["\n## Notes\n", self.text.rstrip() + "\n"]
        (out / "table.md").write_text("\n".join(md))
        if config is not None:
            try:
                from omegaconf import OmegaConf

                text = OmegaConf.to_yaml(config) if OmegaConf.is_config(config) else OmegaConf.to_yaml(
                    OmegaConf.structured(config))
            except Exception:  # noqa: BLE001 - a config that omegaconf cannot render is still recorded
                text = json.dumps(jsonable(dataclasses.asdict(config) if dataclasses.is_dataclass(config)
                                            else config), indent=2)
            (out / "config.yaml").write_text(text)
        (out / "meta.json").write_text(json.dumps(jsonable(run_metadata(seed)), indent=2) + "\n")
        if self.trials:
            from repro.trials import write_trials

            write_trials(out, self.table, self.trials, config)
        print(json.dumps(summary), flush=True)
        return summary
