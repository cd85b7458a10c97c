"""repro.runner: `make repro`'s table runner. Each table in its own forked process after one shared preload: exit
statuses, atexit handlers, isolation between tables, the times file, and stopping at the first failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from repro.report import repro_times
from repro.runner import parse

ROOT = Path(__file__).resolve().parents[2]

TABLE = textwrap.dedent('''
    """A fake table: records what it saw, changes process state the next table must not see, then exits."""
    import atexit, json, os, sys
    import torch

    out = os.environ["RUNNER_TEST_OUT"]
    name = sys.argv[1]
    seen = {"argv": sys.argv[1:], "leak": os.environ.get("RUNNER_TEST_LEAK"), "threads": torch.get_num_threads(),
            "main": __name__, "pid": os.getpid()}
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(seen, f)
    os.environ["RUNNER_TEST_LEAK"] = name
    torch.set_num_threads(1)
    atexit.register(lambda: open(os.path.join(out, name + ".atexit"), "w").close())
    if len(sys.argv) > 2 and sys.argv[2] == "exit=3":
        sys.exit(3)
    if len(sys.argv) > 2 and sys.argv[2] == "kill":
        os.kill(os.getpid(), 9)
''')


def test_parse_keeps_bracketed_lists_and_names_repro_modules():
    assert parse("quality:seeds=[0,1],logger=none") == ("repro.quality", ["seeds=[0,1]", "logger=none"])
    assert parse("transfer:workload=text") == ("repro.transfer", ["workload=text"])
    assert parse("mypkg.table:a={b:1,c:2},d=3") == ("mypkg.table", ["a={b:1,c:2}", "d=3"])
    assert parse("admission") == ("repro.admission", [])
    for bad in ("", ":x", "a b", "a..b", "quality;rm"):
        with pytest.raises(ValueError, match="not a table"):
            parse(bad)


def _run(tmp_path: Path, *tables: str) -> tuple[subprocess.CompletedProcess, Path]:
    pkg = tmp_path / "fakepkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "table.py").write_text(TABLE)
    times = tmp_path / "times.tsv"
    env = {**os.environ, "RUNNER_TEST_OUT": str(tmp_path), "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    env.pop("RUNNER_TEST_LEAK", None)
    proc = subprocess.run([sys.executable, "-m", "repro.runner", "--times", str(times), *tables], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, times


def test_each_table_runs_alone_after_the_shared_preload_and_the_first_failure_stops_the_run(tmp_path):
    proc, times = _run(tmp_path, "fakepkg.table:one", "fakepkg.table:two", "fakepkg.table:three,exit=3",
                       "fakepkg.table:four")
    assert proc.returncode == 3, proc.stderr  # the failing table's own status
    assert "fakepkg.table:three,exit=3 failed (exit status 3); stopping" in proc.stderr
    one, two, three = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two", "three"))
    assert not (tmp_path / "four.json").exists()  # nothing after the failure
    assert one["argv"] == ["one"] and three["argv"] == ["three", "exit=3"] and one["main"] == "__main__"
    # what a table changes in its process never reaches the next one
    assert two["leak"] is None and two["threads"] == one["threads"] == three["threads"]
    assert len({one["pid"], two["pid"], three["pid"]}) == 3
    # each table's atexit handlers ran, as at interpreter exit (Ray's shutdown, W&B's teardown live there)
    assert all((tmp_path / f"{n}.atexit").exists() for n in ("one", "two", "three"))
    rows = [line.split("\t") for line in times.read_text().splitlines()]
    assert rows[0] == ["table", "seconds"] and [r[0] for r in rows[1:]] == ["fakepkg.table:one", "fakepkg.table:two"]
    res = tmp_path / "res"
    res.mkdir()
    (res / "repro-times.tsv").write_text(times.read_text())
    assert repro_times(res) == "`make repro` did not finish in this run (2 tables timed)."


def test_a_table_killed_by_a_signal_fails_the_run_as_a_shell_would_say_it(tmp_path):
    proc, times = _run(tmp_path, "fakepkg.table:one", "fakepkg.table:two,kill")
    assert proc.returncode == 128 + 9, proc.stderr
    assert not (tmp_path / "two.atexit").exists()  # killed: nothing ran after
    assert "total" not in times.read_text()


def test_a_full_run_logs_startup_and_total_and_the_report_reads_them(tmp_path):
    proc, times = _run(tmp_path, "fakepkg.table:one", "fakepkg.table:two")
    assert proc.returncode == 0, proc.stderr
    names = [line.split("\t")[0] for line in times.read_text().splitlines()]
    assert names == ["table", "fakepkg.table:one", "fakepkg.table:two", "startup", "total"]
    res = tmp_path / "res"
    res.mkdir()
    (res / "repro-times.tsv").write_text(times.read_text())
    line = repro_times(res)
    assert "for its 2 tables" in line and "shared imports" in line  # start-up is not counted as a table


def test_an_unknown_table_fails_before_anything_runs(tmp_path):
    proc, times = _run(tmp_path, "fakepkg.table:one", "no_such_table")
    assert proc.returncode == 2 and "no table module repro.no_such_table" in proc.stderr
    assert not (tmp_path / "one.json").exists() and not times.exists()
