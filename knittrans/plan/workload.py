"""The user's response lengths: read from a file or named as a distribution, checked, and drawn into batches.

Files (by suffix): ``.txt`` or anything else unknown, one number per line (blank lines and ``#`` comments
skipped); ``.csv`` / ``.tsv`` with a header; ``.jsonl`` / ``.ndjson``, one object per line; ``.parquet`` (needs
pyarrow: ``pip install 'knittrans[parquet]'``). Every value must be a whole, positive number of tokens no larger
than the maximum response length; the first one that is not is reported with its line (or row) and nothing is
simulated. A group column keeps the real group structure; every group must then hold ``group_size`` samples.

Batches (``draw_batches``): a distribution is sampled as ``workloads.text`` samples it (the same draws for the
same seed); a file's lengths are resampled with replacement -- whole groups when it has a group column, single
responses otherwise (which loses the correlation of a prompt's samples; the planner says so).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from knittrans.plan.config import LengthsError, PlanInputError
from knittrans.sim.lengths import TAILS, LengthDist, batches_of
from knittrans.types import WorkloadBatch


@dataclass(frozen=True)
class Lengths:
    """Response lengths from a file: every value, and its groups when the file names them."""

    values: np.ndarray
    """Every response's length (int64), in file order."""
    groups: tuple[np.ndarray, ...] | None
    """Each group's lengths, in order of first appearance; None without a group column."""
    source: str

    @property
    def group_size(self) -> int | None:
        return len(self.groups[0]) if self.groups else None


def parse_dist(spec: str, max_len: int) -> LengthDist:
    """``light`` / ``heavy`` (log-normal, median 3000, sigma 0.9 / 1.3) or ``lognormal:median=M,sigma=S[,
    prompt_share=F]``, truncated at ``max_len``.

    >>> parse_dist("lognormal:median=800,sigma=1.1", 4096).sigma
    1.1
    """
    name, _, params = spec.partition(":")
    if name in TAILS and not params:
        return LengthDist(sigma=TAILS[name], max_len=max_len)
    if name != "lognormal":
        raise PlanInputError("dist", f"unknown distribution {spec!r}: use light, heavy or "
                                     f"lognormal:median=M,sigma=S[,prompt_share=F]")
    kw: dict[str, float] = {}
    for part in filter(None, params.split(",")):
        key, eq, val = part.partition("=")
        if key not in ("median", "sigma", "prompt_share") or not eq:
            raise PlanInputError("dist", f"{part!r}: lognormal takes median=, sigma= and prompt_share=")
        try:
            kw[key] = float(val)
        except ValueError:
            raise PlanInputError("dist", f"{key}={val!r} is not a number") from None
    if "median" not in kw or "sigma" not in kw:
        raise PlanInputError("dist", f"{spec!r}: lognormal needs median= and sigma=")
    if not (0 < kw["median"] <= max_len and kw["sigma"] >= 0 and 0 <= kw.get("prompt_share", 0.5) <= 1):
        raise PlanInputError("dist", f"{spec!r}: need 0 < median <= max_response_len ({max_len}), sigma >= 0 and "
                                     f"0 <= prompt_share <= 1")
    return LengthDist(max_len=max_len, min_len=min(16, max_len), **kw)


# -- files --------------------------------------------------------------------------------------------------------


def _token_count(raw: object, line: int, max_len: int) -> int:
    """One value as a token count, or a ``LengthsError`` saying what is wrong with it."""
    if isinstance(raw, bool) or raw is None:
        raise LengthsError("lengths", f"{raw!r} is not a number", line)
    if isinstance(raw, str):
        try:
            raw = float(raw.strip())
        except ValueError:
            raise LengthsError("lengths", f"{raw.strip()!r} is not a number", line) from None
    if not isinstance(raw, (int, float)):
        raise LengthsError("lengths", f"{raw!r} is not a number", line)
    if not math.isfinite(raw) or raw != int(raw):
        raise LengthsError("lengths", f"{raw!r} is not a whole number of tokens", line)
    if raw <= 0:
        raise LengthsError("lengths", f"{int(raw)} is not a positive length (an empty or negative response)", line)
    if raw > max_len:
        raise LengthsError("lengths", f"{int(raw)} tokens is over the maximum response length {max_len} (raise "
                                      f"--max-response-len if your rollout allows longer responses)", line)
    return int(raw)


def _rows_txt(path: Path) -> Iterator[tuple[int, object, object]]:
    with path.open(encoding="utf-8") as f:
        for i, ln in enumerate(f, 1):
            s = ln.split("#", 1)[0].strip()
            if s:
                yield i, s, None


def _pick(columns: list[str], column: str | None, group_column: str | None, path: Path) -> str:
    if column is None:
        rest = [c for c in columns if c != group_column]
        if len(rest) != 1:
            raise PlanInputError("column", f"{path.name} has columns {columns}: name the lengths with --column")
        column = rest[0]
    for arg, c in (("column", column), ("group_column", group_column)):
        if c is not None and c not in columns:
            raise PlanInputError(arg, f"{path.name} has no column {c!r} (it has {columns})")
    return column


def _rows_csv(path: Path, column: str | None, group_column: str | None) -> Iterator[tuple[int, object, object]]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ",")
        col = _pick(list(reader.fieldnames or []), column, group_column, path)
        for row in reader:  # line 1 is the header
            yield reader.line_num, row[col], row[group_column] if group_column else None


