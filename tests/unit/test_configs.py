"""Every config under repro/conf composes against its structured schema and instantiates as its dataclass."""

import importlib
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[2] / "repro" / "conf"
TABLES = sorted(p.stem for p in CONF.glob("*.yaml"))


def test_there_is_a_config_per_table():
    assert "staleness" in TABLES and "kernels" in TABLES


@pytest.mark.parametrize("table", TABLES)
def test_config_composes_and_instantiates(table):
    importlib.import_module(f"repro.{table}")  # registers <table>_schema in Hydra's ConfigStore
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name=table)
    obj = OmegaConf.to_object(cfg)
    assert hasattr(obj, "out_dir") and str(obj.out_dir).startswith("results/")
    assert getattr(obj, "logger", "wandb") in ("wandb", "none")
