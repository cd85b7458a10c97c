"""A thin experiment logger: Weights & Biases (offline by default) or a no-op twin.

wandb is imported lazily, only when a W&B logger is built, so nothing else pays for it and tests need no network.
``logger=wandb`` logs offline unless the user has set ``WANDB_MODE=online`` (and their API key);
``logger=none`` disables logging. Runs are written under ``<out_dir>/wandb``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, Sequence


class Logger(Protocol):
    def log_config(self, config: dict[str, Any]) -> None: ...
    def log_rows(self, name: str, rows: Sequence[dict[str, Any]]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_images(self, paths: Sequence[Path]) -> None: ...
    def log_artifact(self, path: Path, name: str, kind: str = "result") -> None: ...
    def finish(self) -> None: ...


class NullLogger:
    """The no-op twin: same interface, logs nothing."""

    def log_config(self, config: dict[str, Any]) -> None:
        pass

    def log_rows(self, name: str, rows: Sequence[dict[str, Any]]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_images(self, paths: Sequence[Path]) -> None:
        pass

    def log_artifact(self, path: Path, name: str, kind: str = "result") -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger:
    """Logs to W&B. Offline unless WANDB_MODE says otherwise; never needs a network in offline mode."""

    def __init__(self, project: str, name: str, out_dir: str | Path, config: dict[str, Any] | None = None,
                 mode: str | None = None) -> None:
        import wandb  # lazy: heavy import, and only needed when logging is on

        self._wandb = wandb
        mode = mode or os.environ.get("WANDB_MODE", "offline")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=str(out_dir), mode=mode, config=config or {},
                              reinit="finish_previous", settings=wandb.Settings(silent=True, console="off"))

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir).parent

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_rows(self, name: str, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            return
        cols = list(dict.fromkeys(k for r in rows for k in r))
        data = [[_cell(r.get(c)) for c in cols] for r in rows]
        # wandb.Table infers one type per column and rejects a column that mixes strings and numbers (a claim's
        # "paper" is 0.93 in one row and ">= 1" in another): render such columns as strings.
        for j in range(len(cols)):
            kinds = {type(row[j]) for row in data if row[j] is not None}
            if str in kinds and len(kinds) > 1:
                for row in data:
                    row[j] = None if row[j] is None else str(row[j])
        self.run.log({name: self._wandb.Table(columns=cols, data=data)})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def log_images(self, paths: Sequence[Path]) -> None:
        imgs = {Path(p).stem: self._wandb.Image(str(p)) for p in paths if Path(p).exists()}
        if imgs:
            self.run.log(imgs)

    def log_artifact(self, path: Path, name: str, kind: str = "result") -> None:
        art = self._wandb.Artifact(name=name, type=kind)
        art.add_file(str(path))
        self.run.log_artifact(art)

    def finish(self) -> None:
        self.run.finish()
        # The wandb service process lingers until teardown or process exit; end it so scripts and tests exit.
        self._wandb.teardown()


def _cell(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)


def make_logger(kind: str, project: str, name: str, out_dir: str | Path,
                config: dict[str, Any] | None = None) -> Logger:
    """``kind``: "wandb" (offline unless WANDB_MODE=online) or "none"."""
    if kind == "none":
        return NullLogger()
    if kind == "wandb":
        return WandbLogger(project=project, name=name, out_dir=out_dir, config=config)
    raise ValueError(f"logger must be 'wandb' or 'none', got {kind!r}")


def log_results(logger: Logger, results: Any) -> None:
    """Log a repro.results.Results: its rows as a table, claims as metrics, plots, summary.json as artifact."""
    logger.log_rows(f"{results.table}/rows", results.rows)
    claims = results.claim_dicts()
    logger.log_rows(f"{results.table}/claims", claims)
    if results.trials:
        logger.log_rows(f"{results.table}/trials", [dict(r.as_dict(), type=type(r).__name__) for r in results.trials])
    metrics = {f"claims/{c['name']}": c["measured"] for c in claims if isinstance(c["measured"], (int, float))}
    if metrics:
        logger.log_metrics(metrics)
    logger.log_images(results.plots)
    summary = Path(results.out_dir) / "summary.json"
    if summary.exists():
        logger.log_artifact(summary, name=f"{results.table}-summary".replace("/", "-"))


def publish(results: Any, logger_kind: str, name: str, config: Any = None, seed: int | None = None) -> dict:
    """Write a table per the results contract, then log it (so summary.json exists to log as an artifact).

    ``config`` may be a dataclass, an OmegaConf config or a dict; it is written as config.yaml and logged as the
    run's config. Returns the summary (also printed as the last stdout line by ``Results.write``)."""
    import dataclasses

    summary = results.write(config=config, seed=seed)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        plain = dataclasses.asdict(config)
    else:
        try:
            from omegaconf import OmegaConf

            plain = OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else config
        except ImportError:  # pragma: no cover
            plain = config
    logger = make_logger(logger_kind, project="knittrans", name=name, out_dir=results.out_dir,
                         config=plain if isinstance(plain, dict) else None)
    try:
        log_results(logger, results)
    finally:
        logger.finish()
    return summary