def _rows_jsonl(path: Path, column: str | None, group_column: str | None) -> Iterator[tuple[int, object, object]]:
    if column is None:
        raise PlanInputError("column", f"{path.name} is JSON lines: name the key holding the lengths with --column")
    with path.open(encoding="utf-8") as f:
        for i, ln in enumerate(f, 1):
            if not ln.strip():
                continue
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise LengthsError("lengths", f"not JSON ({e.msg})", i) from None
            if not isinstance(obj, dict) or column not in obj:
                raise LengthsError("lengths", f"no key {column!r} (--column) in {ln.strip()[:80]}", i)
            if group_column is not None and group_column not in obj:
                raise LengthsError("lengths", f"no key {group_column!r} (--group-column) in {ln.strip()[:80]}", i)
            yield i, obj[column], obj[group_column] if group_column else None


def _rows_parquet(path: Path, column: str | None, group_column: str | None) -> Iterator[tuple[int, object, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PlanInputError("lengths", f"{path.name}: reading Parquet needs pyarrow (pip install "
                                        f"'knittrans[parquet]'), or export the column to CSV") from None
    table = pq.read_table(path)
    col = _pick(table.column_names, column, group_column, path)
    groups = table.column(group_column).to_pylist() if group_column else [None] * table.num_rows
    for i, (v, g) in enumerate(zip(table.column(col).to_pylist(), groups), 1):
        yield i, v, g


def _rows(path: Path, column: str | None, group_column: str | None) -> Iterable[tuple[int, object, object]]:
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        return _rows_csv(path, column, group_column)
    if suffix in (".jsonl", ".ndjson"):
        return _rows_jsonl(path, column, group_column)
    if suffix == ".parquet":
        return _rows_parquet(path, column, group_column)
    if column or group_column:
        raise PlanInputError("column", f"{path.name} is read as one number per line (no columns); use a .csv, "
                                       f".jsonl or .parquet file for named columns")
    return _rows_txt(path)


def read_lengths(path: str | Path, max_len: int, column: str | None = None, group_column: str | None = None,
                 group_size: int | None = None) -> Lengths:
    """Every response length in ``path`` (module docstring), checked against ``max_len`` and, with a group
    column, every group against ``group_size`` (None: the groups must merely all have one size)."""
    path = Path(path)
    if not path.is_file():
        raise PlanInputError("lengths", f"no such file: {path}")
    values: list[int] = []
    by_group: dict[object, list[int]] = {}
    for line, raw, gid in _rows(path, column, group_column):
        v = _token_count(raw, line, max_len)
        values.append(v)
        if group_column is not None:
            if gid is None or gid == "":
                raise LengthsError("group_column", f"empty group id (--group-column {group_column})", line)
            by_group.setdefault(gid, []).append(v)
    if not values:
        raise LengthsError("lengths", f"{path} holds no lengths (empty, or only blank and comment lines)")
    groups = None
    if group_column is not None:
        groups = tuple(np.array(g, dtype=np.int64) for g in by_group.values())
        sizes = sorted({len(g) for g in groups})
        want = group_size if group_size is not None else sizes[0]
        if sizes != [want]:
            bad = sum(len(g) != want for g in groups)
            raise PlanInputError("group_column", f"{path.name}: groups hold {sizes[0]}..{sizes[-1]} samples ({bad} "
                                                 f"of {len(groups)} groups are not of {want}); the planner models "
                                                 f"groups of exactly --group-size samples")
    return Lengths(np.array(values, dtype=np.int64), groups, str(path))


# -- batches ------------------------------------------------------------------------------------------------------


def draw_batches(source: Lengths | LengthDist, prompts_per_batch: int, group_size: int, num_batches: int,
                 seed: int) -> list[WorkloadBatch]:
    """``num_batches`` batches of ``prompts_per_batch`` groups of ``group_size`` (module docstring)."""
    rng = np.random.default_rng(seed)
    groups: list[np.ndarray] = []
    for _ in range(num_batches):
        if isinstance(source, LengthDist):
            groups += list(source.sample(rng, prompts_per_batch, group_size))
        elif source.groups is not None:
            groups += [source.groups[i] for i in rng.integers(len(source.groups), size=prompts_per_batch)]
        else:
            groups += list(rng.choice(source.values, size=(prompts_per_batch, group_size)))
    return batches_of(groups, prompts_per_batch)


def describe(source: Lengths | LengthDist) -> str:
    """One line on where the lengths come from and how they become groups."""
    if isinstance(source, LengthDist):
        return (f"log-normal median {source.median:g}, sigma {source.sigma:g}, {source.prompt_share:g} of the "
                f"log-variance shared within a prompt, truncated at {source.max_len}")
    how = (f"{len(source.groups)} groups of {source.group_size}, resampled whole" if source.groups is not None else
           "groups drawn response by response (no --group-column: a prompt's samples are not correlated, which "
           "understates the longest member of a group)")
    v = source.values
    return (f"{len(v)} lengths from {source.source} (mean {v.mean():.0f}, p50 {np.percentile(v, 50):.0f}, p99 "
            f"{np.percentile(v, 99):.0f}, max {v.max()}); {how}")
