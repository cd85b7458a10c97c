"""The planner's inputs: every lengths format reads the same numbers, and every bad input gets a typed error that
names the problem (and the flag that holds it) before anything is simulated."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from baselines.admission import make_policy
from knittrans.dataplane.controller import HandoffRecord
from knittrans.plan import (Binding, LengthsError, PlanConfig, PlanInputError, TargetUnreachable, plan)
from knittrans.plan.workload import read_lengths
from workloads import example_lengths

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = {k: (lambda c, k=k: make_policy(k, c)) for k in ("knittrans", "train_batch", "greedy", "bounded_async")}
BASE = dict(max_response_len=2048, prompts_per_batch=16, group_size=4, num_minibatches=4, engines=1, slots=32,
            num_batches=4, warmup_batches=1, workers=1, policies=("knittrans", "train_batch"))


def _plan(**kw):
    return plan(PlanConfig(**{**BASE, **kw}), FACTORIES, progress=False)


def _write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# -- formats ------------------------------------------------------------------------------------------------------


def test_every_lengths_format_reads_the_same_values(tmp_path):
    vals = [120, 7, 2048, 333]
    txt = _write(tmp_path, "l.txt", "# lengths\n120\n\n7\n2048  # truncated\n333\n")
    csv = _write(tmp_path, "l.csv", "prompt,tokens\n0,120\n0,7\n1,2048\n1,333\n")
    tsv = _write(tmp_path, "l.tsv", "tokens\n120\n7\n2048\n333\n")
    jsonl = _write(tmp_path, "l.jsonl", "".join(json.dumps({"n": v, "g": i // 2}) + "\n" for i, v in enumerate(vals)))
    assert read_lengths(txt, 2048).values.tolist() == vals
    assert read_lengths(tsv, 2048).values.tolist() == vals  # one column: no --column needed
    got = read_lengths(csv, 2048, "tokens", "prompt")
    assert got.values.tolist() == vals and [g.tolist() for g in got.groups] == [[120, 7], [2048, 333]]
    assert [g.tolist() for g in read_lengths(jsonl, 2048, "n", "g").groups] == [[120, 7], [2048, 333]]


def test_parquet_lengths_read_like_csv(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="the parquet extra (pip install 'knittrans[parquet]') is not installed")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"tokens": [5, 9, 11, 3], "prompt": ["a", "a", "b", "b"]}), tmp_path / "l.parquet")
    got = read_lengths(tmp_path / "l.parquet", 64, "tokens", "prompt")
    assert [g.tolist() for g in got.groups] == [[5, 9], [11, 3]]


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "l.parquet").write_bytes(b"PAR1")
    with pytest.raises(PlanInputError, match=r"knittrans\[parquet\]") as e:
        read_lengths(tmp_path / "l.parquet", 64, "tokens")
    assert e.value.argument == "lengths"


def test_handoff_records_written_as_json_lines_are_a_lengths_file_with_their_groups(tmp_path):
    recs = [HandoffRecord(traj_id=i, group_id=i // 4, batch_id=0, num_tokens=10 + i, v_gen=0, v_train=1,
                          t_complete=0.1 * i, t_admit=1.0, released=True) for i in range(16)]
    path = _write(tmp_path, "records.jsonl", "".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in recs))
    p = _plan(lengths=path, column="num_tokens", group_column="group_id", prompts_per_batch=4)
    assert {len(g) for b in p.scenario.batches for g in b.lengths.values()} == {4}
    assert set(np.concatenate([g for b in p.scenario.batches for g in b.lengths.values()])) <= set(range(10, 26))


def test_the_example_lengths_file_is_what_its_generator_draws():
    got = read_lengths(example_lengths.PATH, example_lengths.DIST.max_len, "num_tokens", "prompt_id")
    rows = example_lengths.rows()
    assert got.values.tolist() == [v for _, v in rows] and len(got.groups) == example_lengths.PROMPTS


def test_a_group_column_keeps_the_files_groups_whole(tmp_path):
    text = "g,n\n" + "".join(f"{g},{100 * g + j + 1}\n" for g in range(8) for j in range(4))
    p = _plan(lengths=_write(tmp_path, "g.csv", text), column="n", group_column="g")
    for b in p.scenario.batches:
        for lens in b.lengths.values():  # each drawn group is one of the file's groups, whole
            assert len({int(v) // 100 for v in lens}) == 1 and sorted(int(v) % 100 for v in lens) == [1, 2, 3, 4]


# -- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, problem, line", [
    ("", "holds no lengths", None),
    ("# only a comment\n\n", "holds no lengths", None),
    ("12\nabc\n", "'abc' is not a number", 2),
    ("12\n-3\n", "-3 is not a positive length", 2),
    ("0\n", "0 is not a positive length", 1),
    ("12.5\n", "not a whole number of tokens", 1),
    ("nan\n", "not a whole number of tokens", 1),
    ("10\n4096\n", "4096 tokens is over the maximum response length 2048", 2),
])
def test_bad_lengths_are_rejected_with_the_line_and_the_problem(tmp_path, text, problem, line):
    with pytest.raises(LengthsError, match=problem) as e:
        _plan(lengths=_write(tmp_path, "l.txt", text))
    assert e.value.argument == "lengths" and e.value.line == line
    assert str(e.value).startswith("--lengths: ")


def test_bad_values_in_csv_and_jsonl_name_their_row(tmp_path):
    with pytest.raises(LengthsError, match="line 3: 'x' is not a number"):
        _plan(lengths=_write(tmp_path, "l.csv", "n\n5\nx\n"), column="n")
    with pytest.raises(LengthsError, match="line 2: True is not a number"):
        _plan(lengths=_write(tmp_path, "l.jsonl", '{"n": 5}\n{"n": true}\n'), column="n")
    with pytest.raises(LengthsError, match="line 2: no key 'n'"):
        _plan(lengths=_write(tmp_path, "l2.jsonl", '{"n": 5}\n{"m": 5}\n'), column="n")


@pytest.mark.parametrize("kw, argument, problem", [
    (dict(batch_size=66), "batch_size", "B=66 is not a multiple of the group size n=4"),
    (dict(num_minibatches=128), "num_minibatches", "M=128 mini-batches is more than the batch's 64 trajectories"),
    (dict(num_minibatches=5), "num_minibatches", "M=5 does not divide the batch of B=64"),
    (dict(num_minibatches=32), "num_minibatches", "cannot hold whole groups of n=4"),
    (dict(group_size=0), "group_size", "must be an int >= 1"),
    (dict(slots=2), "slots", "cannot start one group of n=4"),
    (dict(token_budget=1000), "token_budget", "below the longest allowed trajectory"),
    (dict(decode_tok_s=-1.0), "decode_tok_s", "must be a number > 0"),
    (dict(rollout_tok_s=1000.0, decode_tok_s=40.0), "rollout_tok_s", "not both"),
    (dict(train_step_s=3.0, train_tok_s=100.0), "train_tok_s", "conflicts with --train-step-s"),
    (dict(sync="sometimes"), "sync", "'sometimes' is not one of"),
    (dict(inflight="pause"), "inflight", "'pause' is not one of"),
    (dict(target="fast"), "target", "use max-throughput"),
    (dict(target="staleness<=-1"), "target", "use max-throughput"),
    (dict(grid=("train_batch=0.5",)), "grid", "budget must be >= 1 batch"),
    (dict(grid=("knittrans=0.1",)), "grid", "below one mini-batch"),
    (dict(grid=("bounded_async=1.5",), policies=("bounded_async",)), "grid", "eta is a whole number"),
    (dict(policies=("fifo",)), "policies", "no policy named \\['fifo'\\]"),
    (dict(dist="zipf"), "dist", "unknown distribution"),
    (dict(dist="lognormal:median=3000"), "dist", "needs median= and sigma="),
    (dict(dist="lognormal:median=9000,sigma=1"), "dist", "median <= max_response_len"),
    (dict(warmup_batches=4), "warmup_batches", "leaves none of the 4 batches"),
])
def test_bad_inputs_get_a_typed_error_naming_the_input(kw, argument, problem):
    kw.setdefault("dist", "lognormal:median=300,sigma=0.9")
    with pytest.raises(PlanInputError, match=problem) as e:
        _plan(**kw)
    assert e.value.argument == argument


def test_no_lengths_and_two_lengths_sources_are_errors(tmp_path):
    with pytest.raises(PlanInputError, match="no response lengths") as e:
        PlanConfig()
    assert e.value.argument == "lengths"
    with pytest.raises(PlanInputError, match="not both"):
        PlanConfig(lengths=_write(tmp_path, "l.txt", "5\n"), dist="light")
    with pytest.raises(PlanInputError, match="has no column 'tokens'") as e:
        _plan(lengths=_write(tmp_path, "l.csv", "n\n5\n"), column="tokens")
    assert e.value.argument == "column"


def test_groups_of_the_wrong_size_are_rejected_not_resized(tmp_path):
    text = "g,n\n" + "".join(f"{g},{10 + j}\n" for g in range(4) for j in range(4 if g else 3))
    with pytest.raises(PlanInputError, match="groups hold 3..4 samples \\(1 of 4 groups") as e:
        _plan(lengths=_write(tmp_path, "g.csv", text), column="n", group_column="g")
    assert e.value.argument == "group_column"


def test_an_unreachable_staleness_bound_says_that_staleness_binds():
    with pytest.raises(TargetUnreachable) as e:
        _plan(dist="lognormal:median=300,sigma=0.9", target="staleness<=0", grid=("knittrans=0.5,1",)).recommended()
    err = e.value
    assert err.binding is Binding.STALENESS and err.best is not None
    assert "least stale setting" in str(err) and err.best.metrics.staleness_mean > 0


def test_an_unreachable_throughput_floor_names_the_side_that_binds():
    # the trainer at 60 s per step, whatever admission does: the trainer binds
    slow = dict(dist="lognormal:median=300,sigma=0.9", train_step_s=60.0, target="steps/s>=1")
    with pytest.raises(TargetUnreachable) as e:
        _plan(**slow).recommended()
    assert e.value.binding is Binding.TRAINER and "faster trainer" in str(e.value)
    # one request at a time, 1 token/s: rollout binds
    with pytest.raises(TargetUnreachable) as e:
        _plan(dist="lognormal:median=300,sigma=0.9", slots=4, decode_tok_s=1.0, target="steps/s>=1").recommended()
    assert e.value.binding is Binding.ROLLOUT and "rollout capacity" in str(e.value)


def test_the_command_exits_2_on_bad_input_and_1_on_an_unreachable_target(tmp_path):
    exe = str(Path(sys.executable).parent / "knittrans-plan")
    bad = subprocess.run([exe, "--dist", "light", "--num-minibatches", "5", "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "error: --num-minibatches: M=5 does not divide" in bad.stderr
    assert bad.stdout == ""  # nothing simulated, nothing printed as if it were a result
    unmet = subprocess.run([exe, *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in BASE.items()
                                       if k != "policies"), []),
                            "--dist", "lognormal:median=300,sigma=0.9", "--target", "staleness<=0",
                            "--grid", "knittrans=0.5,1", "--grid", "train_batch=1", "--policies", "knittrans",
                            "train_batch", "--out-dir", str(tmp_path), "--no-progress"],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert unmet.returncode == 1, unmet.stderr
    doc = json.loads(unmet.stdout.strip().splitlines()[-1])
    assert doc["recommendation"] is None and doc["unmet"]["binding"] == "staleness bound"
    assert (tmp_path / "frontier.png").is_file()
