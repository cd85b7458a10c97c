"""Trial logs: every table's typed rows in ``results/<table>/trials.jsonl``, with the run that produced them.

Format (one JSON object per line): first a ``run`` header -- table, git SHA (and whether the tree was dirty),
machine (CPU, cores, GPU), package versions, the resolved config, the seeds, the start time -- then one ``trial``
line per row: ``{"kind": "trial", "type": <row class>, "row": {...}}``. Verdicts are computed from these files by
``repro.spec`` alone, so a results folder copied elsewhere re-evaluates to the same table.

Example::

    >>> import tempfile, dataclasses
    >>> from repro.spec.core import Trial, trial
    >>> @trial("demo-log")
    ... @dataclasses.dataclass(frozen=True)
    ... class DemoLogTrial(Trial):
    ...     x: float
    >>> d = tempfile.mkdtemp()
    >>> p = write_trials(d, "demo-log", [DemoLogTrial(seed=0, x=1.5)], config={"k": 1})
    >>> log = read_trials(p)
    >>> log.rows, log.run["config"]
    ([DemoLogTrial(seed=0, x=1.5)], {'k': 1})
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from repro.results import jsonable, run_metadata
from repro.spec.core import Trial, row_from_dict

FILENAME = "trials.jsonl"


@dataclass(frozen=True)
class TrialLog:
    run: dict[str, Any]
    rows: list[Trial]


def _plain(config: Any) -> Any:
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(config):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return config


def write_trials(out_dir: str | Path, table: str, rows: Sequence[Trial], config: Any = None) -> Path:
    """Write the run header and ``rows`` to ``out_dir/trials.jsonl`` (replacing an older log)."""
    bad = [type(r).__name__ for r in rows if not isinstance(r, Trial) or r.TABLE != table]
    if bad:
        raise ValueError(f"write_trials({table!r}): rows of other tables or untyped rows: {sorted(set(bad))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = {"kind": "run", "table": table, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "seeds": sorted({r.seed for r in rows}), **run_metadata(), "config": _plain(config)}
    path = out / FILENAME
    with open(path, "w") as f:
        f.write(json.dumps(jsonable(header)) + "\n")
        for r in rows:
            f.write(json.dumps({"kind": "trial", "type": type(r).__name__, "row": jsonable(r.as_dict())}) + "\n")
    return path


def read_trials(path: str | Path) -> TrialLog:
    """Parse a trials.jsonl (its header and its typed rows). Raises ``ValueError`` naming the file and line."""
    path = Path(path)
    run: dict[str, Any] | None = None
    rows: list[Trial] = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if obj.get("kind") == "run":
                run = obj
            elif obj.get("kind") == "trial":
                rows.append(row_from_dict(obj["type"], obj["row"]))
            else:
                raise ValueError(f"unknown line kind {obj.get('kind')!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: {e}") from e
    if run is None:
        raise ValueError(f"{path}: no run header")
    return TrialLog(run, rows)


def read_all(results_dir: str | Path) -> dict[str, TrialLog]:
    """Every ``<results_dir>/<folder>/trials.jsonl``, by folder name."""
    return {p.parent.name: read_trials(p) for p in sorted(Path(results_dir).glob(f"*/{FILENAME}"))}
