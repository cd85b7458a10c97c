"""The W&B logger in offline mode (no network): the run directory holds the logged tables, and the no-op twin
logs nothing."""

import json

from repro.logger import NullLogger, make_logger, publish
from repro.results import Claim, Results


def _results(tmp_path):
    r = Results(table="demo", out_dir=tmp_path / "demo")
    r.rows = [{"policy": "knittrans", "staleness": 1.5}, {"policy": "train_batch", "staleness": 7.5}]
    r.claims = [Claim("x", paper=0.93, measured=0.95, unit="fraction", holds=True),
                Claim("y", paper=">= 1", measured=1.2, unit="x", holds=True)]  # mixed-type 'paper' column
    return r


def test_offline_wandb_run_holds_the_logged_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    summary = publish(_results(tmp_path), "wandb", "demo", config={"seed": 0}, seed=0)
    assert summary["table"] == "demo"
    runs = list((tmp_path / "demo" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    tables = list(runs[0].glob("files/media/table/**/*.table.json"))
    assert len(tables) == 2  # rows and claims
    contents = [json.loads(t.read_text()) for t in tables]
    rows = next(c for c in contents if "policy" in c["columns"])
    assert [r[rows["columns"].index("policy")] for r in rows["data"]] == ["knittrans", "train_batch"]
    assert (runs[0] / f"run-{runs[0].name.split('-')[-1]}.wandb").exists()


def test_logger_none_is_the_no_op_twin(tmp_path):
    lg = make_logger("none", project="p", name="n", out_dir=tmp_path)
    assert isinstance(lg, NullLogger)
    publish(_results(tmp_path), "none", "demo")
    assert not (tmp_path / "demo" / "wandb").exists()
    assert (tmp_path / "demo" / "summary.json").exists()
