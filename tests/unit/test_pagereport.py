"""repro.pagereport: the VM's free page reporting is held for the block and restored after, or left alone."""

from __future__ import annotations

import pytest

from repro.pagereport import page_reporting_held


def test_the_parameter_is_raised_for_the_block_and_restored_after_even_when_the_block_raises(tmp_path):
    param = tmp_path / "min_free_ms"
    param.write_text("0\n")
    with page_reporting_held(60_000, param) as line:
        assert param.read_text() == "60000"
        assert line == "free page reporting held: min_free_ms 0 -> 60000 for the run"
    assert param.read_text() == "0"
    with pytest.raises(RuntimeError), page_reporting_held(60_000, param):
        assert param.read_text() == "60000"
        raise RuntimeError("a table failed")
    assert param.read_text() == "0"


def test_without_the_parameter_nothing_changes_and_the_run_says_so(tmp_path):
    with page_reporting_held(60_000, tmp_path / "absent") as line:
        assert line.startswith("free page reporting not held")
    assert not (tmp_path / "absent").exists()


def test_a_run_that_finds_it_held_leaves_it_to_the_run_that_held_it(tmp_path):
    param = tmp_path / "min_free_ms"
    param.write_text("0")
    with page_reporting_held(60_000, param):
        with page_reporting_held(60_000, param) as line:
            assert line == "free page reporting held already: min_free_ms 60000"
        assert param.read_text() == "60000"  # the inner run did not restore it under the outer one
    assert param.read_text() == "0"
