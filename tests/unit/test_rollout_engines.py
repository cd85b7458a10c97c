"""The tables' ``engine=`` option (``workloads.arith_session.RolloutEngines``) in the project's .venv: the HF
default, and clear errors for an unknown engine or vLLM where it is not installed (its own environment)."""

from __future__ import annotations

import importlib.util

import pytest

from workloads.arith_session import ENGINES, RolloutEngines


def test_hf_engine_choice_leaves_run_mode_its_default_engine():
    engines = RolloutEngines("hf")
    assert engines(setup=None) is None and engines(setup=None) is None
    assert engines.describe() == {"engine": "hf", "runs": 2}


def test_unknown_engine_is_rejected_by_name():
    with pytest.raises(ValueError, match=r"engine='sglang'.*\['hf', 'vllm'\]"):
        RolloutEngines("sglang")
    assert ENGINES == ("hf", "vllm")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed in this environment")
def test_vllm_without_vllm_points_at_its_environment():
    with pytest.raises(ImportError, match="scripts/vllm_env.sh"):
        RolloutEngines("vllm")


def test_tables_reject_an_unknown_engine_before_running(tmp_path):
    from repro.quality import QualityConfig, run_table

    with pytest.raises(ValueError, match="engine='nope'"):
        run_table(QualityConfig(engine="nope", out_dir=str(tmp_path)))
